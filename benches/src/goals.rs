//! The goals at a glance: every figure issues 9 (VM snapshots), 13
//! (performance), 39 (shared bases), 40 (snapshots in an object store) and
//! 45 (restarts: the fault path no slower than before) set a goal for,
//! this run's value next to the figure the issue started from, and whether
//! the goal is met.
//!
//! The "before" column quotes the starting point each issue states (the
//! figures of the report in main when it was filed); "this run" is read
//! from the rows of this run, so the judgement is mechanical and cannot
//! drift from the tables below it. A goal whose row this run does not have
//! (a quick run has no 4 GiB sizes) is listed as not measured.

use std::fmt::Write as _;

use crate::numbers::fmt_num;
use crate::plan::Plan;
use crate::row::Row;

/// Which number of a row a goal judges.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Measure {
    /// pagefork's median.
    Median,
    /// pagefork's median / the baseline's median.
    Ratio,
    /// pagefork's median minus the baseline's median.
    OverBaseline,
}

/// How the measured number is judged.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Check {
    AtMost(f64),
    AtLeast(f64),
    /// No threshold: the issue asks for the figure only.
    Report,
}

/// One goal of an issue.
#[derive(Debug, Clone, PartialEq)]
pub struct Goal {
    pub issue: u32,
    /// What is measured, in words.
    pub figure: String,
    /// The issue's starting point, quoted ("—" when the figure is new).
    pub before: String,
    /// The row it is read from.
    pub key: String,
    pub measure: Measure,
    pub check: Check,
    /// The goal in the issue's words.
    pub goal: String,
}

fn goal(
    issue: u32,
    figure: impl Into<String>,
    before: impl Into<String>,
    key: impl Into<String>,
    measure: Measure,
    check: Check,
    text: impl Into<String>,
) -> Goal {
    Goal {
        issue,
        figure: figure.into(),
        before: before.into(),
        key: key.into(),
        measure,
        check,
        goal: text.into(),
    }
}

fn size(mib: u64) -> String {
    if mib >= 1024 {
        format!("{} GiB", mib / 1024)
    } else {
        format!("{mib} MiB")
    }
}

