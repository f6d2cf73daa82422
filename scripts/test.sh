#!/usr/bin/env bash
# Set up and run every pagefork test: unit and property tests, end-to-end
# tests with real uffd-server and vmm processes on real KVM and
# userfaultfd, volume tests on a loop-mounted XFS with reflink=1, and a
# second pass of the fork, snapshot, Firecracker, core, stall and restart
# tests with a warm VMM pool (--vmm-pool 2), a third of the fork, snapshot
# and restart tests on hugepage guest RAM (--hugepages), a bounded run of
# every fuzz target, and a smoke run of every benchmark (no timing
# thresholds). The remote-snapshot tests run against a one-node Ceph
# (scripts/ceph.sh) booted for the run.
#
# With CI=true, tests whose prerequisites (/dev/kvm, /dev/userfaultfd, the
# XFS mount) are missing fail instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh

# One build serves every pass below: incremental state would only take disk
# (4 GB of it), and each `cargo test` names --workspace so that all passes
# resolve the same features and reuse the first build's artifacts instead of
# compiling the workspace a second time.
export CARGO_INCREMENTAL=0

# The run needs room for the build, the loop-mounted XFS's written blocks,
# snapshots and the fuzz build: a full disk shows up much later as a linker
# crash, so say it here.
need_gib="${PAGEFORK_TEST_DISK_GIB:-9}"
free_gib=$(df -P -BG . | awk 'NR == 2 { sub("G", "", $4); print $4 }')
echo "== disk: ${free_gib} GiB free here, the run needs about ${need_gib} GiB" >&2
if [ "$free_gib" -lt "$need_gib" ]; then
	echo "test: only ${free_gib} GiB free on $(df -P . | awk 'NR == 2 { print $6 }'); the run needs about ${need_gib} GiB (free space or set PAGEFORK_TEST_DISK_GIB)" >&2
	exit 1
fi

XFS_DIR="${PAGEFORK_XFS_DIR:-/var/tmp/pagefork-test-xfs}"
CEPH_DIR="$PWD/target/ceph"
stop_xfs=false
stop_ceph=false
cleanup() {
	if [ -n "${trim_pid:-}" ]; then
		kill "$trim_pid" 2>/dev/null || true
		# A trim under way finishes before the XFS is unmounted.
		for _ in 1 2 3 4 5 6 7 8 9 10; do pgrep -x fstrim >/dev/null || break; sleep 0.5; done
	fi
	if $stop_ceph; then
		# A boot still under way finishes first, so nothing outlives the stop.
		[ -z "${ceph_pid:-}" ] || wait "$ceph_pid" 2>/dev/null || true
		scripts/ceph.sh stop "$CEPH_DIR" >/dev/null 2>&1 || true
	fi
	if $stop_xfs; then scripts/xfs-loop.sh down "$XFS_DIR" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
if [ -z "${PAGEFORK_XFS_DIR:-}" ]; then
	stop_xfs=true
	scripts/xfs-loop.sh up "$XFS_DIR" >/dev/null
fi
export PAGEFORK_XFS_DIR="$XFS_DIR"
# The loop-mounted XFS's image keeps every block the tests ever wrote until
# the filesystem hands freed ones back (a trim punches them out of the
# image): without it the image grows by gigabytes over a run.
(while sleep 60; do fstrim "$XFS_DIR" || true; done) >/dev/null 2>&1 &
trim_pid=$!

# The S3 store of the remote-snapshot tests (a one-node Ceph with RGW),
# unless AWS_* already name one: booted once, while the workspace builds.
mkdir -p target
if [ -z "${AWS_ENDPOINT_URL:-}" ]; then
	stop_ceph=true
	ceph_t0=$SECONDS
	scripts/ceph.sh start "$CEPH_DIR" >target/ceph.env 2>target/ceph.log &
	ceph_pid=$!
fi
export PAGEFORK_SCHEMATHESIS="${PAGEFORK_VENV:-/var/tmp/pagefork-venv}/bin/schemathesis"

echo "== build" >&2
cargo build --workspace --all-targets

echo "== format and lints" >&2
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
python3 scripts/test_check_imports.py
python3 scripts/check-imports.py

if $stop_ceph; then
	if ! wait "$ceph_pid"; then
		cat target/ceph.log >&2
		echo "test: cannot boot Ceph (above)" >&2
		exit 1
	fi
	eval "$(cat target/ceph.env)"
	echo "== $(grep -o 'ceph: up in [0-9]* s' target/ceph.log || echo 'ceph: up'), $((SECONDS - ceph_t0)) s before the tests, overlapping the build" >&2
fi

echo "== tests" >&2
set +e
cargo test --workspace --no-fail-fast -- --test-threads=2 2>&1 | tee target/test.log
status=${PIPESTATUS[0]}
set -e
if $stop_ceph; then
	# Only the first pass uses the store: free its memory and cores. Its
	# address goes with it (the benchmark run boots a store of its own).
	scripts/ceph.sh stop "$CEPH_DIR"
	stop_ceph=false
	unset AWS_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN \
		AWS_REGION AWS_ALLOW_HTTP PAGEFORK_REMOTE PAGEFORK_CEPH_DIR
fi

echo "== fork, snapshot, Firecracker, core, stall and restart tests again, with a warm VMM pool" >&2
set +e
PAGEFORK_VMM_POOL=2 cargo test --workspace --no-fail-fast \
	--test fork_e2e --test snapshot_e2e --test firecracker_e2e --test core_e2e --test stalls_e2e \
	--test based_e2e --test lineage_e2e --test restart_e2e \
	-- --test-threads=2 2>&1 | tee -a target/test.log
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
set -e

echo "== fork, snapshot and restart tests again, on hugepage guest RAM (2 MiB hugetlb)" >&2
set +e
PAGEFORK_HUGEPAGES=true cargo test --workspace --no-fail-fast \
	--test fork_e2e --test snapshot_e2e --test based_e2e --test lineage_e2e --test restart_e2e \
	-- --test-threads=2 2>&1 | tee -a target/test.log
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
set -e

echo "== fuzzing (bounded)" >&2
if ! scripts/fuzz.sh "${FUZZ_SECONDS:-30}"; then
	status=1
fi

echo "== benchmark smoke run" >&2
scripts/bench.sh --quick --out target/bench-quick.md

# One closing line for the whole run, summed over every test binary.
summary=$(awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
	END { printf "%d passed, %d failed", p, f }' target/test.log)
echo "tests: $summary"
exit "$status"
