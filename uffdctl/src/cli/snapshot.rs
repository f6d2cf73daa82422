//! `uffdctl snapshot ...`: VM snapshots (memory, vCPU/device state and the
//! attached volume), here and in the server's object store (`remote.rs`).

use clap::Subcommand;
use proto::api;
use serde_json::Value;

use super::body;
use super::table::render;
use super::vm::call;
use crate::client::Client;
use crate::Result;

/// Snapshot commands.
#[derive(Debug, Subcommand)]
pub enum SnapshotCmd {
    /// Snapshot a running VM (the guest pauses only for a moment).
    Create {
        /// The VM (vm-N).
        vm: String,
        /// The snapshot's name.
        name: String,
        /// full, incremental (pages not from the VM's base snapshot) or
        /// dirty (pages written since its last snapshot).
        #[arg(long, default_value = "full")]
        mode: String,
        /// Also write memory.zst (restores then serve the compressed image).
        #[arg(long)]
        compress: bool,
    },
    /// List the complete snapshots (with --remote, those in the store).
    #[command(alias = "ls")]
    List {
        #[arg(long)]
        remote: bool,
    },
    /// Show one snapshot (with --remote, one in the store).
    Show {
        name: String,
        #[arg(long)]
        remote: bool,
    },
    /// Delete a snapshot no VM reads from (with --remote, from the store).
    #[command(alias = "rm")]
    Delete {
        name: String,
        #[arg(long)]
        remote: bool,
    },
    /// Start a VM from a snapshot (remote:NAME: one in the store, lazily).
    Restore { name: String },
    /// Push a snapshot to the object store (with its volume snapshot and
    /// working set), showing its progress.
    Push { name: String },
    /// Pull a snapshot from the object store into this server's catalog.
    Pull {
        name: String,
        /// The local name (default: the same).
        #[arg(long = "as")]
        local: Option<String>,
    },
    /// Start VMs from a snapshot in the object store, all or none.
    Clone {
        name: String,
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[arg(long, default_value_t = 8)]
        concurrency: u32,
    },
    /// Delete the chunks in the object store no snapshot names.
    Gc,
}

fn mode(s: &str) -> Result<api::SnapshotMode> {
    match s {
        "full" => Ok(api::SnapshotMode::Full),
        "incremental" => Ok(api::SnapshotMode::Incremental),
        "dirty" => Ok(api::SnapshotMode::Dirty),
        other => Err(crate::CliError::Usage(format!(
            "unknown mode {other}; use full, incremental or dirty"
        ))),
    }
}

fn row(v: &Value) -> Vec<String> {
    let s = |x: &Value| match x {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    };
    vec![
        s(&v["name"]),
        s(&v["vm"]),
        s(&v["mode"]),
        s(&v["parent"]),
        s(&v["memory_mib"]),
        s(&v["pages"]["data"]),
        s(&v["bytes_on_disk"]),
        s(&v["exclusive_bytes"]),
        s(&v["volume_snapshot"]),
    ]
}

const HEADERS: [&str; 9] = [
    "NAME",
    "VM",
    "MODE",
    "PARENT",
    "MEM_MIB",
    "DATA_PAGES",
    "ON_DISK",
    "EXCLUSIVE",
    "VOLUME",
];

/// `POST /v1/vms/{vm}/snapshots`, drawing a progress bar on a terminal
/// while it runs: the pages saved so far, from the VM's
/// `snapshot_saving`, polled beside the request.
fn create_with_progress(client: &Client, vm: &str, req: &Value) -> Result<Value> {
    use std::sync::atomic::{AtomicBool, Ordering};
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return call(
            client,
            "POST",
            &format!("/v1/vms/{vm}/snapshots"),
            Some(req),
        );
    }
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let poller = s.spawn(|| {
            let pb = indicatif::ProgressBar::new(0);
            pb.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} [{bar:40}] {pos}/{len} pages {per_sec} eta {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            pb.set_message("pausing");
            while !done.load(Ordering::Relaxed) {
                if let Ok(v) = call(client, "GET", &format!("/v1/vms/{vm}"), None) {
                    match v.get("snapshot_saving") {
                        Some(p) => {
                            pb.set_message("saving");
                            pb.set_length(p["pages_total"].as_u64().unwrap_or(0));
                            pb.set_position(p["pages_saved"].as_u64().unwrap_or(0));
                        }
                        None if pb.length().unwrap_or(0) > 0 => {
                            pb.set_message("committing");
                            pb.set_position(pb.length().unwrap_or(0));
                        }
                        None => {}
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            pb.finish_and_clear();
        });
        let r = call(
            client,
            "POST",
            &format!("/v1/vms/{vm}/snapshots"),
            Some(req),
        );
        done.store(true, Ordering::Relaxed);
        let _ = poller.join();
        r
    })
}

