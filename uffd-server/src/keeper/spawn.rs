//! Starting the serving process: a hand-written fork/exec (the keeper's
//! module docs say why not `std::process::Command`), with every unsafe
//! step of it here. Everything the child needs is prepared before the
//! fork; between fork and exec the child makes only async-signal-safe
//! calls.

use std::ffi::{CString, OsString};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;

use libc::{c_char, c_int, c_ulong, pid_t};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::wait::waitpid;
use nix::unistd::Pid;
use tracing::warn;

use crate::fdstore;

/// The environment variables the keeper sets for (or takes away from) the
/// serving process.
const OUR_ENV: [&str; 7] = [
    fdstore::NOTIFY_SOCKET,
    fdstore::KEEPER_ENV,
    fdstore::FDNAMES_ENV,
    fdstore::START_ENV,
    "LISTEN_PID",
    "LISTEN_FDS",
    "LISTEN_FDNAMES",
];

fn cstring(bytes: Vec<u8>) -> io::Result<CString> {
    CString::new(bytes).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "a NUL byte in the program, an argument or the environment",
        )
    })
}

/// What the child needs between fork and exec, all prepared before the
/// fork: the child only makes async-signal-safe calls and writes to its
/// copy of this memory.
struct ExecPlan<'a> {
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    /// The keeper's stored fds, to become 3, 4, ...
    fds: &'a [RawFd],
    /// Room for the temporary copies of `fds`.
    tmp: *mut RawFd,
    /// The first fd above the LISTEN_FDS range (3 + fds.len()).
    floor: c_int,
    /// Where the child's pid goes ("LISTEN_PID=" is before it).
    pid_digits: *mut u8,
    parent: pid_t,
    deathsig: c_ulong,
    /// Write end of the CLOEXEC pipe for the exec errno.
    err: RawFd,
}

/// Starts `program args` with the keeper's environment minus [`OUR_ENV`]
/// plus `env`, and `fds` as its fds 3, 4, ... (LISTEN_PID is set in the
/// child). Returns once the child has exec'd, or the exec error.
pub(super) fn spawn(
    program: &Path,
    args: &[OsString],
    env: &[(&str, Vec<u8>)],
    fds: &[RawFd],
) -> io::Result<Pid> {
    let path = cstring(program.as_os_str().as_bytes().to_vec())?;
    let mut argv = vec![path.clone()];
    for a in args {
        argv.push(cstring(a.clone().into_vec())?);
    }
    let mut envs = Vec::new();
    for (k, v) in std::env::vars_os() {
        if OUR_ENV.iter().any(|o| k == *o) {
            continue;
        }
        let mut kv = k.into_vec();
        kv.push(b'=');
        kv.extend(v.into_vec());
        envs.push(cstring(kv)?);
    }
    for (k, v) in env {
        let mut kv = k.as_bytes().to_vec();
        kv.push(b'=');
        kv.extend_from_slice(v);
        envs.push(cstring(kv)?);
    }
    // "LISTEN_PID=" and room for the digits (and the NUL) the child writes.
    let mut listen_pid = b"LISTEN_PID=".to_vec();
    let digits_at = listen_pid.len();
    listen_pid.resize(digits_at + 24, 0);
    let listen_pid_ptr = listen_pid.as_mut_ptr();

    let argv_p: Vec<*const c_char> = argv
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let mut envp: Vec<*const c_char> = envs.iter().map(|c| c.as_ptr()).collect();
    if !fds.is_empty() {
        envp.push(listen_pid_ptr.cast_const().cast());
    }
    envp.push(std::ptr::null());

    let floor = c_int::try_from(3 + fds.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "too many fds"))?;
    let mut tmp: Vec<RawFd> = vec![-1; fds.len()];
    let (err_read, err_write) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
    let plan = ExecPlan {
        path: path.as_ptr(),
        argv: argv_p.as_ptr(),
        envp: envp.as_ptr(),
        fds,
        tmp: tmp.as_mut_ptr(),
        floor,
        // SAFETY: `digits_at` is inside `listen_pid` (24 bytes follow).
        pid_digits: unsafe { listen_pid_ptr.add(digits_at) },
        parent: nix::unistd::getpid().as_raw(),
        deathsig: c_ulong::try_from(libc::SIGTERM).unwrap_or(15),
        err: err_write.as_raw_fd(),
    };

    // SAFETY: the keeper is single-threaded, so the child is a full copy in
    // a consistent state; it runs only `exec_child` (async-signal-safe calls
    // on memory prepared above) and never returns.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        // SAFETY: in the child, right after fork; see above.
        unsafe { exec_child(&plan) }
    }
    drop(err_write);
    // EOF: the exec closed the pipe (CLOEXEC). Four bytes: its errno.
    let mut report = std::fs::File::from(err_read);
    let mut buf = [0u8; 4];
    let mut got = 0;
    while got < buf.len() {
        match report.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                warn!("reading the exec report of pid {pid}: {e}");
                break;
            }
        }
    }
    // Everything the child used stays alive until here (not needed: the
    // child has its own copy; but the pointers in `plan` were into these).
    drop((argv, envs, listen_pid, tmp, path));
    let pid = Pid::from_raw(pid);
    if got == 0 {
        return Ok(pid);
    }
    while let Err(Errno::EINTR) = waitpid(pid, None) {}
    Err(if got == buf.len() {
        io::Error::from_raw_os_error(i32::from_ne_bytes(buf))
    } else {
        io::Error::other("the child died before exec")
    })
}

