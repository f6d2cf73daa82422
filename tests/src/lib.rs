//! Harness for end-to-end tests: real `uffd-server` and `vmm` processes,
//! real KVM and userfaultfd.
//!
//! - [`TestServer`] starts a server on a fresh temporary state directory,
//!   talks to its REST API, and stops it (and any VMM it leaves behind) when
//!   dropped. If the test is panicking it prints the tail of the server and
//!   VMM logs and keeps the state directory for a post-mortem.
//! - [`require_kvm_uffd`] decides whether a test that needs `/dev/kvm` and
//!   userfaultfd runs: it skips with a printed reason on a machine without
//!   them, but fails loudly under `CI=true` (CI must not skip).
//! - [`RandomImage`] and the `expected_*` helpers build raw memory images and
//!   compute what the guest must report, with the reference implementations
//!   in [`shared::pattern`].
//!
//! The binaries are not built here: the test command runs
//! `cargo build --workspace` first. They are found next to the test
//! executable's `deps/` directory, or in `$PAGEFORK_BIN_DIR`.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::{RngCore, SeedableRng};
use serde_json::{json, Value};
use shared::PAGE_SIZE;
use uffdctl::client::Client;

/// How long one API call may take before the test fails instead of hanging.
pub const API_TIMEOUT: Duration = Duration::from_secs(120);

/// Directory holding the built `uffd-server` and `vmm` binaries.
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PAGEFORK_BIN_DIR") {
        return PathBuf::from(d);
    }
    // The test executable is target/<profile>/deps/<name>-<hash>.
    let exe = std::env::current_exe().expect("cannot find the test executable's path");
    let deps = exe
        .parent()
        .expect("test executable has no parent directory");
    if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().expect("deps/ has no parent").to_owned()
    } else {
        deps.to_owned()
    }
}

/// Path of a built workspace binary; panics with what to do if missing.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build --workspace` before the end-to-end tests \
         (or point PAGEFORK_BIN_DIR at the directory holding uffd-server and vmm)",
        p.display()
    );
    p
}

/// Why device `path` cannot be opened read-write, if it cannot.
fn device_unusable(path: &str) -> Option<String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .err()
        .map(|e| format!("{path} is not usable: {e}"))
}

/// Whether this machine can run KVM guests served through userfaultfd.
///
/// Without `/dev/kvm` or `/dev/userfaultfd`: panics if `CI=true` (CI must
/// run these tests), else prints `skipping: ...` and returns false.
pub fn require_kvm_uffd() -> bool {
    let missing: Vec<String> = ["/dev/kvm", "/dev/userfaultfd"]
        .iter()
        .filter_map(|d| device_unusable(d))
        .collect();
    if missing.is_empty() {
        return true;
    }
    let why = missing.join("; ");
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but a prerequisite of the end-to-end tests is missing: {why}");
    }
    eprintln!("skipping: {why} (these tests need KVM and userfaultfd)");
    false
}

/// Whether process `pid` exists (`kill(pid, 0)` succeeds).
pub fn process_exists(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

/// Send `sig` to `pid`.
pub fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    let pid = i32::try_from(pid).expect("pid fits in i32");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig)
        .unwrap_or_else(|e| panic!("cannot send {sig} to pid {pid}: {e}"));
}

/// Last `n` lines of a text file ("" if unreadable).
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A running `uffd-server` on its own temporary state directory.
#[derive(Debug)]
pub struct TestServer {
    child: Option<Child>,
    dir: Option<tempfile::TempDir>,
    state_dir: PathBuf,
    client: Client,
    /// VMM pids seen, to make sure none outlives the test.
    vmm_pids: Mutex<Vec<u32>>,
}

impl TestServer {
    /// Start a server with default settings and wait until it is healthy.
    pub fn start() -> Self {
        Self::start_with_args(&[])
    }

