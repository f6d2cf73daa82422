//! The serving process's side of the file-descriptor store: what must
//! outlive this process (guest memory memfds, VMM connections, ...) is
//! handed to a keeper with systemd's `sd_notify` protocol, and given back
//! on the next start with the `LISTEN_FDS` protocol.
//!
//! The keeper is either systemd itself (`FileDescriptorStoreMax=`,
//! `NotifyAccess=main`) or our own [`crate::keeper`] process, which sets
//! `PAGEFORK_KEEPER=1` and also understands `X_PAGEFORK_UPGRADE=` and
//! (when it sets `PAGEFORK_KEEPER_FDNAMES=1`) `X_PAGEFORK_FDNAMES=`:
//! several fds, each with its own name, in one datagram
//! ([`FdStore::store_all`], [`FdStore::remove_all`]; systemd gives every
//! fd of a datagram the same name, so under it, or under a keeper too old
//! to set the variable, each fd goes in a datagram of its own). A fork of
//! 1,000 VMs hands over 3,000 fds: one datagram each, each waiting for the
//! keeper to take one off its queue (`net.unix.max_dgram_qlen`, 10 by
//! default), cost 150 ms.
//!
//! Every message is one datagram sent with one synchronous `sendmsg`: once
//! `sendmsg` returns, the datagram (and the fds in it) sits in the
//! keeper's receive queue and is delivered even if this process is
//! SIGKILLed the next instant. That is what makes the store crash-safe.
//! A send blocks while the keeper's queue is full (back-pressure, never a
//! silent drop).
//!
//! Crates: `listen_fds` uses `sd-notify`'s `listen_fds_with_names`, which
//! does exactly systemd's `sd_listen_fds_with_names` (LISTEN_PID check,
//! names, CLOEXEC, unsetting the variables). The sending side is written
//! here with `nix::sys::socket::sendmsg` rather than with
//! `sd_notify::notify_with_fds`, because that function
//! - looks `NOTIFY_SOCKET` up in the environment on every call, while we
//!   must take it out of the environment at start so that the VMMs we
//!   spawn do not inherit it (and then send on it for the life of the
//!   process);
//! - does not support the abstract namespace (`@name`) that systemd may
//!   hand out;
//! - does not check `FDNAME` (a bad name would make systemd drop the fd, and
//!   a newline would inject keys into the message).

use std::ffi::OsStr;
use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::Path;

use nix::errno::Errno;
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, UnixAddr};

/// The keeper's (or systemd's) notification socket: a path, or `@name` for
/// the abstract namespace.
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";
/// Set to `1` by our own keeper (absent under systemd).
pub const KEEPER_ENV: &str = "PAGEFORK_KEEPER";
/// Set to `1` by a keeper that reads [`FDNAMES_KEY`].
pub const FDNAMES_ENV: &str = "PAGEFORK_KEEPER_FDNAMES";
/// Our keeper's extension, with `FDSTORE=1` or `FDSTOREREMOVE=1`: the
/// names of the fds of the datagram, in order, `:`-separated (no
/// `FDNAME=`).
pub const FDNAMES_KEY: &str = "X_PAGEFORK_FDNAMES";
/// The most fds in one datagram (the kernel takes 253).
const BATCH_FDS: usize = 128;
/// The most bytes of names in one datagram (the keeper reads 16 KiB).
const BATCH_BYTES: usize = 8 * 1024;
/// Why the keeper started this process: `first`, `crash` or `upgrade`.
pub const START_ENV: &str = "PAGEFORK_START";
/// Our keeper's extension: start this binary instead of the same one when
/// the serving process exits.
pub const UPGRADE_KEY: &str = "X_PAGEFORK_UPGRADE";
/// The longest fd name systemd accepts.
pub const FDNAME_MAX: usize = 255;
/// The name systemd gives a stored fd sent without `FDNAME=`.
pub const FDNAME_DEFAULT: &str = "stored";

/// Whether this process runs under our own keeper (`PAGEFORK_KEEPER=1`).
pub fn is_kept() -> bool {
    std::env::var_os(KEEPER_ENV).is_some_and(|v| v == "1")
}

