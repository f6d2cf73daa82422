#!/usr/bin/env bash
# One benchmark command, one report: pagefork against its baselines, side by
# side in one run.
#
#   scripts/bench.sh [--quick] [--out FILE]
#
# Builds the benches, uffd-server and vmm (release; --quick uses the debug
# build), runs every bench binary and writes one markdown report (default
# BENCHMARKS.md) with the machine, the exact command and one table per
# benchmark. --quick (CI) runs fewer repetitions on smaller sizes and only
# checks that every bench completed and emitted each of its rows: the exit
# status is non-zero if a bench failed or a row is missing, never because of
# a timing.
#
# The volume, VM-snapshot, qcow2, disk-throughput, density and lineage benches need an XFS (reflink=1) directory: $PAGEFORK_XFS_DIR if
# set, else one is set up with scripts/xfs-loop.sh (needs root) and torn down
# afterwards. The remote-snapshot bench needs an S3 store on this host: the
# one of AWS_ENDPOINT_URL/PAGEFORK_REMOTE if set, else a one-node Ceph
# booted with scripts/ceph.sh for the run and stopped afterwards.
#
# The fault-path A/B (issue 45, bench fault_ab) runs this build's
# uffd-server and vmm against those of the commit before the restart work,
# $PAGEFORK_AB_BASE (default ecc19e4), alternating per repetition in this
# run. The base is checked out with `git worktree add --detach` under
# $CARGO_TARGET_DIR/ab-base/src-<rev> and built there (release, its own
# target dir $CARGO_TARGET_DIR/ab-base/target): both are kept between runs,
# so only the first run builds; the worktree is unregistered afterwards.
# --quick builds no base: fault_ab runs both sides on this build (a smoke
# run of the bench).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
ROOT="$(pwd -P)"
COMMAND="scripts/bench.sh${*:+ $*}"

QUICK=0
OUT=BENCHMARKS.md
while [ $# -gt 0 ]; do
	case "$1" in
	--quick) QUICK=1 ;;
	--out)
		[ $# -ge 2 ] || { echo "bench.sh: --out needs a FILE" >&2; exit 2; }
		OUT="$2"
		shift
		;;
	-h | --help)
		sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'
		exit 0
		;;
	*) echo "bench.sh: unknown argument $1 (usage: scripts/bench.sh [--quick] [--out FILE])" >&2; exit 2 ;;
	esac
	shift
done

TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
if [ "$QUICK" = 1 ]; then
	PROFILE=debug
	BUILD_DESC="debug (cargo build)"
	QUICK_ARG=(--quick)
	# The same selection as the test run's build, so after it this builds
	# nothing (a narrower -p list resolves other features and recompiles).
	cargo build --workspace --all-targets || { echo "bench.sh: build failed" >&2; exit 1; }
else
	PROFILE=release
	BUILD_DESC="release (cargo build --release)"
	QUICK_ARG=()
	cargo build --release -p pagefork-benches -p pagefork-tests -p uffd-server -p vmm || { echo "bench.sh: build failed" >&2; exit 1; }
