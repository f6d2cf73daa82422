//! The raw ioctls, behind safe wrappers: `FICLONE`, `FICLONERANGE` and
//! `FS_IOC_FIEMAP`, with their `repr(C)` structs checked against the kernel
//! ABI at compile time.
//!
//! Everything unsafe in this crate lives here; the rest works on
//! `std::fs::File`.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// `FICLONE = _IOW(0x94, 9, int)`: share all of `src`'s extents with `dst`.
const FICLONE: libc::Ioctl = 0x4004_9409;
/// `FICLONERANGE = _IOW(0x94, 13, struct file_clone_range)`.
const FICLONERANGE: libc::Ioctl = 0x4020_940d;
/// `FS_IOC_FIEMAP = _IOWR('f', 11, struct fiemap)`.
const FS_IOC_FIEMAP: libc::Ioctl = 0xc020_660b;

const _: () = assert!(FICLONE == libc::FICLONE);
const _: () = assert!(FICLONERANGE == libc::FICLONERANGE);

/// `FIEMAP_FLAG_SYNC`: flush dirty data first so delayed allocations show.
const FIEMAP_FLAG_SYNC: u32 = 0x1;
/// `FIEMAP_EXTENT_LAST`: this is the file's last extent.
const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// `FIEMAP_EXTENT_SHARED`: the extent's blocks are shared with another file.
pub const FIEMAP_EXTENT_SHARED: u32 = 0x2000;
/// `FIEMAP_EXTENT_UNWRITTEN`: allocated but reads as zeroes.
pub const FIEMAP_EXTENT_UNWRITTEN: u32 = 0x800;
/// Flags under which `fe_physical` does not identify the blocks: UNKNOWN,
/// DELALLOC, ENCODED, NOT_ALIGNED, DATA_INLINE, DATA_TAIL.
pub const FIEMAP_EXTENT_NO_IDENTITY: u32 = 0x2 | 0x4 | 0x8 | 0x100 | 0x200 | 0x400;

/// `struct file_clone_range` of `<linux/fs.h>`.
#[repr(C)]
struct FileCloneRange {
    src_fd: i64,
    src_offset: u64,
    src_length: u64,
    dest_offset: u64,
}
const _: () = assert!(std::mem::size_of::<FileCloneRange>() == 32);

/// `struct fiemap_extent` of `<linux/fiemap.h>`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FiemapExtent {
    fe_logical: u64,
    fe_physical: u64,
    fe_length: u64,
    fe_reserved64: [u64; 2],
    fe_flags: u32,
    fe_reserved: [u32; 3],
}
const _: () = assert!(std::mem::size_of::<FiemapExtent>() == 56);

/// `struct fiemap` header of `<linux/fiemap.h>`.
#[repr(C)]
#[derive(Default)]
struct FiemapHeader {
    fm_start: u64,
    fm_length: u64,
    fm_flags: u32,
    fm_mapped_extents: u32,
    fm_extent_count: u32,
    fm_reserved: u32,
}
const _: () = assert!(std::mem::size_of::<FiemapHeader>() == 32);

/// Extents fetched per `FS_IOC_FIEMAP` call.
const BATCH_U32: u32 = 256;
const BATCH: usize = BATCH_U32 as usize;

/// A `struct fiemap` followed by room for [`BATCH`] extents, as one
/// contiguous `repr(C)` buffer the kernel fills in.
#[repr(C)]
struct FiemapBuf {
    header: FiemapHeader,
    extents: [FiemapExtent; BATCH],
}

/// One extent as reported by FIEMAP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Offset in the file.
    pub logical: u64,
    /// Offset on the device: equal ranges are the same blocks (reflinks).
    pub physical: u64,
    /// Length in bytes.
    pub length: u64,
    /// `FIEMAP_EXTENT_*` flags.
    pub flags: u32,
}

/// Make `dst` share all of `src`'s data (`ioctl(dst, FICLONE, src)`).
pub fn ficlone(dst: &File, src: &File) -> io::Result<()> {
    // SAFETY: FICLONE takes the source fd as its integer argument; both fds
    // are open for the duration of the call and the kernel reads no memory.
    let rc = unsafe { libc::ioctl(dst.as_raw_fd(), FICLONE, src.as_raw_fd()) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Share `len` bytes of `src` at `src_offset` into `dst` at `dst_offset`
/// (`ioctl(dst, FICLONERANGE, ...)`); offsets and length must be block
/// aligned (except a range ending at `src`'s EOF).
pub fn ficlonerange(
    dst: &File,
    dst_offset: u64,
    src: &File,
    src_offset: u64,
    len: u64,
) -> io::Result<()> {
    let arg = FileCloneRange {
        src_fd: i64::from(src.as_raw_fd()),
        src_offset,
        src_length: len,
        dest_offset: dst_offset,
    };
    // SAFETY: `arg` is a valid `struct file_clone_range` that outlives the
    // call; the kernel only reads it. Both fds are open.
    let rc = unsafe { libc::ioctl(dst.as_raw_fd(), FICLONERANGE, &arg as *const FileCloneRange) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// All extents of `file`, after flushing its dirty data.
pub fn fiemap(file: &File) -> io::Result<Vec<Extent>> {
    let mut out = Vec::new();
    let mut start = 0u64;
    loop {
        let mut buf = FiemapBuf {
            header: FiemapHeader {
                fm_start: start,
                fm_length: u64::MAX - start,
                fm_flags: FIEMAP_FLAG_SYNC,
                fm_extent_count: BATCH_U32,
                ..FiemapHeader::default()
            },
            extents: [FiemapExtent::default(); BATCH],
        };
        // SAFETY: `buf` is a `struct fiemap` header immediately followed by
        // `fm_extent_count` extents, as the ABI requires (both repr(C), sizes
        // asserted above, no padding between them); it lives across the call
        // and the kernel writes at most `fm_extent_count` extents.
        let rc =
            unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP, &mut buf as *mut FiemapBuf) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        let mapped = (buf.header.fm_mapped_extents as usize).min(BATCH);
        if mapped == 0 {
            return Ok(out);
        }
        let mut last = false;
        for e in &buf.extents[..mapped] {
            out.push(Extent {
                logical: e.fe_logical,
                physical: e.fe_physical,
                length: e.fe_length,
                flags: e.fe_flags,
            });
            last |= e.fe_flags & FIEMAP_EXTENT_LAST != 0;
        }
        let tail = &buf.extents[mapped - 1];
        let next = tail.fe_logical.saturating_add(tail.fe_length);
        if last || next <= start || next == u64::MAX {
            return Ok(out);
        }
        start = next;
    }
}
