//! `memory.img`: creating it (empty or as a reflink of a parent image),
//! writing page runs, punching holes, and reading back where its data is.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{fallocate, FallocateFlags};
use shared::PAGE_SIZE;

use super::error::{Result, SnapshotError};

/// Byte ranges `[start, end)` of `fd` (of `len` bytes) that hold data, found
/// with SEEK_DATA / SEEK_HOLE; everything else reads as zero.
pub fn data_ranges(fd: RawFd, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let len_off = libc::off_t::try_from(len).unwrap_or(libc::off_t::MAX);
    let mut out = Vec::new();
    let mut pos: libc::off_t = 0;
    while pos < len_off {
        // SAFETY: lseek on an open fd has no memory effects.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // No data past `pos`.
            }
            return Err(e);
        }
        if data >= len_off {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let hole = hole.min(len_off);
        out.push((data.unsigned_abs(), hole.unsigned_abs()));
        pos = hole;
    }
    Ok(out)
}

/// Page runs `(first, pages)` of an image that hold data (a partly written
/// page counts as data).
pub fn data_pages(file: &File, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (s, e) in data_ranges(file.as_raw_fd(), len)? {
        let (first, end) = (s / PAGE_SIZE, e.div_ceil(PAGE_SIZE));
        match out.last_mut() {
            Some((f, n)) if *f + *n >= first => *n = (*n).max(end - *f),
            _ => out.push((first, end - first)),
        }
    }
    Ok(out)
}

/// Open an image read-only, never through a symlink.
pub fn open_read(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(SnapshotError::io("open", path))
}

/// A `memory.img` being written.
#[derive(Debug)]
pub struct ImageWriter {
    pub path: PathBuf,
    pub file: File,
}

impl ImageWriter {
    /// A new, all-hole image of `size` bytes.
    pub fn create(path: &Path, size: u64) -> Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(SnapshotError::io("create", path))?;
        file.set_len(size)
            .map_err(SnapshotError::io("size", path))?;
        Ok(ImageWriter {
            path: path.to_owned(),
            file,
        })
    }

    /// A new image sharing every extent of `parent` (one FICLONE; the
    /// cost does not depend on the image's size).
    pub fn reflink(path: &Path, parent: &Path, size: u64) -> std::io::Result<Self> {
        let src = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(parent)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?;
        let cloned = reflink::ficlone(&file, &src).and_then(|()| file.set_len(size));
        if let Err(e) = cloned {
            drop(file);
            let _ = std::fs::remove_file(path);
            return Err(e);
        }
        Ok(ImageWriter {
            path: path.to_owned(),
            file,
        })
    }

    /// Write `bytes` (whole pages) at `first`'s offset.
    pub fn write_pages(&self, first: u64, bytes: &[u8]) -> Result<()> {
        self.file
            .write_all_at(bytes, first * PAGE_SIZE)
            .map_err(SnapshotError::io("write", &self.path))
    }

    /// Write `bytes` (whole pages of memory another process may be
    /// writing) at `first`'s offset: the kernel copies them straight from
    /// the mapping, with no buffer between.
    pub fn write_volatile(&self, first: u64, bytes: &vm_memory::VolatileSlice<'_>) -> Result<()> {
        let guard = bytes.ptr_guard();
        let (ptr, len) = (guard.as_ptr(), bytes.len());
        let mut done = 0;
        while done < len {
            let off =
                libc::off_t::try_from(first * PAGE_SIZE + done as u64).unwrap_or(libc::off_t::MAX);
            // SAFETY: `[ptr + done, ptr + len)` lies in a live mapping the
            // guard keeps; the kernel only reads it. Concurrent changes to
            // those bytes give a torn copy, which the caller re-saves
            // (`writer::Memory`).
            let n = unsafe {
                libc::pwrite(self.file.as_raw_fd(), ptr.add(done).cast(), len - done, off)
            };
            match n {
                n if n > 0 => done += n.unsigned_abs(),
                0 => {
                    return Err(SnapshotError::io("write", &self.path)(
                        std::io::ErrorKind::WriteZero.into(),
                    ))
                }
                _ => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(SnapshotError::io("write", &self.path)(e));
                    }
                }
            }
        }
        Ok(())
    }

    /// Read pages from `first` into all of `buf` (whole pages).
    pub fn read_pages(&self, first: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.file.read_exact_at(buf, first * PAGE_SIZE)
    }

    /// Start writing `[first, first + pages)` back to the disk without
    /// waiting for it, so the fsync that commits the snapshot finds most
    /// of the image already written instead of starting all of it then.
    pub fn start_writeback(&self, first: u64, pages: u64) -> std::io::Result<()> {
        let off = libc::off64_t::try_from(first * PAGE_SIZE).unwrap_or(libc::off64_t::MAX);
        let len = libc::off64_t::try_from(pages * PAGE_SIZE).unwrap_or(libc::off64_t::MAX);
        // nix has no wrapper for sync_file_range(2).
        // SAFETY: a plain syscall on an fd this writer owns, with integer
        // arguments; no memory is passed.
        let r = unsafe {
            libc::sync_file_range(self.file.as_raw_fd(), off, len, libc::SYNC_FILE_RANGE_WRITE)
        };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Make `[first, first + pages)` a hole (reads as zero).
    /// Start reading `runs` (`(first page, pages)`) into the page cache,
    /// without waiting for them (best effort: a failure only costs the
    /// later read its head start).
    pub fn prefetch(&self, runs: &[(u64, u64)]) {
        for &(first, pages) in runs {
            let off = libc::off_t::try_from(first * PAGE_SIZE).unwrap_or(libc::off_t::MAX);
            let len = libc::off_t::try_from(pages * PAGE_SIZE).unwrap_or(libc::off_t::MAX);
            if let Err(e) = nix::fcntl::posix_fadvise(
                self.file.as_raw_fd(),
                off,
                len,
                nix::fcntl::PosixFadviseAdvice::POSIX_FADV_WILLNEED,
            ) {
                tracing::debug!("prefetch of {}: {e}", self.path.display());
                return;
            }
        }
    }

    pub fn punch(&self, first: u64, pages: u64) -> Result<()> {
        let off = libc::off_t::try_from(first * PAGE_SIZE).unwrap_or(libc::off_t::MAX);
        let len = libc::off_t::try_from(pages * PAGE_SIZE).unwrap_or(libc::off_t::MAX);
        fallocate(
            self.file.as_raw_fd(),
            FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE,
            off,
            len,
        )
        .map_err(|e| SnapshotError::io("punch a hole in", &self.path)(e.into()))
    }
}

