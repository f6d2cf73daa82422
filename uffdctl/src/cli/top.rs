//! `uffdctl top`: a live full-screen view of every VM's faults, refreshed
//! in place (ratatui over crossterm).
//!
//! Each refresh reads `GET /v1/vms` and turns the counters into rates
//! against the previous reading: faults per second by kind, pages
//! installed and pre-write copies per second, and the median and 99th
//! percentile of the time the server spent on the VM's events in the
//! interval (from the log2 buckets of `service_us_log2`; shown as the
//! bucket's upper bound, `<16` meaning under 16 µs). Keys: `f` faults/s,
//! `i` installs/s, `r` resident, `p` p99, `n` id (sort), `q` or Esc quits.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use proto::api::{VmInfo, VmList};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Cell, Paragraph, Row, Table};
use ratatui::DefaultTerminal;

use super::vm::call;
use crate::client::Client;
use crate::{CliError, Result};

/// What the table is sorted by (largest first, but the id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sort {
    Faults,
    Installs,
    Resident,
    P99,
    Id,
}

impl Sort {
    fn name(self) -> &'static str {
        match self {
            Sort::Faults => "faults/s",
            Sort::Installs => "installs/s",
            Sort::Resident => "resident",
            Sort::P99 => "p99",
            Sort::Id => "id",
        }
    }
}

/// One VM's line: rates over the last interval and its totals.
#[derive(Debug, Clone, PartialEq)]
pub struct VmRates {
    pub id: String,
    pub state: String,
    pub missing_s: f64,
    pub wp_s: f64,
    pub remove_s: f64,
    pub installed_s: f64,
    pub copies_s: f64,
    pub resident: u64,
    /// Upper bounds (µs) of the buckets holding the median and the 99th
    /// percentile of the interval's events; `None` without events.
    pub p50_us: Option<u64>,
    pub p99_us: Option<u64>,
    /// Faults since the VM began (MISSING + WP + REMOVE).
    pub faults: u64,
    /// Its pages in the swap store now.
    pub swapped: u64,
    /// Faults per second on pages reclaim gave back before.
    pub refaults_s: f64,
    /// Reclaim finds it thrashing.
    pub thrashing: bool,
}

fn faults_of(v: &VmInfo) -> u64 {
    v.faults.missing + v.faults.write_protect + v.faults.removes
}

/// The upper bound in µs of the bucket where `permille`/1000 of
/// `buckets` is reached.
pub fn percentile_us(buckets: &[u64], permille: u64) -> Option<u64> {
    let total: u64 = buckets.iter().sum();
    if total == 0 {
        return None;
    }
    let want = (permille * total).div_ceil(1000).max(1);
    let mut seen = 0;
    for (i, n) in buckets.iter().enumerate() {
        seen += n;
        if seen >= want {
            return Some(2u64 << i);
        }
    }
    None
}

/// Rates of `now` against `before` (same VM, `secs` apart); without an
/// earlier reading, rates are zero.
pub fn rates(now: &VmInfo, before: Option<&VmInfo>, secs: f64) -> VmRates {
    let f = &now.faults;
    let per_s = |a: u64, b: Option<u64>| match b {
        Some(b) if secs > 0.0 => a.saturating_sub(b) as f64 / secs,
        _ => 0.0,
    };
    let b = before.map(|b| &b.faults);
    let delta: Vec<u64> = f
        .service_us_log2
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let old = b.and_then(|b| b.service_us_log2.get(i)).copied();
            match old {
                Some(o) => n.saturating_sub(o),
                None if b.is_some() => *n,
                None => 0,
            }
        })
        .collect();
    VmRates {
        id: now.id.clone(),
        state: now.state.to_string(),
        missing_s: per_s(f.missing, b.map(|b| b.missing)),
        wp_s: per_s(f.write_protect, b.map(|b| b.write_protect)),
        remove_s: per_s(f.removes, b.map(|b| b.removes)),
        installed_s: per_s(f.pages_installed, b.map(|b| b.pages_installed)),
        copies_s: per_s(f.wp_copies, b.map(|b| b.wp_copies)),
        resident: now.resident_pages,
        p50_us: percentile_us(&delta, 500),
        p99_us: percentile_us(&delta, 990),
        faults: faults_of(now),
        swapped: now.reclaim.swapped_pages,
        refaults_s: per_s(now.reclaim.refaults, before.map(|b| b.reclaim.refaults)),
        thrashing: now.reclaim.thrashing,
    }
}

