//! The markdown report: machine, command, and one table per benchmark.
//!
//! Rows come from the benches' JSON lines; the volume bench's own JSON
//! (one object of medians) is converted here. Completeness is checked
//! against [`Plan::expected_keys`]: a failed bench or a missing row is
//! listed in the report and makes the run fail.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::Value;

use crate::numbers::{fmt_num, fmt_ratio};
use crate::plan::{Plan, BENCHES};
use crate::row::{Row, Stats};

/// Facts about the run printed in the report's header.
#[derive(Debug, Clone, Default)]
pub struct RunInfo {
    pub command: String,
    pub date: String,
    pub commit: String,
    pub build: String,
    pub cpus: usize,
    pub cpu_model: String,
    pub kernel: String,
    pub mem_total_kib: u64,
}

/// What one bench produced.
#[derive(Debug, Clone, Default)]
pub struct BenchOutput {
    /// Its rows.
    pub rows: Vec<Row>,
    /// Why it failed, if it did (exit status, unreadable output).
    pub failure: Option<String>,
}

/// Rows of the volume bench from its `--json` object.
pub fn volume_rows(v: &Value) -> Result<Vec<Row>, Box<dyn std::error::Error>> {
    let get = |k: &str| {
        v[k].as_f64()
            .ok_or_else(|| format!("volume_snapshot JSON lacks {k}: {v}"))
    };
    let (s1, s16, cp, clones) = (
        get("snapshot_1g_ms")?,
        get("snapshot_16g_ms")?,
        get("cp_1g_ms")?,
        get("clones_total_ms")?,
    );
    let n = v["clones"].as_f64().unwrap_or(100.0);
    let table = "Reflink volumes (issue 4)";
    let note = "the volume bench reports medians of 5 only (no spread)";
    Ok(vec![
        Row::new(
            "volume_snapshot",
            "volume.snap16_vs_snap1",
            table,
            "snapshot of a 16 GiB volume full of data",
            "ms",
            &[s16],
            "snapshot of a 1 GiB volume full of data",
            &[s1],
        )
        .goal("≈ 1, both in milliseconds")
        .note(note),
        Row::new(
            "volume_snapshot",
            "volume.snap1_vs_cp",
            table,
            "snapshot of a 1 GiB volume",
            "ms",
            &[s1],
            "cp --reflink=never + fsync of the 1 GiB volume",
            &[cp],
        )
        .goal("≪ 1")
        .note(note),
        Row::new(
            "volume_snapshot",
            "volume.clone_vs_cp",
            table,
            &format!("one clone of a snapshot (mean of {n:.0} clones, {clones:.1} ms in all)"),
            "ms",
            &[clones / n],
            "cp --reflink=never + fsync of the 1 GiB volume",
            &[cp],
        )
        .goal("≪ 1")
        .note(note),
    ])
}

fn fmt_median(s: &Option<Stats>, unit: &str, missing: &str) -> String {
    s.as_ref().map_or_else(
        || missing.to_owned(),
        |s| format!("{} {unit}", fmt_num(s.median)),
    )
}