/// The name a fragmented image is rewritten under before it replaces the
/// image (a leftover of a crash is removed at start-up).
pub const REWRITE_SUFFIX: &str = ".rewrite";

/// Rewrite the image at `path` sequentially: the same bytes (holes stay
/// holes) in new, contiguous extents, replacing the fragmented file with
/// one rename. The content does not change, so the snapshot's checksums
/// hold and a crash at any point leaves a valid image (the old one or the
/// new one); VMs reading the old file keep it open until they are done.
/// It gives up the extents the image shared with its parent: that is the
/// point (a chain of dirty snapshots on reflinks fragments without end,
/// and FICLONE and reads cost per extent). Returns the extent counts
/// before and after. Blocking I/O: run it off the core thread.
pub fn rewrite_sequential(path: &Path) -> std::io::Result<(u64, u64)> {
    let src = File::open(path)?;
    let len = src.metadata()?.len();
    let before = extent_count(&src);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}{REWRITE_SUFFIX}"));
    let out = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    let copy = || -> std::io::Result<()> {
        out.set_len(len)?;
        // Plain reads and writes: copy_file_range would share the extents
        // again on a reflink filesystem.
        let mut buf = vec![0u8; 1 << 20];
        for (start, end) in data_ranges(src.as_raw_fd(), len)? {
            let mut at = start;
            while at < end {
                let chunk = usize::try_from((end - at).min(buf.len() as u64)).unwrap_or(buf.len());
                src.read_exact_at(&mut buf[..chunk], at)?;
                out.write_all_at(&buf[..chunk], at)?;
                at += chunk as u64;
            }
        }
        out.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            File::open(dir)?.sync_all()?;
        }
        Ok(())
    };
    if let Err(e) = copy() {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok((before, extent_count(&out)))
}

/// Number of extents of `file` (FIEMAP; 0 if it cannot tell).
pub fn extent_count(file: &File) -> u64 {
    reflink::fiemap(file).map_or(0, |e| e.len() as u64)
}

/// Bytes of `file` no other file shares (FIEMAP).
pub fn exclusive_bytes(file: &File) -> u64 {
    reflink::usage(file).map_or(0, |u| u.exclusive_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_pages_find_written_runs() {
        let dir = tempfile::tempdir().unwrap();
        let img = ImageWriter::create(&dir.path().join("m"), 64 * PAGE_SIZE).unwrap();
        img.write_pages(3, &[1u8; 2 * 4096]).unwrap();
        img.write_pages(40, &[2u8; 4096]).unwrap();
        let runs = data_pages(&img.file, 64 * PAGE_SIZE).unwrap();
        // Filesystems may round data to their block size; the written
        // pages are always inside a data run.
        let covered = |p: u64| runs.iter().any(|(f, n)| p >= *f && p < f + n);
        assert!(covered(3) && covered(4) && covered(40), "{runs:?}");
        assert!(!covered(20), "{runs:?}");
        img.punch(40, 1).unwrap();
        let runs = data_pages(&img.file, 64 * PAGE_SIZE).unwrap();
        assert!(
            !runs.iter().any(|(f, n)| 40 >= *f && 40 < f + n),
            "{runs:?}"
        );
    }
}
