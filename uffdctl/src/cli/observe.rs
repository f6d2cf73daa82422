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
        match (step.present, &step.shared_from) {
            (Some(true), _) => line.push_str(": present"),
            (Some(false), Some(base)) => line.push_str(&format!(": shared from {base}")),
            (Some(false), None) => line.push_str(": not present"),
            (None, _) => {}
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

/// What `uffdctl access` does.
#[derive(Debug, Clone, Default)]
pub struct AccessArgs {
    /// Only pages first faulted within this many ms of the record's start.
    pub within_ms: Option<u64>,
    /// Save the heat map PNG here instead of printing.
    pub out: Option<std::path::PathBuf>,
    /// Begin the record again (after printing it).
    pub reset: bool,
}

/// `uffdctl access VM [--within-ms N] [-o FILE] [--reset]`: what the VM
/// touched since its record began.
pub fn access(client: &Client, id: &str, args: &AccessArgs, as_json: bool) -> Result<()> {
    if let Some(out) = &args.out {
        let (status, bytes) = client.get_bytes(&format!("/v1/vms/{id}/access.png"))?;
        if !(200..300).contains(&status) {
            let message = serde_json::from_slice::<proto::api::ErrorBody>(&bytes)
                .map(|e| e.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
            return Err(CliError::Api { status, message });
        }
        std::fs::write(out, &bytes).map_err(|source| CliError::Local {
            what: format!("write {}", out.display()),
            source,
        })?;
        println!("{id}: access map written to {}", out.display());
    } else {
        let path = match args.within_ms {
            Some(ms) => format!("/v1/vms/{id}/access?within_ms={ms}"),
            None => format!("/v1/vms/{id}/access"),
        };
        let v = call(client, "GET", &path, None)?;
        if as_json {
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        } else {
            let map: proto::api::AccessMap =
                serde_json::from_value(v).map_err(|e| CliError::Answer(e.to_string()))?;
            print_access(&map, args.within_ms);
        }
    }
    if args.reset {
        call(client, "POST", &format!("/v1/vms/{id}/access/reset"), None)?;
        println!("{id}: access record begins again now");
    }
    Ok(())
}

fn print_access(map: &proto::api::AccessMap, within_ms: Option<u64>) {
    println!(
        "{}: {} of {} pages faulted{} since {}",
        map.id,
        map.touched,
        map.pages,
        within_ms.map_or(String::new(), |ms| format!(" in the first {ms} ms")),
        clock_ms(map.since_ms)
    );
    let rows: Vec<Vec<String>> = map
        .extents
        .iter()
        .map(|e| {
            vec![
                format!("{}..{}", e.start_page, e.start_page + e.pages),
                e.pages.to_string(),
                e.kind.name().to_owned(),
                format!("{}..{}", e.first_ms, e.last_ms),
                e.faults.to_string(),
            ]
        })
        .collect();
    print!(
        "{}",
        super::table::render(&["PAGES", "COUNT", "FIRST FAULT", "AT MS", "FAULTS"], &rows)
    );
}
