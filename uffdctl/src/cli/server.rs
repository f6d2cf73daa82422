//! `uffdctl server ...`: the serving process itself: its status, and a
//! handover to a new process (an upgrade) without stopping any VM.

use std::time::{Duration, Instant};

use clap::Subcommand;
use proto::api;

use crate::client::Client;
use crate::{CliError, Result};

/// Server commands.
#[derive(Debug, Clone, Subcommand)]
pub enum ServerCmd {
    /// Which process serves, since when, why it started and what it took
    /// back.
    Status,
    /// The memory limit the server keeps its VMs under, what is in use,
    /// what reclaim gave back, and its swap store.
    Memory,
    /// Hand every VM to a new server process (this binary again, or
    /// `--binary`), without stopping any; waits until the new one serves.
    Upgrade {
        /// The server binary to start (a path on the server's host).
        #[arg(long)]
        binary: Option<std::path::PathBuf>,
        /// How long to wait for the new process, in seconds.
        #[arg(long, default_value_t = 120)]
        timeout_s: u64,
    },
}

fn health(client: &Client) -> Result<api::Health> {
    let resp = client.request("GET", "/v1/health", None)?;
    if !resp.ok() {
        return Err(CliError::Api {
            status: resp.status,
            message: resp.error_text(),
        });
    }
    serde_json::from_value(resp.body)
        .map_err(|e| CliError::Usage(format!("bad health answer: {e}")))
}

/// Print `uffdctl server status`'s lines for `h`.
pub(crate) fn print_health(h: &api::Health) {
    let started = std::time::UNIX_EPOCH + Duration::from_millis(h.started_unix_ms);
    let up = std::time::SystemTime::now()
        .duration_since(started)
        .unwrap_or_default();
    println!("pid        {}", h.pid);
    println!("version    {}", h.version);
    println!(
        "up         {:.1} s (started: {})",
        up.as_secs_f64(),
        h.start
    );
    println!(
        "kept       {}",
        if h.kept {
            "yes: VMs survive a crash of this process and an upgrade"
        } else {
            "no (--no-keeper): VMs die with this process"
        }
    );
    if h.start != "first" {
        println!("adopted    {} VM(s)", h.adopted_vms);
        if let Some(ms) = h.recovery_ms {
            println!("recovery   {ms:.1} ms");
        }
        for l in &h.lost_vms {
            println!("lost       {l}");
        }
    }
}

fn print_memory(m: &api::MemoryStatus) {
    let mib = |b: u64| b >> 20;
    println!(
        "reclaim    {}",
        if m.reclaim {
            "on"
        } else {
            "off (--reclaim off)"
        }
    );
    match m.limit_bytes {
        Some(l) => println!("limit      {} MiB ({})", mib(l), m.limit_source),
        None => println!("limit      none known"),
    }
    if let Some(w) = m.watermark_bytes {
        println!("watermark  {} MiB", mib(w));
    }
    println!("in use     {} MiB", mib(m.usage_bytes));
    println!("resident   {} MiB of guest memory", mib(m.resident_bytes));
    println!("given back {} MiB", mib(m.given_back_bytes));
    println!(
        "swap       {} pages in {} MiB ({} MiB file{}) at {}",
        m.swap.pages,
        mib(m.swap.stored_bytes),
        mib(m.swap.file_bytes),
        if m.swap.full { ", full" } else { "" },
        m.swap.path
    );
    if let Some(k) = m.oom_kills {
        println!("oom kills  {k} (in the server's cgroup)");
    }
    if let Some(why) = &m.behind_reason {
        println!("behind     {why}");
    }
    if !m.thrashing_vms.is_empty() {
        println!("thrashing  {}", m.thrashing_vms.join(", "));
    }
}

/// Run `cmd` against the server behind `client`.
pub fn run(cmd: ServerCmd, client: &Client, json: bool) -> Result<()> {
    match cmd {
        ServerCmd::Memory => {
            let resp = client.request("GET", "/v1/memory", None)?;
            if !resp.ok() {
                return Err(CliError::Api {
                    status: resp.status,
                    message: resp.error_text(),
                });
            }
            let m: api::MemoryStatus = serde_json::from_value(resp.body)
                .map_err(|e| CliError::Usage(format!("bad memory answer: {e}")))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&m).unwrap_or_default());
            } else {
                print_memory(&m);
            }
            Ok(())
        }
        ServerCmd::Status => {
            let h = health(client)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&h).unwrap_or_default());
            } else {
                print_health(&h);
            }
            Ok(())
        }
        ServerCmd::Upgrade { binary, timeout_s } => {
            let before = health(client)?;
            let binary = binary
                .map(|b| {
                    std::path::absolute(&b)
                        .map(|p| p.display().to_string())
                        .map_err(|source| CliError::Local {
                            what: format!("resolve {}", b.display()),
                            source,
                        })
                })
                .transpose()?;
            let req = api::Upgrade { binary };
            let t0 = Instant::now();
            let resp = client.request("POST", "/v1/server/upgrade", Some(&super::body(&req)))?;
            if !resp.ok() {
                return Err(CliError::Api {
                    status: resp.status,
                    message: resp.error_text(),
                });
            }
            let started: api::UpgradeStarted = serde_json::from_value(resp.body)
                .map_err(|e| CliError::Usage(format!("bad upgrade answer: {e}")))?;
            if !json {
                println!(
                    "pid {} hands {} VM(s) over to {}",
                    started.pid, started.vms, started.binary
                );
            }
            // The new process answers once it serves every VM it took.
            let deadline = t0 + Duration::from_secs(timeout_s);
            loop {
                if let Ok(h) = health(client) {
                    if h.pid != before.pid {
                        if json {
                            println!("{}", serde_json::to_string_pretty(&h).unwrap_or_default());
                        } else {
                            println!(
                                "pid {} serves {} VM(s) after {:.0} ms",
                                h.pid,
                                h.adopted_vms,
                                t0.elapsed().as_secs_f64() * 1e3
                            );
                            for l in &h.lost_vms {
                                println!("lost: {l}");
                            }
                        }
                        return Ok(());
                    }
                }
                if Instant::now() > deadline {
                    return Err(CliError::Usage(format!(
                        "no new server answered within {timeout_s} s; see the server's log"
                    )));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}
