//! Guest RAM owned by the server: one memfd per VM, mapped MAP_SHARED into
//! the server (a vm-memory `MmapRegion`, as the VMM maps it) so it can fill
//! pages before waking a faulting vCPU, and read a page to hand it to
//! another VM.
//!
//! Invariant: bytes are only written into this mapping for pages the table
//! does not yet mark as present (`Vm(self)`), or by an explicit copy-on-write
//! step; a page present in the memfd never faults again in the VMM.
//!
//! Guest RAM is either 4 KiB shmem or 2 MiB hugetlb ([`PageSize`]). On
//! hugetlb the kernel's unit is the 2 MiB block: it is installed, write-
//! protected, copied and dropped whole, so the server keeps every block
//! wholly present or wholly absent (the page-source table keeps its 4 KiB
//! entries; see `docs/architecture.md`). Two kernel facts shape the code:
//! - a store through the server's mapping into an absent hugetlb block
//!   allocates it, and with no free huge page that store is a SIGBUS: the
//!   server allocates a block with `fallocate` first (which fails with
//!   ENOSPC instead) before writing into it ([`GuestMemory::write_block`]);
//! - SEEK_DATA/SEEK_HOLE see a hugetlb file as all data, so the kernel
//!   cannot say which blocks are present ([`GuestMemory::present_ranges`]
//!   answers `None`; the table is the record).

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
    #[error("{0} is not a multiple of the {1}-byte page size")]
    Unaligned(u64, u64),
    #[error("cannot allocate a huge page (are enough reserved in /proc/sys/vm/nr_hugepages?)")]
    Allocate(#[source] nix::Error),
    #[error("cannot read guest memory")]
    Read(#[source] std::io::Error),
    #[error("cannot write guest memory")]
    Write(#[source] std::io::Error),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, MemoryError>;

/// The page size guest RAM is backed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PageSize {
    /// 4 KiB shmem pages.
    #[default]
    Small,
    /// 2 MiB hugetlb pages (`MFD_HUGETLB | MFD_HUGE_2MB`).
    Huge2M,
}

/// Bytes of one hugetlb block.
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;

impl PageSize {
    /// `Huge2M` when `huge`.
    pub fn huge(huge: bool) -> Self {
        if huge {
            PageSize::Huge2M
        } else {
            PageSize::Small
        }
    }

    /// Bytes of one kernel page.
    pub fn bytes(self) -> u64 {
        match self {
            PageSize::Small => PAGE_SIZE,
            PageSize::Huge2M => HUGE_PAGE_SIZE,
        }
    }

    /// 4 KiB pages per kernel page (1 or 512).
    pub fn unit_pages(self) -> u64 {
        self.bytes() / PAGE_SIZE
    }
}

/// A file's device and inode number: which file it is, among those alive.
pub type FileId = (u64, u64);

/// A VM's guest RAM: a memfd and the server's shared mapping of it.
#[derive(Debug)]
pub struct GuestMemory {
    /// The memfd; the mapping shares this one fd (no duplicate).
    memfd: Arc<File>,
    /// MAP_SHARED, read-write, unmapped on drop. `from_file` adds
    /// MAP_NORESERVE, which changes nothing for a shared shmem mapping and
    /// keeps a hugetlb mapping from reserving huge pages for all of guest
    /// RAM up front (blocks are taken as they are installed).
    map: MmapRegion,
    size: u64,
    page_size: PageSize,
    /// The memfd's name.
    name: String,
    /// The memfd's file: device and inode number, unique among the
    /// files alive (an inode number alone is not: hugetlbfs and shmem
    /// number their inodes each on their own).
    file_id: FileId,
}

impl GuestMemory {
    /// Create a 4 KiB-page memfd of `size` bytes named `name` and map it.
    pub fn create(name: &str, size: u64) -> Result<Self> {
        Self::create_with(name, size, PageSize::Small)
    }

    /// Create a memfd of `size` bytes (a multiple of `page_size`) named
    /// `name`, backed by `page_size` pages, and map it.
    pub fn create_with(name: &str, size: u64, page_size: PageSize) -> Result<Self> {
        if !size.is_multiple_of(page_size.bytes()) {
            return Err(MemoryError::Unaligned(size, page_size.bytes()));
        }
        let mut opts = memfd::MemfdOptions::default().close_on_exec(true);
        if page_size == PageSize::Huge2M {
            opts = opts.hugetlb(Some(memfd::HugetlbSize::Huge2MB));
        }
        let mfd = opts.create(name).map_err(MemoryError::CreateMemfd)?;
        let memfd = mfd.into_file();
        memfd
            .set_len(size)
            .map_err(|e| MemoryError::SizeMemfd(size, e))?;
        Self::map(memfd, size, name, page_size)
    }

    /// Map `memfd` (made by a server before this one and handed back by
    /// the fd store), of `page_size` pages, named `name`.
    pub fn adopt(memfd: File, name: &str, page_size: PageSize) -> Result<Self> {
        let size = memfd
            .metadata()
            .map_err(|e| MemoryError::SizeMemfd(0, e))?
            .len();
        Self::map(memfd, size, name, page_size)
    }

    /// Map `memfd`, already `size` bytes long, into the server: the one
    /// step every way of making guest memory ends with.
    fn map(memfd: File, size: u64, name: &str, page_size: PageSize) -> Result<Self> {
        let memfd = Arc::new(memfd);
        let len = usize::try_from(size)
            .ok()
            .filter(|l| *l > 0)
            .ok_or(MemoryError::SizeMemfd(
                size,
                std::io::Error::from_raw_os_error(libc::EINVAL),
            ))?;
        let map = MmapRegion::from_file(FileOffset::from_arc(Arc::clone(&memfd), 0), len)
            .map_err(MemoryError::Map)?;
        let meta = memfd
            .metadata()
            .map_err(|e| MemoryError::SizeMemfd(size, e))?;
        let file_id = (
            std::os::unix::fs::MetadataExt::dev(&meta),
            std::os::unix::fs::MetadataExt::ino(&meta),
        );
        Ok(GuestMemory {
            memfd,
            map,
            size,
            page_size,
            name: name.to_owned(),
            file_id,
        })
    }

    /// The memfd's device and inode number, unique among the files alive
    /// (a hugetlb memfd and a shmem one can have the same inode number).
    pub fn file_id(&self) -> FileId {
        self.file_id
    }

    /// The memfd's name, as `/proc/<pid>/fd` and `maps` show it
    /// (`/memfd:NAME (deleted)`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The page size backing this memory.
    pub fn page_size(&self) -> PageSize {
        self.page_size
    }

    /// 4 KiB pages per kernel page: the unit every install, protection
    /// change and drop works in (1, or 512 on hugetlb).
    pub fn unit_pages(&self) -> u64 {
        self.page_size.unit_pages()
    }

    /// `[lo, hi)` widened to whole kernel pages.
    pub fn unit_range(&self, lo: u64, hi: u64) -> (u64, u64) {
        let u = self.unit_pages();
        (lo / u * u, hi.div_ceil(u) * u)
    }

    /// Write `bytes` into `[page, page + bytes/4 KiB)` through the server's
    /// mapping, for memory no VMM is running on (see
    /// [`Self::copy_page_from`]). On hugetlb the range is whole blocks and
    /// they are allocated with `fallocate` first, so running out of huge
    /// pages is an error here instead of a SIGBUS in the store.
    pub fn write_block(&self, page: u64, bytes: &[u8]) -> Result<()> {
        let pages = bytes.len() as u64 / PAGE_SIZE;
        let dst = self.slice(page, pages)?;
        if self.page_size == PageSize::Huge2M {
            self.allocate(page, pages)?;
        }
        dst.copy_from(bytes);
        Ok(())
    }

    /// The bytes of `[page, page + pages)` in the server's mapping, to be
    /// written: on hugetlb (whole blocks) they are allocated first, as in
    /// [`Self::write_block`].
    pub fn allocated_slice(&self, page: u64, pages: u64) -> Result<VolatileSlice<'_>> {
        let dst = self.slice(page, pages)?;
        if self.page_size == PageSize::Huge2M {
            self.allocate(page, pages)?;
        }
        Ok(dst)
    }

    /// Allocate `[page, page + pages)` (whole blocks on hugetlb).
    fn allocate(&self, page: u64, pages: u64) -> Result<()> {
        let (lo, hi) = self.unit_range(page, page + pages);
        if (lo, hi) != (page, page + pages) {
            return Err(MemoryError::Unaligned(
                page * PAGE_SIZE,
                self.page_size.bytes(),
            ));
        }
        let off = libc::off_t::try_from(page * PAGE_SIZE).unwrap_or(libc::off_t::MAX);
        let len = libc::off_t::try_from(pages * PAGE_SIZE).unwrap_or(libc::off_t::MAX);
        fallocate(
            self.memfd.as_fd().as_raw_fd(),
            FallocateFlags::FALLOC_FL_KEEP_SIZE,
            off,
            len,
        )
        .map_err(MemoryError::Allocate)
    }

    /// The memfd (to send to the VMM).
    pub fn memfd(&self) -> &File {
        &self.memfd
    }

    /// The memfd, shared (for a thread of its own to map).
    pub fn shared_memfd(&self) -> Arc<File> {
        Arc::clone(&self.memfd)
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
        debug_assert_eq!(
            self.page_size,
            PageSize::Small,
            "hugetlb copies whole blocks"
        );
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

    /// Read the pages from `page` into `out` (whole pages) with pread on
    /// the memfd, not through the server's mapping: the server then maps
    /// no page it only reads, so a later hole punch (a rollback) has one
    /// mapping fewer to clear, and a hole reads as zeroes without being
    /// allocated.
    pub fn read_pages_at(&self, page: u64, out: &mut [u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.slice(page, out.len() as u64 / PAGE_SIZE)?;
        self.memfd
            .read_exact_at(out, page * PAGE_SIZE)
            .map_err(MemoryError::Read)
    }

    /// Drop `[page, page+pages)` from the memfd: the pages become holes and
    /// fault again on next access. On hugetlb the range is widened to whole
    /// blocks (which the server keeps whole anyway).
    pub fn punch_hole(&self, page: u64, pages: u64) -> Result<()> {
        self.slice(page, pages)?;
        let (page, end) = self.unit_range(page, page + pages);
        let pages = end - page;
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
    /// kernel's own view, independent of the table); `None` on hugetlb,
    /// where the kernel reports every offset as data.
    pub fn present_ranges(&self) -> Option<Vec<(u64, u64)>> {
        if self.page_size == PageSize::Huge2M {
            return None;
        }
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
        Some(out)
    }

    /// Whether `page` is present in the memfd; `None` on hugetlb (see
    /// [`Self::present_ranges`]).
    pub fn is_present(&self, page: u64) -> Option<bool> {
        if self.page_size == PageSize::Huge2M {
            return None;
        }
        let fd = self.memfd.as_raw_fd();
        let off = libc::off_t::try_from(page * PAGE_SIZE).unwrap_or(libc::off_t::MAX);
        // SAFETY: lseek on our own fd has no memory effects.
        let data = unsafe { libc::lseek(fd, off, libc::SEEK_DATA) };
        Some(data >= 0 && data < off + libc::off_t::try_from(PAGE_SIZE).unwrap_or(4096))
    }

    /// Bytes the memfd has allocated (st_blocks * 512).
    pub fn allocated_bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.memfd.metadata().map(|m| m.blocks() * 512).unwrap_or(0)
    }
}

/// Whether the host has no 2 MiB huge page left to give guest RAM: free
/// pages minus those reserved for other mappings (guest RAM is mapped
/// without a reservation).
///
/// Needed because, on hugetlb memory, a UFFDIO_COPY the kernel cannot
/// allocate a page for fails with EEXIST, not ENOMEM, once the block's
/// page table exists (measured on this kernel): taken for "already
/// there", the block would be marked present and its fault woken forever.
pub fn hugepages_exhausted() -> bool {
    let read = |what: &str| {
        std::fs::read_to_string(format!("/sys/kernel/mm/hugepages/hugepages-2048kB/{what}"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    match (read("free_hugepages"), read("resv_hugepages")) {
        (Some(free), Some(resv)) => free <= resv,
        _ => false,
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
        assert_eq!(m.present_ranges(), Some(vec![(1, 3)]));
        let mut buf = vec![0u8; PAGE];
        m.read_page(3, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 0xab));
        m.read_page(4, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 0));
        let other = GuestMemory::create("u", 8 * PAGE_SIZE).unwrap();
        other.copy_page_from(&m, 2).unwrap();
        other.read_page(2, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 0xab));
        assert!(other.is_present(2) == Some(true) && other.is_present(3) == Some(false));
        m.punch_hole(1, 4).unwrap();
        assert_eq!(m.allocated_bytes(), 0);
        assert!(m.slice(7, 2).is_err());
        assert!(m.punch_hole(7, 2).is_err());
    }

    /// Free 2 MiB huge pages (`HugePages_Free`).
    fn free_hugepages() -> u64 {
        std::fs::read_to_string("/proc/meminfo")
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("HugePages_Free:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    #[test]
    fn hugetlb_blocks_are_allocated_written_and_dropped_whole() {
        if free_hugepages() < 2 {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI=true but no huge pages are free (scripts/setup.sh reserves them)"
            );
            eprintln!("skipping: no free 2 MiB huge pages");
            return;
        }
        let unit = PageSize::Huge2M.unit_pages();
        assert!(matches!(
            GuestMemory::create_with("h", 3 << 20, PageSize::Huge2M),
            Err(MemoryError::Unaligned(..))
        ));
        let m = GuestMemory::create_with("h", 4 << 20, PageSize::Huge2M).unwrap();
        assert_eq!(
            (m.unit_pages(), m.present_ranges(), m.is_present(0)),
            (512, None, None)
        );
        assert_eq!(m.unit_range(513, 514), (512, 1024));
        let block = vec![0x5au8; 2 << 20];
        // Not a whole block: refused before anything is allocated.
        assert!(m.write_block(1, &block[..PAGE]).is_err());
        assert_eq!(m.allocated_bytes(), 0);
        m.write_block(unit, &block).unwrap();
        assert_eq!(m.allocated_bytes(), 2 << 20);
        let mut buf = vec![0u8; PAGE];
        m.read_page(unit + 511, &mut buf).unwrap();
        assert!(buf.iter().all(|b| *b == 0x5a));
        // Dropping one page drops its block.
        m.punch_hole(unit + 3, 1).unwrap();
        assert_eq!(m.allocated_bytes(), 0);
    }
}
