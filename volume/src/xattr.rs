//! File extended attributes (`fsetxattr`, `fgetxattr`), where a snapshot
//! keeps its sequence number.
//!
//! Everything unsafe in this crate lives here; reflinks and extents are the
//! `reflink` crate's.

use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Set the extended attribute `name` of `file` to `value`.
pub fn fsetxattr(file: &File, name: &CStr, value: &[u8]) -> io::Result<()> {
    // SAFETY: `name` is NUL-terminated and `value` is valid for
    // `value.len()` bytes; both outlive the call, which only reads them.
    let rc = unsafe {
        libc::fsetxattr(
            file.as_raw_fd(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The extended attribute `name` of `file`, or `None` if it has none
/// (values longer than 64 bytes are reported as `E2BIG`).
pub fn fgetxattr(file: &File, name: &CStr) -> io::Result<Option<Vec<u8>>> {
    let mut buf = [0u8; 64];
    // SAFETY: `name` is NUL-terminated; `buf` is writable for `buf.len()`
    // bytes and outlives the call.
    let rc = unsafe {
        libc::fgetxattr(
            file.as_raw_fd(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if rc < 0 {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::ENODATA) | Some(libc::ENOTSUP) => Ok(None),
            _ => Err(err),
        };
    }
    let len = usize::try_from(rc).map_err(|_| io::Error::from_raw_os_error(libc::EIO))?;
    Ok(Some(buf[..len.min(buf.len())].to_vec()))
}