/// The goals of issues 9, 13, 39, 40 and 45 under `plan`.
pub fn goals(plan: &Plan) -> Vec<Goal> {
    use Check::*;
    use Measure::*;
    let mut g = Vec::new();
    // Issue 13: "where we stand" and its goals.
    for (mib, before) in [(256, "8.4 ms"), (1024, "11.8 ms"), (4096, "24.8 ms")] {
        g.push(goal(
            13,
            format!(
                "live fork of a {} VM → 1 child answers (no pool)",
                size(mib)
            ),
            before,
            format!("fork.e2e1.{mib}"),
            Median,
            Report,
            "report (the pool's rows below are the goals)",
        ));
    }
    g.push(goal(
        13,
        "fork of a 256 MiB template → child answers, pooled VMM (p50)",
        "8.4 ms (live fork, no pool)",
        "pool.template",
        Median,
        AtMost(1.0),
        "≤ 1 ms p50 (zeroboot 0.79 ms)",
    ));
    g.push(goal(
        13,
        "create from a snapshot of the template → answers, pooled VMM (p50)",
        "—",
        "pool.restore",
        Median,
        AtMost(1.0),
        "≤ 1 ms p50",
    ));
    g.push(goal(
        13,
        "live fork → child answers, pooled, minus the parent's pause and the write-protect armed before it",
        "—",
        "pool.live",
        OverBaseline,
        AtMost(1.0),
        "≤ parent pause + 1 ms",
    ));
    g.push(goal(
        13,
        "100 children of the template in one request, all answering",
        "—",
        "pool.fanout_small",
        Median,
        AtMost(100.0),
        "≤ 100 ms",
    ));
    g.push(goal(
        13,
        "1,000 children of the template in one request, all answering",
        "—",
        "pool.fanout_large",
        Median,
        AtMost(800.0),
        "≤ 800 ms (zeroboot 815 ms)",
    ));
    g.push(goal(
        13,
        "host memory per child once all answer (KiB)",
        "—",
        "pool.child_memory",
        Median,
        // 265 KB = 258.8 KiB.
        AtMost(265_000.0 / 1024.0),
        "≤ 265 KB",
    ));
    g.push(goal(
        13,
        "one page per fault, sequential: pagefork / Firecracker's example handler",
        "1.33×",
        "fc.seq.single",
        Ratio,
        AtMost(0.9),
        "≤ 0.9×",
    ));
    g.push(goal(
        13,
        "the same with a 50 µs poll window (--fault-poll-us 50, off by default)",
        "—",
        "fc.seq.single_poll",
        Ratio,
        AtMost(0.9),
        "≤ 0.9×",
    ));
    g.push(goal(
        13,
        "one fault's round trip p50: pagefork / the example handler",
        "—",
        "fc.seq.latency_p50",
        Ratio,
        AtMost(0.9),
        "≤ 0.9×",
    ));
    g.push(goal(
        13,
        format!(
            "lazy restore of {} with the defaults / prefetched",
            size(plan.lazy_mib)
        ),
        "1.58×",
        "lazy.touch.readahead",
        Ratio,
        AtMost(1.2),
        "≤ 1.2×",
    ));
    for (mib, before) in [(256, "2.4 ms"), (1024, "4.5 ms"), (4096, "15.3 ms")] {
        g.push(goal(
            13,
            format!(
                "fork pause, {} VM with {} written, 4 KiB pages (µs)",
                size(mib),
                size(mib / 4)
            ),
            before,
            format!("fork.pause.{mib}"),
            Median,
            Report,
            "report (hugepages are the goal)",
        ));
        g.push(goal(
            13,
            format!(
                "fork pause, {} VM with {} written, 2 MiB hugepages (µs)",
                size(mib),
                size(mib / 4)
            ),
            "—",
            format!("fork.pause_huge.{mib}"),
            Median,
            if mib == 4096 { AtMost(1000.0) } else { Report },
            if mib == 4096 { "≤ 1 ms" } else { "report" },
        ));
        g.push(goal(
            13,
            format!(
                "one first write after a fork, {} VM: a 2 MiB block / a 4 KiB page",
                size(mib)
            ),
            "—",
            format!("fork.first_write_huge.{mib}"),
            Ratio,
            Report,
            "report",
        ));
    }
    g.push(goal(
        13,
        format!(
            "lazy restore of {} on hugepages / prefetched",
            size(plan.lazy_mib)
        ),
        "—",
        "lazy.touch.huge",
        Ratio,
        AtMost(1.1),
        "≤ 1.1×",
    ));
    g.push(goal(
        13,
        "guest disk write throughput (pages from guest RAM, 1 MiB per request) / host pwrite, same file",
        "one 512-byte sector per exit (row disk.write.one)",
        "disk.write.pages",
        Ratio,
        AtLeast(0.5),
        "≥ 0.5",
    ));
    // Issue 9.
    for pct in [1, 10, 50, 100] {
        g.push(goal(
            9,
            format!(
                "dirty snapshot, {pct} % dirty: pause / its write-protect of KVM-mapped memory"
            ),
            "—",
            format!("snap.pause.{pct}"),
            Ratio,
            AtMost(1.3),
            "≤ 1.3×",
        ));
        g.push(goal(
            9,
            format!("dirty snapshot, {pct} % dirty: whole request / write + fsync"),
            "—",
            format!("snap.total.{pct}"),
            Ratio,
            AtMost(1.3),
            "≤ 1.3×",
        ));
        g.push(goal(
            9,
            format!("dirty snapshot, {pct} % dirty: bytes written / dirty bytes"),
            "—",
            format!("snap.bytes.{pct}"),
            Ratio,
            AtMost(1.0),
            "1.00",
        ));
    }
    g.push(goal(
        9,
        format!(
            "dirty snapshot pause at 100 % dirty of {} (µs)",
            size(plan.snap_mib)
        ),
        "—",
        "snap.pause.100",
        Median,
        AtMost(20_000.0),
        "< 20 ms (Cube ~487 ms)",
    ));
    for &mib in &plan.restore_mib {
        g.push(goal(
            9,
            format!("restore a {} VM until it answers (ms)", size(mib)),
            "—",
            format!("snap.restore.{mib}"),
            Median,
            AtMost(10.0),
            "< 10 ms, flat (Firecracker < 8 ms)",
        ));
    }
    g.push(goal(
        9,
        format!(
            "rollback in place, {} VM, 10 % dirty (ms)",
            size(plan.snap_mib)
        ),
        "—",
        "snap.rollback",
        Median,
        AtMost(10.0),
        "≤ 10 ms (Cube 81.6 ms)",
    ));
    g.push(goal(
        9,
        format!(
            "rollback in place, {} VM on hugepages, 10 % dirty (ms)",
            size(plan.snap_mib)
        ),
        "—",
        "snap.rollback_huge",
        Median,
        AtMost(10.0),
        "≤ 10 ms",
    ));
    g.push(goal(
        9,
        format!(
            "clone(n = {}, concurrency 50) of a 256 MiB VM (ms)",
            plan.clone_count
        ),
        "—",
        "snap.clone",
        Median,
        AtMost(270.0),
        "≤ 270 ms at n = 100 (Cube 540.9 ms)",
    ));
    g.push(goal(
        9,
        format!("the same clone with --vmm-pool {} (ms)", plan.clone_count),
        "—",
        "snap.clone_pool",
        Median,
        AtMost(270.0),
        "≤ 270 ms at n = 100",
    ));
    g.push(goal(
        9,
        "a restored guest touching its working set, lazy / prefetched (a snapshot's memory.img is served by the raw-image path)",
        "—",
        "lazy.touch.readahead",
        Ratio,
        AtMost(1.5),
        "≤ 1.5×",
    ));
    // Shared bases (issue 39): host memory per VM and start latency, bases
    // on / off (--shared-bases=false).
    let ws_kib = plan.density_ws_mib * 1024;
    for n in &plan.density_children {
        g.push(goal(
            39,
            format!(
                "{n} children of a paused {} template, each reading its {} (W): host memory the reads add per child (KiB)",
                size(plan.density_mib),
                size(plan.density_ws_mib)
            ),
            "W (every child copied what it read)",
            format!("density.read.{n}"),
            Median,
            AtMost(ws_kib as f64 * 0.05),
            "≤ 5 % of W, near 0",
        ));
    }
    g.push(goal(
        39,
        "children writing half of W: host memory added per child (KiB)",
        "W",
        "density.write_half",
        Median,
        AtMost(ws_kib as f64 / 2.0 * 1.05),
        "≤ 1.05 × own writes (W/2)",
    ));
    g.push(goal(
        39,
        "host memory per child, start and reads, at the largest count (KiB)",
        "—",
        "density.child",
        Median,
        Report,
        "report (zeroboot: 265 KB per fork)",
    ));
    g.push(goal(
        39,
        "restores of one snapshot reading 16 MiB each, until all read: bases on / off",
        "—",
        "density.restore_time",
        Ratio,
        AtMost(1.05),
        "≤ 1.05×",
    ));
    g.push(goal(
        39,
        "template fork → child answers (p50): bases on / off",
        "—",
        "density.fork_p50",
        Ratio,
        AtMost(1.05),
        "≤ 1.05×",
    ));
    g.push(goal(
        39,
        "create from a snapshot → answers (p50): bases on / off",
        "—",
        "density.restore_p50",
        Ratio,
        AtMost(1.05),
        "≤ 1.05×",
    ));
    // Issue 40: snapshots in an object store, restored on another host.
    let remote = size(plan.remote_mib);
    g.push(goal(
        40,
        format!("restore of a {remote} snapshot from the store on another host → answers, / a local restore"),
        "—",
        "remote.answer",
        Ratio,
        AtMost(2.0),
        "≤ 2×",
    ));
    g.push(goal(
        40,
        "the same restore until the guest answers (ms)",
        "—",
        "remote.answer",
        Median,
        AtMost(730.0),
        "beat Cube's 730 ms across nodes",
    ));
    g.push(goal(
        40,
        format!(
            "the same until the guest has touched its {} working set, / the floor (the longer of plain parallel GETs of its chunks and a local restore's touch)",
            size(plan.remote_ws_mib)
        ),
        "—",
        "remote.ws",
        Ratio,
        AtMost(1.5),
        "≤ 1.5×",
    ));
    g.push(goal(
        40,
        "stored bytes fetched before the guest answers, / the snapshot's",
        "—",
        "remote.fetched_answer",
        Ratio,
        Report,
        "≪ 1",
    ));
    g.push(goal(
        40,
        "push, / a plain multipart upload of the same bytes",
        "—",
        "remote.push",
        Ratio,
        Report,
        "report",
    ));
    // Issue 45: restarts must not make the fault path slower; this build
    // against the commit before (ecc19e4), alternated in the same run.
    let fork_mib = plan.fork_mib.first().copied().unwrap_or(256);
    for (key, figure) in [
        (
            "ab.fault_rtt",
            format!(
                "one fault's round trip ({}, written one page per fault): this build / ecc19e4",
                size(plan.ab_fault_mib)
            ),
        ),
        (
            "ab.lazy_restore",
            format!(
                "lazy restore of {} from a raw image, the guest touching all of it: this build / ecc19e4",
                size(plan.lazy_mib)
            ),
        ),
        (
            "ab.fork_child",
            format!(
                "live fork of a {} VM → the child answers: this build / ecc19e4",
                size(fork_mib)
            ),
        ),
    ] {
        g.push(goal(
            45,
            format!("{figure} (same run, alternated)"),
            "—",
            key,
            Ratio,
            AtMost(1.05),
            "≤ 1.05× of ecc19e4 (no slower)",
        ));
    }
    g
}