    /// Start a server with extra command-line arguments.
    pub fn start_with_args(args: &[&str]) -> Self {
        let server = bin("uffd-server");
        let vmm = bin("vmm");
        let dir = tempfile::Builder::new()
            .prefix("pagefork-e2e-")
            .tempdir()
            .expect("cannot create a temp dir");
        let state_dir = dir.path().join("state");
        std::fs::create_dir_all(&state_dir).expect("cannot create the state dir");
        let log = File::create(dir.path().join("server.log")).expect("cannot create server.log");
        let child = Command::new(&server)
            .arg("--state-dir")
            .arg(&state_dir)
            .arg("--vmm-bin")
            .arg(&vmm)
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", server.display()));
        let client = Client::new(state_dir.join("api.sock"));
        let mut s = TestServer {
            child: Some(child),
            dir: Some(dir),
            state_dir,
            client,
            vmm_pids: Mutex::default(),
        };
        s.wait_healthy(Duration::from_secs(15));
        s
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
            if let Ok(r) = self.client.request("GET", "/v1/health", None) {
                if r.status == 200 {
                    return;
                }
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

    /// The server process's pid.
    pub fn pid(&self) -> u32 {
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

    /// Call the API; panics if the call fails at the transport level or
    /// takes longer than [`API_TIMEOUT`].
    pub fn api(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let client = self.client.clone();
        let (m, p) = (method.to_owned(), path.to_owned());
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(client.request(&m, &p, body.as_ref()));
        });
        match rx.recv_timeout(API_TIMEOUT) {
            Ok(Ok(r)) => (r.status, r.body),
            Ok(Err(e)) => panic!("{method} {path}: API call failed: {e}"),
            Err(_) => panic!("{method} {path}: no answer within {API_TIMEOUT:?}"),
        }
    }

    /// Send raw body bytes (which need not be JSON); returns status and body
    /// text.
    pub fn api_raw(&self, method: &str, path: &str, body: &[u8]) -> (u16, String) {
        let mut s = UnixStream::connect(self.api_sock()).expect("cannot connect to api.sock");
        s.set_read_timeout(Some(API_TIMEOUT))
            .expect("set_read_timeout");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).expect("cannot send request");
        // A server may answer (413, 400) and close before it has read a
        // large body; the answer is still there to read.
        let sent = s.write_all(body);
        let mut resp = Vec::new();
        if let Err(e) = s.read_to_end(&mut resp) {
            assert!(
                !resp.is_empty(),
                "cannot read response: {e} (send: {sent:?})"
            );
        }
        let resp = String::from_utf8_lossy(&resp).into_owned();
        let status = resp
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP response: {resp:?}"));
        let body = resp
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (status, body)
    }

    /// Create a VM; panics unless the answer is 201. Returns its id.
    pub fn create_vm(&self, body: Value) -> String {
        let (status, v) = self.api("POST", "/v1/vms", Some(body.clone()));
        assert_eq!(status, 201, "POST /v1/vms {body} failed: {v}");
        let id = v["id"]
            .as_str()
            .unwrap_or_else(|| panic!("no id in {v}"))
            .to_owned();
        if let Some(pid) = v["pid"].as_u64().and_then(|p| u32::try_from(p).ok()) {
            self.vmm_pids
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(pid);
        }
        id
    }

    /// Run a guest op; panics unless the answer is 200. Returns its result.
    pub fn exec(&self, id: &str, body: Value) -> u64 {
        let (status, v) = self.try_exec(id, body.clone());
        assert_eq!(status, 200, "exec {body} on {id} failed: {v}");
        v["result"]
            .as_u64()
            .unwrap_or_else(|| panic!("no result in {v}"))
    }

    /// `fill` pages `[start, start+pages)` of `id` with `seed`'s pattern.
    pub fn fill(&self, id: &str, start: u64, pages: u64, seed: u64) {
        let r = self.exec(
            id,
            json!({"op": "fill", "start_page": start, "pages": pages, "seed": seed}),
        );
        assert_eq!(r, 0, "fill on {id} returned {r}");
    }

    /// `touch` (read, or rewrite unchanged) pages `[start, start+pages)`.
    pub fn touch(&self, id: &str, start: u64, pages: u64, write: bool) {
        self.exec(
            id,
            json!({"op": "touch", "start_page": start, "pages": pages, "write": write}),
        );
    }

    /// Pages of `[start, start+pages)` whose fill words differ from `seed`'s.
    pub fn verify(&self, id: &str, start: u64, pages: u64, seed: u64) -> u64 {
        self.exec(
            id,
            json!({"op": "verify", "start_page": start, "pages": pages, "seed": seed}),
        )
    }

    /// The guest's checksum of `[start, start+pages)`.
    pub fn checksum(&self, id: &str, start: u64, pages: u64) -> u64 {
        self.exec(
            id,
            json!({"op": "checksum", "start_page": start, "pages": pages}),
        )
    }

    /// The VMM's digest of `[start, start+pages)`.
    pub fn digest(&self, id: &str, start: u64, pages: u64) -> u64 {
        self.exec(
            id,
            json!({"op": "digest", "start_page": start, "pages": pages}),
        )
    }

    /// Run a guest op and return the raw answer.
    pub fn try_exec(&self, id: &str, body: Value) -> (u16, Value) {
        self.api("POST", &format!("/v1/vms/{id}/exec"), Some(body))
    }

    /// `GET /v1/vms/{id}`; panics unless 200.
    pub fn vm(&self, id: &str) -> Value {
        let (status, v) = self.api("GET", &format!("/v1/vms/{id}"), None);
        assert_eq!(status, 200, "GET {id} failed: {v}");
        v
    }

    /// Ids listed by `GET /v1/vms`.
    pub fn vm_ids(&self) -> Vec<String> {
        let (status, v) = self.api("GET", "/v1/vms", None);
        assert_eq!(status, 200, "GET /v1/vms failed: {v}");
        v["vms"]
            .as_array()
            .unwrap_or_else(|| panic!("no vms array in {v}"))
            .iter()
            .map(|vm| vm["id"].as_str().expect("vm without id").to_owned())
            .collect()
    }

