#!/usr/bin/env bash
# A one-node Ceph cluster with an S3 gateway, for the remote-snapshot tests,
# benchmarks and demo: the real store, booted from Debian's packages
# (ceph-mon, ceph-mgr, ceph-osd, radosgw; scripts/setup.sh installs them)
# in a directory of its own.
#
#   scripts/ceph.sh start [DIR]      boot it (or find it running), wait until
#                                    it is healthy and RGW answers, then print
#                                    the environment to `eval`
#   scripts/ceph.sh env [DIR]        print that environment again
#   scripts/ceph.sh stop [DIR]       stop every daemon and remove DIR
#   scripts/ceph.sh rgw-stop [DIR]   stop only the S3 gateway (outage tests)
#   scripts/ceph.sh rgw-start [DIR]  start it again and wait until it answers
#
#   eval "$(scripts/ceph.sh start)"  # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
#                                    # AWS_SECRET_ACCESS_KEY, AWS_REGION,
#                                    # AWS_ALLOW_HTTP, PAGEFORK_REMOTE
#                                    # (s3://pagefork, a bucket made for you),
#                                    # PAGEFORK_CEPH_DIR
#
# DIR defaults to ${TMPDIR:-/tmp}/pagefork-ceph. The cluster: one monitor on
# 127.0.0.1 (msgr v1 only: a monitor on a port other than 6789 needs its v1
# address spelt out, or daemons fail to authenticate), one manager, one OSD
# on the memstore backend (data in RAM, `osd pool default size = 1`), and
# RGW's beast frontend on 127.0.0.1; the ports are free ones picked at start.
# Every daemon logs to DIR/log/ and its stdout/stderr go to DIR/log/*.out, so
# nothing holds the caller's pipe open. Everything the cluster writes is
# under DIR; `stop` kills the daemons by the pids it recorded and removes
# DIR. `start` is idempotent: a healthy cluster in DIR is reused as is, a
# broken one is stopped and booted again.
#
# Environment: PAGEFORK_CEPH_MEMSTORE_BYTES (the OSD's capacity, default
# 6 GiB; memstore holds what is stored in RAM), PAGEFORK_CEPH_TIMEOUT
# (seconds to wait for each step, default 90).
set -Eeuo pipefail
# A step that fails names itself (line and command) before the script exits.
trap 'rc=$?; echo "ceph: line $LINENO: \`$BASH_COMMAND\` failed (exit $rc)" >&2' ERR

DIR_DEFAULT="${TMPDIR:-/tmp}/pagefork-ceph"
MEMSTORE_BYTES="${PAGEFORK_CEPH_MEMSTORE_BYTES:-$((6 << 30))}"
TIMEOUT="${PAGEFORK_CEPH_TIMEOUT:-90}"
BUCKET=pagefork
REGION=us-east-1

die() {
	echo "ceph: $*" >&2
	exit 1
}

usage() {
	echo "usage: $0 {start|stop|env|rgw-stop|rgw-start} [DIR]" >&2
	exit 2
}