/// The value a goal judges, from its row.
pub fn value(goal: &Goal, row: &Row) -> Option<f64> {
    let p = row.pagefork.as_ref()?.median;
    match goal.measure {
        Measure::Median => Some(p),
        Measure::Ratio => row.ratio,
        Measure::OverBaseline => Some(p - row.baseline.as_ref()?.median),
    }
}

/// "met", "missed" or "report" for a measured value.
pub fn verdict(check: Check, v: f64) -> &'static str {
    match check {
        Check::AtMost(x) if v <= x => "met",
        Check::AtLeast(x) if v >= x => "met",
        Check::Report => "report",
        _ => "**missed**",
    }
}

fn shown(goal: &Goal, row: &Row, v: f64) -> String {
    match goal.measure {
        Measure::Ratio => format!("{v:.2}×"),
        Measure::Median => format!("{} {}", fmt_num(v), row.unit),
        Measure::OverBaseline => format!("+{} {}", fmt_num(v), row.unit),
    }
}

/// The "goals at a glance" section for the rows of one run.
pub fn render(plan: &Plan, rows: &[&Row]) -> String {
    let mut md = String::new();
    let _ = writeln!(md, "## Goals at a glance (issues 9, 13, 39, 40 and 45)\n");
    let _ = writeln!(
        md,
        "Every figure issues 9, 13, 39, 40 and 45 set a goal for. \"Before\" quotes the starting point the \
         issue states; \"this run\" is read from the rows below; the verdict is mechanical. Where \
         a goal is missed, docs/performance.md gives the measured floor that stands in the way.\n"
    );
    let _ = writeln!(
        md,
        "| issue | figure | before | this run | goal | verdict | row |"
    );
    let _ = writeln!(md, "|---|---|---|---:|---|---|---|");
    let (mut met, mut missed) = (0, 0);
    for g in goals(plan) {
        let row = rows.iter().find(|r| r.key == g.key);
        let (now, verdict) = match row.and_then(|r| value(&g, r).map(|v| (r, v))) {
            Some((r, v)) if v.is_finite() => (shown(&g, r, v), verdict(g.check, v)),
            _ => ("not measured".to_owned(), "—"),
        };
        match verdict {
            "met" => met += 1,
            "**missed**" => missed += 1,
            _ => {}
        }
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | `{}` |",
            g.issue, g.figure, g.before, now, g.goal, verdict, g.key
        );
    }
    let _ = writeln!(md, "\n{met} goals met, {missed} missed in this run.\n");
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_goal_reads_a_row_the_plan_expects() {
        for quick in [false, true] {
            let plan = Plan::new(quick);
            let keys: Vec<String> = crate::plan::BENCHES
                .iter()
                .flat_map(|b| plan.expected_keys(b))
                .collect();
            for g in goals(&plan) {
                // Quick runs drop the 4 GiB sizes.
                if quick && g.key.ends_with(".4096") {
                    continue;
                }
                assert!(keys.contains(&g.key), "goal reads {} (not a row)", g.key);
            }
        }
    }

    #[test]
    fn verdicts_follow_the_check() {
        assert_eq!(verdict(Check::AtMost(1.0), 0.99), "met");
        assert_eq!(verdict(Check::AtMost(1.0), 1.01), "**missed**");
        assert_eq!(verdict(Check::AtLeast(0.5), 0.02), "**missed**");
        assert_eq!(verdict(Check::Report, 7.0), "report");
    }

    #[test]
    fn over_baseline_subtracts_medians() {
        let row = Row::new("b", "k", "t", "w", "ms", &[5.0], "base", &[3.5]);
        let g = goal(
            13,
            "f",
            "—",
            "k",
            Measure::OverBaseline,
            Check::AtMost(1.0),
            "g",
        );
        assert_eq!(value(&g, &row), Some(1.5));
    }
}
