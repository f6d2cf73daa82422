//! `uffdctl vm ...`.

use clap::Subcommand;
use proto::api;
use serde_json::Value;

use super::body;
use super::table::render;
use crate::client::Client;
use crate::{CliError, Result};

/// VM commands.
#[derive(Debug, Subcommand)]
pub enum VmCmd {
    /// Create a VM and wait until its guest agent runs.
    Create {
        /// Guest RAM in MiB.
        #[arg(long, default_value_t = 256)]
        memory_mib: u64,
        #[arg(long, default_value_t = 1)]
        vcpus: u8,
        /// Raw memory image to serve the guest's RAM from (lazily).
        #[arg(long, conflicts_with = "zstd_image")]
        image: Option<String>,
        /// Compressed memory image (memory.zst) to serve it from (lazily).
        #[arg(long)]
        zstd_image: Option<String>,
        /// Disk volume to attach.
        #[arg(long)]
        volume: Option<String>,
        /// Fault-around block in KiB for image-backed faults (0 = off).
        #[arg(long)]
        fault_around_kib: Option<u64>,
        /// Install all memory before the guest starts.
        #[arg(long)]
        prefetch: bool,
        /// Back guest RAM with 2 MiB hugetlb pages (`--hugepages=false`
        /// for 4 KiB pages); the server's default if absent.
        #[arg(long, num_args = 0..=1, default_missing_value = "true")]
        hugepages: Option<bool>,
        /// Never give this VM's memory back under pressure (a
        /// latency-critical VM).
        #[arg(long)]
        no_reclaim: bool,
        /// Resident guest memory this VM may hold at most, in MiB; its
        /// coldest pages beyond it are given back even without pressure.
        #[arg(long)]
        memory_limit_mib: Option<u64>,
    },
    /// List VMs.
    List,
    /// List the shared bases VMs map their clean pages from: what each
    /// holds, once, and which VMs map it.
    Bases,
    /// Show one VM.
    Show { id: String },
    /// Stop and delete a VM.
    Delete { id: String },
    /// Pause a VM's vCPUs.
    Pause { id: String },
    /// Resume a VM's vCPUs.
    Resume { id: String },
    /// Fork a running VM, or a paused one (a template: it stays paused), into
    /// COUNT children without copying its memory.
    Fork {
        id: String,
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
    /// Give back every page of a VM that can be given back now (pages
    /// equal to their source are dropped, written pages compressed into
    /// the swap store); each comes back at its next access.
    Reclaim { id: String },
    /// Roll a running VM back in place to one of its snapshots.
    Rollback { id: String, snapshot: String },
    /// Clone a running VM COUNT times (all or none), through one snapshot.
    Clone {
        id: String,
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Clones being created at once at most.
        #[arg(long, default_value_t = 8)]
        concurrency: u32,
    },
    /// Run a guest agent op: fill, touch, checksum, verify, digest, identity,
    /// disk_fill, disk_write_pages, disk_checksum.
    Exec {
        id: String,
        op: String,
        #[arg(long)]
        start_page: Option<u64>,
        #[arg(long)]
        pages: Option<u64>,
        #[arg(long)]
        seed: Option<u64>,
        #[arg(long)]
        write: bool,
        #[arg(long)]
        sector: Option<u64>,
        #[arg(long)]
        count: Option<u64>,
        /// Sectors per block device request of a disk op (1 to 2048).
        #[arg(long)]
        sectors_per_io: Option<u32>,
    },
}

/// Call the API and return the body, or the server's error text.
pub fn call(client: &Client, method: &str, path: &str, body: Option<&Value>) -> Result<Value> {
    let r = client.request(method, path, body)?;
    if r.ok() {
        Ok(r.body)
    } else {
        Err(CliError::Api {
            status: r.status,
            message: r.error_text(),
        })
    }
}

fn pages_summary(v: &Value) -> String {
    v["pages"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, n)| format!("{k}={n}"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

fn vm_row(v: &Value) -> Vec<String> {
    let s = |k: &str| match &v[k] {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    };
    let mem = &v["memory"];
    vec![
        s("id"),
        s("state"),
        s("pid"),
        s("memory_mib"),
        mib(&mem["own_bytes"]),
        mib(&mem["shared_bytes"]),
        mem["base"].as_str().unwrap_or("-").to_owned(),
        pages_summary(v),
        s("parent"),
    ]
}

/// Bytes as MiB with one decimal.
fn mib(v: &Value) -> String {
    v.as_u64()
        .map_or_else(|| "-".into(), |b| format!("{:.1}", b as f64 / 1048576.0))
}

/// OWN: the host memory the VM alone holds; SHARED: what it maps from its
/// base, held once for all the VMs on it.
const HEADERS: [&str; 9] = [
    "ID",
    "STATE",
    "PID",
    "MEM_MIB",
    "OWN_MIB",
    "SHARED_MIB",
    "BASE",
    "PAGES BY SOURCE",
    "PARENT",
];

const BASE_HEADERS: [&str; 6] = ["BASE", "KIND", "OF", "HELD_MIB", "SIZE_MIB", "USERS"];

fn base_row(b: &Value) -> Vec<String> {
    vec![
        b["id"].as_str().unwrap_or("?").to_owned(),
        b["kind"].as_str().unwrap_or("?").to_owned(),
        b["of"].as_str().unwrap_or("?").to_owned(),
        mib(&b["bytes"]),
        mib(&b["size_bytes"]),
        b["users"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|u| u.as_str().unwrap_or("?"))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .unwrap_or_default(),
    ]
}

/// Run a VM command.
pub fn run(cmd: VmCmd, client: &Client, as_json: bool) -> Result<()> {
    let out = match cmd {
        VmCmd::Create {
            memory_mib,
            vcpus,
            image,
            zstd_image,
            volume,
            fault_around_kib,
            prefetch,
            hugepages,
            no_reclaim,
            memory_limit_mib,
        } => {
            let req = api::CreateVm {
                memory_mib,
                vcpus,
                from_snapshot: None,
                memory_source: match (image, zstd_image) {
                    (Some(path), _) => Some(api::MemorySource::File { path }),
                    (None, Some(path)) => Some(api::MemorySource::Zstd { path }),
                    (None, None) => None,
                },
                volume,
                fault_around_kib,
                readahead_kib: None,
                prefetch,
                hugepages,
                reclaim: (no_reclaim || memory_limit_mib.is_some()).then_some(api::ReclaimPolicy {
                    enabled: !no_reclaim,
                    limit_mib: memory_limit_mib,
                }),
            };
            call(client, "POST", "/v1/vms", Some(&body(&req)))?
        }
        VmCmd::List => {
            let v = call(client, "GET", "/v1/vms", None)?;
            if !as_json {
                let rows: Vec<Vec<String>> = v["vms"]
                    .as_array()
                    .map(|a| a.iter().map(vm_row).collect())
                    .unwrap_or_default();
                print!("{}", render(&HEADERS, &rows));
                return Ok(());
            }
            v
        }
        VmCmd::Bases => {
            let v = call(client, "GET", "/v1/bases", None)?;
            if !as_json {
                let rows: Vec<Vec<String>> = v["bases"]
                    .as_array()
                    .map(|a| a.iter().map(base_row).collect())
                    .unwrap_or_default();
                print!("{}", render(&BASE_HEADERS, &rows));
                return Ok(());
            }
            v
        }
        VmCmd::Show { id } => call(client, "GET", &format!("/v1/vms/{id}"), None)?,
        VmCmd::Delete { id } => call(client, "DELETE", &format!("/v1/vms/{id}"), None)?,
        VmCmd::Pause { id } => call(client, "POST", &format!("/v1/vms/{id}/pause"), None)?,
        VmCmd::Resume { id } => call(client, "POST", &format!("/v1/vms/{id}/resume"), None)?,
        VmCmd::Fork { id, count } => {
            let v = call(
                client,
                "POST",
                &format!("/v1/vms/{id}/fork"),
                Some(&body(&api::ForkRequest { count })),
            )?;
            if !as_json {
                println!(
                    "{id} forked into {} (parent paused {} us, table fork {} us)",
                    v["children"]
                        .as_array()
                        .map(|a| a
                            .iter()
                            .map(|c| c.as_str().unwrap_or("?"))
                            .collect::<Vec<_>>()
                            .join(", "))
                        .unwrap_or_default(),
                    v["pause_us"],
                    v["fork_us"]
                );
                return Ok(());
            }
            v
        }
        VmCmd::Reclaim { id } => {
            let v = call(client, "POST", &format!("/v1/vms/{id}/reclaim"), None)?;
            if !as_json {
                println!(
                    "{id}: {} MiB given back ({} pages dropped to their source, {} swapped; {} \
                     kept)",
                    v["freed_bytes"].as_u64().unwrap_or(0) >> 20,
                    v["dropped_pages"],
                    v["swapped_pages"],
                    v["kept_pages"]
                );
                return Ok(());
            }
            v
        }
        VmCmd::Rollback { id, snapshot } => call(
            client,
            "POST",
            &format!("/v1/vms/{id}/rollback"),
            Some(&body(&api::RollbackVm { snapshot })),
        )?,
        VmCmd::Clone {
            id,
            count,
            concurrency,
        } => call(
            client,
            "POST",
            &format!("/v1/vms/{id}/clone"),
            Some(&body(&api::CloneVm { count, concurrency })),
        )?,
        VmCmd::Exec {
            id,
            op,
            start_page,
            pages,
            seed,
            write,
            sector,
            count,
            sectors_per_io,
        } => {
            let need = |v: Option<u64>, what: &str| {
                v.ok_or_else(|| CliError::Usage(format!("op {op} needs --{what}")))
            };
            let req = match op.as_str() {
                "fill" => api::ExecRequest::Fill {
                    start_page,
                    pages,
                    seed: need(seed, "seed")?,
                },
                "touch" => api::ExecRequest::Touch {
                    start_page,
                    pages,
                    write,
                },
                "checksum" => api::ExecRequest::Checksum { start_page, pages },
                "verify" => api::ExecRequest::Verify {
                    start_page,
                    pages,
                    seed: need(seed, "seed")?,
                },
                "digest" => api::ExecRequest::Digest { start_page, pages },
                "identity" => api::ExecRequest::Identity {},
                "disk_fill" => api::ExecRequest::DiskFill {
                    sector: sector.unwrap_or(0),
                    count: need(count, "count")?,
                    seed: need(seed, "seed")?,
                    sectors_per_io,
                },
                "disk_write_pages" => api::ExecRequest::DiskWritePages {
                    start_page,
                    pages,
                    sector: sector.unwrap_or(0),
                    sectors_per_io,
                },
                "disk_checksum" => api::ExecRequest::DiskChecksum {
                    sector: sector.unwrap_or(0),
                    count: need(count, "count")?,
                    sectors_per_io,
                },
                other => {
                    return Err(CliError::Usage(format!(
                        "unknown op {other}; use fill, touch, checksum, verify, digest, identity, disk_fill, disk_write_pages or disk_checksum"
                    )))
                }
            };
            let v = call(
                client,
                "POST",
                &format!("/v1/vms/{id}/exec"),
                Some(&body(&req)),
            )?;
            if !as_json {
                println!(
                    "{} {} = {} ({} us)",
                    id,
                    v["op"].as_str().unwrap_or("?"),
                    v["result"],
                    v["elapsed_us"]
                );
                return Ok(());
            }
            v
        }
    };
    if as_json || out.get("id").is_none() {
        println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    } else {
        print!("{}", render(&HEADERS, &[vm_row(&out)]));
    }
    Ok(())
}