/// Whether our keeper reads several named fds in one datagram.
fn keeper_takes_fdnames() -> bool {
    is_kept() && std::env::var_os(FDNAMES_ENV).is_some_and(|v| v == "1")
}

/// Why the keeper started this process (`PAGEFORK_START`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartReason {
    /// The keeper's first start.
    First,
    /// A restart after the previous serving process died (or after a failed
    /// upgrade, with the previous binary).
    Crash,
    /// The start of the binary named by an upgrade request.
    Upgrade,
}

impl StartReason {
    /// The value of `PAGEFORK_START`.
    pub fn as_str(self) -> &'static str {
        match self {
            StartReason::First => "first",
            StartReason::Crash => "crash",
            StartReason::Upgrade => "upgrade",
        }
    }

    /// Parses a `PAGEFORK_START` value.
    pub fn parse(s: &str) -> Option<StartReason> {
        match s {
            "first" => Some(StartReason::First),
            "crash" => Some(StartReason::Crash),
            "upgrade" => Some(StartReason::Upgrade),
            _ => None,
        }
    }
}

impl std::fmt::Display for StartReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why our keeper started this process; `None` when not kept by our keeper
/// (under systemd: fds from [`listen_fds`] mean a restart).
pub fn start_reason() -> Option<StartReason> {
    if !is_kept() {
        return None;
    }
    StartReason::parse(std::env::var(START_ENV).ok()?.as_str())
}

/// Whether `name` is a valid fd name: 1..=255 printable ASCII characters,
/// no `:` (the separator of `LISTEN_FDNAMES`). systemd's rule, minus the
/// empty name.
pub fn fdname_is_valid(name: &str) -> bool {
    (1..=FDNAME_MAX).contains(&name.len())
        && name
            .bytes()
            .all(|b| (b' '..=b'~').contains(&b) && b != b':')
}

fn check_name(name: &str) -> io::Result<()> {
    if fdname_is_valid(name) {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "invalid fd name {name:?}: 1 to {FDNAME_MAX} printable ASCII characters, no ':'"
            ),
        ))
    }
}

/// A free-text value (STATUS=) on one line.
fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

/// The connection to the keeper's (or systemd's) notification socket.
#[derive(Debug)]
pub struct FdStore {
    sock: UnixDatagram,
    addr: UnixAddr,
    keeper: bool,
    /// The keeper reads [`FDNAMES_KEY`].
    fdnames: bool,
}

impl FdStore {
    /// From `$NOTIFY_SOCKET` (a path, or `@` for the abstract namespace);
    /// `None` if unset (or unusable, with a warning).
    ///
    /// Removes `NOTIFY_SOCKET` from the process environment so children
    /// (VMMs) do not inherit it: call it before any thread is started.
    pub fn from_env() -> Option<FdStore> {
        let address = std::env::var_os(NOTIFY_SOCKET)?;
        std::env::remove_var(NOTIFY_SOCKET);
        match FdStore::connect(&address, is_kept()) {
            Ok(store) => Some(store.with_fdnames(keeper_takes_fdnames())),
            Err(e) => {
                tracing::warn!("NOTIFY_SOCKET={address:?} is unusable, no fd store: {e}");
                None
            }
        }
    }