impl VmRates {
    fn faults_s(&self) -> f64 {
        self.missing_s + self.wp_s + self.remove_s
    }
}

/// Sort `rows` by `sort`.
pub fn sort_rows(rows: &mut [VmRates], sort: Sort) {
    let num = |id: &str| {
        id.trim_start_matches("vm-")
            .parse::<u64>()
            .unwrap_or(u64::MAX)
    };
    rows.sort_by(|a, b| {
        let by = match sort {
            Sort::Faults => b.faults_s().total_cmp(&a.faults_s()),
            Sort::Installs => b.installed_s.total_cmp(&a.installed_s),
            Sort::Resident => b.resident.cmp(&a.resident),
            Sort::P99 => b.p99_us.cmp(&a.p99_us),
            Sort::Id => std::cmp::Ordering::Equal,
        };
        by.then(num(&a.id).cmp(&num(&b.id)))
    });
}

/// One reading of the server.
struct Reading {
    at: Instant,
    vms: BTreeMap<String, VmInfo>,
}

fn read(client: &Client) -> Result<Reading> {
    let v = call(client, "GET", "/v1/vms", None)?;
    let list: VmList = serde_json::from_value(v).map_err(|e| CliError::Answer(e.to_string()))?;
    Ok(Reading {
        at: Instant::now(),
        vms: list.vms.into_iter().map(|v| (v.id.clone(), v)).collect(),
    })
}

fn rate(x: f64) -> String {
    format!("{x:.0}")
}

fn us(x: Option<u64>) -> String {
    x.map_or("-".into(), |v| format!("<{v}"))
}

/// `uffdctl top [--interval S]`.
pub fn run(client: &Client, interval: Duration, sort: Sort) -> Result<()> {
    let first = read(client)?;
    let mut terminal = ratatui::try_init().map_err(|source| CliError::Local {
        what: "set up the terminal".into(),
        source,
    })?;
    let r = main_loop(&mut terminal, client, interval, sort, first);
    ratatui::restore();
    r
}

fn main_loop(
    terminal: &mut DefaultTerminal,
    client: &Client,
    interval: Duration,
    mut sort: Sort,
    first: Reading,
) -> Result<()> {
    let mut before = first;
    let mut now = read(client)?;
    loop {
        let secs = now.at.duration_since(before.at).as_secs_f64();
        let mut rows: Vec<VmRates> = now
            .vms
            .values()
            .map(|v| rates(v, before.vms.get(&v.id), secs))
            .collect();
        sort_rows(&mut rows, sort);
        let local = |e| CliError::Local {
            what: "draw".into(),
            source: e,
        };
        terminal
            .draw(|f| draw(f, &rows, &now, &before, interval, sort))
            .map_err(local)?;
        let next = Instant::now() + interval;
        while let Some(left) = next.checked_duration_since(Instant::now()) {
            if !event::poll(left).map_err(local)? {
                break;
            }
            if let Event::Key(k) = event::read().map_err(local)? {
                if k.kind != KeyEventKind::Press {
                    continue;
                }
                match k.code {
                    KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                    KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                        return Ok(())
                    }
                    KeyCode::Char('f') => sort = Sort::Faults,
                    KeyCode::Char('i') => sort = Sort::Installs,
                    KeyCode::Char('r') => sort = Sort::Resident,
                    KeyCode::Char('p') => sort = Sort::P99,
                    KeyCode::Char('n') => sort = Sort::Id,
                    _ => continue,
                }
                sort_rows(&mut rows, sort);
                terminal
                    .draw(|f| draw(f, &rows, &now, &before, interval, sort))
                    .map_err(local)?;
            }
        }
        before = now;
        now = read(client)?;
    }
}

