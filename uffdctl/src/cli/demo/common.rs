//! The demo's parts the steps share: its options, its server (started
//! under a keeper in a state directory of its own, stopped on drop), and
//! how a step is announced and a guest op run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use proto::api;

use super::super::body;
use super::super::vm::call;
use crate::client::Client;
use crate::{CliError, Result};

/// Demo options.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Guest RAM of the demo VM in MiB.
    #[arg(long, default_value_t = 256)]
    pub memory_mib: u64,
    /// State directory (default: a new temporary directory). Put it on XFS
    /// with reflink=1 to include the volume snapshot step.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// The uffd-server binary (default: next to uffdctl).
    #[arg(long)]
    pub server_bin: Option<PathBuf>,
}

/// The demo's server process, stopped (and its temporary state
/// directory removed) on drop.
pub(super) struct Server {
    pub(super) child: Child,
    pub(super) dir: PathBuf,
    temp: bool,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGTERM);
        }
        let _ = self.child.wait();
        if self.temp {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

pub(super) fn step(n: u32, text: &str) {
    println!("\n[{n}] {text}");
}

pub(super) fn exec(c: &Client, id: &str, req: api::ExecRequest) -> Result<u64> {
    let v = call(c, "POST", &format!("/v1/vms/{id}/exec"), Some(&body(&req)))?;
    v["result"]
        .as_u64()
        .ok_or_else(|| CliError::Answer(format!("no result in {v}")))
}

pub(super) fn server_bin(args: &DemoArgs) -> Result<PathBuf> {
    match &args.server_bin {
        Some(b) => Ok(b.clone()),
        None => std::env::current_exe()
            .map(|p| p.with_file_name("uffd-server"))
            .map_err(|source| CliError::Local {
                what: "find uffdctl's own binary".into(),
                source,
            }),
    }
}

pub(super) fn start_server(args: &DemoArgs) -> Result<Server> {
    let (dir, temp) = match &args.state_dir {
        Some(d) => (d.clone(), false),
        None => {
            let d = std::env::temp_dir().join(format!("pagefork-demo-{}", std::process::id()));
            (d, true)
        }
    };
    let local = |what: String| move |source| CliError::Local { what, source };
    std::fs::create_dir_all(&dir).map_err(local(format!("create {}", dir.display())))?;
    let bin = server_bin(args)?;
    spawn_server(&bin, dir, temp)
}

/// Start `bin` on state directory `dir` under its keeper (the default; a
/// `PAGEFORK_NO_KEEPER` or `NOTIFY_SOCKET` of the caller's is not passed
/// on) and wait until it answers.
pub(super) fn spawn_server(bin: &Path, dir: PathBuf, temp: bool) -> Result<Server> {
    let local = |what: String| move |source| CliError::Local { what, source };
    std::fs::create_dir_all(&dir).map_err(local(format!("create {}", dir.display())))?;
    let log = std::fs::File::create(dir.join("server.log"))
        .map_err(local(format!("create {}/server.log", dir.display())))?;
    let child = Command::new(bin)
        .arg("--state-dir")
        .arg(&dir)
        .env_remove("PAGEFORK_NO_KEEPER")
        .env_remove("NOTIFY_SOCKET")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .map_err(local(format!("start {}", bin.display())))?;
    let server = Server { child, dir, temp };
    wait_healthy(&server.dir.join("api.sock"))?;
    Ok(server)
}

pub(super) fn wait_healthy(sock: &Path) -> Result<()> {
    let c = Client::new(sock);
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if c.request("GET", "/v1/health", None)
            .map(|r| r.ok())
            .unwrap_or(false)
        {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(CliError::NoServer(sock.display().to_string()))
}