/// The child's side of [`spawn`]: never returns.
///
/// # Safety
/// Only in the child of a fork of a single-threaded process, with `plan`'s
/// pointers valid.
unsafe fn exec_child(plan: &ExecPlan<'_>) -> ! {
    /// Reports errno on `err` and leaves.
    unsafe fn fail(err: RawFd) -> ! {
        let e = Errno::last_raw().to_ne_bytes();
        // SAFETY: writing 4 bytes from a local array; _exit never returns.
        unsafe {
            libc::write(err, e.as_ptr().cast(), e.len());
            libc::_exit(127)
        }
    }
    // SAFETY: every call below is async-signal-safe, on fds and memory of
    // this (child) process prepared by `spawn`.
    unsafe {
        // Stop (gracefully) if the keeper dies; it may already have.
        if libc::prctl(
            libc::PR_SET_PDEATHSIG,
            plan.deathsig,
            0 as c_ulong,
            0 as c_ulong,
            0 as c_ulong,
        ) != 0
        {
            fail(plan.err);
        }
        if libc::getppid() != plan.parent {
            Errno::set_raw(libc::ESRCH);
            fail(plan.err);
        }
        // The error pipe, then copies of every stored fd, above 3 + n, so
        // that moving them onto 3.. clobbers nothing still to be copied.
        let mut err = plan.err;
        if err < plan.floor {
            err = libc::fcntl(err, libc::F_DUPFD_CLOEXEC, plan.floor);
            if err < 0 {
                fail(plan.err);
            }
        }
        for (i, &fd) in plan.fds.iter().enumerate() {
            let copy = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, plan.floor);
            if copy < 0 {
                fail(err);
            }
            *plan.tmp.add(i) = copy;
        }
        // dup2 leaves the new fd without CLOEXEC: these are inherited.
        for (i, target) in (0..plan.fds.len()).zip(3..) {
            while libc::dup2(*plan.tmp.add(i), target) < 0 {
                if Errno::last_raw() != libc::EINTR {
                    fail(err);
                }
            }
        }
        // Nothing else of the keeper's goes through exec (its own fds are
        // CLOEXEC already; this also covers what the keeper inherited).
        // Best effort: ENOSYS before Linux 5.11.
        libc::syscall(
            libc::SYS_close_range,
            plan.floor,
            c_int::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
        write_decimal(plan.pid_digits, libc::getpid());
        // Signals as a fresh process has them: none blocked (the keeper
        // blocks its own for the signalfd), SIGPIPE default.
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::execve(plan.path, plan.argv, plan.envp);
        fail(err)
    }
}

/// Writes `n` in decimal and a NUL at `out` (room for 12 bytes needed).
///
/// # Safety
/// `out` must be valid for 12 bytes of writes.
unsafe fn write_decimal(out: *mut u8, n: pid_t) {
    let mut digits = [0u8; 12];
    let mut len = 0;
    let mut v = n.unsigned_abs();
    loop {
        digits[len] = b'0' + u8::try_from(v % 10).unwrap_or(0);
        len += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    for i in 0..len {
        // SAFETY: len <= 10 digits + NUL < 12 bytes, which the caller provides.
        unsafe { *out.add(i) = digits[len - 1 - i] };
    }
    // SAFETY: as above.
    unsafe { *out.add(len) = 0 };
}
