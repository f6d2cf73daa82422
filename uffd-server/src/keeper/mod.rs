//! The keeper: a tiny supervisor process that holds what must outlive the
//! serving process (its stored fds: guest memory memfds, VMM connections,
//! ...), restarts the serving process when it dies (SIGKILL, OOM, panic)
//! and starts a new binary on request (upgrade), handing the stored fds
//! to each new serving process.
//!
//! It speaks systemd's protocols, so that under systemd, systemd itself can
//! be the keeper (`Type=notify`, `NotifyAccess=main`,
//! `FileDescriptorStoreMax=`, `Restart=always`):
//! - the serving process sends `sd_notify` datagrams to `NOTIFY_SOCKET`
//!   (`<state_dir>/keeper.sock`): `FDSTORE=1`+`FDNAME=` with fds,
//!   `FDSTOREREMOVE=1`, `READY=1`, `STATUS=`, and our extension
//!   `X_PAGEFORK_UPGRADE=<binary>`, and `X_PAGEFORK_FDNAMES=a:b:...`,
//!   which names each of several fds sent (or removed) in one datagram
//!   (see [`crate::fdstore`]);
//! - each start gets the stored fds on 3, 4, ... with `LISTEN_PID`,
//!   `LISTEN_FDS`, `LISTEN_FDNAMES`, plus `PAGEFORK_KEEPER=1`,
//!   `PAGEFORK_KEEPER_FDNAMES=1` (this keeper reads `X_PAGEFORK_FDNAMES=`:
//!   a keeper of an older binary, which an upgrade leaves running, does
//!   not set it, and is sent one fd per datagram) and
//!   `PAGEFORK_START=first|crash|upgrade`.
//!
//! The keeper is single-threaded: one poll loop over the notification
//! socket and a signalfd (SIGCHLD, SIGTERM, SIGINT, SIGHUP). It is a child
//! subreaper, so the VMMs of a dead serving process become its children,
//! and it reaps every child. When the serving process dies, every datagram
//! it queued before dying is read before the next one starts: an fd stored
//! just before a crash is never lost.
//!
//! The serving process is started with a hand-written fork/exec rather
//! than `std::process::Command`: `Command`'s child reports exec errors on an
//! internal CLOEXEC pipe whose fd number is unknown to us, so moving the
//! stored fds onto 3, 4, ... in `pre_exec` could land on it, and a failed
//! exec would then write its error code into a stored fd (guest memory!).
//! Here the error pipe is moved above the LISTEN_FDS range first.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use libc::c_int;
use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::resource::{getrlimit, setrlimit, Resource};
use nix::sys::signal::{kill, SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::socket::{
    self, sockopt, AddressFamily, SockFlag, SockType, UnixAddr, UnixCredentials,
};
use nix::sys::stat::{umask, Mode};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tracing::{debug, error, info, warn};

use crate::fdstore::{self, StartReason};

mod notify;
mod spawn;

use spawn::spawn;

/// The notification socket's name in the state directory.
pub const SOCKET_NAME: &str = "keeper.sock";
/// The most fds the keeper stores; more are refused with a warning.
pub const MAX_STORED_FDS: usize = 1 << 20;
/// The first back-off after a start that died before READY; it doubles
/// with each such death, up to [`BACKOFF_MAX`].
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Room for one notification (systemd allows 4 KiB; an upgrade path may
/// be PATH_MAX long).
const MAX_DATAGRAM: usize = 16 * 1024;
/// The kernel's limit of fds in one SCM_RIGHTS message.
const SCM_MAX_FD: usize = 253;

/// Whether this process runs under our own keeper (`PAGEFORK_KEEPER=1`).
pub fn is_kept() -> bool {
    fdstore::is_kept()
}

/// Run as the keeper of `state_dir` (blocks until the server is stopped for
/// good). `program` is the binary to start (normally
/// `std::env::current_exe()`), `args` its arguments (the keeper's own
/// `argv[1..]` unchanged).
///
/// Exits with the serving process's status after a SIGTERM/SIGINT (0 when
/// it stopped cleanly), or with the status of a first start that exited
/// before READY (bad arguments must not loop forever). Meant to be the last
/// thing the process does: SIGCHLD, SIGTERM, SIGINT and SIGHUP stay blocked
/// when it returns.
pub fn run(state_dir: &Path, program: PathBuf, args: Vec<OsString>) -> ExitCode {
    ExitCode::from(run_with_code(state_dir, program, args))
}

fn run_with_code(state_dir: &Path, program: PathBuf, args: Vec<OsString>) -> u8 {
    let mut keeper = match Keeper::new(state_dir, program, args) {
        Ok(keeper) => keeper,
        Err(e) => {
            error!("keeper of {}: {e}", state_dir.display());
            return 1;
        }
    };
    keeper.main_loop()
}

/// The fds stored under one name (usually one), in store order.
#[derive(Debug)]
struct Stored {
    seq: u64,
    fds: Vec<OwnedFd>,
}

/// The serving process of the moment.
#[derive(Debug)]
struct Serving {
    pid: Pid,
    binary: PathBuf,
    reason: StartReason,
    ready: bool,
}

#[derive(Debug)]
struct Keeper {
    sock: OwnedFd,
    sock_path: PathBuf,
    sigfd: SignalFd,
    stored: HashMap<String, Stored>,
    /// Store order of the next stored name.
    seq: u64,
    /// Stored fds in all.
    nfds: usize,
    /// The binary started on a crash (the upgraded one once it is READY).
    program: PathBuf,
    args: Vec<OsString>,
    child: Option<Serving>,
    /// The binary the serving process asked to be replaced with.
    upgrade: Option<PathBuf>,
    /// The binary before an upgrade, until the upgraded one is READY.
    fallback: Option<PathBuf>,
    /// A SIGTERM/SIGINT was forwarded: the next exit is the last.
    stopping: bool,
    /// Starts in a row that died before READY.
    failures: u32,
    /// A restart waiting for its back-off.
    restart_at: Option<Instant>,
    buf: Vec<u8>,
    cmsg: Vec<u8>,
}

impl Keeper {
    fn new(state_dir: &Path, program: PathBuf, args: Vec<OsString>) -> io::Result<Keeper> {
        raise_nofile();
        if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
            warn!(
                "cannot become a child subreaper ({e}): VMMs of a dead server are not reaped here"
            );
        }
        std::fs::create_dir_all(state_dir)?;
        let state_dir = std::path::absolute(state_dir)?;

        let mut mask = SigSet::empty();
        for sig in [
            Signal::SIGCHLD,
            Signal::SIGTERM,
            Signal::SIGINT,
            Signal::SIGHUP,
        ] {
            mask.add(sig);
        }
        mask.thread_block()?;
        let sigfd = SignalFd::with_flags(&mask, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)?;

        let sock_path = state_dir.join(SOCKET_NAME);
        let sock = bind_socket(&sock_path)?;
        Ok(Keeper {
            sock,
            sock_path,
            sigfd,
            stored: HashMap::new(),
            seq: 0,
            nfds: 0,
            program,
            args,
            child: None,
            upgrade: None,
            fallback: None,
            stopping: false,
            failures: 0,
            restart_at: None,
            buf: vec![0; MAX_DATAGRAM],
            cmsg: nix::cmsg_space!([RawFd; SCM_MAX_FD], UnixCredentials),
        })
    }

    fn main_loop(&mut self) -> u8 {
        if let Err(e) = self.start(StartReason::First) {
            error!("cannot start {}: {e}", self.program.display());
            return self.shutdown(1);
        }
        loop {
            let mut timeout = PollTimeout::NONE;
            if let Some(at) = self.restart_at {
                let now = Instant::now();
                if now >= at {
                    self.restart_at = None;
                    self.restart();
                    continue;
                }
                // Round up, so that the wake-up is not early.
                let ms = (at - now).as_micros().div_ceil(1000);
                timeout = PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX);
            }
            let mut pfds = [
                PollFd::new(self.sigfd.as_fd(), PollFlags::POLLIN),
                PollFd::new(self.sock.as_fd(), PollFlags::POLLIN),
            ];
            match poll(&mut pfds, timeout) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(e) => {
                    error!("keeper: poll: {e}");
                    return self.shutdown(1);
                }
            }
            let ready = |p: &PollFd| p.revents().is_some_and(|r| !r.is_empty());
            let (signals, messages) = (ready(&pfds[0]), ready(&pfds[1]));
            if messages {
                self.drain();
            }
            if signals {
                if let Some(code) = self.handle_signals() {
                    return code;
                }
            }
        }
    }

    /// Starts `self.program` for `reason`.
    fn start(&mut self, reason: StartReason) -> io::Result<()> {
        let mut entries: Vec<(&String, &Stored)> = self.stored.iter().collect();
        entries.sort_by_key(|(_, s)| s.seq);
        let mut names = Vec::new();
        let mut fds = Vec::with_capacity(self.nfds);
        for (name, s) in entries {
            for fd in &s.fds {
                names.push(name.as_str());
                fds.push(fd.as_raw_fd());
            }
        }
        let mut env = vec![
            (
                fdstore::NOTIFY_SOCKET,
                self.sock_path.as_os_str().as_bytes().to_vec(),
            ),
            (fdstore::KEEPER_ENV, b"1".to_vec()),
            (fdstore::FDNAMES_ENV, b"1".to_vec()),
            (fdstore::START_ENV, reason.as_str().as_bytes().to_vec()),
        ];
        if !fds.is_empty() {
            env.push(("LISTEN_FDS", fds.len().to_string().into_bytes()));
            env.push(("LISTEN_FDNAMES", names.join(":").into_bytes()));
        }
        let pid = spawn(&self.program, &self.args, &env, &fds)?;
        info!(
            "started {} (pid {pid}, {reason} start, {} stored fds)",
            self.program.display(),
            fds.len()
        );
        self.child = Some(Serving {
            pid,
            binary: self.program.clone(),
            reason,
            ready: false,
        });
        Ok(())
    }

    /// A start after a death (or a failed upgrade): on failure to even
    /// start, counts as a death before READY.
    fn restart(&mut self) {
        let reason = if self.upgrade.is_some() {
            StartReason::Upgrade
        } else {
            StartReason::Crash
        };
        if let Some(new) = self.upgrade.take() {
            self.program = new;
        }
        if let Err(e) = self.start(reason) {
            error!("cannot start {}: {e}", self.program.display());
            if let (StartReason::Upgrade, Some(prev)) = (reason, self.fallback.take()) {
                error!(
                    "UPGRADE FAILED: {} did not start; going back to {}",
                    self.program.display(),
                    prev.display()
                );
                self.program = prev;
                return self.restart();
            }
            self.failures += 1;
            self.restart_at = Some(Instant::now() + backoff(self.failures));
        }
    }

    /// Reads the pending signals; `Some(exit code)` when the keeper is done.
    fn handle_signals(&mut self) -> Option<u8> {
        let mut reap = false;
        loop {
            let info = match self.sigfd.read_signal() {
                Ok(Some(info)) => info,
                Ok(None) => break,
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    error!("keeper: reading signals: {e}");
                    break;
                }
            };
            let Ok(sig) = Signal::try_from(c_int::try_from(info.ssi_signo).unwrap_or(0)) else {
                continue;
            };
            match sig {
                Signal::SIGCHLD => reap = true,
                Signal::SIGTERM | Signal::SIGINT => {
                    self.stopping = true;
                    match &self.child {
                        Some(child) => {
                            info!("{sig}: stopping the serving process (pid {})", child.pid);
                            if let Err(e) = kill(child.pid, sig) {
                                warn!("cannot signal pid {}: {e}", child.pid);
                            }
                        }
                        None => {
                            info!("{sig}: no serving process running; keeper exits");
                            return Some(self.shutdown(0));
                        }
                    }
                }
                Signal::SIGHUP => {
                    if let Some(child) = &self.child {
                        info!(
                            "SIGHUP: forwarded to the serving process (pid {})",
                            child.pid
                        );
                        let _ = kill(child.pid, sig);
                    }
                }
                _ => {}
            }
        }
        if reap {
            return self.reap();
        }
        None
    }

    /// Reaps every exited child (the serving process, orphaned VMMs).
    fn reap(&mut self) -> Option<u8> {
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return None,
                Ok(status) => {
                    let pid = status.pid();
                    if pid.is_some() && pid == self.child.as_ref().map(|c| c.pid) {
                        if let Some(code) = self.child_exited(status) {
                            return Some(code);
                        }
                    } else {
                        debug!("reaped {status:?}");
                    }
                }
                Err(Errno::EINTR) => {}
                Err(e) => {
                    warn!("keeper: waitpid: {e}");
                    return None;
                }
            }
        }
    }

    /// The serving process is gone: decide what comes next.
    fn child_exited(&mut self, status: WaitStatus) -> Option<u8> {
        // What it sent before it died is still queued (and still accepted:
        // `self.child` is still it): read it all before anything else.
        self.drain();
        let child = self.child.take()?;
        let pid = child.pid;
        let (what, code) = describe(&status);

        if self.stopping {
            if code == 0 {
                info!("serving process {pid} stopped");
            } else {
                warn!("serving process {pid} stopped with {what}");
            }
            return Some(self.shutdown(code));
        }
        if let Some(new) = &self.upgrade {
            info!(
                "serving process {pid} exited ({what}); upgrading to {} with {} stored fds",
                new.display(),
                self.nfds
            );
            // Back to the last binary known to serve if this one fails.
            if child.ready || self.fallback.is_none() {
                self.fallback = Some(child.binary);
            }
            self.restart();
            return None;
        }
        if child.reason == StartReason::Upgrade && !child.ready {
            if let Some(prev) = self.fallback.take() {
                error!(
                    "UPGRADE FAILED: {} (pid {pid}) died before READY ({what}); \
                     going back to {} with {} stored fds",
                    child.binary.display(),
                    prev.display(),
                    self.nfds
                );
                self.program = prev;
                self.restart();
                return None;
            }
        }
        if child.reason == StartReason::First
            && !child.ready
            && matches!(status, WaitStatus::Exited(..))
        {
            error!("serving process {pid} exited before it was ready ({what}); keeper exits");
            return Some(self.shutdown(code));
        }

        if child.ready {
            self.failures = 0;
        } else {
            self.failures += 1;
        }
        let delay = backoff(self.failures);
        let after = if delay.is_zero() {
            String::new()
        } else {
            format!(" in {delay:?}")
        };
        warn!(
            "serving process {pid} died ({what}); restarting with {} stored fds{after}",
            self.nfds
        );
        if self.failures == 5 {
            error!(
                "the serving process died 5 times in a row before it was ready; \
                 still restarting, at most every {BACKOFF_MAX:?}"
            );
        }
        self.restart_at = Some(Instant::now() + delay);
        None
    }

    /// Closes every stored fd and the socket's name; returns `code`.
    fn shutdown(&mut self, code: u8) -> u8 {
        let n = self.nfds;
        self.stored.clear();
        self.nfds = 0;
        if let Err(e) = std::fs::remove_file(&self.sock_path) {
            warn!("removing {}: {e}", self.sock_path.display());
        }
        info!("keeper exits ({code}); {n} stored fds closed");
        code
    }
}

