//! [`TestServer`]: a real `uffd-server` on a fresh temporary state
//! directory, reached through the typed [`Api`] client (which it derefs
//! to), stopped with any VMM it left behind when dropped. If the test is
//! panicking it prints the tail of the server and VMM logs and keeps the
//! state directory for a post-mortem.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use proto::api::{CreateListener, MemorySource};

use crate::api::{new_listener, Api};
use crate::host::{bin, process_exists, require_kvm_uffd, signal, tail, xfs_dir};

/// A running `uffd-server` on its own temporary state directory.
#[derive(Debug)]
pub struct TestServer {
    child: Option<Child>,
    dir: Option<tempfile::TempDir>,
    state_dir: PathBuf,
    api: Api,
    /// How it was started (a restart starts it the same way).
    options: ServerOptions,
}

/// Every call of the API reads `s.create_vm(..)`, `s.fork(..)`: the
/// server's client is the server's face in a test.
impl std::ops::Deref for TestServer {
    type Target = Api;

    fn deref(&self) -> &Api {
        &self.api
    }
}

impl TestServer {
    /// Start a server with default settings and wait until it is healthy.
    pub fn start() -> Self {
        Self::start_with_args(&[])
    }

    /// Start a server with extra command-line arguments.
    pub fn start_with_args(args: &[&str]) -> Self {
        Self::start_with_options(args, &ServerOptions::default())
    }