# A free TCP port on 127.0.0.1 (the kernel picks it).
free_port() {
	python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

UPPER=ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789
LOWER=abcdefghijklmnopqrstuvwxyz
# N random characters of ALPHABET.
random_text() {
	python3 -c 'import secrets, sys; print("".join(secrets.choice(sys.argv[2]) for _ in range(int(sys.argv[1]))))' "$1" "$2"
}

# The `ceph` CLI against this cluster, bounded in time.
cephcli() {
	timeout "$TIMEOUT" ceph -c "$DIR/ceph.conf" --connect-timeout 15 "$@"
}

# Start daemon NAME (its pid goes to DIR/run/NAME.pid) running COMMAND in
# the foreground, detached from the caller, output to DIR/log/NAME.out.
spawn() {
	local name="$1"
	shift
	setsid "$@" -f </dev/null >"$DIR/log/$name.out" 2>&1 &
	echo $! >"$DIR/run/$name.pid"
}

alive() {
	local pidfile="$DIR/run/$1.pid"
	[ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

# Stop daemon NAME by its recorded pid: TERM, then KILL after 10 s.
kill_daemon() {
	local pidfile="$DIR/run/$1.pid" pid
	[ -f "$pidfile" ] || return 0
	pid="$(cat "$pidfile")"
	if kill -0 "$pid" 2>/dev/null; then
		kill -TERM "$pid" 2>/dev/null || true
		for _ in $(seq 100); do
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$pid" 2>/dev/null || true
	fi
	rm -f "$pidfile"
}

# Wait up to TIMEOUT seconds for COMMAND to succeed; on failure say WHAT
# did not happen and show the log of daemon LOG.
wait_for() {
	local what="$1" log="$2"
	shift 2
	local deadline=$((SECONDS + TIMEOUT))
	until "$@" >/dev/null 2>&1; do
		if [ "$SECONDS" -ge "$deadline" ]; then
			echo "ceph: timed out after ${TIMEOUT}s waiting for $what; the end of $DIR/log/$log:" >&2
			tail -20 "$DIR/log/$log" >&2 2>/dev/null || true
			return 1
		fi
		sleep 0.2
	done
}

rgw_answers() {
	curl -sf -o /dev/null --max-time 2 "http://127.0.0.1:$RGW_PORT/"
}

healthy() {
	cephcli health 2>/dev/null | grep -q '^HEALTH_OK'
}

osd_up() {
	[ "$(cephcli osd stat -f json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["num_up_osds"])')" = 1 ]
}

load_env() {
	[ -f "$DIR/cluster.env" ] || return 1
	# shellcheck source=/dev/null
	. "$DIR/cluster.env"
}

print_env() {
	load_env || die "no cluster in $DIR (scripts/ceph.sh start $DIR)"
	cat <<EOF
export AWS_ENDPOINT_URL=http://127.0.0.1:$RGW_PORT
export AWS_ACCESS_KEY_ID=$ACCESS_KEY
export AWS_SECRET_ACCESS_KEY=$SECRET_KEY
export AWS_REGION=$REGION
export AWS_ALLOW_HTTP=true
export PAGEFORK_REMOTE=s3://$BUCKET
export PAGEFORK_CEPH_DIR=$DIR
EOF
}

write_conf() {
	cat >"$DIR/ceph.conf" <<EOF
[global]
fsid = $FSID
mon host = [v1:127.0.0.1:$MON_PORT]
public addr = 127.0.0.1
ms bind msgr2 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $DIR/\$name.keyring
run dir = $DIR/run
admin socket = $DIR/run/\$name.asok
pid file = $DIR/run/\$name.daemon.pid
log file = $DIR/log/\$name.log
mon cluster log file = $DIR/log/\$cluster.\$channel.log
crash dir = $DIR/crash
exporter sock dir = $DIR/run
mon data = $DIR/\$name
mgr data = $DIR/\$name
osd data = $DIR/\$name
rgw data = $DIR/\$name
osd objectstore = memstore
memstore device bytes = $MEMSTORE_BYTES
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon data avail warn = 2
mon data avail crit = 1
mon warn on insecure global id reclaim allowed = false
auth allow insecure global id reclaim = false
mgr initial modules =
mon max pg per osd = 1000
# Map changes (pools, OSD boot) commit in ~0.1 s instead of ~1 s each:
# RGW makes its pools one by one, and that alone took ~15 s.
paxos propose interval = 0.05
osd max object name len = 460
osd max object namespace len = 64

[client]
# One-shot CLI clients share a name: no admin socket for them.
admin socket =

[client.rgw.a]
admin socket = $DIR/run/\$name.asok
# Every address, so namespaces of scripts/netns.sh reach it over their veth.
rgw frontends = beast endpoint=0.0.0.0:$RGW_PORT tcp_nodelay=1
rgw enable usage log = false
# Deleted objects' tails (multipart parts, anything past 4 MiB) are freed by
# RGW's own gc, by default two hours later: memstore holds them in RAM
# until then and fills up.
rgw gc obj min wait = 5
rgw gc processor period = 10
EOF
}

start_rgw() {
	spawn rgw radosgw -c "$DIR/ceph.conf" -n client.rgw.a
	wait_for "RGW to answer on 127.0.0.1:$RGW_PORT" client.rgw.a.log rgw_answers
}

boot() {
	rm -rf "$DIR"
	mkdir -p "$DIR"/{log,run,crash}
	FSID="$(cat /proc/sys/kernel/random/uuid)"
	MON_PORT="$(free_port)"
	RGW_PORT="$(free_port)"
	while [ "$RGW_PORT" = "$MON_PORT" ]; do RGW_PORT="$(free_port)"; done
	ACCESS_KEY="$(random_text 20 "$UPPER")"
	SECRET_KEY="$(random_text 40 "$UPPER$LOWER")"
	write_conf

	# Monitor: a keyring for it and the admin, a monmap, mkfs, run.
	ceph-authtool --create-keyring "$DIR/mon.a.keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
	ceph-authtool --create-keyring "$DIR/client.admin.keyring" --gen-key -n client.admin \
		--cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null
	ceph-authtool "$DIR/mon.a.keyring" --import-keyring "$DIR/client.admin.keyring" >/dev/null
	monmaptool --create --fsid "$FSID" --addv a "[v1:127.0.0.1:$MON_PORT]" "$DIR/monmap" >/dev/null
	mkdir -p "$DIR/mon.a"
	ceph-mon -c "$DIR/ceph.conf" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/mon.a.keyring" \
		>"$DIR/log/mon-mkfs.out" 2>&1 || { cat "$DIR/log/mon-mkfs.out" >&2; die "ceph-mon --mkfs failed"; }
	spawn mon ceph-mon -c "$DIR/ceph.conf" -i a
	wait_for "the monitor" mon.a.log cephcli mon stat

	# Manager (the health report needs one).
	mkdir -p "$DIR/mgr.x"
	cephcli auth get-or-create mgr.x mon 'allow profile mgr' osd 'allow *' mds 'allow *' \
		-o "$DIR/mgr.x.keyring" >/dev/null
	spawn mgr ceph-mgr -c "$DIR/ceph.conf" -i x

	# OSD, created with an explicit uuid (else it logs "wrong fsid" and
	# stays down).
	local uuid id
	uuid="$(cat /proc/sys/kernel/random/uuid)"
	id="$(cephcli osd create "$uuid")"
	mkdir -p "$DIR/osd.$id"
	ceph-osd -c "$DIR/ceph.conf" -i "$id" --mkfs --mkkey --osd-uuid "$uuid" --no-mon-config \
		>"$DIR/log/osd-mkfs.out" 2>&1 || { cat "$DIR/log/osd-mkfs.out" >&2; die "ceph-osd --mkfs failed"; }
	cephcli auth add "osd.$id" osd 'allow *' mon 'allow profile osd' mgr 'allow profile osd' \
		-i "$DIR/osd.$id.keyring" >"$DIR/log/auth-osd.out" 2>&1 ||
		{ cat "$DIR/log/auth-osd.out" >&2; die "cannot register osd.$id"; }
	spawn osd ceph-osd -c "$DIR/ceph.conf" -i "$id"
	wait_for "the OSD to be up" "osd.$id.log" osd_up

	# The S3 gateway, once the OSD is up.
	mkdir -p "$DIR/client.rgw.a"
	cephcli auth get-or-create client.rgw.a mon 'allow rw' osd 'allow rwx' mgr 'allow rw' \
		-o "$DIR/client.rgw.a.keyring" >/dev/null
	cat >"$DIR/cluster.env" <<EOF
MON_PORT=$MON_PORT
RGW_PORT=$RGW_PORT
ACCESS_KEY=$ACCESS_KEY
SECRET_KEY=$SECRET_KEY
EOF
	start_rgw
	timeout "$TIMEOUT" radosgw-admin -c "$DIR/ceph.conf" user create --uid=pagefork \
		--display-name=pagefork --access-key="$ACCESS_KEY" --secret-key="$SECRET_KEY" \
		>"$DIR/log/user-create.out" 2>&1 || { cat "$DIR/log/user-create.out" >&2; die "radosgw-admin user create failed"; }
	cat >"$DIR/s3cfg" <<EOF
[default]
access_key = $ACCESS_KEY
secret_key = $SECRET_KEY
host_base = 127.0.0.1:$RGW_PORT
host_bucket = 127.0.0.1:$RGW_PORT
use_https = False
signature_v2 = False
bucket_location = $REGION
EOF
	timeout "$TIMEOUT" s3cmd -c "$DIR/s3cfg" mb "s3://$BUCKET" >"$DIR/log/s3cmd-mb.out" 2>&1 ||
		{ cat "$DIR/log/s3cmd-mb.out" >&2; die "cannot create bucket $BUCKET"; }
	wait_for "HEALTH_OK" mon.a.log healthy || { cephcli health detail >&2 || true; exit 1; }
}

running() {
	load_env && alive mon && alive mgr && alive osd && alive rgw && rgw_answers
}

stop_all() {
	for d in rgw osd mgr mon; do
		kill_daemon "$d"
	done
	rm -rf "$DIR"
}

cmd="${1:-}"
[ -n "$cmd" ] || usage
DIR="$(realpath -m "${2:-$DIR_DEFAULT}")"
case "$cmd" in
start)
	for tool in ceph-mon ceph-mgr ceph-osd radosgw radosgw-admin s3cmd curl python3; do
		command -v "$tool" >/dev/null 2>&1 || die "$tool is missing; run scripts/setup.sh"
	done
	if running; then
		echo "ceph: already running in $DIR" >&2
	else
		[ -d "$DIR" ] && { echo "ceph: $DIR holds a cluster that is not healthy; booting it again" >&2; stop_all; }
		t0=$SECONDS
		# A boot that fails once (a daemon that dies at start, a port taken
		# between picking and binding it) gets one more try on fresh ports.
		"$0" boot-once "$DIR" ||
			{ echo "ceph: booting again once" >&2; "$0" boot-once "$DIR"; }
		load_env
		echo "ceph: up in $((SECONDS - t0)) s in $DIR (RGW on 127.0.0.1:$RGW_PORT)" >&2
	fi
	print_env
	;;
boot-once)
	# One boot attempt (for `start`). A failed step exits (set -e, die): stop
	# what did start, keep the logs.
	trap 'echo "ceph: boot failed; stopping what started; logs kept in $DIR.failed-logs" >&2
		rm -rf "$DIR.failed-logs"; cp -a "$DIR/log" "$DIR.failed-logs" 2>/dev/null || true; stop_all' EXIT
	rm -rf "$DIR.failed-logs"
	boot
	trap - EXIT
	;;
env) print_env ;;
stop) stop_all ;;
rgw-stop)
	load_env || die "no cluster in $DIR"
	kill_daemon rgw
	;;
rgw-start)
	load_env || die "no cluster in $DIR"
	alive rgw || start_rgw
	;;
*) usage ;;
esac
