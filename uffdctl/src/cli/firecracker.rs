//! `uffdctl firecracker ...`: Firecracker UFFD listeners.

use clap::Subcommand;
use serde_json::Value;

use super::table::render;
use super::vm::call;
use crate::client::Client;
use crate::Result;

/// Firecracker listener commands.
#[derive(Debug, Subcommand)]
pub enum FirecrackerCmd {
    /// Serve Firecracker's Uffd memory backend on SOCKET from IMAGE (a
    /// Firecracker memory snapshot or a raw image).
    Listen {
        /// Socket path to create for Firecracker's `mem_backend.backend_path`.
        #[arg(value_name = "SOCKET")]
        listen_on: String,
        /// Memory file to serve (or, with --snapshot, a snapshot's name).
        image: String,
        /// The memory file is a compressed memory.zst image.
        #[arg(long, conflicts_with = "snapshot")]
        zstd: bool,
        /// Serve the memory of the pagefork snapshot named IMAGE (its
        /// memory.zst if it has one).
        #[arg(long)]
        snapshot: bool,
        /// Fault-around block in KiB (0 = one page per fault).
        #[arg(long)]
        fault_around_kib: Option<u64>,
        /// Largest readahead window in KiB for sequential faults (0 = off).
        #[arg(long)]
        readahead_kib: Option<u64>,
        /// Record the first VM's working set and prefetch it for later VMs.
        #[arg(long)]
        working_set: bool,
    },
    /// List listeners with their counters.
    List,
    /// Stop accepting on a listener (its connected VMs keep being served).
    Delete { id: String },
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// Run a Firecracker listener command.
pub fn run(cmd: FirecrackerCmd, client: &Client, as_json: bool) -> Result<()> {
    let out = match cmd {
        FirecrackerCmd::Listen {
            listen_on,
            image,
            zstd,
            snapshot,
            fault_around_kib,
            readahead_kib,
            working_set,
        } => {
            let req = proto::api::CreateListener {
                socket: listen_on,
                memory_source: if snapshot {
                    proto::api::MemorySource::Snapshot { name: image }
                } else if zstd {
                    proto::api::MemorySource::Zstd { path: image }
                } else {
                    proto::api::MemorySource::File { path: image }
                },
                fault_around_kib,
                readahead_kib,
                working_set,
            };
            call(
                client,
                "POST",
                "/v1/firecracker/listeners",
                Some(&super::body(&req)),
            )?
        }
        FirecrackerCmd::List => {
            let v = call(client, "GET", "/v1/firecracker/listeners", None)?;
            if !as_json {
                let rows: Vec<Vec<String>> = v["listeners"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|l| {
                                vec![
                                    s(&l["id"]),
                                    s(&l["socket"]),
                                    s(&l["memory_source"]["path"]),
                                    s(&l["accepted"]),
                                    s(&l["refused"]),
                                    s(&l["recorded_pages"]),
                                    l["vms"].as_array().map_or(0, Vec::len).to_string(),
                                    s(&l["last_refusal"]),
                                ]
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let headers = [
                    "ID",
                    "SOCKET",
                    "SOURCE",
                    "ACCEPTED",
                    "REFUSED",
                    "WS_PAGES",
                    "VMS",
                    "LAST REFUSAL",
                ];
                print!("{}", render(&headers, &rows));
                return Ok(());
            }
            v
        }
        FirecrackerCmd::Delete { id } => call(
            client,
            "DELETE",
            &format!("/v1/firecracker/listeners/{id}"),
            None,
        )?,
    };
    println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    Ok(())
}