    fn wait_healthy(&mut self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "uffd-server exited during start-up ({status}); log:\n{}",
                    self.server_log_tail(40)
                );
            }
            if self.api.answers_health() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "uffd-server did not answer /v1/health within {within:?}; log:\n{}",
                self.server_log_tail(40)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's state directory (api.sock, vmm.sock, logs/).
    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Path of the VMM protocol socket.
    pub fn vmm_sock(&self) -> PathBuf {
        self.state_dir.join("vmm.sock")
    }

    /// Path of the REST API socket.
    pub fn api_sock(&self) -> PathBuf {
        self.state_dir.join("api.sock")
    }

    /// A listener request for a socket `<state dir>/<name>.sock` serving
    /// `memory_source`, everything else the server's default.
    pub fn listener_request(&self, name: &str, memory_source: MemorySource) -> CreateListener {
        new_listener(self.state_dir.join(format!("{name}.sock")), memory_source)
    }

    /// The serving process's pid: the one that holds the VMs' memory and
    /// answers the API (`GET /v1/health`). It changes when the server
    /// restarts; the process this test started is its keeper.
    pub fn pid(&self) -> u32 {
        match self.health().pid {
            0 => self.keeper_pid(),
            pid => pid,
        }
    }

    /// The process this test started: the keeper that starts the serving
    /// process and holds what outlives it (or, with `--no-keeper`, the
    /// serving process itself).
    pub fn keeper_pid(&self) -> u32 {
        self.child
            .as_ref()
            .map(Child::id)
            .expect("server already stopped")
    }

    fn server_log(&self) -> PathBuf {
        self.state_dir
            .parent()
            .map(|p| p.join("server.log"))
            .unwrap_or_default()
    }

    /// Last `n` lines of the server's log.
    pub fn server_log_tail(&self, n: usize) -> String {
        tail(&self.server_log(), n)
    }

    /// Wait until the warm pool holds `want` ready VMMs; panics after
    /// `within`, with the server's log.
    pub fn wait_pool_ready(&self, want: u64, within: Duration) {
        let deadline = Instant::now() + within;
        while self.pool_ready() < want {
            assert!(
                Instant::now() < deadline,
                "the VMM pool did not reach {want} ready VMMs within {within:?}\n{}",
                self.server_log_tail(30)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait until the warm pool, if the server keeps one, is full again:
    /// its ready VMMs are children of the server holding fds, so a count
    /// of those taken while it refills reads low.
    pub fn wait_pool_full(&self) {
        let target = self.metric("pagefork_vmm_pool_target").unwrap_or(0);
        if target > 0 {
            self.wait_pool_ready(target, Duration::from_secs(30));
        }
    }

    /// Stop the server with SIGTERM, wait up to `within` for it to exit,
    /// and return its exit status (SIGKILL and panic if it does not stop).
    pub fn stop(&mut self, within: Duration) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("server already stopped");
        signal(child.id(), nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = child.try_wait().expect("try_wait on uffd-server") {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "uffd-server did not stop within {within:?} of SIGTERM; log:\n{}",
                    self.server_log_tail(40)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn print_logs(&self) {
        eprintln!(
            "---- uffd-server log ({}) ----\n{}",
            self.server_log().display(),
            self.server_log_tail(60)
        );
        if let Ok(entries) = std::fs::read_dir(self.state_dir.join("logs")) {
            for e in entries.flatten() {
                eprintln!("---- {} ----\n{}", e.path().display(), tail(&e.path(), 20));
            }
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(0)),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        // A VMM must not outlive its server; make sure none of ours does.
        for pid in self.api.take_vmm_pids() {
            if process_exists(pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap_or(0)),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        if std::thread::panicking() {
            self.print_logs();
            if let Some(dir) = self.dir.take() {
                eprintln!(
                    "state directory kept for inspection: {}",
                    dir.keep().display()
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Servers started differently: under resource limits, on another
// filesystem, restarted on the same state directory, or refusing to start.

/// How to start a [`TestServer`] beyond its command-line arguments.
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    /// Directory the server's temporary directory (state directory and
    /// log) is made in; default the system's temp dir. On an XFS mount the
    /// server gets volumes and shares a filesystem with images made there.
    pub parent: Option<PathBuf>,
    /// `RLIMIT_NOFILE` (soft, hard) the server starts with, set by
    /// `prlimit(1)`, which then execs the server (same pid).
    pub nofile: Option<(u64, u64)>,
    /// Environment variables the server gets besides the test's.
    pub env: Vec<(String, String)>,
    /// Run the server in this network namespace (`ip netns exec`, which
    /// execs it: same pid), a second "host" (`scripts/netns.sh`).
    pub netns: Option<String>,
}

/// Spawn `uffd-server` on `state_dir`, its stderr appended to `log`.
fn spawn_server(state_dir: &Path, log: &Path, args: &[&str], opts: &ServerOptions) -> Child {
    let server = bin("uffd-server");
    let vmm = bin("vmm");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap_or_else(|e| panic!("cannot open {}: {e}", log.display()));
    let mut cmd = match (opts.nofile, &opts.netns) {
        (Some((soft, hard)), _) => {
            let mut c = Command::new("prlimit");
            c.arg(format!("--nofile={soft}:{hard}"))
                .arg("--")
                .arg(&server);
            c
        }
        (None, Some(ns)) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&server);
            c
        }
        (None, None) => Command::new(&server),
    };
    cmd.envs(opts.env.iter().map(|(k, v)| (k, v)));
    cmd.arg("--state-dir").arg(state_dir);
    if !args.contains(&"--vmm-bin") {
        cmd.arg("--vmm-bin").arg(&vmm);
    }
    cmd.args(args)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", server.display()))
}

impl TestServer {
    /// Start a server with extra arguments and [`ServerOptions`].
    pub fn start_with_options(args: &[&str], opts: &ServerOptions) -> Self {
        let mut builder = tempfile::Builder::new();
        builder.prefix("pagefork-e2e-");
        let dir = match &opts.parent {
            Some(p) => builder.tempdir_in(p),
            None => builder.tempdir(),
        }
        .expect("cannot create a temp dir");
        let state_dir = dir.path().join("state");
        std::fs::create_dir_all(&state_dir).expect("cannot create the state dir");
        let child = spawn_server(&state_dir, &dir.path().join("server.log"), args, opts);
        let api = Api::new(state_dir.join("api.sock"));
        let mut s = TestServer {
            child: Some(child),
            dir: Some(dir),
            state_dir,
            api,
            options: opts.clone(),
        };
        s.wait_healthy(Duration::from_secs(15));
        s.settle_env_pool(args);
        s
    }

    /// With a pool asked for through `PAGEFORK_VMM_POOL` (the pooled pass
    /// of `scripts/test.sh`), wait until it is full, so what a test
    /// measures first (fds, processes) does not race the pool's first
    /// fill. Tests that pass `--vmm-pool` themselves wait as they need.
    fn settle_env_pool(&self, args: &[&str]) {
        if args.iter().any(|a| a.starts_with("--vmm-pool")) {
            return;
        }
        self.wait_pool_full();
    }

    /// Stop the server (SIGTERM) and start a new one with `args` on the
    /// same state directory, appending to the same log.
    pub fn restart(&mut self, args: &[&str]) {
        if self.child.is_some() {
            let status = self.stop(Duration::from_secs(20));
            assert!(status.success(), "uffd-server stopped with {status}");
        }
        let opts = ServerOptions {
            nofile: None,
            ..self.options.clone()
        };
        self.child = Some(spawn_server(
            &self.state_dir,
            &self.server_log(),
            args,
            &opts,
        ));
        // A restart after a crash verifies what it finds first.
        self.wait_healthy(Duration::from_secs(60));
        self.settle_env_pool(args);
    }

    /// SIGKILL the server and its keeper, so none of their clean-up runs,
    /// and reap them. The state directory stays; its VMMs end once they
    /// find nobody holds the socket they would rejoin on.
    pub fn kill_hard(&mut self) {
        if let Some(mut child) = self.child.take() {
            let keeper = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(0));
            let serving = children_of(child.id());
            // The keeper, stopped, cannot start another serving process.
            let _ = nix::sys::signal::kill(keeper, nix::sys::signal::Signal::SIGSTOP);
            for pid in serving {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap_or(0)),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The whole server log so far.
    pub fn server_log_text(&self) -> String {
        std::fs::read_to_string(self.server_log()).unwrap_or_default()
    }
}

/// Run `uffd-server` on `state_dir` expecting it to refuse to start.
/// Returns its exit status and what it logged; panics if it is still
/// running after `within` (it is killed then).
pub fn server_start_failure(
    state_dir: &Path,
    args: &[&str],
    within: Duration,
) -> (std::process::ExitStatus, String) {
    let log = tempfile::NamedTempFile::new().expect("cannot create a log file");
    let mut child = spawn_server(state_dir, log.path(), args, &ServerOptions::default());
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait on uffd-server") {
            let text = std::fs::read_to_string(log.path()).unwrap_or_default();
            return (status, text);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "uffd-server on {} still runs after {within:?}; it should have refused to start; log:\n{}",
                state_dir.display(),
                tail(log.path(), 20)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A server whose state directory is on the XFS mount, started with
/// `args`, or None (see [`xfs_dir`], [`require_kvm_uffd`]). The harness
/// makes its temporary directories under TMPDIR, which this points at the
/// mount for the rest of the test binary: images made there share the
/// state directory's filesystem.
pub fn server_on_xfs(args: &[&str]) -> Option<TestServer> {
    let dir = xfs_dir()?;
    if !require_kvm_uffd() {
        return None;
    }
    std::env::set_var("TMPDIR", &dir);
    Some(TestServer::start_with_args(args))
}

/// The processes whose parent is `pid` (from /proc).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|stat| {
                // Fields after the command (which may hold spaces): state, ppid.
                stat.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(pid)
            })
        })
        .collect()
}
