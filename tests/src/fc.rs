//! `fc_client`, the stand-in that does what Firecracker does on the wire
//! and in memory, run as a child process whose JSON lines a test reads.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::host::bin;

/// How long an `fc_client` command may take before its test fails.
pub const FC_CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

/// A running `fc_client` (the stand-in that does what Firecracker does on
/// the wire and in memory), its stdin held open (for `hold`) and its JSON
/// lines read by a thread.
#[derive(Debug)]
pub struct FcClient {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    what: String,
}

impl FcClient {
    pub fn spawn(socket: &Path, opts: &[&str], commands: &[&str]) -> Self {
        let what = format!("fc_client {} {}", opts.join(" "), commands.join(" "));
        let mut child = Command::new(bin("fc_client"))
            .arg("--socket")
            .arg(socket)
            .args(opts)
            .args(commands)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        FcClient {
            child,
            stdin,
            lines,
            what,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next JSON line; panics if the client stops printing.
    pub fn next_line(&mut self) -> Value {
        match self.lines.recv_timeout(FC_CLIENT_TIMEOUT) {
            Ok(l) => serde_json::from_str(&l)
                .unwrap_or_else(|e| panic!("{}: not JSON ({e}): {l}", self.what)),
            Err(e) => {
                let status = self.child.try_wait().ok().flatten();
                panic!(
                    "{}: no further output ({e}); exit status {status:?}",
                    self.what
                )
            }
        }
    }

    /// Read lines up to the one of command `cmd`; returns it.
    pub fn until(&mut self, cmd: &str) -> Value {
        loop {
            let v = self.next_line();
            if v["cmd"] == cmd {
                return v;
            }
        }
    }

    /// The next JSON line if one was printed, as text, without waiting.
    pub fn try_line(&self) -> Option<String> {
        self.lines.try_recv().ok()
    }

    /// The client's exit status if it has ended.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Close stdin: a `hold` returns.
    pub fn release(&mut self) {
        self.stdin.take();
    }

    /// Release, wait for a successful exit, and return the lines not read yet.
    pub fn finish(mut self) -> Vec<Value> {
        self.release();
        let deadline = Instant::now() + FC_CLIENT_TIMEOUT;
        let status = loop {
            if let Some(st) = self.child.try_wait().expect("try_wait on fc_client") {
                break st;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within {FC_CLIENT_TIMEOUT:?}",
                self.what
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(status.success(), "{} failed: {status}", self.what);
        let mut rest = Vec::new();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(10)) {
            rest.push(
                serde_json::from_str(&l)
                    .unwrap_or_else(|e| panic!("{}: not JSON ({e}): {l}", self.what)),
            );
        }
        rest
    }
}

impl Drop for FcClient {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