/// Print `v` as JSON if that is what was asked (the command printed its
/// summary otherwise).
fn done(v: Value, as_json: bool) -> Result<()> {
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    }
    Ok(())
}

/// Run a snapshot command.
pub fn run(cmd: SnapshotCmd, client: &Client, as_json: bool) -> Result<()> {
    let out = match cmd {
        SnapshotCmd::Create {
            vm,
            name,
            mode: m,
            compress,
        } => {
            let req = api::CreateSnapshot {
                name,
                mode: mode(&m)?,
                compress,
            };
            let v = create_with_progress(client, &vm, &body(&req))?;
            if !as_json {
                println!(
                    "snapshot {} of {vm}: {} ({} pages, {} bytes written; paused {} us, {} us in all){}",
                    v["name"].as_str().unwrap_or("?"),
                    v["mode_used"].as_str().unwrap_or("?"),
                    v["pages_written"],
                    v["bytes_written"],
                    v["pause_us"],
                    v["duration_us"],
                    v["fallback_reason"]
                        .as_str()
                        .map(|r| format!("\n  not {m}: {r}"))
                        .unwrap_or_default()
                );
                if let Some(z) = v["compressed_bytes"].as_u64() {
                    println!("  memory.zst: {z} bytes");
                }
                return Ok(());
            }
            v
        }
        SnapshotCmd::List { remote: true } => {
            return done(super::remote::list(client, as_json)?, as_json)
        }
        SnapshotCmd::Show { name, remote: true } => {
            return done(super::remote::show(client, &name, as_json)?, as_json)
        }
        SnapshotCmd::Delete { name, remote: true } => super::remote::delete(client, &name)?,
        SnapshotCmd::Push { name } => {
            return done(super::remote::push(client, &name, as_json)?, as_json)
        }
        SnapshotCmd::Pull { name, local } => {
            return done(super::remote::pull(client, &name, local, as_json)?, as_json)
        }
        SnapshotCmd::Clone {
            name,
            count,
            concurrency,
        } => super::remote::clone(client, &name, count, concurrency)?,
        SnapshotCmd::Gc => return done(super::remote::gc(client, as_json)?, as_json),
        SnapshotCmd::List { remote: false } => {
            let v = call(client, "GET", "/v1/snapshots", None)?;
            if !as_json {
                let rows: Vec<Vec<String>> = v["snapshots"]
                    .as_array()
                    .map(|a| a.iter().map(row).collect())
                    .unwrap_or_default();
                print!("{}", render(&HEADERS, &rows));
                if let Some(q) = v["quarantined"].as_array().filter(|q| !q.is_empty()) {
                    println!("quarantined (did not verify): {}", Value::Array(q.clone()));
                }
                return Ok(());
            }
            v
        }
        SnapshotCmd::Show {
            name,
            remote: false,
        } => {
            let v = call(client, "GET", &format!("/v1/snapshots/{name}"), None)?;
            if !as_json {
                print!("{}", render(&HEADERS, &[row(&v)]));
                return Ok(());
            }
            v
        }
        SnapshotCmd::Delete {
            name,
            remote: false,
        } => call(client, "DELETE", &format!("/v1/snapshots/{name}"), None)?,
        SnapshotCmd::Restore { name } => {
            let req = api::CreateVm {
                memory_mib: 0,
                from_snapshot: Some(name),
                vcpus: 1,
                memory_source: None,
                volume: None,
                fault_around_kib: None,
                readahead_kib: None,
                prefetch: false,
                hugepages: None,
                reclaim: None,
            };
            call(client, "POST", "/v1/vms", Some(&body(&req)))?
        }
    };
    println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    Ok(())
}
