//! `uffdctl trace`, `uffdctl page --explain`: watching a VM's faults as
//! they happen, and a page's whole chain.

use proto::api::{FaultEvent, FaultKind, PageInfo, TraceDropped};

use super::vm::call;
use crate::client::Client;
use crate::{CliError, Result};

/// `uffdctl trace VM [--kind K] [--limit N]`: print the VM's faults as
/// they happen (one line each, or the NDJSON lines with `--json`).
pub fn trace(
    client: &Client,
    id: &str,
    kind: Option<FaultKind>,
    limit: Option<u64>,
    as_json: bool,
) -> Result<()> {
    let mut path = format!("/v1/vms/{id}/faults?follow=true");
    if let Some(k) = kind {
        path.push_str(&format!("&kind={}", k.name()));
    }
    if let Some(n) = limit {
        path.push_str(&format!("&limit={n}"));
    }
    let mut bad = None;
    let failed = client.stream_lines(&path, |line| {
        if as_json {
            println!("{line}");
        } else if let Ok(ev) = serde_json::from_str::<FaultEvent>(line) {
            println!("{}", event_line(&ev));
        } else if let Ok(d) = serde_json::from_str::<TraceDropped>(line) {
            println!("... {} events dropped (this reader fell behind)", d.dropped);
        } else {
            bad = Some(line.to_owned());
            return false;
        }
        true
    })?;
    if let Some(r) = failed {
        return Err(CliError::Api {
            status: r.status,
            message: r.error_text(),
        });
    }
    match bad {
        Some(line) => Err(CliError::Answer(line)),
        None => Ok(()),
    }
}

/// One event as a line: time, VM, kind, page, source, pages, service time.
pub fn event_line(ev: &FaultEvent) -> String {
    let secs = ev.time_us / 1_000_000;
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    format!(
        "{h:02}:{m:02}:{s:02}.{:06} {} {:<8} page {:>8} {:<5} from {:<24} {:>4} page{} {:>6} us",
        ev.time_us % 1_000_000,
        ev.vm,
        ev.kind.name(),
        ev.page,
        if ev.write { "write" } else { "read" },
        ev.source.as_deref().unwrap_or("-"),
        ev.pages,
        if ev.pages == 1 { " " } else { "s" },
        ev.service_us,
    )
}

/// `uffdctl page VM P --explain`.
pub fn explain(client: &Client, id: &str, page: u64, as_json: bool) -> Result<()> {
    let v = call(
        client,
        "GET",
        &format!("/v1/vms/{id}/pages/{page}?explain=true"),
        None,
    )?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(());
    }
    let info: PageInfo = serde_json::from_value(v).map_err(|e| CliError::Answer(e.to_string()))?;
    println!("{id} page {page}:");
    for (i, step) in info
        .explain
        .map(|e| e.chain)
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let arrow = if i == 0 { "  " } else { "  ← " };
        let mut line = format!("{arrow}{}", step.at);
        match step.present {
            Some(true) => line.push_str(": present"),
            Some(false) => line.push_str(": not present"),
            None => {}
        }
        if let Some(inst) = &step.installed {
            line.push_str(&format!(
                ", installed by {} from {} at {}",
                inst.event,
                inst.from,
                clock_ms(inst.time_ms)
            ));
        }
        if let (Some(f), Some(off)) = (&step.file, step.offset) {
            line.push_str(&format!(": {f} at offset {off} ({off:#x})"));
        }
        println!("{line}");
    }
    Ok(())
}

/// Milliseconds since the epoch as UTC `HH:MM:SS.mmm`.
fn clock_ms(ms: u64) -> String {
    let secs = ms / 1000;
    format!(
        "{:02}:{:02}:{:02}.{:03} UTC",
        (secs / 3600) % 24,
        (secs / 60) % 60,
        secs % 60,
        ms % 1000
    )
}
