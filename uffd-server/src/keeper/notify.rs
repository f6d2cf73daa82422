//! The notification socket: the serving process's `sd_notify` datagrams
//! (`FDSTORE=1`, `FDSTOREREMOVE=1`, `READY=1`, `STATUS=`, our
//! `X_PAGEFORK_UPGRADE=` and `X_PAGEFORK_FDNAMES=`), read and acted on,
//! and the store of the fds they carry.

use std::ffi::OsString;
use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

use nix::errno::Errno;
use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
use tracing::{debug, info, warn};

use super::{Keeper, Stored, MAX_DATAGRAM, MAX_STORED_FDS};
use crate::fdstore::{self, StartReason};

impl Keeper {
    /// Handles every queued notification.
    pub(super) fn drain(&mut self) {
        loop {
            match self.recv_one() {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    warn!("keeper: receiving a notification: {e}");
                    return;
                }
            }
        }
    }

    /// Receives and handles one notification; `false` when none is queued.
    fn recv_one(&mut self) -> io::Result<bool> {
        self.cmsg.clear();
        let mut iov = [IoSliceMut::new(&mut self.buf)];
        let msg = match recvmsg::<()>(
            self.sock.as_raw_fd(),
            &mut iov,
            Some(&mut self.cmsg),
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(msg) => msg,
            Err(Errno::EAGAIN) => return Ok(false),
            Err(Errno::EINTR) => return Ok(true),
            Err(e) => return Err(e.into()),
        };
        let mut fds = Vec::new();
        let mut sender = None;
        match msg.cmsgs() {
            Ok(cmsgs) => {
                for c in cmsgs {
                    match c {
                        ControlMessageOwned::ScmRights(raw) => {
                            // SAFETY: SCM_RIGHTS fds were just installed in
                            // this process for us; nothing else owns them.
                            fds.extend(raw.into_iter().map(|r| unsafe { OwnedFd::from_raw_fd(r) }));
                        }
                        ControlMessageOwned::ScmCredentials(cred) => sender = Some(cred.pid()),
                        _ => {}
                    }
                }
            }
            Err(_) => {
                // MSG_CTRUNC: the kernel could not give us every fd (out of
                // fds); those it did are not reachable through nix.
                warn!("a notification's fds were cut (keeper out of fds?); dropped");
                return Ok(true);
            }
        }
        let (len, truncated) = (msg.bytes, msg.flags.contains(MsgFlags::MSG_TRUNC));
        let child = self.child.as_ref().map(|c| c.pid.as_raw());
        if sender.is_none() || sender != child {
            warn!(
                "dropping a notification from pid {}: not the serving process ({})",
                sender.map_or("?".into(), |p| p.to_string()),
                child.map_or("none".into(), |p| p.to_string()),
            );
            return Ok(true);
        }
        if truncated {
            warn!("dropping a notification longer than {MAX_DATAGRAM} bytes");
            return Ok(true);
        }
        let data = self.buf[..len].to_vec();
        self.handle_message(&data, fds);
        Ok(true)
    }

    /// One notification of the serving process: newline-separated KEY=VALUE.
    fn handle_message(&mut self, data: &[u8], fds: Vec<OwnedFd>) {
        let (mut store, mut remove, mut ready) = (false, false, false);
        let (mut name, mut status, mut upgrade) = (None, None, None);
        let mut names = None;
        for line in data.split(|b| *b == b'\n') {
            let Some(eq) = line.iter().position(|b| *b == b'=') else {
                continue;
            };
            let (key, value) = (&line[..eq], &line[eq + 1..]);
            match key {
                b"FDSTORE" => store = value == b"1",
                b"FDSTOREREMOVE" => remove = value == b"1",
                b"FDNAME" => name = Some(value),
                b"READY" => ready = value == b"1",
                b"STATUS" => status = Some(value),
                k if k == fdstore::UPGRADE_KEY.as_bytes() => upgrade = Some(value),
                k if k == fdstore::FDNAMES_KEY.as_bytes() => names = Some(value),
                _ => {}
            }
        }
        let name = match name {
            None => Some(fdstore::FDNAME_DEFAULT.to_owned()),
            Some(n) => std::str::from_utf8(n)
                .ok()
                .filter(|n| fdstore::fdname_is_valid(n))
                .map(str::to_owned),
        };

        if let Some(names) = names {
            self.handle_named(store, remove, names, fds);
        } else {
            if remove {
                match &name {
                    Some(name) => {
                        if let Some(old) = self.stored.remove(name) {
                            self.nfds -= old.fds.len();
                            debug!("removed {name} ({} fds)", old.fds.len());
                        }
                    }
                    None => warn!("FDSTOREREMOVE with an invalid FDNAME; ignored"),
                }
            }
            if store {
                match name {
                    Some(name) => self.store(name, fds),
                    None => warn!("FDSTORE with an invalid FDNAME; {} fds closed", fds.len()),
                }
            } else if !fds.is_empty() {
                debug!("closing {} fds sent without FDSTORE=1", fds.len());
            }
        }
        if let Some(status) = status {
            debug!("status: {}", String::from_utf8_lossy(status));
        }
        if let Some(path) = upgrade {
            let path = PathBuf::from(OsString::from_vec(path.to_vec()));
            if path.is_absolute() {
                info!(
                    "upgrade to {} requested: it starts when the serving process exits",
                    path.display()
                );
                self.upgrade = Some(path);
            } else {
                warn!(
                    "ignoring an upgrade to {}: not an absolute path",
                    path.display()
                );
            }
        }
        if ready {
            if let Some(child) = &mut self.child {
                if !child.ready {
                    child.ready = true;
                    info!("serving (pid {})", child.pid);
                    if child.reason == StartReason::Upgrade {
                        info!("upgrade to {} complete", child.binary.display());
                    }
                }
                self.failures = 0;
                self.fallback = None;
            }
        }
    }

    /// `FDSTORE=1` or `FDSTOREREMOVE=1` of the fds named in `names`
    /// (`:`-separated, each fd sent with its own name, in order). Nothing
    /// is stored unless every name is valid and there is one per fd.
    fn handle_named(&mut self, store: bool, remove: bool, names: &[u8], fds: Vec<OwnedFd>) {
        let names: Option<Vec<String>> = names
            .split(|b| *b == b':')
            .map(|n| {
                std::str::from_utf8(n)
                    .ok()
                    .filter(|n| fdstore::fdname_is_valid(n))
                    .map(str::to_owned)
            })
            .collect();
        let Some(names) = names else {
            warn!(
                "{} with an invalid name; {} fds closed",
                fdstore::FDNAMES_KEY,
                fds.len()
            );
            return;
        };
        if store {
            if names.len() != fds.len() {
                warn!(
                    "FDSTORE=1 naming {} fds with {} fds; closed",
                    names.len(),
                    fds.len()
                );
                return;
            }
            for (name, fd) in names.into_iter().zip(fds) {
                self.store(name, vec![fd]);
            }
        } else if remove {
            for name in &names {
                if let Some(old) = self.stored.remove(name) {
                    self.nfds -= old.fds.len();
                    debug!("removed {name} ({} fds)", old.fds.len());
                }
            }
        } else if !fds.is_empty() {
            debug!("closing {} fds sent without FDSTORE=1", fds.len());
        }
    }

    fn store(&mut self, name: String, fds: Vec<OwnedFd>) {
        if fds.is_empty() {
            warn!("FDSTORE=1 for {name} without an fd; ignored");
            return;
        }
        let replaced = self.stored.get(&name).map_or(0, |s| s.fds.len());
        if self.nfds - replaced + fds.len() > MAX_STORED_FDS {
            warn!(
                "fd store full ({MAX_STORED_FDS} fds): {name} not stored, its {} fds closed",
                fds.len()
            );
            return;
        }
        self.seq += 1;
        let n = fds.len();
        // A replaced entry's fds close as it drops.
        if let Some(old) = self
            .stored
            .insert(name.clone(), Stored { seq: self.seq, fds })
        {
            self.nfds -= old.fds.len();
            debug!("stored {name} ({n} fds), replacing {} fds", old.fds.len());
        } else {
            debug!("stored {name} ({n} fds)");
        }
        self.nfds += n;
    }
}
