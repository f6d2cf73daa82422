//! `uffd-server`: the pagefork page server daemon.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tracing::{error, info, warn};
use uffd_server::conn::{self, PendingLaunches};
use uffd_server::core::{Core, Settings};

/// The pagefork page server: owns guest RAM, serves VM page faults, forks VMs.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// State directory: api.sock, vmm.sock, logs/, volumes/.
    /// Default: $XDG_STATE_HOME/pagefork or ~/.local/state/pagefork.
    #[arg(long, env = "PAGEFORK_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// The vmm binary to launch VMs with (default: `vmm` next to this binary).
    #[arg(long)]
    vmm_bin: Option<PathBuf>,
    /// Pages installed around an image-backed fault, in KiB (0 = off).
    #[arg(long, default_value_t = 64)]
    fault_around_kib: u64,
    /// Largest readahead window in KiB: sequential faults on an image double
    /// the install window up to this (0 = off).
    #[arg(long, default_value_t = 2048)]
    readahead_kib: u64,
    /// Serve Firecracker's UFFD memory backend: SOCKET=IMAGE (repeatable).
    /// Point Firecracker's `/snapshot/load` `mem_backend.backend_path` at SOCKET.
    #[arg(long, value_name = "SOCKET=IMAGE")]
    firecracker: Vec<String>,
    /// With --firecracker: record the first VM's working set and prefetch
    /// it for later VMs of the same listener.
    #[arg(long)]
    working_set: bool,
    /// Rewrite a snapshot image sequentially, in the background, when it
    /// has more extents than this (a long chain of dirty snapshots on
    /// reflinks fragments; FICLONE and reads cost per extent). 0 = never.
    #[arg(long, default_value_t = 4096)]
    snapshot_rewrite_extents: u64,
    /// For tests: a snapshot's writer waits this many ms before the first
    /// run it copies out of guest memory, so that guest writes meet runs
    /// still in flight. Not for production use.
    #[arg(long, default_value_t = 0, hide = true)]
    snapshot_copy_hold_ms: u64,
    /// After serving a VM's page faults, keep polling its uffd for this
    /// long, in µs, before waiting for it in the event loop again: a
    /// thread that faulted usually faults again within microseconds, and
    /// waking an idle core thread costs more than that. Pays where a core
    /// is spare, costs where none is (50 is a good value then). Each poll
    /// yields to every other task first; 0 turns polling off; at most 1000.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1000))]
    fault_poll_us: u64,
    /// Install a readahead window in pieces of this many KiB (at least the
    /// fault-around block), the faulting page's piece first: its thread is
    /// woken after that piece and runs while the rest goes in. 0 = the
    /// whole window before the wake.
    #[arg(long, default_value_t = 64)]
    readahead_piece_kib: u64,
    /// Threads decoding frames of compressed (zstd) images.
    #[arg(long, default_value_t = 2)]
    zstd_workers: usize,
    /// Decoded frames of compressed images kept in memory, in MiB.
    #[arg(long, default_value_t = 256)]
    zstd_cache_mib: u64,
    /// How long a VMM may take to pause, resume or capture its state before
    /// the request answers 504, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    vmm_deadline_ms: u64,
    /// After a rollback resumes its VM, wait this long, in milliseconds,
    /// before punching the pages it discarded in the background; an access
    /// to one meanwhile punches it (and its run) itself. The old bytes use
    /// memory until then.
    #[arg(long, default_value_t = 0)]
    rollback_scrub_delay_ms: u64,
    /// Requests in flight per VM at most; beyond it that VM answers 503.
    #[arg(long, default_value_t = 64)]
    vmm_queue: usize,
    /// API connections open at once at most; one more closes the one idle
    /// longest, or gets a 503 if every one has a request in flight.
    #[arg(long, default_value_t = 256)]
    api_max_connections: usize,
    /// An API client must send a request's headers within this, in ms.
    #[arg(long, default_value_t = 5000)]
    api_header_timeout_ms: u64,
    /// An API connection that moves no bytes for this long is closed, in ms.
    #[arg(long, default_value_t = 60000)]
    api_idle_timeout_ms: u64,
    /// How often the server counts its open fds against its limit (it warns
    /// from 80 % on), in ms.
    #[arg(long, default_value_t = 5000)]
    fd_check_ms: u64,
    /// Logs of deleted VMs kept in logs/ for post-mortems.
    #[arg(long, default_value_t = 32)]
    keep_logs: usize,
    /// Guest memory the server may promise, in MiB; a create or fork
    /// beyond it answers 507. Default: MemAvailable at start times
    /// --overcommit.
    #[arg(long)]
    memory_budget_mib: Option<u64>,
    /// Default budget as a multiple of the memory available at start
    /// (forks share their parent's pages until written).
    #[arg(long, default_value_t = 4.0)]
    overcommit: f64,
    /// VMs at most.
    #[arg(long, default_value_t = 4096)]
    max_vms: usize,
    /// Give memory back under pressure: `auto` keeps the VMs' memory under
    /// a watermark below the limit that applies (the server's memory
    /// cgroup's, or the host's memory) by dropping pages equal to their
    /// source and compressing written ones into STATE/swap; `off` leaves
    /// it to the kernel's OOM killer.
    #[arg(long, value_enum, default_value = "auto")]
    reclaim: uffd_server::core::reclaim::state::Mode,
    /// Reclaim starts above this share of the memory limit, in percent
    /// (it goes on until 5 points below).
    #[arg(long, default_value_t = 85)]
    reclaim_watermark_pct: u64,
    /// Where reclaim's swap store of written pages lives (default
    /// STATE/swap; a fast local disk).
    #[arg(long)]
    swap_dir: Option<PathBuf>,
    /// The swap store grows to this many MiB at most (default: as far as
    /// its filesystem allows); beyond it written pages stay in memory.
    #[arg(long)]
    swap_max_mib: Option<u64>,

    /// Keep this many `vmm` processes started, connected and holding their
    /// KVM VM, ready for the next create, fork, restore or clone (taken
    /// VMMs are replaced in the background). 0 = start a VMM per VM.
    #[arg(long, default_value_t = 0, env = "PAGEFORK_VMM_POOL")]
    vmm_pool: usize,
    /// The guest RAM size pooled VMMs prepare KVM's memory slot for before
    /// they are taken (KVM takes ~0.15-0.3 ms per 256 MiB to set one up);
    /// a VM of another size costs that at its start. 0 = prepare none.
    #[arg(long, default_value_t = 256)]
    vmm_pool_memory_mib: u64,
    /// Back new VMs' guest RAM with 2 MiB hugetlb pages unless a create
    /// says otherwise (`"hugepages": false`); reserve huge pages first in
    /// /proc/sys/vm/nr_hugepages.
    #[arg(long, env = "PAGEFORK_HUGEPAGES")]
    hugepages: bool,
    /// Map the clean pages of VMs made from one image, restored from one
    /// snapshot or forked from one paused VM from a shared base (one copy
    /// per host) instead of copying them into each VM. On by default
    /// where the kernel can (userfaultfd MINOR faults, PAGEMAP_SCAN).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, env = "PAGEFORK_SHARED_BASES")]
    shared_bases: bool,
    /// Also serve `GET /metrics` (Prometheus) over TCP at this address,
    /// e.g. 127.0.0.1:9464; it is always on the API socket.
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Serve only memory images under this directory (VM memory sources and
    /// Firecracker memory files); any path by default.
    #[arg(long)]
    image_dir: Option<PathBuf>,
    /// Restores install the working set their snapshot's first restore
    /// recorded ahead of the guest, in the order it touched it (false:
    /// they fault it in).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    prefetch_working_set: bool,
    /// A snapshot's first restore records the pages its guest touches
    /// for this long at most, in ms (or until the VM is deleted).
    #[arg(long, default_value_t = 30000)]
    working_set_window_ms: u64,

    /// Serve without a keeper: every VM dies with this process. By
    /// default a small keeper process holds what must outlive the server
    /// (its sockets, the VMs' memory and userfaultfds) and restarts it if
    /// it dies; under systemd (`$NOTIFY_SOCKET` set), systemd's fd store
    /// does, and no keeper starts.
    #[arg(long, env = "PAGEFORK_NO_KEEPER")]
    no_keeper: bool,

    #[command(flatten)]
    remote: RemoteArgs,
}