    /// To the notification socket at `address` (a path, or `@name` for the
    /// abstract namespace); `is_keeper` says whether that is our own keeper.
    pub fn connect(address: &OsStr, is_keeper: bool) -> io::Result<FdStore> {
        let bytes = address.as_bytes();
        let addr = match bytes.first() {
            Some(b'@') => UnixAddr::new_abstract(&bytes[1..])?,
            Some(b'/') => UnixAddr::new(Path::new(address))?,
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{address:?} is neither an absolute path nor @abstract"),
                ))
            }
        };
        Ok(FdStore {
            sock: UnixDatagram::unbound()?,
            addr,
            keeper: is_keeper,
            fdnames: false,
        })
    }

    /// Whether the keeper reads several named fds in one datagram
    /// ([`FDNAMES_KEY`]; only ours does, when it says so).
    pub fn with_fdnames(mut self, on: bool) -> Self {
        self.fdnames = on && self.keeper;
        self
    }

    /// Sends one datagram: `msg` with `fds` in SCM_RIGHTS.
    fn send(&self, msg: &str, fds: &[RawFd]) -> io::Result<()> {
        let iov = [IoSlice::new(msg.as_bytes())];
        let rights = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
        loop {
            match sendmsg(
                self.sock.as_raw_fd(),
                &iov,
                cmsgs,
                MsgFlags::MSG_NOSIGNAL,
                Some(&self.addr),
            ) {
                Ok(n) if n == msg.len() => return Ok(()),
                Ok(n) => {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        format!("notification cut at {n} of {} bytes", msg.len()),
                    ))
                }
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Store `fd` under `name`: `FDSTORE=1`, `FDNAME=<name>` with the fd in
    /// SCM_RIGHTS. A stored fd of the same name is replaced (our keeper;
    /// systemd keeps both unless they are the same file).
    ///
    /// Names: 1..=255 printable ASCII characters, no `:`, else
    /// [`io::ErrorKind::InvalidInput`].
    pub fn store(&self, name: &str, fd: BorrowedFd<'_>) -> io::Result<()> {
        check_name(name)?;
        self.send(&format!("FDSTORE=1\nFDNAME={name}\n"), &[fd.as_raw_fd()])
    }

    /// Forget (and close in the keeper) the fd(s) stored under `name`.
    pub fn remove(&self, name: &str) -> io::Result<()> {
        check_name(name)?;
        self.send(&format!("FDSTOREREMOVE=1\nFDNAME={name}\n"), &[])
    }

    /// [`FdStore::store`] each of `fds`, several in one datagram where the
    /// keeper allows it. On an error, how many of them (the first ones)
    /// were stored. A datagram is stored whole or not at all.
    pub fn store_all(&self, fds: &[(&str, BorrowedFd<'_>)]) -> Result<(), (usize, io::Error)> {
        if !self.fdnames {
            for (i, (name, fd)) in fds.iter().enumerate() {
                self.store(name, *fd).map_err(|e| (i, e))?;
            }
            return Ok(());
        }
        let mut done = 0;
        for batch in batches(fds.iter().map(|(n, _)| *n)) {
            let part = &fds[done..done + batch.len()];
            let raw: Vec<RawFd> = part.iter().map(|(_, fd)| fd.as_raw_fd()).collect();
            self.send_named("FDSTORE=1", &batch, &raw)
                .map_err(|e| (done, e))?;
            done += part.len();
        }
        Ok(())
    }

    /// [`FdStore::remove`] each of `names`, several in one datagram where
    /// the keeper allows it. On an error, how many (the first ones) were
    /// removed.
    pub fn remove_all(&self, names: &[&str]) -> Result<(), (usize, io::Error)> {
        if !self.fdnames {
            for (i, name) in names.iter().enumerate() {
                self.remove(name).map_err(|e| (i, e))?;
            }
            return Ok(());
        }
        let mut done = 0;
        for batch in batches(names.iter().copied()) {
            self.send_named("FDSTOREREMOVE=1", &batch, &[])
                .map_err(|e| (done, e))?;
            done += batch.len();
        }
        Ok(())
    }

    /// One datagram: `what` for the fds named `names` (checked), in order.
    fn send_named(&self, what: &str, names: &[&str], fds: &[RawFd]) -> io::Result<()> {
        for name in names {
            check_name(name)?;
        }
        self.send(&format!("{what}\n{FDNAMES_KEY}={}\n", names.join(":")), fds)
    }

    /// Tell the keeper this process is serving.
    pub fn ready(&self, status: &str) -> io::Result<()> {
        self.send(
            &format!(
                "READY=1\nMAINPID={}\nSTATUS={}\n",
                std::process::id(),
                one_line(status)
            ),
            &[],
        )
    }

    /// A free-text status line (`systemctl status`, the keeper's debug log).
    pub fn status(&self, status: &str) -> io::Result<()> {
        self.send(&format!("STATUS={}\n", one_line(status)), &[])
    }

    /// Ask the keeper to start `binary` (same arguments, same stored fds,
    /// `PAGEFORK_START=upgrade`) once this process exits, instead of
    /// restarting the same binary. If the new binary dies before it sends
    /// READY, the keeper goes back to the previous one.
    ///
    /// Only our own keeper knows this: under systemd it fails with
    /// [`io::ErrorKind::Unsupported`]; there, an upgrade is replacing the
    /// binary and `systemctl restart` (the fd store is kept across it).
    /// `binary` must be an absolute path to an executable file.
    pub fn request_upgrade(&self, binary: &Path) -> io::Result<()> {
        if !self.keeper {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "not under pagefork's keeper: under systemd, replace the binary and \
                 `systemctl restart` the unit (stored fds are kept)",
            ));
        }
        let bytes = binary.as_os_str().as_bytes();
        if !binary.is_absolute() || bytes.contains(&b'\n') || bytes.contains(&0) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("upgrade binary {binary:?} must be an absolute path on one line"),
            ));
        }
        let meta = std::fs::metadata(binary)?;
        if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("upgrade binary {binary:?} is not an executable file"),
            ));
        }
        let mut msg = Vec::with_capacity(bytes.len() + UPGRADE_KEY.len() + 2);
        msg.extend_from_slice(UPGRADE_KEY.as_bytes());
        msg.push(b'=');
        msg.extend_from_slice(bytes);
        msg.push(b'\n');
        // Paths need not be UTF-8: send the bytes as they are.
        let iov = [IoSlice::new(&msg)];
        loop {
            match sendmsg(
                self.sock.as_raw_fd(),
                &iov,
                &[],
                MsgFlags::MSG_NOSIGNAL,
                Some(&self.addr),
            ) {
                Ok(n) if n == msg.len() => return Ok(()),
                Ok(_) => return Err(io::ErrorKind::WriteZero.into()),
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Whether this store is our own keeper (`PAGEFORK_KEEPER=1` was set when
    /// we started) rather than systemd.
    pub fn is_keeper(&self) -> bool {
        self.keeper
    }
}

/// `names` in runs that fit one datagram each.
fn batches<'a>(names: impl Iterator<Item = &'a str>) -> Vec<Vec<&'a str>> {
    let mut out: Vec<Vec<&str>> = Vec::new();
    let mut bytes = 0;
    for name in names {
        let fits = out
            .last()
            .is_some_and(|b| b.len() < BATCH_FDS && bytes + name.len() < BATCH_BYTES);
        if !fits {
            out.push(Vec::new());
            bytes = 0;
        }
        bytes += name.len() + 1;
        if let Some(b) = out.last_mut() {
            b.push(name);
        }
    }
    out
}

