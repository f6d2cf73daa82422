#!/usr/bin/env bash
# Set up and run the pagefork demo: a server in a temporary state directory
# on a loop-mounted XFS (so the disk snapshot step can reflink), a VM, a
# fork, a snapshot, restores on a shared base, a crash of the server.
#
# Installs only what the demo needs (the test suite's setup is
# scripts/setup.sh) and builds only the three binaries it runs. Says how
# long setup, build and run took. The binaries are built with the `demo`
# profile (Cargo.toml): for build time, in target/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."

T0=$SECONDS
# The demo's own needs: libclang-dev (userfaultfd-sys runs bindgen at build
# time), xfsprogs and mount's losetup (the loop-mounted XFS of the volume
# snapshot step).
missing=()
dpkg -s libclang-dev >/dev/null 2>&1 || missing+=(libclang-dev)
command -v mkfs.xfs >/dev/null 2>&1 || missing+=(xfsprogs)
command -v losetup >/dev/null 2>&1 || missing+=(mount)
if [ "${#missing[@]}" -gt 0 ]; then
	echo "demo: installing ${missing[*]}" >&2
	if [ "$(id -u)" -ne 0 ]; then
		echo "demo: need root to install ${missing[*]} (run as root or install them yourself)" >&2
		exit 1
	fi
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq "${missing[@]}" >/dev/null
fi
command -v cargo >/dev/null 2>&1 || {
	echo "demo: cargo not found; install a Rust toolchain (rustup) first" >&2
	exit 1
}
T_SETUP=$((SECONDS - T0))

T1=$SECONDS
cargo build --profile demo -p uffd-server -p vmm -p uffdctl --bins
T_BUILD=$((SECONDS - T1))
TARGET="${CARGO_TARGET_DIR:-target}"

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
T2=$SECONDS
status=0
"$TARGET/demo/uffdctl" demo --state-dir "$STATE" --server-bin "$TARGET/demo/uffd-server" "$@" || status=$?
T_RUN=$((SECONDS - T2))
echo
echo "demo: setup ${T_SETUP} s, build ${T_BUILD} s, run ${T_RUN} s (the demo started $((T2 - T0)) s after the script)"
exit "$status"