fi
BIN="$TARGET_DIR/$PROFILE"
export PAGEFORK_BIN_DIR="$BIN"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/pagefork-bench.XXXXXX")"
XFS_DIR="${PAGEFORK_XFS_DIR:-}"
XFS_OURS=""
CEPH_OURS=""
AB_SRC=""
cleanup() {
	if [ -n "$AB_SRC" ]; then
		ab_unregister "$AB_SRC"
	fi
	if [ -n "$CEPH_OURS" ]; then
		"$ROOT/scripts/ceph.sh" stop "$CEPH_OURS" >/dev/null 2>&1 || echo "bench.sh: could not stop Ceph in $CEPH_OURS" >&2
	fi
	if [ -n "$XFS_OURS" ]; then
		"$ROOT/scripts/xfs-loop.sh" down "$XFS_OURS" >/dev/null || echo "bench.sh: could not tear down $XFS_OURS" >&2
		rmdir "$XFS_OURS" 2>/dev/null || true
	fi
	rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# run NAME ARGS...: run a bench binary; rows to WORK/NAME.jsonl, log to
# WORK/NAME.log (and stderr), its status to WORK/NAME.status.
run() {
	local name="$1"
	shift
	echo "== $name" >&2
	local t0=$SECONDS
	"$BIN/$name" "$@" >"$WORK/$name.jsonl" 2> >(tee "$WORK/$name.log" >&2)
	local rc=$?
	wait
	if [ $rc -eq 0 ]; then echo 0 >"$WORK/$name.status"; else echo "exit status $rc" >"$WORK/$name.status"; fi
	echo "== $name: exit $rc in $((SECONDS - t0)) s" >&2
}

run lazy_restore "${QUICK_ARG[@]}"
run fork "${QUICK_ARG[@]}"
run vmm_pool "${QUICK_ARG[@]}"

if [ -z "$XFS_DIR" ]; then
	if [ "$(id -u)" -eq 0 ]; then
		XFS_OURS="$(mktemp -d "${TMPDIR:-/tmp}/pagefork-bench-xfs.XXXXXX")"
		if "$ROOT/scripts/xfs-loop.sh" up "$XFS_OURS" >/dev/null; then
			XFS_DIR="$XFS_OURS"
		else
			echo "xfs-loop.sh up failed" >"$WORK/volume_snapshot.status"
			rmdir "$XFS_OURS" 2>/dev/null || true
			XFS_OURS=""
		fi
	else
		echo "no XFS directory: set PAGEFORK_XFS_DIR or run as root" >"$WORK/volume_snapshot.status"
	fi
fi
if [ -n "$XFS_DIR" ]; then
	run volume_snapshot "$XFS_DIR" --json "$WORK/volume_snapshot.json"
	run vm_snapshot "$XFS_DIR" "${QUICK_ARG[@]}"
	run qcow2_interchange "$XFS_DIR" "${QUICK_ARG[@]}"
	run disk_throughput "$XFS_DIR" "${QUICK_ARG[@]}"
	run density "$XFS_DIR" "${QUICK_ARG[@]}"
	run lineage "$XFS_DIR" "${QUICK_ARG[@]}"
else
	cp "$WORK/volume_snapshot.status" "$WORK/vm_snapshot.status"
	cp "$WORK/volume_snapshot.status" "$WORK/qcow2_interchange.status"
	cp "$WORK/volume_snapshot.status" "$WORK/disk_throughput.status"
	cp "$WORK/volume_snapshot.status" "$WORK/density.status"
	cp "$WORK/volume_snapshot.status" "$WORK/lineage.status"
fi

run fc_restore "${QUICK_ARG[@]}"
run zstd_image "${QUICK_ARG[@]}"
run minor_fault "${QUICK_ARG[@]}"
run restart "${QUICK_ARG[@]}"

# build_ab_base: check out $PAGEFORK_AB_BASE (default ecc19e4) in a worktree
# under TARGET_DIR/ab-base and build its uffd-server and vmm (release) into
# AB_BIN, its short hash in AB_NAME. The checkout is reused if a run before
# left it there (a stamp names its commit), and so is the build.
build_ab_base() {
	local want="${PAGEFORK_AB_BASE:-ecc19e4}" rev dir
	rev="$(git rev-parse --verify --quiet "$want^{commit}")" || {
		echo "no commit $want in this repository" >&2
		return 1
	}
	dir="$(mkdir -p "$TARGET_DIR/ab-base" && cd "$TARGET_DIR/ab-base" && pwd -P)" || return 1
	AB_NAME="$(git rev-parse --short "$rev")"
	AB_SRC="$dir/src-$AB_NAME"
	if [ "$(cat "$AB_SRC/.ab-rev" 2>/dev/null)" != "$rev" ]; then
		rm -rf "$AB_SRC"
		git worktree prune
		git worktree add --detach "$AB_SRC" "$rev" || return 1
		echo "$rev" >"$AB_SRC/.ab-rev"
	fi
	(cd "$AB_SRC" && CARGO_TARGET_DIR="$dir/target" cargo build --release -p uffd-server -p vmm) || return 1
	AB_BIN="$dir/target/release"
}

# ab_unregister DIR: forget the worktree DIR in this repository's git
# metadata but keep its files (and the build from them) for the next run.
ab_unregister() {
	rm -f "$1/.git"
	git worktree prune
}

if [ "$QUICK" = 1 ]; then
	run fault_ab --quick
else
	echo "== fault_ab: building the base ${PAGEFORK_AB_BASE:-ecc19e4}" >&2
	t0=$SECONDS
	build_ab_base > >(tee "$WORK/fault_ab.build.log" >&2) 2>&1
	built=$?
	wait
	if [ -n "$AB_SRC" ]; then
		ab_unregister "$AB_SRC"
		AB_SRC=""
	fi
	if [ $built -eq 0 ]; then
		echo "== fault_ab: base $AB_NAME built in $((SECONDS - t0)) s" >&2
		PAGEFORK_AB_BASE_BIN="$AB_BIN" PAGEFORK_AB_BASE="$AB_NAME" run fault_ab
	else
		echo "cannot build the base ${PAGEFORK_AB_BASE:-ecc19e4} (git worktree add, then cargo build --release -p uffd-server -p vmm under $TARGET_DIR/ab-base): $(tail -5 "$WORK/fault_ab.build.log" | tr '\n' ' ')" >"$WORK/fault_ab.status"
	fi
fi
run reclaim "${QUICK_ARG[@]}"

# The object store of the remote-snapshot bench, RGW on this host.
if [ -z "${AWS_ENDPOINT_URL:-}" ] || [ -z "${PAGEFORK_REMOTE:-}" ]; then
	CEPH_OURS="$WORK/ceph"
	if CEPH_ENV="$("$ROOT/scripts/ceph.sh" start "$CEPH_OURS" 2>"$WORK/ceph.log")"; then
		eval "$CEPH_ENV"
	else
		echo "scripts/ceph.sh start failed: $(tail -5 "$WORK/ceph.log" | tr '\n' ' ')" >"$WORK/remote_restore.status"
	fi
fi
if [ ! -f "$WORK/remote_restore.status" ]; then
	run remote_restore "${QUICK_ARG[@]}"
fi

COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if ! git diff --quiet HEAD 2>/dev/null; then
	COMMIT="$COMMIT (worktree had uncommitted changes)"
fi
mkdir -p "$(dirname "$OUT")"
"$BIN/bench_report" --dir "$WORK" --out "$OUT" --command "$COMMAND" --commit "$COMMIT" \
	--date "$(date -u '+%Y-%m-%d %H:%M UTC')" --build "$BUILD_DESC" \
	"${QUICK_ARG[@]}"
