//! Guest RAM owned by the server: one memfd per VM, mapped MAP_SHARED into
//! the server (a vm-memory `MmapRegion`, as the VMM maps it) so it can fill
//! pages before waking a faulting vCPU, and read a page to hand it to
//! another VM.
//!
//! Invariant: bytes are only written into this mapping for pages the table
//! does not yet mark as present (`Vm(self)`), or by an explicit copy-on-write
//! step; a page present in the memfd never faults again in the VMM.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;

use nix::fcntl::{fallocate, FallocateFlags};
use shared::PAGE_SIZE;
use vm_memory::mmap::MmapRegionError;
use vm_memory::{FileOffset, MmapRegion, VolatileMemory, VolatileSlice};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("cannot create the guest memfd")]
    CreateMemfd(#[source] memfd::Error),
    #[error("cannot size the guest memfd to {0} bytes")]
    SizeMemfd(u64, #[source] std::io::Error),
    #[error("cannot map guest memory into the server")]
    Map(#[source] MmapRegionError),
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
    /// The memfd; the mapping shares this one fd (no duplicate).
    memfd: Arc<File>,
    /// MAP_SHARED, read-write, unmapped on drop. `from_file` adds
    /// MAP_NORESERVE, which changes nothing for a shared shmem mapping.
    map: MmapRegion,
    size: u64,
}

impl GuestMemory {
    /// Create a memfd of `size` bytes named `name` and map it.
    pub fn create(name: &str, size: u64) -> Result<Self> {
        let mfd = memfd::MemfdOptions::default()
            .close_on_exec(true)
            .create(name)
            .map_err(MemoryError::CreateMemfd)?;
        let memfd = Arc::new(mfd.into_file());
        memfd
            .set_len(size)
            .map_err(|e| MemoryError::SizeMemfd(size, e))?;
        let len = usize::try_from(size)
            .ok()
            .filter(|l| *l > 0)
            .ok_or(MemoryError::SizeMemfd(
                size,
                std::io::Error::from_raw_os_error(libc::EINVAL),
            ))?;
        let map = MmapRegion::from_file(FileOffset::from_arc(Arc::clone(&memfd), 0), len)
            .map_err(MemoryError::Map)?;
        Ok(GuestMemory { memfd, map, size })
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

    /// The bytes of `[page, page+pages)` in the server's mapping.
    pub fn slice(&self, page: u64, pages: u64) -> Result<VolatileSlice<'_>> {
        let out = || MemoryError::OutOfRange(page, page.saturating_add(pages));
        let end = page.checked_add(pages).filter(|e| *e <= self.pages());
        end.ok_or_else(out)?;
        let off = shared::geometry::usize_of(page * PAGE_SIZE);
        let len = shared::geometry::usize_of(pages * PAGE_SIZE);
        self.map.get_slice(off, len).map_err(|_| out())
    }

    /// Address of `page` in the server's mapping, to copy from.
    pub fn page_ptr(&self, page: u64) -> Result<*const u8> {
        Ok(self.slice(page, 1)?.ptr_guard().as_ptr())
    }

    /// Copy one page from `src` (another VM's memory) into this memory.
    ///
    /// Only for memory no VMM is running on: a running guest could touch
    /// the page between the first store (which makes it present) and the
    /// last, and see or lose a torn page. Running VMs get pages through
    /// UFFDIO_COPY, which installs them whole.
    pub fn copy_page_from(&self, src: &GuestMemory, page: u64) -> Result<()> {
        let d = self.slice(page, 1)?;
        src.slice(page, 1)?.copy_to_volatile_slice(d);
        Ok(())
    }

    /// Read page bytes (for debugging and snapshots).
    pub fn read_page(&self, page: u64, out: &mut [u8]) -> Result<()> {
        let s = self.slice(page, 1)?;
        s.copy_to(out);
        Ok(())
    }

    /// Drop `[page, page+pages)` from the memfd: the pages become holes and
    /// fault again on next access.
    pub fn punch_hole(&self, page: u64, pages: u64) -> Result<()> {
        self.slice(page, pages)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;

    #[test]
    fn write_copy_punch_round_trip() {
        let m = GuestMemory::create("t", 8 * PAGE_SIZE).unwrap();
        assert_eq!(m.allocated_bytes(), 0);
        m.slice(1, 3).unwrap().copy_from(&[0xabu8; 3 * PAGE]);
        assert_eq!(m.allocated_bytes(), 3 * PAGE_SIZE);
        assert_eq!(m.present_ranges(), vec![(1, 3)]);
        let mut buf = vec![0u8; PAGE];
        m.read_page(3, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 0xab));
        m.read_page(4, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 0));
        let other = GuestMemory::create("u", 8 * PAGE_SIZE).unwrap();
        other.copy_page_from(&m, 2).unwrap();
        other.read_page(2, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 0xab));
        assert!(other.is_present(2) && !other.is_present(3));
        m.punch_hole(1, 4).unwrap();
        assert_eq!(m.allocated_bytes(), 0);
        assert!(m.slice(7, 2).is_err());
        assert!(m.punch_hole(7, 2).is_err());
    }
}
