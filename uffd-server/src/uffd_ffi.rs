//! The few raw userfaultfd ioctls the server issues itself.
//!
//! The userfaultfd crate's `copy` turns a partial copy that ends in EAGAIN
//! into a byte count by casting the kernel's *signed* result field, which
//! is negative (-EAGAIN) in exactly that case (DESIGN §2), and loses the
//! count on EEXIST. Installing pages into Firecracker's anonymous memory
//! needs both counts, so UFFDIO_COPY and UFFDIO_ZEROPAGE are issued here
//! and their results read with their sign.

use std::os::fd::RawFd;

/// `struct uffdio_range`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

/// `struct uffdio_copy`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

/// `struct uffdio_zeropage`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}

const _: () = assert!(std::mem::size_of::<UffdioCopy>() == 40);
const _: () = assert!(std::mem::size_of::<UffdioZeropage>() == 32);

const UFFDIO: u8 = 0xAA;
nix::ioctl_readwrite!(ioctl_copy, UFFDIO, 0x03, UffdioCopy);
nix::ioctl_readwrite!(ioctl_zeropage, UFFDIO, 0x04, UffdioZeropage);

/// UFFDIO_COPY_MODE_WP: install the page write-protected.
pub const COPY_MODE_WP: u64 = 1 << 1;

/// What an install ioctl did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Install {
    /// All `len` bytes installed (and woken unless DONTWAKE).
    Done,
    /// Stopped at a page that already exists after `copied` bytes.
    Exists { copied: u64 },
    /// The address space is changing (a non-cooperative event is pending);
    /// `copied` bytes were installed. Retry after reading events.
    Again { copied: u64 },
    /// The process is gone.
    Gone,
    /// Another error (errno).
    Failed(i32),
}

fn outcome(res: nix::Result<libc::c_int>, result: i64, len: u64) -> Install {
    let copied = u64::try_from(result).unwrap_or(0);
    match res {
        Ok(_) if copied >= len => Install::Done,
        Ok(_) => Install::Again { copied },
        Err(nix::Error::EEXIST) => Install::Exists { copied },
        Err(nix::Error::EAGAIN) => Install::Again { copied },
        Err(nix::Error::ESRCH) => Install::Gone,
        Err(e) => Install::Failed(e as i32),
    }
}

/// UFFDIO_COPY `len` bytes from `src` (in this process) to `dst` (in the
/// registered range of the uffd's process), waking the faulting threads.
///
/// # Safety
/// `src..src+len` must be readable memory of this process for the call.
pub unsafe fn copy(uffd: RawFd, src: *const u8, dst: u64, len: u64, mode: u64) -> Install {
    let mut arg = UffdioCopy {
        dst,
        src: src as u64,
        len,
        mode,
        copy: 0,
    };
    // SAFETY: `arg` is a valid uffdio_copy; the caller guarantees `src`.
    let res = unsafe { ioctl_copy(uffd, &mut arg) };
    outcome(res, arg.copy, len)
}

/// UFFDIO_ZEROPAGE over `len` bytes at `dst`, waking the faulting threads.
pub fn zeropage(uffd: RawFd, dst: u64, len: u64) -> Install {
    let mut arg = UffdioZeropage {
        range: UffdioRange { start: dst, len },
        mode: 0,
        zeropage: 0,
    };
    // SAFETY: `arg` is a valid uffdio_zeropage; the kernel only touches the
    // uffd's own registered range in the other process.
    let res = unsafe { ioctl_zeropage(uffd, &mut arg) };
    outcome(res, arg.zeropage, len)
}
