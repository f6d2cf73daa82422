//! One result row of a benchmark, and the statistics of repeated samples.
//!
//! A row is pagefork's figure next to the baseline it must beat, both
//! measured in the same run: medians and spreads of repeated samples, the
//! ratio of the medians (pagefork / baseline) and the goal it is judged by.

use serde::{Deserialize, Serialize};

/// Median and spread of repeated samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// 10th and 90th percentiles (nearest rank).
    pub p10: f64,
    pub p90: f64,
    /// Number of samples.
    pub n: usize,
}

impl Stats {
    /// Statistics of `samples`; `None` if there are none (or any is NaN).
    pub fn of(samples: &[f64]) -> Option<Stats> {
        if samples.is_empty() || samples.iter().any(|x| x.is_nan()) {
            return None;
        }
        let mut v = samples.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let rank = |pct: usize| {
            // Nearest rank: the smallest value with at least pct % of the
            // samples at or below it.
            v[(pct * n).div_ceil(100).clamp(1, n) - 1]
        };
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Stats {
            median,
            min: v[0],
            max: v[n - 1],
            p10: rank(10),
            p90: rank(90),
            n,
        })
    }
}

/// One row of the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// The bench binary that produced it (`lazy_restore`, `fork`, ...).
    pub bench: String,
    /// Stable id of the row, checked by the report (`fork.pause.1024`).
    pub key: String,
    /// The report table the row belongs to.
    pub table: String,
    /// What is measured.
    pub what: String,
    /// Unit of the figures (`µs`, `ms`, `KiB`).
    pub unit: String,
    /// pagefork's samples; `None` when pagefork cannot be measured yet.
    pub pagefork: Option<Stats>,
    /// The baseline's name.
    pub baseline_name: String,
    /// The baseline's samples; `None` for a row without a baseline.
    pub baseline: Option<Stats>,
    /// pagefork median / baseline median.
    pub ratio: Option<f64>,
    /// The goal the row is judged by.
    pub goal: String,
    /// Anything a reader needs to interpret the row.
    pub note: String,
}

impl Row {
    /// A row from samples; the ratio is computed from the medians.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        bench: &str,
        key: &str,
        table: &str,
        what: &str,
        unit: &str,
        pagefork: &[f64],
        baseline_name: &str,
        baseline: &[f64],
    ) -> Row {
        let (p, b) = (Stats::of(pagefork), Stats::of(baseline));
        let ratio = match (&p, &b) {
            (Some(p), Some(b)) if b.median > 0.0 => Some(p.median / b.median),
            _ => None,
        };
        Row {
            bench: bench.into(),
            key: key.into(),
            table: table.into(),
            what: what.into(),
            unit: unit.into(),
            pagefork: p,
            baseline_name: baseline_name.into(),
            baseline: b,
            ratio,
            goal: String::new(),
            note: String::new(),
        }
    }

    /// Set the goal.
    pub fn goal(mut self, goal: impl Into<String>) -> Row {
        self.goal = goal.into();
        self
    }

    /// Set the note.
    pub fn note(mut self, note: impl Into<String>) -> Row {
        self.note = note.into();
        self
    }

    /// Print the row as one JSON line on stdout.
    pub fn emit(&self) {
        match serde_json::to_string(self) {
            Ok(s) => println!("{s}"),
            Err(e) => eprintln!("cannot serialize row {}: {e}", self.key),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_sample_counts() {
        assert_eq!(Stats::of(&[3.0, 1.0, 2.0]).map(|s| s.median), Some(2.0));
        assert_eq!(
            Stats::of(&[4.0, 1.0, 2.0, 3.0]).map(|s| s.median),
            Some(2.5)
        );
    }

    #[test]
    fn spread_covers_all_samples() {
        let s = Stats::of(&[5.0, 1.0, 9.0, 3.0, 7.0]).expect("stats");
        assert_eq!((s.min, s.max, s.n), (1.0, 9.0, 5));
        assert!(s.p10 >= s.min && s.p90 <= s.max);
    }

    #[test]
    fn no_samples_give_no_stats_and_no_ratio() {
        assert!(Stats::of(&[]).is_none());
        let r = Row::new("b", "k", "t", "w", "µs", &[], "base", &[1.0]);
        assert!(r.ratio.is_none());
    }

    #[test]
    fn ratio_is_pagefork_over_baseline() {
        let r = Row::new("b", "k", "t", "w", "µs", &[2.0, 2.0], "base", &[4.0]);
        assert_eq!(r.ratio, Some(0.5));
    }
}
