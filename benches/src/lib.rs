//! Benchmarks that compare pagefork with its baselines in one run.
//!
//! Every bench binary prints its results as JSON [`Row`]s, one per line on
//! stdout (progress goes to stderr). `bench_report` turns the rows of all
//! benches into the markdown report (`BENCHMARKS.md`); `scripts/bench.sh`
//! builds, runs and assembles everything.
//!
//! - [`row`]: the row type and the statistics (median, spread) of samples.
//! - [`plan`]: sizes and repetitions for full and `--quick` runs, and the
//!   rows each bench must emit (the report fails on a missing one).
//! - [`report`]: the markdown report and its completeness check.
//! - [`numbers`]: how figures read in the report (digits, `1/N` ratios).
//! - [`goals`]: the goals of issues 9, 13 and 40 at a glance, judged from the
//!   rows of one run.
//! - [`sys`]: host counters (Shmem, a process's RSS) and machine facts.
//! - [`mapping`]: owned mmaps (shared memfd, anonymous, private file).
//! - [`wp_floor`]: a bare UFFDIO_WRITEPROTECT of populated shmem, in-process
//!   (the floor of a fork's pause).
//! - [`phases`]: the server's fault-path timing by phase, as a note.
//! - [`fc_handler`]: the baseline page-fault handler that does what
//!   Firecracker's example on-demand handler does.
//!
//! End-to-end benches reuse the test harness of `pagefork-tests`
//! ([`pagefork_tests::TestServer`]), which starts a real `uffd-server` with
//! real `vmm` processes from the directory of the running binary (or
//! `$PAGEFORK_BIN_DIR`).

pub mod fc_handler;
pub mod goals;
pub mod mapping;
pub mod numbers;
pub mod phases;
pub mod plan;
pub mod report;
pub mod row;
pub mod sys;
pub mod wp_floor;

pub use plan::Plan;
pub use row::{Row, Stats};
