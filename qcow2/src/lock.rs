//! qemu's image locks, so an offline operation never changes an image a
//! running qemu has open (and qemu cannot open one we are changing).
//!
//! qemu's file driver expresses its use of an image with open file
//! description (OFD) read locks on single bytes: byte `100 + p` while it
//! uses permission `p`, byte `200 + p` while it refuses to share `p`
//! (p = 0 consistent read, 1 write). Two users conflict when one uses what
//! the other refuses to share. We take the same locks for as long as the
//! file stays open, after checking that nobody holds a conflicting one.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

use crate::error::{Error, Result};

const PERM_BASE: i64 = 100;
const SHARED_BASE: i64 = 200;
const CONSISTENT_READ: i64 = 0;
const WRITE: i64 = 1;

fn flock(kind: libc::c_int, byte: i64) -> libc::flock {
    // SAFETY: `flock` is a plain C struct; all-zero is a valid value.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    #[allow(clippy::cast_possible_truncation)] // F_RDLCK/F_WRLCK are tiny
    {
        fl.l_type = kind as libc::c_short;
        fl.l_whence = libc::SEEK_SET as libc::c_short;
    }
    fl.l_start = byte;
    fl.l_len = 1;
    fl
}

fn fcntl(file: &File, cmd: libc::c_int, fl: &mut libc::flock) -> io::Result<()> {
    // SAFETY: `fl` is a valid, live `struct flock` for the call, which the
    // kernel reads and (for F_OFD_GETLK) writes; the fd is open.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), cmd, fl as *mut libc::flock) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Whether another open file description holds a lock on `byte`.
fn held_by_other(file: &File, byte: i64) -> io::Result<bool> {
    let mut fl = flock(libc::F_WRLCK, byte);
    fcntl(file, libc::F_OFD_GETLK, &mut fl)?;
    Ok(i32::from(fl.l_type) != libc::F_UNLCK)
}

/// Check that no qemu (or other user) conflicts with reading (`write`
/// false) or changing the image, then hold qemu's locks for that use until
/// `file` is closed.
pub fn acquire(file: &File, write: bool) -> Result<()> {
    let err = |source| Error::Read {
        what: "image locks",
        offset: 0,
        source,
    };
    let busy = |what: &str| {
        Err(Error::BadRequest(format!(
            "the image is in use: another process holds its {what} lock (a running qemu?); stop it first"
        )))
    };
    if held_by_other(file, SHARED_BASE + CONSISTENT_READ).map_err(err)? {
        return busy("\"consistent read\"");
    }
    if write {
        if held_by_other(file, SHARED_BASE + WRITE).map_err(err)? {
            return busy("\"write\"");
        }
        if held_by_other(file, PERM_BASE + WRITE).map_err(err)? {
            return busy("\"write\"");
        }
    }
    let mut bytes = vec![PERM_BASE + CONSISTENT_READ];
    if write {
        bytes.extend([PERM_BASE + WRITE, SHARED_BASE + WRITE]);
    }
    for b in bytes {
        let mut fl = flock(libc::F_RDLCK, b);
        if let Err(e) = fcntl(file, libc::F_OFD_SETLK, &mut fl) {
            if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) {
                return busy("image");
            }
            return Err(err(e));
        }
    }
    Ok(())
}