/// The object store of snapshots.
#[derive(Debug, clap::Args)]
struct RemoteArgs {
    /// Keep snapshots in this S3-compatible store: s3://BUCKET[/PREFIX].
    /// Endpoint, credentials and region come from AWS_ENDPOINT_URL,
    /// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN) and
    /// AWS_REGION, or the flags below.
    #[arg(long, value_name = "s3://BUCKET[/PREFIX]")]
    remote: Option<String>,
    /// The store's endpoint (instead of AWS_ENDPOINT_URL), e.g.
    /// http://127.0.0.1:7480 for a Ceph RGW.
    #[arg(long, value_name = "URL")]
    remote_endpoint: Option<String>,
    /// The store's region (instead of AWS_REGION).
    #[arg(long)]
    remote_region: Option<String>,
    /// Read the credentials from this file of KEY=VALUE lines
    /// (AWS_ACCESS_KEY_ID=..., AWS_SECRET_ACCESS_KEY=...) instead of the
    /// environment; credentials never go on a command line.
    #[arg(long, value_name = "FILE")]
    remote_credentials_file: Option<PathBuf>,
    /// Chunks of remote snapshots cached on the state directory, in MiB.
    #[arg(long, default_value_t = 4096)]
    remote_cache_mib: u64,
    /// Chunks kept in memory for faults on remote snapshots, in MiB.
    #[arg(long, default_value_t = 512)]
    remote_memory_mib: u64,
    /// Threads fetching chunks for faults and working sets (each has one
    /// request in flight).
    #[arg(long, default_value_t = 16)]
    remote_fetchers: usize,
    /// A chunk not fetched within this, in ms (retries included), fails
    /// the VMs that need it.
    #[arg(long, default_value_t = 30000)]
    remote_fetch_deadline_ms: u64,
    /// Requests in flight at once in a push or a pull.
    #[arg(long, default_value_t = 16)]
    remote_concurrency: usize,
    /// For tests: how long a push's or gc's lock in the store is trusted
    /// without a refresh, in seconds.
    #[arg(long, default_value_t = 300, hide = true)]
    remote_lock_ttl_s: u64,
}