/// The back-off before the next start after `failures` deaths before READY
/// in a row: none after a death of a process that was serving.
fn backoff(failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    let doublings = (failures - 1).min(16);
    (BACKOFF_FIRST * 2u32.pow(doublings)).min(BACKOFF_MAX)
}

/// How a process ended, and the matching exit status of the keeper.
fn describe(status: &WaitStatus) -> (String, u8) {
    match *status {
        WaitStatus::Exited(_, code) => (
            format!("exit status {code}"),
            u8::try_from(code).unwrap_or(1),
        ),
        WaitStatus::Signaled(_, sig, core) => {
            let n = sig as c_int;
            let core = if core { ", core dumped" } else { "" };
            (
                format!("signal {n}{core}"),
                u8::try_from(128 + n).unwrap_or(255),
            )
        }
        ref other => (format!("{other:?}"), 1),
    }
}

/// The soft fd limit up to the hard one: the keeper holds thousands.
fn raise_nofile() {
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                warn!("cannot raise the fd limit from {soft} to {hard}: {e}");
            }
        }
        Ok(_) => {}
        Err(e) => warn!("getrlimit(RLIMIT_NOFILE): {e}"),
    }
}

/// The notification socket at `path` (mode 0600, SO_PASSCRED). A stale
/// socket is replaced; a live one (another keeper) is an error.
fn bind_socket(path: &Path) -> io::Result<OwnedFd> {
    if std::fs::symlink_metadata(path).is_ok() {
        let probe = UnixDatagram::unbound()?;
        if probe.connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("another keeper is running on {}", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let sock = socket::socket(
        AddressFamily::Unix,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    socket::setsockopt(&sock, sockopt::PassCred, &true)?;
    let addr = UnixAddr::new(path)?;
    // Created 0600 (the keeper is single-threaded: the umask is ours).
    let old = umask(Mode::from_bits_truncate(0o177));
    let bound = socket::bind(sock.as_raw_fd(), &addr);
    umask(old);
    bound?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(sock)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use nix::unistd::ForkResult;
    use std::fs;
    use std::io::IoSlice;
    use std::sync::Mutex;

    /// The served program: a python script speaking the protocol. What it
    /// does depends on its file name, `PAGEFORK_START`, the fds it got and
    /// the scenario (argv[2]); it logs to `<dir>/events`.
    const SERVER_PY: &str = r#"#!/usr/bin/env python3
import array, os, signal, socket, sys, time

d, scenario = sys.argv[1], sys.argv[2]
me = os.path.basename(sys.argv[0])
start = os.environ.get("PAGEFORK_START", "none")
pid = os.getpid()

def log(*words):
    with open(os.path.join(d, "events"), "a") as f:
        f.write(" ".join([me, start] + [str(w) for w in words]) + "\n")

def fail(why):
    log("error", why)
    sys.exit(1)

addr = os.environ.get("NOTIFY_SOCKET") or fail("no NOTIFY_SOCKET")
if os.environ.get("PAGEFORK_KEEPER") != "1":
    fail("no PAGEFORK_KEEPER")
if os.environ.get("PAGEFORK_KEEPER_FDNAMES") != "1":
    fail("no PAGEFORK_KEEPER_FDNAMES")

def notify(text, fds=()):
    if fds:
        # (socket.send_fds ignores its address argument before 3.12)
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        sock.sendmsg([text.encode()], rights, 0, addr)
    else:
        sock.sendto(text.encode(), addr)

def memfd(name, content):
    fd = os.memfd_create(name)
    os.write(fd, content.encode())
    return fd

fds = {}
n = int(os.environ.get("LISTEN_FDS", "0"))
if n:
    if os.environ.get("LISTEN_PID") != str(pid):
        fail("LISTEN_PID=" + os.environ.get("LISTEN_PID", "unset"))
    names = os.environ["LISTEN_FDNAMES"].split(":")
    if len(names) != n:
        fail("LISTEN_FDNAMES")
    for i, name in enumerate(names):
        if not os.get_inheritable(3 + i):
            fail("fd %d is CLOEXEC" % (3 + i))
        fds[name] = os.pread(3 + i, 100, 0).decode()
try:
    os.fstat(3 + n)
    fail("fd %d leaked to the served process" % (3 + n))
except OSError:
    pass
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
listing = ",".join("%s=%s" % kv for kv in sorted(fds.items())) or "-"
log("start", "pid=%d" % pid, "fds=" + listing)

def stop(*_):
    log("stopping", "pid=%d" % pid)
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)

def serve_forever():
    while True:
        signal.pause()

if scenario == "main":
    if me == "v1.py" and start == "first":
        notify("FDSTORE=1\nFDNAME=mem\n", [memfd("mem", "one")])
        vmm = os.fork()
        if vmm == 0:
            # A VMM: outlives this process, until the test releases it.
            while not os.path.exists(os.path.join(d, "release")):
                time.sleep(0.01)
            os._exit(0)
        notify("READY=1\nMAINPID=%d\nSTATUS=serving\n" % pid)
        log("ready", "pid=%d" % pid, "vmm=%d" % vmm)
        serve_forever()
    elif me == "v1.py" and start == "crash" and "late" not in fds:
        notify("FDSTORE=1\nFDNAME=tmp\n", [memfd("tmp", "x")])
        notify("FDSTOREREMOVE=1\nFDNAME=tmp\n")
        notify("FDSTORE=1\nFDNAME=late\n", [memfd("late", "two")])
        # Several fds, each named, in one datagram; then two of them
        # removed in one; a count that does not match stores nothing.
        notify("FDSTORE=1\nX_PAGEFORK_FDNAMES=b1:b2:b3\n",
               [memfd("b1", "three"), memfd("b2", "y"), memfd("b3", "z")])
        notify("FDSTOREREMOVE=1\nX_PAGEFORK_FDNAMES=b3:b2\n")
        notify("FDSTORE=1\nX_PAGEFORK_FDNAMES=c1:c2\n", [memfd("c1", "w")])
        notify("FDSTORE=1\nX_PAGEFORK_FDNAMES=d:e:f\n", [memfd("d", "w")] * 3)
        notify("FDSTOREREMOVE=1\nX_PAGEFORK_FDNAMES=d:e\n")
        notify("FDSTORE=1\nX_PAGEFORK_FDNAMES=g1::g2\n", [memfd("g", "w")] * 3)
        # Dies right after the sends: the keeper must still see them.
        os.kill(pid, signal.SIGKILL)
    elif me == "v1.py" and start == "crash":
        notify("READY=1\n")
        notify("X_PAGEFORK_UPGRADE=%s\n" % os.path.join(d, "v2.py"))
        log("upgrading", "pid=%d" % pid)
        sys.exit(0)
    elif me == "v2.py" and start == "upgrade":
        notify("READY=1\n")
        log("ready", "pid=%d" % pid)
        serve_forever()
    else:
        fail("unexpected start")
elif scenario == "badupgrade":
    if me == "v1.py" and start == "first":
        notify("FDSTORE=1\nFDNAME=mem\n", [memfd("mem", "one")])
        notify("READY=1\n")
        notify("X_PAGEFORK_UPGRADE=%s\n" % os.path.join(d, "bad.py"))
        log("upgrading", "pid=%d" % pid)
        sys.exit(0)
    elif me == "bad.py":
        sys.exit(1)
    elif me == "v1.py" and start == "crash":
        notify("READY=1\n")
        log("ready", "pid=%d" % pid)
        serve_forever()
    else:
        fail("unexpected start")
elif scenario == "badargs":
    sys.exit(3)
"#;

    fn install(dir: &Path, names: &[&str]) {
        // No fork while a script is open for writing (its exec would fail
        // with ETXTBSY while a forked child holds that fd).
        let _lock = crate::fdstore::tests::env_lock();
        for name in names {
            let path = dir.join(name);
            fs::write(&path, SERVER_PY).unwrap();
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        }
    }

    /// A keeper in a forked child of the test process.
    struct Kept {
        pid: Pid,
        dir: PathBuf,
        done: bool,
    }

    impl Drop for Kept {
        fn drop(&mut self) {
            if !self.done {
                // Its children get SIGTERM (PDEATHSIG).
                let _ = kill(self.pid, Signal::SIGKILL);
                let _ = waitpid(self.pid, None);
            }
        }
    }

    fn start_keeper(dir: &Path, program: &str, scenario: &str) -> Kept {
        let program = dir.join(program);
        let args = vec![dir.as_os_str().to_owned(), OsString::from(scenario)];
        let log = fs::File::create(dir.join("keeper.log")).unwrap();
        let _env = crate::fdstore::tests::env_lock();
        // SAFETY: the child only runs the keeper, single-threaded (the only
        // thread that survives a fork), and leaves with _exit; glibc's malloc
        // is fork-safe, and `env_lock` keeps our tests out of the
        // environment during the fork.
        match unsafe { nix::unistd::fork() }.unwrap() {
            ForkResult::Child => {
                // Only stdio and the log of the test process's fds: the
                // others (other tests' files and pipes) are not the keeper's.
                let logfd = libc::c_uint::try_from(log.as_raw_fd()).unwrap();
                // SAFETY: closes fds nothing in this process uses any more.
                unsafe {
                    libc::syscall(libc::SYS_close_range, 3u32, logfd.saturating_sub(1), 0u32);
                    libc::syscall(libc::SYS_close_range, logfd + 1, u32::MAX, 0u32);
                }
                let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let subscriber = tracing_subscriber::fmt()
                        .with_writer(Mutex::new(log))
                        .with_ansi(false)
                        .with_max_level(tracing::Level::DEBUG)
                        .finish();
                    tracing::subscriber::with_default(subscriber, || {
                        run_with_code(dir, program, args)
                    })
                }))
                .unwrap_or(101);
                // SAFETY: leaves the forked copy of the test process without
                // running any of the parent's exit handlers.
                unsafe { libc::_exit(code.into()) }
            }
            ForkResult::Parent { child } => Kept {
                pid: child,
                dir: dir.to_owned(),
                done: false,
            },
        }
    }

    impl Kept {
        fn events(&self) -> String {
            fs::read_to_string(self.dir.join("events")).unwrap_or_default()
        }

        fn log(&self) -> String {
            fs::read_to_string(self.dir.join("keeper.log")).unwrap_or_default()
        }

        fn wait_until<T>(&self, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                if let Some(t) = f() {
                    return t;
                }
                let events = self.events();
                assert!(
                    !events.contains(" error ") && Instant::now() < deadline,
                    "waiting for {what}\nevents:\n{events}\nkeeper log:\n{}",
                    self.log()
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        }

        /// The fields of the `nth` events line that starts with `prefix`.
        fn event(&self, prefix: &str, nth: usize) -> HashMap<String, String> {
            self.wait_until(prefix, || {
                let events = self.events();
                let line = events.lines().filter(|l| l.starts_with(prefix)).nth(nth)?;
                Some(
                    line.split(' ')
                        .filter_map(|w| w.split_once('='))
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .collect(),
                )
            })
        }

        fn logged(&self, needle: &str) {
            self.wait_until(needle, || self.log().contains(needle).then_some(()));
        }

        fn wait_exit(&mut self) -> WaitStatus {
            let status = self.wait_until("the keeper's exit", || {
                match waitpid(self.pid, Some(WaitPidFlag::WNOHANG)).unwrap() {
                    WaitStatus::StillAlive => None,
                    status => Some(status),
                }
            });
            self.done = true;
            status
        }
    }

    fn pid_of(fields: &HashMap<String, String>, key: &str) -> i32 {
        fields[key].parse().unwrap()
    }

    /// Reaped (no zombie left behind): its /proc entry is gone.
    fn gone(pid: i32) -> bool {
        !Path::new(&format!("/proc/{pid}")).exists()
    }

    fn ppid(pid: i32) -> Option<i32> {
        let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let line = status.lines().find(|l| l.starts_with("PPid:"))?;
        line["PPid:".len()..].trim().parse().ok()
    }

    #[test]
    fn keeper_restarts_upgrades_and_stops() {
        let dir = tempfile::tempdir().unwrap();
        install(dir.path(), &["v1.py", "v2.py"]);
        let mut k = start_keeper(dir.path(), "v1.py", "main");
        let keeper = k.pid.as_raw();

        let first = k.event("v1.py first ready", 0);
        let (pid1, vmm) = (pid_of(&first, "pid"), pid_of(&first, "vmm"));
        k.logged(&format!("serving (pid {pid1})"));

        // A stranger cannot store fds.
        let stranger = UnixDatagram::unbound().unwrap();
        let evil = memfd::MemfdOptions::new()
            .create("evil")
            .unwrap()
            .into_file();
        sendmsg(
            stranger.as_raw_fd(),
            &[IoSlice::new(b"FDSTORE=1\nFDNAME=evil\n")],
            &[ControlMessage::ScmRights(&[evil.as_raw_fd()])],
            MsgFlags::empty(),
            Some(&UnixAddr::new(&dir.path().join(SOCKET_NAME)).unwrap()),
        )
        .unwrap();
        k.logged(&format!(
            "dropping a notification from pid {}: not the serving process ({pid1})",
            std::process::id()
        ));

        kill(Pid::from_raw(pid1), Signal::SIGKILL).unwrap();
        // The dead server's VMM is now the keeper's child (subreaper).
        k.wait_until("the VMM's reparenting", || {
            (ppid(vmm) == Some(keeper)).then_some(())
        });

        // Restarted at once with the stored fd; that one stores two more,
        // removes one, and dies before READY without a pause.
        let second = k.event("v1.py crash start", 0);
        assert_eq!(second["fds"], "mem=one");
        let pid2 = pid_of(&second, "pid");
        // Its last sends were not lost: the third start has them.
        let third = k.event("v1.py crash start", 1);
        assert_eq!(third["fds"], "b1=three,f=w,late=two,mem=one");
        let pid3 = pid_of(&third, "pid");
        k.event("v1.py crash upgrading", 0);
        // The upgrade request starts the other binary, with the same fds.
        let v2 = k.event("v2.py upgrade start", 0);
        assert_eq!(v2["fds"], "b1=three,f=w,late=two,mem=one");
        let pid4 = pid_of(&v2, "pid");
        k.event("v2.py upgrade ready", 0);
        k.logged(&format!("serving (pid {pid4})"));
        k.logged(&format!(
            "upgrade to {} complete",
            dir.path().join("v2.py").display()
        ));
        let log = k.log();
        assert!(
            log.contains(&format!(
                "serving process {pid1} died (signal 9); restarting with 1 stored fds\n"
            )),
            "{log}"
        );
        assert!(
            log.contains(&format!(
                "serving process {pid2} died (signal 9); restarting with 4 stored fds in 100ms"
            )),
            "{log}"
        );

        // No zombies: every dead serving process is reaped ...
        for pid in [pid1, pid2, pid3] {
            k.wait_until("a dead server's reaping", || gone(pid).then_some(()));
        }
        // ... and so is the orphaned VMM when it exits.
        fs::write(dir.path().join("release"), "").unwrap();
        k.wait_until("the VMM's reaping", || gone(vmm).then_some(()));

        // SIGTERM: forwarded, the server stops cleanly, the keeper exits 0.
        kill(k.pid, Signal::SIGTERM).unwrap();
        assert_eq!(k.wait_exit(), WaitStatus::Exited(k.pid, 0));
        assert!(k
            .events()
            .contains(&format!("v2.py upgrade stopping pid={pid4}")));
        assert!(!dir.path().join(SOCKET_NAME).exists());
        assert!(gone(pid4));
    }

    #[test]
    fn failed_upgrade_goes_back_to_the_previous_binary() {
        let dir = tempfile::tempdir().unwrap();
        install(dir.path(), &["v1.py", "bad.py"]);
        let mut k = start_keeper(dir.path(), "v1.py", "badupgrade");
        k.event("v1.py first upgrading", 0);
        let back = k.event("v1.py crash start", 0);
        assert_eq!(back["fds"], "mem=one");
        k.event("v1.py crash ready", 0);
        k.logged("UPGRADE FAILED");
        assert!(k.log().contains("bad.py"));
        kill(k.pid, Signal::SIGTERM).unwrap();
        assert_eq!(k.wait_exit(), WaitStatus::Exited(k.pid, 0));
    }

    #[test]
    fn first_start_exiting_before_ready_ends_the_keeper() {
        let dir = tempfile::tempdir().unwrap();
        install(dir.path(), &["v1.py"]);
        let mut k = start_keeper(dir.path(), "v1.py", "badargs");
        assert_eq!(k.wait_exit(), WaitStatus::Exited(k.pid, 3));
        assert!(!dir.path().join(SOCKET_NAME).exists());
        assert_eq!(k.log().matches("started ").count(), 1, "{}", k.log());
    }

    #[test]
    fn backoff_doubles_up_to_five_seconds() {
        assert_eq!(backoff(0), Duration::ZERO);
        assert_eq!(backoff(1), Duration::from_millis(100));
        assert_eq!(backoff(2), Duration::from_millis(200));
        assert_eq!(backoff(4), Duration::from_millis(800));
        assert_eq!(backoff(7), Duration::from_secs(5));
        assert_eq!(backoff(1000), Duration::from_secs(5));
    }

    #[test]
    fn a_live_keeper_socket_is_not_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SOCKET_NAME);
        let live = bind_socket(&path).unwrap();
        let e = bind_socket(&path).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        drop(live);
        // Stale now: replaced.
        bind_socket(&path).unwrap();
    }
}
