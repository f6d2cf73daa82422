#!/usr/bin/env bash
# Set up and run the pagefork demo: a server in a temporary state directory
# on a loop-mounted XFS (so the disk snapshot step can reflink), a VM, a
# fork, a snapshot.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
cargo build --workspace --bins

DIR="$(mktemp -d /var/tmp/pagefork-demo.XXXXXX)"
cleanup() {
	scripts/xfs-loop.sh down "$DIR" >/dev/null 2>&1 || true
	rmdir "$DIR" 2>/dev/null || true
}
trap cleanup EXIT
if [ "$(id -u)" -eq 0 ] && XFS_LOOP_SIZE=4G scripts/xfs-loop.sh up "$DIR" >/dev/null 2>&1; then
	STATE="$DIR/state"
else
	echo "demo: no loop-mounted XFS (needs root); the disk snapshot step will be skipped" >&2
	STATE="$DIR/state"
fi
target/debug/uffdctl demo --state-dir "$STATE" "$@"