fn draw(
    f: &mut ratatui::Frame<'_>,
    rows: &[VmRates],
    now: &Reading,
    before: &Reading,
    interval: Duration,
    sort: Sort,
) {
    let [head, body] =
        Layout::vertical([Constraint::Length(4), Constraint::Min(3)]).areas(f.area());
    let total = |g: fn(&VmRates) -> f64| rows.iter().map(g).sum::<f64>();
    let mut all = vec![0u64; 16];
    for v in now.vms.values() {
        let old = before.vms.get(&v.id);
        for (i, n) in v.faults.service_us_log2.iter().enumerate() {
            let o = old
                .and_then(|o| o.faults.service_us_log2.get(i))
                .copied()
                .unwrap_or(*n);
            if let Some(slot) = all.get_mut(i) {
                *slot += n.saturating_sub(o);
            }
        }
    }
    let summary = format!(
        "{} VMs  faults/s {}  installed/s {}  WP copies/s {}  resident {} pages  p50 {} us  p99 {} us",
        rows.len(),
        rate(total(VmRates::faults_s)),
        rate(total(|r| r.installed_s)),
        rate(total(|r| r.copies_s)),
        rows.iter().map(|r| r.resident).sum::<u64>(),
        us(percentile_us(&all, 500)),
        us(percentile_us(&all, 990)),
    );
    let keys = format!(
        "every {:.1} s, sorted by {} (f faults, i installs, r resident, p p99, n id; q quits)",
        interval.as_secs_f64(),
        sort.name()
    );
    f.render_widget(
        Paragraph::new(vec![Line::from(summary), Line::from(keys)])
            .block(Block::bordered().title(" pagefork top ")),
        head,
    );
    let header = Row::new(
        [
            "VM", "STATE", "MISS/s", "WP/s", "REM/s", "INST/s", "COPY/s", "RESIDENT", "P50us",
            "P99us", "FAULTS", "SWAPPED", "REFLT/s",
        ]
        .map(Cell::from),
    )
    .style(Style::default().add_modifier(Modifier::BOLD));
    let lines = rows.iter().map(|r| {
        Row::new([
            r.id.clone(),
            r.state.clone(),
            rate(r.missing_s),
            rate(r.wp_s),
            rate(r.remove_s),
            rate(r.installed_s),
            rate(r.copies_s),
            r.resident.to_string(),
            us(r.p50_us),
            us(r.p99_us),
            r.faults.to_string(),
            r.swapped.to_string(),
            if r.thrashing {
                format!("{} T", rate(r.refaults_s))
            } else {
                rate(r.refaults_s)
            },
        ])
    });
    let widths = [
        Constraint::Length(8),
        Constraint::Length(9),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(7),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(9),
        Constraint::Length(7),
        Constraint::Length(7),
        Constraint::Length(10),
        Constraint::Length(9),
        Constraint::Length(9),
    ];
    f.render_widget(
        Table::new(lines, widths)
            .header(header)
            .block(Block::bordered()),
        body,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(id: &str, missing: u64, buckets: Vec<u64>) -> VmInfo {
        serde_json::from_value(serde_json::json!({
            "id": id, "state": "running", "kind": "pagefork", "pid": 1,
            "memory_mib": 8, "vcpus": 1, "pages": {}, "resident_pages": 10,
            "faults": {"missing": missing, "write_protect": 0, "pages_installed": missing,
                       "removes": 0, "fault_around_kib": 0, "service_us_log2": buckets}
        }))
        .expect("a VmInfo")
    }

    #[test]
    fn rates_are_deltas_per_second_and_percentiles_come_from_bucket_deltas() {
        let before = vm("vm-1", 100, vec![5, 0, 0, 0]);
        let now = vm("vm-1", 300, vec![5, 90, 9, 1]);
        let r = rates(&now, Some(&before), 2.0);
        assert_eq!(r.missing_s, 100.0);
        assert_eq!(r.installed_s, 100.0);
        assert_eq!(r.p50_us, Some(4)); // bucket 1: [2, 4) µs
        assert_eq!(r.p99_us, Some(8)); // the 99th of 100 is in bucket 2
        assert_eq!(r.faults, 300);
        let first = rates(&now, None, 0.0);
        assert_eq!((first.missing_s, first.p50_us), (0.0, None));
    }

    #[test]
    fn sorting_puts_the_busiest_first_and_ties_by_id() {
        let mut rows = vec![
            rates(&vm("vm-2", 10, vec![]), Some(&vm("vm-2", 0, vec![])), 1.0),
            rates(&vm("vm-10", 50, vec![]), Some(&vm("vm-10", 0, vec![])), 1.0),
            rates(&vm("vm-3", 10, vec![]), Some(&vm("vm-3", 0, vec![])), 1.0),
        ];
        sort_rows(&mut rows, Sort::Faults);
        let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["vm-10", "vm-2", "vm-3"]);
        sort_rows(&mut rows, Sort::Id);
        let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["vm-2", "vm-3", "vm-10"]);
    }
}