fn fmt_spread(s: &Option<Stats>) -> String {
    match s {
        None => "—".into(),
        Some(s) if s.n == 1 => "n/a".into(),
        Some(s) => format!("{}–{} (n={})", fmt_num(s.min), fmt_num(s.max), s.n),
    }
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

/// Render the report; returns it and the list of problems (failed benches,
/// missing rows), which must be empty for the run to pass.
pub fn render(
    info: &RunInfo,
    plan: &Plan,
    outputs: &BTreeMap<String, BenchOutput>,
) -> (String, Vec<String>) {
    let mut md = String::new();
    let mut problems = Vec::new();
    let _ = writeln!(md, "# pagefork benchmarks\n");
    let _ = writeln!(
        md,
        "Produced by one run of the command below; every figure comes from that run \
         (nothing is carried over from earlier runs). Rerun it to reproduce.\n"
    );
    let _ = writeln!(md, "| | |\n|---|---|");
    let _ = writeln!(md, "| command | `{}` |", cell(&info.command));
    let _ = writeln!(md, "| date | {} |", info.date);
    let _ = writeln!(md, "| commit | {} |", info.commit);
    let _ = writeln!(
        md,
        "| machine | {} cores, {}, {:.1} GiB RAM (MemTotal {} kB) |",
        info.cpus,
        info.cpu_model,
        info.mem_total_kib as f64 / (1u64 << 20) as f64,
        info.mem_total_kib
    );
    let _ = writeln!(md, "| kernel | {} |", info.kernel);
    let _ = writeln!(md, "| build | {} |", info.build);
    let _ = writeln!(
        md,
        "| mode | {} ({} repetitions per measurement{}) |",
        if plan.quick {
            "quick (smoke run: smaller sizes, timings not meaningful)"
        } else {
            "full"
        },
        plan.reps,
        if plan.quick {
            ""
        } else {
            "; in-process micro-measurements 11"
        }
    );
    let _ = writeln!(
        md,
        "\nHow to read: each row puts pagefork next to its baseline, both measured side by side in \
         this run. Figures are medians; spread is min–max over n repetitions; ratio = pagefork \
         median / baseline median (for times, below 1 means pagefork is faster). Goals come from \
         the issues. Notes follow each table.\n"
    );
    let _ = writeln!(
        md,
        "Caveat for this kind of machine: it is a nested KVM guest with few vCPUs, and every \
         page-fault round trip wakes a thread on another vCPU. Waking an idle vCPU costs tens of \
         µs, so fault-heavy rows (lazy restore, the Firecracker baseline) run up to ~10× slower \
         on an idle machine than on a busy one (the baseline handler measured ~4 µs per fault \
         with the other CPU busy, 40–60 µs with it idle). Compare ratios within one run, not \
         absolute figures across runs.\n"
    );

    let all: Vec<&Row> = outputs.values().flat_map(|o| &o.rows).collect();
    md.push_str(&crate::goals::render(plan, &all));

    for bench in BENCHES {
        let out = outputs.get(bench).cloned().unwrap_or_default();
        if let Some(f) = &out.failure {
            problems.push(format!("{bench}: {f}"));
        }
        for key in plan.expected_keys(bench) {
            if !out.rows.iter().any(|r| r.key == key) {
                problems.push(format!("{bench}: row {key} missing"));
            }
        }
        // Tables in order of first appearance.
        let mut tables: Vec<&str> = Vec::new();
        for r in &out.rows {
            if !tables.contains(&r.table.as_str()) {
                tables.push(&r.table);
            }
        }
        if tables.is_empty() {
            let _ = writeln!(
                md,
                "## {bench}\n\nNo rows: {}\n",
                out.failure
                    .as_deref()
                    .unwrap_or("the bench emitted nothing")
            );
        }
        for t in tables {
            let _ = writeln!(md, "## {t}\n");
            let _ = writeln!(md, "| # | what | pagefork | spread | baseline | baseline median | spread | ratio | goal |");
            let _ = writeln!(md, "|---|---|---:|---|---|---:|---|---:|---|");
            let rows: Vec<&Row> = out.rows.iter().filter(|r| r.table == t).collect();
            for (i, r) in rows.iter().enumerate() {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    i + 1,
                    cell(&r.what),
                    fmt_median(&r.pagefork, &r.unit, "not yet available"),
                    fmt_spread(&r.pagefork),
                    cell(&r.baseline_name),
                    fmt_median(&r.baseline, &r.unit, "—"),
                    fmt_spread(&r.baseline),
                    fmt_ratio(r.ratio),
                    cell(&r.goal),
                );
            }
            let _ = writeln!(md);
            // One line per distinct note, naming the rows it applies to.
            let mut notes: Vec<(&str, Vec<usize>)> = Vec::new();
            for (i, r) in rows.iter().enumerate().filter(|(_, r)| !r.note.is_empty()) {
                match notes.iter_mut().find(|(n, _)| *n == r.note) {
                    Some((_, idx)) => idx.push(i + 1),
                    None => notes.push((&r.note, vec![i + 1])),
                }
            }
            for (note, idx) in notes {
                let idx: Vec<String> = idx.iter().map(ToString::to_string).collect();
                let rows = if idx.len() == 1 { "Row" } else { "Rows" };
                let _ = writeln!(md, "- {rows} {}: {note}", idx.join(", "));
            }
            let _ = writeln!(md);
        }
    }

    let _ = writeln!(md, "## Completeness\n");
    if problems.is_empty() {
        let _ = writeln!(md, "Every bench completed and emitted every expected row.");
    } else {
        for p in &problems {
            let _ = writeln!(md, "- **{p}**");
        }
    }
    (md, problems)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_rows_and_failures_are_problems() {
        let plan = Plan::new(true);
        let mut outs = BTreeMap::new();
        outs.insert(
            "fc_restore".into(),
            BenchOutput {
                rows: Vec::new(),
                failure: Some("exit 1".into()),
            },
        );
        let (md, problems) = render(&RunInfo::default(), &plan, &outs);
        assert!(problems.iter().any(|p| p.contains("fc_restore: exit 1")));
        assert!(problems
            .iter()
            .any(|p| p.contains("row fc.seq.single missing")));
        assert!(md.contains("## Completeness"));
    }

    #[test]
    fn volume_json_becomes_three_rows() {
        let v = serde_json::json!({"snapshot_1g_ms": 2.0, "snapshot_16g_ms": 2.2, "cp_1g_ms": 900.0, "clones": 100, "clones_total_ms": 300.0});
        let rows = volume_rows(&v).expect("rows");
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].ratio, Some(1.1));
    }
}
