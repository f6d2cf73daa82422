//! `uffd-server`: the pagefork page server daemon.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use tracing::{error, info, warn};
use uffd_server::core::{CommandKind, Core, Settings};
use uffd_server::vmm_conn::{self, PendingLaunches};

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
fn lock_state_dir(dir: &Path) -> Result<nix::fcntl::Flock<std::fs::File>, String> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("lock"))
        .map_err(|e| format!("cannot open {}/lock: {e}", dir.display()))?;
    nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|_| {
        format!(
            "another uffd-server already uses {}; stop it or pick another --state-dir",
            dir.display()
        )
    })
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let state_dir = args.state_dir.unwrap_or_else(default_state_dir);
    std::fs::create_dir_all(state_dir.join("logs"))
        .map_err(|e| format!("cannot create state directory {}: {e}", state_dir.display()))?;
    let _lock = lock_state_dir(&state_dir)?;
    let vmm_bin = match args.vmm_bin {
        Some(p) => p,
        None => std::env::current_exe()
            .map_err(|e| format!("cannot find own binary: {e}"))?
            .with_file_name("vmm"),
    };
    let fault_around = uffd_server::pages::FaultAround::from_kib(args.fault_around_kib)
        .map_err(|e| format!("--fault-around-kib {e}"))?;
    let volumes = match uffd_server::volume::VolumeEngine::open(&state_dir) {
        Ok(engine) => Some(Arc::new(engine)),
        Err(e) => {
            warn!("volumes unavailable: {}", uffd_server::core::chain(&e));
            None
        }
    };
    let settings = Settings {
        state_dir: state_dir.clone(),
        vmm_bin,
        fault_around_pages: fault_around.pages(),
        readahead_pages: args.readahead_kib / 4,
        start_timeout: Duration::from_secs(30),
        exec_timeout: Duration::from_secs(300),
    };
    let api_path = state_dir.join("api.sock");
    let vmm_path = state_dir.join("vmm.sock");
    let vmm_listener = bind_0600(&vmm_path)
        .map_err(|e| format!("cannot listen on {}: {e}", vmm_path.display()))?;
    let api_listener = bind_0600(&api_path)
        .map_err(|e| format!("cannot listen on {}: {e}", api_path.display()))?;

    let pending: PendingLaunches = Arc::default();
    let (events_tx, events_rx) = tokio::sync::mpsc::unbounded_channel();
    let core_events = events_tx.clone();
    let mut fc_listeners = Vec::new();
    for spec in &args.firecracker {
        let (sock, image) = spec
            .split_once('=')
            .ok_or_else(|| format!("--firecracker {spec}: expected SOCKET=IMAGE"))?;
        fc_listeners.push(uffd_server::core::firecracker::CreateListener {
            socket: sock.into(),
            memory_source: proto::api::MemorySource::File { path: image.into() },
            fault_around_kib: None,
            readahead_kib: None,
            working_set: args.working_set,
        });
    }
    {
        let pending = pending.clone();
        std::thread::Builder::new()
            .name("vmm-accept".into())
            .spawn(move || vmm_conn::accept_loop(vmm_listener, pending, events_tx))
            .map_err(|e| format!("cannot start the vmm acceptor: {e}"))?;
    }

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let core = Core::new(settings, pending, volumes.clone(), core_events);
        for l in fc_listeners {
            let sock = l.socket.clone();
            let _ = std::fs::remove_file(&sock);
            core.add_fc_listener(l)
                .map_err(|e| format!("firecracker listener {}: {}", sock.display(), e.message))?;
        }
        let (handle, commands) = Core::command_channel();
        api_listener
            .set_nonblocking(true)
            .map_err(|e| e.to_string())?;
        let listener =
            tokio::net::UnixListener::from_std(api_listener).map_err(|e| e.to_string())?;
        let app = uffd_server::api::router(handle.clone(), volumes);
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                error!("api server failed: {e}");
            }
        });
        let stopper = handle.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            info!("signal received; stopping");
            let _ = stopper.call(CommandKind::Shutdown).await;
        });
        info!(
            "uffd-server listening: api {} vmm {}",
            api_path.display(),
            vmm_path.display()
        );
        core.run(commands, events_rx).await;
        let _ = std::fs::remove_file(&api_path);
        let _ = std::fs::remove_file(&vmm_path);
        info!("stopped");
        Ok::<(), String>(())
    })
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