impl RemoteArgs {
    /// The store's settings, if `--remote` was given.
    fn settings(&self) -> Result<Option<uffd_server::remote::RemoteSettings>, StartError> {
        let Some(url) = &self.remote else {
            return Ok(None);
        };
        let file: std::collections::HashMap<String, String> = match &self.remote_credentials_file {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| StartError::RemoteCredentials(path.clone(), e))?
                .lines()
                .filter_map(|l| l.trim().trim_start_matches("export ").split_once('='))
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .collect(),
            None => Default::default(),
        };
        let from_file = self.remote_credentials_file.is_some();
        let lookup = |k: &str| {
            let env = || std::env::var(k).ok().filter(|v| !v.is_empty());
            match k {
                "AWS_ENDPOINT_URL" | "AWS_ENDPOINT_URL_S3" if self.remote_endpoint.is_some() => {
                    self.remote_endpoint.clone()
                }
                "AWS_REGION" if self.remote_region.is_some() => self.remote_region.clone(),
                "AWS_ACCESS_KEY_ID" | "AWS_SECRET_ACCESS_KEY" | "AWS_SESSION_TOKEN"
                    if from_file =>
                {
                    file.get(k).cloned()
                }
                _ => env(),
            }
        };
        let mut config =
            pagefork_remote::RemoteConfig::from_lookup(url, lookup).map_err(StartError::Remote)?;
        config.tuning.fetch_deadline = Duration::from_millis(self.remote_fetch_deadline_ms.max(1));
        config.tuning.concurrency = self.remote_concurrency.max(1);
        config.tuning.lock_ttl = Duration::from_secs(self.remote_lock_ttl_s.max(1));
        Ok(Some(uffd_server::remote::RemoteSettings {
            config,
            cache_bytes: self.remote_cache_mib.saturating_mul(1 << 20),
            memory_bytes: self.remote_memory_mib.max(1).saturating_mul(1 << 20),
            fetchers: self.remote_fetchers.max(1),
        }))
    }
}

