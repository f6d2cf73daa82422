//! `uffdctl`: the pagefork control CLI and memory-source debugging tool.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use uffdctl::cli::{
    demo, firecracker, image, inspect, map, observe, qcow2, server, snapshot, top, vm, volume,
};
use uffdctl::client::Client;

/// Control a pagefork uffd-server over its REST API.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The server's API socket (default: STATE_DIR/api.sock).
    #[arg(long, global = true)]
    socket: Option<PathBuf>,
    /// The server's state directory.
    #[arg(long, global = true, env = "PAGEFORK_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// Print raw JSON.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Manage VMs.
    #[command(subcommand)]
    Vm(vm::VmCmd),
    /// Serve Firecracker's Uffd memory backend: listeners.
    #[command(subcommand)]
    Firecracker(firecracker::FirecrackerCmd),
    /// VM snapshots: create, list, show, delete, restore; push, pull, gc.
    #[command(subcommand)]
    Snapshot(snapshot::SnapshotCmd),
    /// Compressed memory images (memory.zst): compress, inspect, verify.
    #[command(subcommand)]
    Image(image::ImageCmd),
    /// Manage disk volumes and their snapshots.
    #[command(subcommand)]
    Volume(volume::VolumeCmd),
    /// The server process: status, and an upgrade that keeps every VM.
    #[command(subcommand)]
    Server(server::ServerCmd),
    /// Work on qcow2 files directly (offline, no server).
    #[command(subcommand)]
    Qcow2(qcow2::Qcow2Cmd),
    /// Where a VM's pages come from: per source, and as extents.
    Sources {
        id: String,
        /// Extents to print at most.
        #[arg(long, default_value_t = 40)]
        extents: usize,
    },
    /// One page's source and presence.
    Page {
        id: String,
        page: u64,
        /// The whole chain: the VM holding the bytes, the image or file
        /// and offset (or zero), when and how the page was installed.
        #[arg(long)]
        explain: bool,
    },
    /// Which pages a VM faulted on since its creation, restore or reset.
    Access {
        id: String,
        /// Only pages first faulted within this many ms of the start.
        #[arg(long)]
        within_ms: Option<u64>,
        /// Save the heat map PNG here instead.
        #[arg(short, long)]
        out: Option<PathBuf>,
        /// Begin the record again (after showing it).
        #[arg(long)]
        reset: bool,
    },
    /// Every VM's fault rates, live, in a full-screen view (q quits).
    Top {
        /// Seconds between refreshes.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
    },
    /// A VM's faults as they happen (NDJSON with --json).
    Trace {
        id: String,
        /// Only this kind: missing, wp, remove, prefetch.
        #[arg(long)]
        kind: Option<proto::api::FaultKind>,
        /// Stop after this many events.
        #[arg(long)]
        limit: Option<u64>,
    },
    /// The fork tree and what each VM reads from its ancestors.
    Tree,
    /// Where a VM's pages come from, as a picture: in the terminal, as a
    /// PNG (-o), or the whole fork tree as strips (--tree).
    Map {
        /// The VM (not with --tree).
        id: Option<String>,
        /// Save the server's PNG here instead.
        #[arg(short, long)]
        out: Option<PathBuf>,
        /// Every VM of the fork tree, one strip each.
        #[arg(long)]
        tree: bool,
    },
    /// Start a server in a temporary directory and show a VM, a fork, a snapshot.
    Demo(demo::DemoArgs),
    /// Call any API route: uffdctl api GET /v1/vms ['{"json": 1}'].
    Api {
        method: String,
        path: String,
        body: Option<String>,
    },
}

fn socket(args: &Args) -> PathBuf {
    if let Some(s) = &args.socket {
        return s.clone();
    }
    let dir = args.state_dir.clone().unwrap_or_else(|| {
        std::env::var_os("XDG_STATE_HOME")
            .map(|d| PathBuf::from(d).join("pagefork"))
            .unwrap_or_else(|| {
                PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/tmp".into()))
                    .join(".local/state/pagefork")
            })
    });
    dir.join("api.sock")
}

fn main() -> ExitCode {
    let args = Args::parse();
    let client = Client::new(socket(&args));
    let result = match args.cmd {
        Cmd::Vm(cmd) => vm::run(cmd, &client, args.json),
        Cmd::Demo(d) => demo::run(d),
        Cmd::Image(cmd) => image::run(cmd, args.json),
        Cmd::Qcow2(cmd) => qcow2::run(cmd, args.json),
        Cmd::Firecracker(cmd) => firecracker::run(cmd, &client, args.json),
        Cmd::Volume(cmd) => volume::run(cmd, &client, args.json),
        Cmd::Server(cmd) => server::run(cmd, &client, args.json),
        Cmd::Snapshot(cmd) => snapshot::run(cmd, &client, args.json),
        Cmd::Sources { id, extents } => inspect::sources(&client, &id, extents, args.json),
        Cmd::Page { id, page, explain } => {
            if explain {
                observe::explain(&client, &id, page, args.json)
            } else {
                inspect::page(&client, &id, page, args.json)
            }
        }
        Cmd::Access {
            id,
            within_ms,
            out,
            reset,
        } => {
            let a = observe::AccessArgs {
                within_ms,
                out,
                reset,
            };
            observe::access(&client, &id, &a, args.json)
        }
        Cmd::Top { interval } => {
            if interval.is_finite() && interval >= 0.1 {
                top::run(
                    &client,
                    std::time::Duration::from_secs_f64(interval),
                    top::Sort::Faults,
                )
            } else {
                Err(uffdctl::CliError::Usage(
                    "--interval must be at least 0.1 seconds".into(),
                ))
            }
        }
        Cmd::Trace { id, kind, limit } => observe::trace(&client, &id, kind, limit, args.json),
        Cmd::Tree => inspect::tree(&client, args.json),
        Cmd::Map { id, out, tree } => match (id, out, tree) {
            (None, None, true) => map::tree(&client, args.json),
            (Some(id), Some(out), false) => map::save_png(&client, &id, &out),
            (Some(id), None, false) => map::show(&client, &id, args.json),
            _ => Err(uffdctl::CliError::Usage(
                "use: uffdctl map VM [-o FILE] | uffdctl map --tree".into(),
            )),
        },
        Cmd::Api { method, path, body } => {
            let body = match body.map(|b| serde_json::from_str(&b)) {
                Some(Ok(v)) => Some(v),
                Some(Err(e)) => {
                    eprintln!("uffdctl: body is not JSON: {e}");
                    return ExitCode::from(2);
                }
                None => None,
            };
            client
                .request(&method.to_uppercase(), &path, body.as_ref())
                .map_err(uffdctl::CliError::from)
                .map(|r| {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&r.body).unwrap_or_default()
                    )
                })
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("uffdctl: {}", shared::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
