//! Guest RAM owned by the server: one memfd per VM, mapped MAP_SHARED into
//! the server so it can fill pages before waking a faulting vCPU, and read
//! a page to hand it to another VM.
//!
//! Invariant: bytes are only written into this mapping for pages the table
//! does not yet mark as present (`Vm(self)`), or by an explicit copy-on-write
//! step; a page present in the memfd never faults again in the VMM.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::ptr::NonNull;

use nix::fcntl::{fallocate, FallocateFlags};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use shared::PAGE_SIZE;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot create the guest memfd")]
    CreateMemfd(#[source] memfd::Error),
    #[error("cannot size the guest memfd to {0} bytes")]
    SizeMemfd(u64, #[source] std::io::Error),
    #[error("cannot map guest memory into the server")]
    Map(#[source] nix::Error),
    #[error("cannot read image {path} at byte {offset}")]
    ReadImage {
        path: String,
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot punch a hole in guest memory")]
    PunchHole(#[source] nix::Error),
    #[error("page range {0}..{1} is outside guest memory")]
    OutOfRange(u64, u64),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, MemoryError>;

/// A VM's guest RAM: a memfd and the server's shared mapping of it.
#[derive(Debug)]
pub struct GuestMemory {
    memfd: File,
    base: NonNull<u8>,
    size: u64,
}

impl GuestMemory {
    /// Create a memfd of `size` bytes named `name` and map it.
    pub fn create(name: &str, size: u64) -> Result<Self> {
        let mfd = memfd::MemfdOptions::default()
            .close_on_exec(true)
            .create(name)
            .map_err(MemoryError::CreateMemfd)?;
        let memfd = mfd.into_file();
        memfd
            .set_len(size)
            .map_err(|e| MemoryError::SizeMemfd(size, e))?;
        let len = std::num::NonZeroUsize::new(usize::try_from(size).unwrap_or(0)).ok_or(
            MemoryError::SizeMemfd(size, std::io::Error::from_raw_os_error(libc::EINVAL)),
        )?;
        // SAFETY: a fresh shared mapping of a file we own; no existing memory
        // is replaced (no MAP_FIXED) and the mapping lives until Drop.
        let ptr = unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &memfd,
                0,
            )
        }
        .map_err(MemoryError::Map)?;
        Ok(GuestMemory {
            memfd,
            base: ptr.cast(),
            size,
        })
    }

    /// The memfd (to send to the VMM).
    pub fn memfd(&self) -> &File {
        &self.memfd
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Number of pages.
    pub fn pages(&self) -> u64 {
        self.size / PAGE_SIZE
    }

    fn check(&self, page: u64, pages: u64) -> Result<*mut u8> {
        let end = page.checked_add(pages).filter(|e| *e <= self.pages());
        match end {
            // SAFETY: `page * PAGE_SIZE` is inside the mapping (checked above).
            Some(_) => Ok(unsafe {
                self.base
                    .as_ptr()
                    .add(shared::geometry::usize_of(page * PAGE_SIZE))
            }),
            None => Err(MemoryError::OutOfRange(page, page.saturating_add(pages))),
        }
    }

    /// Make `page` present and zero in the memfd (allocates it).
    pub fn zero_page(&self, page: u64) -> Result<()> {
        let ptr = self.check(page, 1)?;
        // SAFETY: `ptr` points into our live shared mapping (checked). A
        // volatile store of 0 into a hole makes shmem allocate a zeroed page;
        // into an existing page (a race with a concurrent fill) it writes
        // a byte of what must already be zero for an uninitialized page.
        unsafe { std::ptr::write_volatile(ptr, 0) };
        Ok(())
    }

    /// Fill `[page, page+pages)` from `file` at byte `offset` with one pread.
    pub fn fill_from_file(
        &self,
        page: u64,
        pages: u64,
        file: &File,
        path: &str,
        offset: u64,
    ) -> Result<()> {
        let ptr = self.check(page, pages)?;
        let len = shared::geometry::usize_of(pages * PAGE_SIZE);
        let mut done = 0usize;
        while done < len {
            let off = libc::off_t::try_from(offset + done as u64).unwrap_or(libc::off_t::MAX);
            // SAFETY: the destination is `len - done` bytes inside our live
            // mapping (checked above); the kernel writes at most that many.
            let n = unsafe { libc::pread(file.as_raw_fd(), ptr.add(done).cast(), len - done, off) };
            match n {
                n if n > 0 => done += n.unsigned_abs(),
                0 => {
                    // Past the end of the image: the rest reads as zero.
                    // SAFETY: same range as above.
                    unsafe { std::ptr::write_bytes(ptr.add(done), 0, len - done) };
                    done = len;
                }
                _ => {
                    let err = std::io::Error::last_os_error();
                    if err.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(MemoryError::ReadImage {
                        path: path.to_owned(),
                        offset,
                        source: err,
                    });
                }
            }
        }
        Ok(())
    }

    /// Address of `page` in the server's mapping, to copy from.
    pub fn page_ptr(&self, page: u64) -> Result<*const u8> {
        self.check(page, 1).map(|p| p as *const u8)
    }

    /// Copy one page from `src` (another VM's memory) into this memory.
    ///
    /// Only for memory no VMM is running on: a running guest could touch
    /// the page between the first store (which makes it present) and the
    /// last, and see or lose a torn page. Running VMs get pages through
    /// UFFDIO_COPY, which installs them whole.
    pub fn copy_page_from(&self, src: &GuestMemory, page: u64) -> Result<()> {
        let d = self.check(page, 1)?;
        let s = src.check(page, 1)?;
        // SAFETY: both pointers are one page inside live mappings of two
        // different memfds, so they do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(s, d, shared::geometry::usize_of(PAGE_SIZE)) };
        Ok(())
    }

    /// Read page bytes (for debugging and snapshots).
    pub fn read_page(&self, page: u64, out: &mut [u8]) -> Result<()> {
        let s = self.check(page, 1)?;
        let n = out.len().min(shared::geometry::usize_of(PAGE_SIZE));
        // SAFETY: `s` is one page inside the live mapping; `out` is ours.
        unsafe { std::ptr::copy_nonoverlapping(s, out.as_mut_ptr(), n) };
        Ok(())
    }

    /// Drop `[page, page+pages)` from the memfd: the pages become holes and
    /// fault again on next access.
    pub fn punch_hole(&self, page: u64, pages: u64) -> Result<()> {
        self.check(page, pages)?;
        let off = libc::off_t::try_from(page * PAGE_SIZE).unwrap_or(libc::off_t::MAX);
        let len = libc::off_t::try_from(pages * PAGE_SIZE).unwrap_or(libc::off_t::MAX);
        fallocate(
            self.memfd.as_fd().as_raw_fd(),
            FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE,
            off,
            len,
        )
        .map_err(MemoryError::PunchHole)
    }

    /// Page runs present in the memfd, found with SEEK_DATA/SEEK_HOLE (the
    /// kernel's own view, independent of the table).
    pub fn present_ranges(&self) -> Vec<(u64, u64)> {
        let fd = self.memfd.as_raw_fd();
        let size = libc::off_t::try_from(self.size).unwrap_or(libc::off_t::MAX);
        let mut out = Vec::new();
        let mut pos: libc::off_t = 0;
        while pos < size {
            // SAFETY: lseek on our own fd has no memory effects.
            let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
            if data < 0 || data >= size {
                break;
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
            let hole = if hole < 0 { size } else { hole.min(size) };
            let (d, h) = (
                data.unsigned_abs() / PAGE_SIZE,
                hole.unsigned_abs().div_ceil(PAGE_SIZE),
            );
            out.push((d, h - d));
            pos = hole;
        }
        out
    }

    /// Whether `page` is present in the memfd.
    pub fn is_present(&self, page: u64) -> bool {
        let fd = self.memfd.as_raw_fd();
        let off = libc::off_t::try_from(page * PAGE_SIZE).unwrap_or(libc::off_t::MAX);
        // SAFETY: lseek on our own fd has no memory effects.
        let data = unsafe { libc::lseek(fd, off, libc::SEEK_DATA) };
        data >= 0 && data < off + libc::off_t::try_from(PAGE_SIZE).unwrap_or(4096)
    }

    /// Bytes the memfd has allocated (st_blocks * 512).
    pub fn allocated_bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.memfd.metadata().map(|m| m.blocks() * 512).unwrap_or(0)
    }
}

impl Drop for GuestMemory {
    fn drop(&mut self) {
        // SAFETY: `base`/`size` are exactly the mapping created in `create`,
        // and no reference into it outlives `self`.
        let _ = unsafe { munmap(self.base.cast(), shared::geometry::usize_of(self.size)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn fill_zero_punch_round_trip() {
        let m = GuestMemory::create("t", 8 * PAGE_SIZE).unwrap();
        assert_eq!(m.allocated_bytes(), 0);
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![0xab; 3 * shared::geometry::usize_of(PAGE_SIZE)])
            .unwrap();
        m.fill_from_file(1, 4, &f, "img", 0).unwrap();
        let mut buf = vec![0u8; shared::geometry::usize_of(PAGE_SIZE)];
        m.read_page(3, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 0xab));
        m.read_page(4, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 0));
        assert_eq!(m.allocated_bytes(), 4 * PAGE_SIZE);
        m.punch_hole(1, 4).unwrap();
        assert_eq!(m.allocated_bytes(), 0);
        m.zero_page(0).unwrap();
        assert_eq!(m.allocated_bytes(), PAGE_SIZE);
        assert!(m.fill_from_file(7, 2, &f, "img", 0).is_err());
    }
}