/// MemAvailable from /proc/meminfo, in MiB.
fn mem_available_mib() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()?
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))?
        .split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()
        .map(|kb| kb / 1024)
}

/// The server should be the last process the OOM killer picks: it holds
/// every VM's memory. Its VMMs get the default back (see
/// `core/link/process.rs`).
fn lower_oom_score() {
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", "-500") {
        warn!(
            "cannot lower the server's oom_score_adj: {e} (it needs CAP_SYS_RESOURCE); \
             its VMMs' are raised instead, so the OOM killer still picks a VMM first"
        );
    }
}

/// Why the server cannot start.
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("cannot create the state directory {}", .0.display())]
    CreateStateDir(PathBuf, #[source] std::io::Error),
    #[error("{0}")]
    UnsafeStateDir(String),
    #[error("another uffd-server already uses {}; stop it or pick another --state-dir", .0.display())]
    Locked(PathBuf),
    #[error("cannot open {}", .0.display())]
    OpenLock(PathBuf, #[source] std::io::Error),
    #[error("cannot find the server's own binary to locate vmm; pass --vmm-bin")]
    OwnBinary(#[source] std::io::Error),
    #[error("{0}")]
    BadArgument(String),
    #[error("cannot listen on {}", .0.display())]
    Listen(PathBuf, #[source] std::io::Error),
    #[error("cannot listen for metrics (--metrics-addr)")]
    MetricsListen(#[source] std::io::Error),
    #[error("cannot start a thread")]
    Thread(#[source] std::io::Error),
    #[error("cannot start the runtime")]
    Runtime(#[source] std::io::Error),
    #[error("cannot open the snapshots of the state directory")]
    Snapshots(#[source] uffd_server::snapshot::SnapshotError),
    #[error("firecracker listener {}", .0.display())]
    Firecracker(PathBuf, #[source] Box<uffd_server::core::Error>),
    #[error("--remote")]
    Remote(#[source] pagefork_remote::Error),
    #[error("cannot read the credentials file {}", .0.display())]
    RemoteCredentials(PathBuf, #[source] std::io::Error),
    #[error("--remote")]
    RemoteService(#[source] uffd_server::remote::ServiceError),
}

fn default_state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_STATE_HOME") {
        return PathBuf::from(d).join("pagefork");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"));
    home.join(".local/state/pagefork")
}

fn bind_0600(path: &Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    let _ = std::fs::remove_file(path);
    let l = std::os::unix::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

/// Hold an exclusive lock on DIR/lock so two servers never share a state
/// dir. The lock lives as long as the returned guard.
fn lock_state_dir(dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, StartError> {
    lock_file(dir, "lock")
}

/// Hold an exclusive lock on DIR/NAME.
fn lock_file(dir: &Path, name: &str) -> Result<nix::fcntl::Flock<std::fs::File>, StartError> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(name);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| StartError::OpenLock(path.clone(), e))?;
    // A server that was just stopped may still be stopping its VMMs:
    // wait a few seconds for it before refusing.
    let mut f = f;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut said = false;
    loop {
        match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
            Ok(l) => return Ok(l),
            Err((back, _)) if std::time::Instant::now() < deadline => {
                if !said {
                    info!(
                        "{} is locked by another server; waiting up to 10 s",
                        path.display()
                    );
                    said = true;
                }
                f = back;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(_) => return Err(StartError::Locked(dir.to_owned())),
        }
    }
}

/// Create `dir` (0700) if missing and refuse one that another user owns or
/// that group or others can write: the server (often root) would otherwise
/// trust files someone else can plant there.
fn prepare_private_dir(dir: &Path) -> Result<(), StartError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| StartError::CreateStateDir(dir.to_owned(), e))?;
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| StartError::CreateStateDir(dir.to_owned(), e))?;
    let uid = nix::unistd::geteuid().as_raw();
    if !meta.is_dir() {
        return Err(StartError::UnsafeStateDir(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    if meta.uid() != uid {
        return Err(StartError::UnsafeStateDir(format!(
            "{} belongs to uid {}, not to this server's uid {uid}; use a directory of your own",
            dir.display(),
            meta.uid()
        )));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(StartError::UnsafeStateDir(format!(
            "{} can be written by other users (mode {:o}); chmod go-w it or pick another --state-dir",
            dir.display(),
            meta.mode() & 0o777
        )));
    }
    Ok(())
}

/// Raise the soft fd limit to the hard one: every VM holds a few fds
/// (memfd, uffd, image, sockets), and the default soft limit (1024) is
/// far below what a host with many VMs needs. Creates and forks are
/// admitted against it (`core::fd_budget`), with a reserve kept.
fn raise_fd_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    use uffd_server::core::fd_budget::reserve;
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => info!(
                "fd limit raised from {soft} to {hard}, {} of them kept for running VMs and the API",
                reserve(hard)
            ),
            Err(e) => warn!(
                "cannot raise the fd limit from {soft} to {hard}: {e}; VMs are admitted \
                 against {soft}, {} of them kept for running VMs and the API",
                reserve(soft)
            ),
        },
        Ok((soft, _)) => info!(
            "fd limit {soft}, {} of them kept for running VMs and the API",
            reserve(soft)
        ),
        Err(e) => warn!("cannot read the fd limit: {e}"),
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let since_start = std::time::Instant::now();
    let args = Args::parse();
    if !args.no_keeper
        && std::env::var_os("NOTIFY_SOCKET").is_none()
        && !uffd_server::fdstore::is_kept()
    {
        return keep(&args);
    }
    match run(args, since_start) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{}", shared::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// Become the keeper of the state directory: it starts the serving
/// process (this binary again, with the same arguments) and holds what
/// must outlive it (`uffd_server::keeper`).
fn keep(args: &Args) -> ExitCode {
    let state_dir = args.state_dir.clone().unwrap_or_else(default_state_dir);
    let lock = prepare_private_dir(&state_dir).and_then(|()| lock_file(&state_dir, "keeper.lock"));
    let _lock = match lock {
        Ok(l) => l,
        Err(e) => {
            error!("{}", shared::error_chain(&e));
            return ExitCode::FAILURE;
        }
    };
    let program = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            error!("cannot find the server's own binary: {e}");
            return ExitCode::FAILURE;
        }
    };
    uffd_server::keeper::run(&state_dir, program, std::env::args_os().skip(1).collect())
}

fn run(args: Args, since_start: std::time::Instant) -> Result<(), StartError> {
    // The keeper that started this process, if one did.
    let keeper = uffd_server::fdstore::is_kept().then(nix::unistd::getppid);
    // What a keeper or systemd handed over, and where to hand it again.
    let mut handed = uffd_server::fdstore::listen_fds();
    let store = uffd_server::fdstore::FdStore::from_env();
    let start_kind = uffd_server::core::restart::state::StartKind::from_env(!handed.is_empty());
    let mut take_handed = |name: &str| {
        let i = handed.iter().position(|(n, _)| n == name)?;
        Some(handed.swap_remove(i).1)
    };
    let handed_api = take_handed(uffd_server::core::restart::journal::API_LISTENER);
    let handed_vmm = take_handed(uffd_server::core::restart::journal::VMM_LISTENER);
    let remote_settings = args.remote.settings()?;
    let state_dir = args.state_dir.unwrap_or_else(default_state_dir);
    prepare_private_dir(&state_dir)?;
    prepare_private_dir(&state_dir.join("logs"))?;
    let _lock = lock_state_dir(&state_dir)?;
    raise_fd_limit();
    if let Err(e) =
        uffd_server::observe::fds::watch(Duration::from_millis(args.fd_check_ms.max(100)))
    {
        warn!("cannot start the fd watcher: {e}");
    }
    lower_oom_score();
    let memory_budget_mib = match args.memory_budget_mib {
        Some(m) => m,
        None => {
            let avail = mem_available_mib().unwrap_or(0);
            // Truncation is fine: the budget is a coarse bound.
            #[allow(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss
            )]
            let budget = (avail as f64 * args.overcommit.max(0.0)) as u64;
            budget
        }
    };
    info!("memory budget {memory_budget_mib} MiB");
    let vmm_bin = match args.vmm_bin {
        Some(p) => p,
        None => std::env::current_exe()
            .map_err(StartError::OwnBinary)?
            .with_file_name("vmm"),
    };
    let fault_around = uffd_server::pages::FaultAround::from_kib(args.fault_around_kib)
        .map_err(|e| StartError::BadArgument(format!("--fault-around-kib {e}")))?;
    let volumes = match volume::VolumeEngine::open(&state_dir) {
        Ok(engine) => Some(Arc::new(engine)),
        Err(e) => {
            warn!("volumes unavailable: {}", e.chain());
            None
        }
    };
    let restarting = start_kind != uffd_server::core::restart::state::StartKind::First;
    let mut snapshots = uffd_server::snapshot::Catalog::open_with(&state_dir, !restarting)
        .map_err(StartError::Snapshots)?;
    // A crash between a VM snapshot's volume snapshot (`<name>.disk`,
    // taken in the pause) and its commit leaves the volume snapshot
    // behind: the snapshot it belongs to never came to be.
    for name in snapshots.take_unfinished() {
        let disk = format!("{name}.disk");
        if let Some(engine) = volumes.as_ref().filter(|e| e.snapshot_info(&disk).is_ok()) {
            match engine.delete_snapshot(&disk) {
                Ok(()) => info!("removed volume snapshot {disk} of unfinished snapshot {name}"),
                Err(e) => warn!("cannot remove volume snapshot {disk}: {}", e.chain()),
            }
        }
    }
    let frames = uffd_server::images::zst::FramePool::start(
        args.zstd_workers.max(1),
        args.zstd_cache_mib.max(1).saturating_mul(1 << 20),
    )
    .map_err(StartError::Thread)?;
    let settings = Settings {
        state_dir: state_dir.clone(),
        vmm_bin,
        fault_around_pages: fault_around.pages(),
        readahead_pages: args.readahead_kib / 4,
        start_timeout: Duration::from_secs(30),
        exec_timeout: Duration::from_secs(300),
        vmm_deadline: Duration::from_millis(args.vmm_deadline_ms.max(1)),
        rollback_scrub_delay: Duration::from_millis(args.rollback_scrub_delay_ms),
        vmm_queue: args.vmm_queue.max(1),
        keep_logs: args.keep_logs,
        memory_budget: memory_budget_mib.saturating_mul(1 << 20),
        max_vms: args.max_vms.max(1),
        compress_threads: args.zstd_workers.max(1),
        rewrite_extents: args.snapshot_rewrite_extents,
        snapshot_copy_hold: Duration::from_millis(args.snapshot_copy_hold_ms),
        vmm_pool: args.vmm_pool,
        vmm_pool_memory_mib: args.vmm_pool_memory_mib,
        hugepages: args.hugepages,
        fault_poll: Duration::from_micros(args.fault_poll_us),
        readahead_piece_pages: args.readahead_piece_kib / 4,
        shared_bases: args.shared_bases && shared_bases_work(),
        prefetch_working_set: args.prefetch_working_set,
        working_set_window: Duration::from_millis(args.working_set_window_ms),
        reclaim: args.reclaim,
        reclaim_watermark_pct: args.reclaim_watermark_pct,
        swap_dir: args.swap_dir.clone(),
        swap_max_bytes: args.swap_max_mib.map(|m| m.saturating_mul(1 << 20)),
        image_dir: match &args.image_dir {
            Some(d) => Some(std::fs::canonicalize(d).map_err(|e| {
                StartError::BadArgument(format!("--image-dir {}: {e}", d.display()))
            })?),
            None => None,
        },
    };
    info!(
        "shared bases {}",
        if settings.shared_bases { "on" } else { "off" }
    );
    let args_metrics_addr = args.metrics_addr;
    let limits = uffd_server::api::serve::Limits {
        max_connections: args.api_max_connections.max(1),
        header_timeout: Duration::from_millis(args.api_header_timeout_ms.max(1)),
        idle_timeout: Duration::from_millis(args.api_idle_timeout_ms.max(1)),
    };
    let api_path = state_dir.join("api.sock");
    let vmm_path = state_dir.join("vmm.sock");
    // Listeners handed over are the ones clients already wait on.
    let fresh_listeners = handed_vmm.is_none() || handed_api.is_none();
    let vmm_listener = match handed_vmm {
        Some(fd) => std::os::unix::net::UnixListener::from(fd),
        None => bind_0600(&vmm_path).map_err(|e| StartError::Listen(vmm_path.clone(), e))?,
    };
    let api_listener = match handed_api {
        Some(fd) => std::os::unix::net::UnixListener::from(fd),
        None => bind_0600(&api_path).map_err(|e| StartError::Listen(api_path.clone(), e))?,
    };
    let vmm_listener_copy = vmm_listener
        .try_clone()
        .map_err(|e| StartError::Listen(vmm_path.clone(), e))?;

    let pending: PendingLaunches = Arc::default();
    let (events_tx, events_rx) = tokio::sync::mpsc::unbounded_channel();
    let core_events = events_tx.clone();
    let mut fc_listeners = Vec::new();
    for spec in &args.firecracker {
        let (sock, image) = spec.split_once('=').ok_or_else(|| {
            StartError::BadArgument(format!("--firecracker {spec}: expected SOCKET=IMAGE"))
        })?;
        fc_listeners.push(proto::api::CreateListener {
            socket: sock.into(),
            memory_source: proto::api::MemorySource::File { path: image.into() },
            fault_around_kib: None,
            readahead_kib: None,
            working_set: args.working_set,
        });
    }
    {
        let pending = pending.clone();
        let queue = settings.vmm_queue + 8;
        std::thread::Builder::new()
            .name("vmm-accept".into())
            .spawn(move || conn::vmm::accept_loop(vmm_listener, pending, events_tx, queue))
            .map_err(StartError::Thread)?;
    }

    // The store's requests run on a runtime of their own, never on the
    // core's thread; it is shut down after the core's loop ends.
    let remote_rt = match &remote_settings {
        Some(_) => Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("remote-io")
                .enable_all()
                .build()
                .map_err(StartError::Runtime)?,
        ),
        None => None,
    };
    let remote = match (&remote_settings, &remote_rt) {
        (Some(s), Some(rt)) => {
            let service =
                uffd_server::remote::RemoteService::open(s, &state_dir, rt.handle().clone())
                    .map_err(StartError::RemoteService)?;
            info!(
                "snapshots in the object store {} at {}",
                service.url(),
                service.remote.endpoint()
            );
            Some(Arc::new(service))
        }
        _ => None,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(StartError::Runtime)?;
    let local = tokio::task::LocalSet::new();
    let core_remote = remote.clone();
    local.block_on(&rt, async move {
        let core = Core::new(
            settings,
            pending,
            volumes.clone(),
            snapshots,
            core_events,
            frames,
            core_remote,
            uffd_server::core::restart::state::Restart::new(&state_dir)
                .with_store(store, start_kind),
        );
        if fresh_listeners {
            use std::os::fd::AsFd;
            use uffd_server::core::restart::journal::{store_listener, API_LISTENER, VMM_LISTENER};
            store_listener(&core, API_LISTENER, api_listener.as_fd());
            store_listener(&core, VMM_LISTENER, vmm_listener_copy.as_fd());
        }
        drop(vmm_listener_copy);
        uffd_server::core::restart::start(&core, handed, since_start);
        uffd_server::core::reclaim::tick::start(&core);
        for l in fc_listeners {
            let sock = PathBuf::from(&l.socket);
            // Taken back from the process before this one, still bound.
            let same = |p: &std::path::Path| {
                p == sock
                    || std::fs::canonicalize(p)
                        .ok()
                        .is_some_and(|p| std::fs::canonicalize(&sock).is_ok_and(|s| s == p))
            };
            if core
                .reg
                .borrow()
                .fc_listeners
                .values()
                .any(|a| same(&a.socket))
            {
                continue;
            }
            if std::fs::symlink_metadata(&sock)
                .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
            {
                let _ = std::fs::remove_file(&sock);
            }
            core.add_fc_listener(l)
                .map_err(|e| StartError::Firecracker(sock, Box::new(e)))?;
        }
        let (handle, commands) = Core::command_channel();
        let listener = api_listener
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixListener::from_std(api_listener))
            .map_err(|e| StartError::Listen(api_path.clone(), e))?;
        let app = uffd_server::api::router(handle.clone(), volumes);
        tokio::spawn(uffd_server::api::serve::serve(listener, app, limits));
        if let Some(addr) = args_metrics_addr {
            let tcp = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(StartError::MetricsListen)?;
            let app = uffd_server::api::metrics_router(handle.clone());
            info!("metrics on http://{addr}/metrics");
            tokio::spawn(async move {
                if let Err(e) = axum::serve(tcp, app).await {
                    warn!("metrics listener stopped: {e}");
                }
            });
        }
        let stopper = handle.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            if keeper.is_some_and(|k| nix::unistd::getppid() != k) {
                // The keeper died (its death signal is a SIGTERM): what
                // would have outlived this process is gone with it, so
                // nothing can take the VMs back; they end with the server,
                // at once, stopped VMMs too.
                warn!("the keeper is gone; stopping every VM now");
                let pids = stopper
                    .run(|c| async move { Ok(uffd_server::core::restart::vmm_pids(&c)) })
                    .await
                    .unwrap_or_default();
                for pid in pids {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap_or(0)),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
                #[allow(clippy::exit)]
                std::process::exit(1);
            }
            info!("signal received; stopping");
            stopper.shutdown().await;
        });
        info!(
            "uffd-server listening: api {} vmm {}",
            api_path.display(),
            vmm_path.display()
        );
        core.start_pool();
        if let Some(store) = core.restart.store() {
            let status = format!("serving {} VM(s)", core.reg.borrow().vms.len());
            if let Err(e) = store.ready(&status) {
                warn!("cannot tell the keeper the server is ready: {e}");
            }
        }
        core.run(commands, events_rx).await;
        let _ = std::fs::remove_file(&api_path);
        let _ = std::fs::remove_file(&vmm_path);
        info!("stopped");
        Ok::<(), StartError>(())
    })?;
    if let Some(service) = &remote {
        service.chunks.stop();
    }
    if let Some(rt) = remote_rt {
        rt.shutdown_background();
    }
    Ok(())
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Whether this kernel can serve VMs on shared bases; says why not.
fn shared_bases_work() -> bool {
    match uffd_server::bases::probe() {
        Ok(()) => true,
        Err(e) => {
            warn!(
                "shared bases off: {}; every VM copies the pages it reads",
                shared::error_chain(&e)
            );
            false
        }
    }
}
