#!/usr/bin/env bash
# A second "host" on this machine for the remote-snapshot tests: a network
# namespace whose only link is a veth pair to the host, so a server run in
# it (`ip netns exec NAME ...`) shares nothing with the host's but the store
# it reaches over that link (scripts/ceph.sh's RGW listens on every address
# of the host).
#
#   scripts/netns.sh up NAME     make namespace NAME (idempotent); prints
#                                PAGEFORK_NETNS_HOST=<the host's address as
#                                seen from NAME>, to `eval`
#   scripts/netns.sh down NAME   delete it and its veth pair (idempotent)
#
# Addresses: the pair gets 10.77.K.1 (host side, interface pfnKh) and
# 10.77.K.2 (namespace side, pfnKn) with the first K from 1 to 250 that no
# host interface uses; the namespace routes everything through the host
# side. So from NAME, RGW is http://10.77.K.1:<port of AWS_ENDPOINT_URL>.
# Needs root.
set -euo pipefail

die() {
	echo "netns: $*" >&2
	exit 1
}

usage() {
	echo "usage: $0 {up|down} NAME" >&2
	exit 2
}

[ $# -eq 2 ] || usage
cmd="$1"
NAME="$2"
[[ "$NAME" =~ ^[A-Za-z0-9_.-]{1,64}$ ]] || die "bad namespace name '$NAME'"
[ "$(id -u)" -eq 0 ] || die "must run as root (ip netns needs it)"

# The host-side address of namespace NAME's link, if it has one.
host_addr_of() {
	ip netns exec "$NAME" ip -4 -o addr show 2>/dev/null |
		awk '$4 ~ /^10\.77\./ { split($4, a, "[./]"); print "10.77." a[3] ".1" }' | head -1
}

case "$cmd" in
up)
	exec 9>/run/lock/pagefork-netns.lock
	flock 9
	if ip netns list | awk '{ print $1 }' | grep -qx "$NAME"; then
		addr="$(host_addr_of)"
		if [ -n "$addr" ] && ip -4 -o addr show | grep -q " $addr/"; then
			echo "PAGEFORK_NETNS_HOST=$addr"
			exit 0
		fi
		echo "netns: $NAME exists without a working link; making it again" >&2
		ip netns del "$NAME"
	fi
	used="$(ip -4 -o addr show | awk '{ print $4 }')"
	k=""
	for i in $(seq 1 250); do
		if ! grep -q "^10\.77\.$i\." <<<"$used" && ! ip link show "pfn${i}h" >/dev/null 2>&1; then
			k=$i
			break
		fi
	done
	[ -n "$k" ] || die "no free 10.77.K.0/24 subnet left"
	host="pfn${k}h"
	peer="pfn${k}n"
	ip netns add "$NAME"
	if ! {
		ip link add "$host" type veth peer name "$peer" &&
			ip link set "$peer" netns "$NAME" &&
			ip addr add "10.77.$k.1/24" dev "$host" &&
			ip link set "$host" up &&
			ip netns exec "$NAME" ip link set lo up &&
			ip netns exec "$NAME" ip addr add "10.77.$k.2/24" dev "$peer" &&
			ip netns exec "$NAME" ip link set "$peer" up &&
			ip netns exec "$NAME" ip route add default via "10.77.$k.1"
	}; then
		ip link del "$host" 2>/dev/null || true
		ip netns del "$NAME" 2>/dev/null || true
		die "cannot set up the veth pair of $NAME"
	fi
	echo "PAGEFORK_NETNS_HOST=10.77.$k.1"
	;;
down)
	if ip netns list | awk '{ print $1 }' | grep -qx "$NAME"; then
		addr="$(host_addr_of)"
		# Deleting the namespace deletes its end of the pair, and with it
		# the host's end.
		ip netns del "$NAME"
		if [ -n "$addr" ]; then
			k="$(cut -d. -f3 <<<"$addr")"
			ip link del "pfn${k}h" 2>/dev/null || true
		fi
	fi
	;;
*) usage ;;
esac