/// The fds this process was started with, by name: `LISTEN_PID` (must equal
/// our pid, else none), `LISTEN_FDS`, `LISTEN_FDNAMES` (`:`-separated,
/// `unknown` when absent); the fds are 3, 4, ...; each is made O_CLOEXEC and
/// the three variables are removed from the environment (call this before
/// any thread is started). Malformed variables give none, with a warning.
pub fn listen_fds() -> Vec<(String, OwnedFd)> {
    // SAFETY: the function's only unsafety is its `std::env::remove_var`;
    // this is called at start, before the process has other threads (see
    // above), like `FdStore::from_env`.
    let fds = unsafe { sd_notify::listen_fds_with_names_and_unset_env() };
    match fds {
        Ok(fds) => fds
            .map(|(fd, name)| {
                // SAFETY: the LISTEN_FDS protocol hands these fds to this
                // process (LISTEN_PID is ours), and nothing else owns them;
                // the variables are gone, so nobody takes them a second time.
                (name, unsafe { OwnedFd::from_raw_fd(fd) })
            })
            .collect(),
        Err(e) => {
            tracing::warn!("ignoring the fds passed to this process: {e}");
            Vec::new()
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use nix::sys::socket::{recvmsg, ControlMessageOwned};
    use std::io::{IoSliceMut, Read, Seek, SeekFrom, Write};
    use std::os::fd::AsFd;
    use std::sync::Mutex;

    /// Serializes the tests that change the process environment, fork, or
    /// write executables: no fork while another test is inside `set_var`
    /// (the child would find std's environment lock taken) or has a file
    /// open for writing that is about to be exec'd (ETXTBSY).
    pub(crate) static TEST_ENV_LOCK: Mutex<()> = Mutex::new(());

    pub(crate) fn env_lock() -> std::sync::MutexGuard<'static, ()> {
        TEST_ENV_LOCK.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Receives one datagram with its fds.
    fn recv(sock: &UnixDatagram) -> (String, Vec<OwnedFd>) {
        let mut buf = vec![0u8; 4096];
        let mut iov = [IoSliceMut::new(&mut buf)];
        let mut cmsg = nix::cmsg_space!([RawFd; 8]);
        let msg = recvmsg::<()>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .unwrap();
        let mut fds = Vec::new();
        for c in msg.cmsgs().unwrap() {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: SCM_RIGHTS fds were just installed for us.
                fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
            }
        }
        let n = msg.bytes;
        (String::from_utf8(buf[..n].to_vec()).unwrap(), fds)
    }

    #[test]
    fn fd_names() {
        assert!(fdname_is_valid("vm-1.mem"));
        assert!(fdname_is_valid("a b~!"));
        assert!(fdname_is_valid(&"x".repeat(255)));
        assert!(!fdname_is_valid(&"x".repeat(256)));
        assert!(!fdname_is_valid(""));
        assert!(!fdname_is_valid("a:b"));
        assert!(!fdname_is_valid("a\nFDSTOREREMOVE=1"));
        assert!(!fdname_is_valid("caf\u{e9}"));
        assert!(!fdname_is_valid("tab\t"));
    }

    #[test]
    fn store_round_trip_through_notify_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let server = UnixDatagram::bind(&path).unwrap();

        let store = {
            let _env = env_lock();
            std::env::set_var(NOTIFY_SOCKET, &path);
            let store = FdStore::from_env().expect("NOTIFY_SOCKET is set");
            assert!(std::env::var_os(NOTIFY_SOCKET).is_none(), "not removed");
            store
        };

        let mut mem = memfd::MemfdOptions::new()
            .create("guest-ram")
            .unwrap()
            .into_file();
        mem.write_all(b"hello pagefork").unwrap();
        store.store("vm-1.mem", mem.as_fd()).unwrap();

        let (text, fds) = recv(&server);
        assert_eq!(text, "FDSTORE=1\nFDNAME=vm-1.mem\n");
        assert_eq!(fds.len(), 1);
        let mut got = std::fs::File::from(fds.into_iter().next().unwrap());
        // The same open file: same inode, and bytes go both ways.
        use std::os::unix::fs::MetadataExt;
        assert_eq!(got.metadata().unwrap().ino(), mem.metadata().unwrap().ino());
        let mut s = String::new();
        got.seek(SeekFrom::Start(0)).unwrap();
        got.read_to_string(&mut s).unwrap();
        assert_eq!(s, "hello pagefork");
        got.write_all(b" and back").unwrap();
        let mut s = String::new();
        mem.seek(SeekFrom::Start(0)).unwrap();
        mem.read_to_string(&mut s).unwrap();
        assert_eq!(s, "hello pagefork and back");

        // Bad names never reach the socket.
        for bad in ["", "a:b", "x\ny"] {
            let e = store.store(bad, mem.as_fd()).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad:?}");
        }

        store.remove("vm-1.mem").unwrap();
        assert_eq!(recv(&server).0, "FDSTOREREMOVE=1\nFDNAME=vm-1.mem\n");
        store.ready("up\nREADY=0").unwrap();
        assert_eq!(
            recv(&server).0,
            format!(
                "READY=1\nMAINPID={}\nSTATUS=up READY=0\n",
                std::process::id()
            )
        );
        store.status("3 VMs").unwrap();
        assert_eq!(recv(&server).0, "STATUS=3 VMs\n");

        // Not our keeper: no upgrade.
        assert!(!store.is_keeper());
        let e = store.request_upgrade(Path::new("/bin/sh")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::Unsupported);
    }

    #[test]
    fn abstract_socket_and_upgrade() {
        let name = format!("pagefork-fdstore-test-{}", std::process::id());
        let server = UnixDatagram::unbound().unwrap();
        nix::sys::socket::bind(
            server.as_raw_fd(),
            &UnixAddr::new_abstract(name.as_bytes()).unwrap(),
        )
        .unwrap();
        let store = FdStore::connect(OsStr::new(&format!("@{name}")), true).unwrap();
        assert!(store.is_keeper());
        store.status("abstract").unwrap();
        assert_eq!(recv(&server).0, "STATUS=abstract\n");

        let sh = Path::new("/bin/sh").canonicalize().unwrap();
        store.request_upgrade(&sh).unwrap();
        assert_eq!(
            recv(&server).0,
            format!("X_PAGEFORK_UPGRADE={}\n", sh.display())
        );
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("not-executable");
        std::fs::write(&plain, "").unwrap();
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
        for bad in [
            Path::new("relative/bin"),
            Path::new("/nonexistent/pagefork"),
            &plain,
            dir.path(),
        ] {
            assert!(store.request_upgrade(bad).is_err(), "{}", bad.display());
        }

        assert!(FdStore::connect(OsStr::new("relative.sock"), false).is_err());
        // Nobody listening: the error is the caller's to see.
        let gone = FdStore::connect(OsStr::new("/nonexistent/notify.sock"), false).unwrap();
        assert!(gone.status("x").is_err());
    }

    #[test]
    fn several_fds_in_one_datagram_only_for_a_keeper_that_reads_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let server = UnixDatagram::bind(&path).unwrap();
        let mems: Vec<std::fs::File> = (0..3)
            .map(|i| {
                memfd::MemfdOptions::new()
                    .create(format!("m{i}"))
                    .unwrap()
                    .into_file()
            })
            .collect();
        let fds: Vec<(&str, BorrowedFd<'_>)> = ["a", "b", "c"]
            .into_iter()
            .zip(mems.iter().map(|m| m.as_fd()))
            .collect();
        use std::os::unix::fs::MetadataExt;
        let ino = |f: &OwnedFd| nix::sys::stat::fstat(f.as_raw_fd()).unwrap().st_ino;

        let batched = FdStore::connect(path.as_os_str(), true)
            .unwrap()
            .with_fdnames(true);
        batched.store_all(&fds).unwrap();
        let (text, got) = recv(&server);
        assert_eq!(text, "FDSTORE=1\nX_PAGEFORK_FDNAMES=a:b:c\n");
        assert_eq!(got.len(), 3);
        for (g, m) in got.iter().zip(&mems) {
            assert_eq!(ino(g), m.metadata().unwrap().ino());
        }
        batched.remove_all(&["c", "a"]).unwrap();
        assert_eq!(recv(&server).0, "FDSTOREREMOVE=1\nX_PAGEFORK_FDNAMES=c:a\n");
        // A bad name is refused before anything is sent.
        let e = batched
            .store_all(&[("ok", mems[0].as_fd()), ("no:pe", mems[1].as_fd())])
            .unwrap_err();
        assert_eq!((e.0, e.1.kind()), (0, io::ErrorKind::InvalidInput));

        // systemd (or a keeper that does not say it reads them): one each.
        for plain in [
            FdStore::connect(path.as_os_str(), false)
                .unwrap()
                .with_fdnames(true),
            FdStore::connect(path.as_os_str(), true).unwrap(),
        ] {
            plain.store_all(&fds).unwrap();
            for (name, m) in ["a", "b", "c"].iter().zip(&mems) {
                let (text, got) = recv(&server);
                assert_eq!(text, format!("FDSTORE=1\nFDNAME={name}\n"));
                assert_eq!(got.len(), 1);
                assert_eq!(ino(&got[0]), m.metadata().unwrap().ino());
            }
            plain.remove_all(&["b", "c"]).unwrap();
            assert_eq!(recv(&server).0, "FDSTOREREMOVE=1\nFDNAME=b\n");
            assert_eq!(recv(&server).0, "FDSTOREREMOVE=1\nFDNAME=c\n");
        }
    }

    #[test]
    fn batches_stay_within_a_datagram() {
        let names: Vec<String> = (0..300).map(|i| format!("n{i}")).collect();
        let b = batches(names.iter().map(String::as_str));
        assert_eq!(
            b.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![BATCH_FDS, BATCH_FDS, 300 - 2 * BATCH_FDS]
        );
        let long: Vec<String> = (0..100).map(|i| format!("{i:0>200}")).collect();
        let b = batches(long.iter().map(String::as_str));
        assert!(b.len() > 1);
        for part in &b {
            assert!(part.iter().map(|n| n.len() + 1).sum::<usize>() <= BATCH_BYTES);
        }
        assert_eq!(b.iter().map(Vec::len).sum::<usize>(), 100);
        assert!(batches(std::iter::empty()).is_empty());
    }

    /// `listen_fds` in a process started the way the keeper starts one: the
    /// test binary re-executed through `sh` (`LISTEN_PID=$$` then `exec`
    /// keeps the pid) with a memfd on fd 3.
    #[test]
    fn listen_fds_in_a_started_process() {
        if std::env::var_os("PAGEFORK_TEST_LISTEN_CHILD").is_some() {
            return listen_fds_child();
        }
        let mut mem = memfd::MemfdOptions::new()
            .create("mem")
            .unwrap()
            .into_file();
        mem.write_all(b"kept").unwrap();
        let raw = mem.as_raw_fd();
        let exe = std::env::current_exe().unwrap();
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(
                "LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=vm-7.mem exec \"$0\" \
                 --exact fdstore::tests::listen_fds_in_a_started_process --nocapture \
                 --test-threads=1",
            )
            .arg(&exe)
            .env("PAGEFORK_TEST_LISTEN_CHILD", "1");
        // SAFETY: dup2 and fcntl are async-signal-safe; `raw` is open in the parent
        // (and so in the child) for the whole spawn.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                // dup2 onto itself would keep CLOEXEC: clear it instead.
                let ok = if raw == 3 {
                    libc::fcntl(3, libc::F_SETFD, 0)
                } else {
                    libc::dup2(raw, 3)
                };
                if ok < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = {
            // Not while another test forks or has an executable open.
            let _lock = env_lock();
            cmd.stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        };
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "child: {:?}\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        // The child wrote through its fd 3.
        let mut s = String::new();
        mem.seek(SeekFrom::Start(0)).unwrap();
        mem.read_to_string(&mut s).unwrap();
        assert_eq!(s, "kept+child");
    }

    fn listen_fds_child() {
        let fds = listen_fds();
        for var in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
            assert!(std::env::var_os(var).is_none(), "{var} left set");
        }
        assert_eq!(fds.len(), 1);
        let (name, fd) = fds.into_iter().next().unwrap();
        assert_eq!(name, "vm-7.mem");
        assert_eq!(fd.as_raw_fd(), 3);
        let flags = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFD).unwrap();
        assert!(flags & libc::FD_CLOEXEC != 0, "not made CLOEXEC");
        let mut f = std::fs::File::from(fd);
        let mut s = String::new();
        f.seek(SeekFrom::Start(0)).unwrap();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, "kept");
        f.write_all(b"+child").unwrap();
        // A second call finds nothing (variables gone).
        assert!(listen_fds().is_empty());
    }

    #[test]
    fn listen_fds_for_another_pid_are_not_ours() {
        let _env = env_lock();
        std::env::set_var("LISTEN_PID", "1");
        std::env::set_var("LISTEN_FDS", "1");
        std::env::set_var("LISTEN_FDNAMES", "x");
        assert!(listen_fds().is_empty());
        for var in ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"] {
            assert!(std::env::var_os(var).is_none(), "{var} left set");
        }
    }
}
