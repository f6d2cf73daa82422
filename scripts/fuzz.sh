#!/usr/bin/env bash
# Run every cargo-fuzz target for a bounded time, starting from the
# checked-in seeds (fuzz/seeds/<target>/). Installs cargo-fuzz if missing.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]     (default 30; env FUZZ_SECONDS)
#
# The machine has one (stable) toolchain; libFuzzer's instrumentation needs
# unstable rustc flags, which RUSTC_BOOTSTRAP=1 allows on stable. A crash
# leaves its input in fuzz/artifacts/<target>/ and fails the script.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

seconds="${1:-${FUZZ_SECONDS:-30}}"
if ! cargo fuzz --version >/dev/null 2>&1; then
	echo "fuzz: installing cargo-fuzz" >&2
	cargo install cargo-fuzz --locked --quiet
fi
export RUSTC_BOOTSTRAP=1

total=0
for target in $(cargo fuzz list); do
	work="corpus/$target"
	mkdir -p "$work"
	echo "fuzz: $target for ${seconds}s" >&2
	# New inputs go to the scratch corpus; the seeds are read-only input.
	cargo fuzz run "$target" "$work" "seeds/$target" -- \
		-max_total_time="$seconds" -print_final_stats=1 2>"target-$target.log" ||
		{ tail -40 "target-$target.log" >&2; echo "fuzz: $target FAILED" >&2; exit 1; }
	runs=$(awk '/stat::number_of_executed_units/ { print $NF }' "target-$target.log")
	echo "fuzz: $target: ${runs:-0} inputs, no crash" >&2
	total=$((total + ${runs:-0}))
	rm -f "target-$target.log"
done
echo "fuzz: $total inputs in all, no crash"