    /// Poll `GET /v1/vms/{id}` until its state is `state`; panics after
    /// `within`. Returns the last answer.
    pub fn wait_state(&self, id: &str, state: &str, within: Duration) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let v = self.vm(id);
            if v["state"] == state {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{id} did not become {state} within {within:?}: {v}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Check `/v1/health` answers 200.
    pub fn assert_healthy(&self) {
        let (status, v) = self.api("GET", "/v1/health", None);
        assert_eq!(status, 200, "health check failed: {v}");
        assert_eq!(v["status"], "ok", "health check body: {v}");
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
        for pid in self
            .vmm_pids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
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

/// A raw memory image file of random content, and its bytes.
#[derive(Debug)]
pub struct RandomImage {
    pub file: tempfile::NamedTempFile,
    pub bytes: Vec<u8>,
}

impl RandomImage {
    /// An image of `mib` MiB filled from a seeded RNG.
    pub fn new(mib: u64, seed: u64) -> Self {
        let len = usize::try_from(mib << 20).expect("image size fits in usize");
        let mut bytes = vec![0u8; len];
        rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut bytes);
        Self::from_bytes(bytes)
    }

    /// An image holding exactly `bytes`.
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        let mut file = tempfile::Builder::new()
            .prefix("pagefork-image-")
            .tempfile()
            .expect("cannot create image");
        file.write_all(&bytes).expect("cannot write image");
        file.flush().expect("cannot flush image");
        RandomImage { file, bytes }
    }

    /// The image's path as a string for `memory_source`.
    pub fn path(&self) -> String {
        self.file
            .path()
            .to_str()
            .expect("temp path is UTF-8")
            .to_owned()
    }

    /// The `memory_source` JSON for this image.
    pub fn source(&self) -> Value {
        json!({ "kind": "file", "path": self.path() })
    }
}

/// Pages in `mib` MiB.
pub fn pages_of(mib: u64) -> u64 {
    (mib << 20) / PAGE_SIZE
}

/// Guest `checksum` of pages `[start, start+pages)` of memory `mem`
/// (which starts at guest page 0).
pub fn expected_checksum(mem: &[u8], start: u64, pages: u64) -> u64 {
    shared::pattern::checksum(mem, 0, start, pages)
}

/// VMM `digest` of pages `[start, start+pages)` of memory `mem`.
pub fn expected_digest(mem: &[u8], start: u64, pages: u64) -> u64 {
    shared::pattern::digest(mem, 0, start, pages)
}

/// Apply the guest's `fill` of `seed` to pages `[start, start+pages)` of `mem`.
pub fn apply_fill(mem: &mut [u8], start: u64, pages: u64, seed: u64) {
    let ps = usize::try_from(PAGE_SIZE).expect("page size fits");
    for p in start..start + pages {
        let b = usize::try_from(p).expect("page fits") * ps;
        shared::pattern::fill_page(&mut mem[b..b + ps], p, seed);
    }
}

/// Memory of `mib` MiB of zeroes with `fill` of `seed` applied to all pages.
pub fn filled_zero_memory(mib: u64, seed: u64) -> Vec<u8> {
    let mut mem = vec![0u8; usize::try_from(mib << 20).expect("size fits")];
    apply_fill(&mut mem, 0, pages_of(mib), seed);
    mem
}

/// A field of a VM's `faults` counters.
pub fn fault_counter(vm: &Value, name: &str) -> u64 {
    vm["faults"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no faults.{name} in {vm}"))
}

/// Pages of a VM with source kind `kind` (0 if the kind is absent).
pub fn pages_by(vm: &Value, kind: &str) -> u64 {
    vm["pages"]
        .get(kind)
        .map(|n| {
            n.as_u64()
                .unwrap_or_else(|| panic!("pages.{kind} not a number in {vm}"))
        })
        .unwrap_or(0)
}

/// Sum of a VM's pages over all source kinds.
pub fn pages_total(vm: &Value) -> u64 {
    vm["pages"]
        .as_object()
        .unwrap_or_else(|| panic!("no pages map in {vm}"))
        .values()
        .map(|n| n.as_u64().expect("page count is a number"))
        .sum()
}

/// Crash and restart of a [`TestServer`] on the same state directory (for
/// crash-safety tests).
impl TestServer {
    /// SIGKILL the server, so none of its clean-up runs, and reap it. The
    /// state directory stays; its VMMs lose their server.
    pub fn kill_hard(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start a new server process on this server's state directory (after
    /// [`TestServer::kill_hard`] or [`TestServer::stop`]), appending to the
    /// same log, and wait until it is healthy.
    pub fn restart(&mut self, args: &[&str]) {
        assert!(self.child.is_none(), "the server is still running");
        let log = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(self.server_log())
            .expect("cannot open server.log");
        let child = Command::new(bin("uffd-server"))
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--vmm-bin")
            .arg(bin("vmm"))
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("cannot restart uffd-server");
        self.child = Some(child);
        self.wait_healthy(Duration::from_secs(60));
    }
}
