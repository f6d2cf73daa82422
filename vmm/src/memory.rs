//! The VM's memory: guest RAM (memfds from the server, or anonymous in
//! standalone mode) plus the VMM-private region, as one vm-memory
//! `GuestMemoryMmap`.
//!
//! Guest RAM is never written at set-up; only the private region is. Reads
//! of guest RAM by the VMM (digest, the block device's buffers) go through
//! the same mapping KVM uses, so they fault through the userfaultfd.

use proto::vmm::{MemoryKind, RequestError};
use std::fs::File;
use std::os::fd::OwnedFd;

use shared::{pattern, GuestRegion, PAGE_SIZE};
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap, MmapRegion,
};

use crate::layout::{self, PRIV_BASE, PRIV_SIZE};

/// Errors of building or accessing guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error(transparent)]
    Layout(#[from] layout::LayoutError),
    #[error("the server sent {got} memory fds for {want} regions")]
    FdCount { want: usize, got: usize },
    #[error("cannot map guest RAM region at {guest_phys:#x}")]
    MapRegion {
        guest_phys: u64,
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    #[error("guest memory regions are invalid")]
    Collect(#[source] vm_memory::GuestRegionCollectionError),
    #[error("region size {0:#x} does not fit this host's address space")]
    Size(u64),
    #[error(
        "pages {start}..{end} are outside guest RAM ({ram_pages} pages ending at page {ram_end_page})"
    )]
    PagesOutsideRam {
        start: u64,
        end: u64,
        ram_pages: u64,
        ram_end_page: u64,
    },
    #[error("cannot access guest memory at {addr:#x}")]
    Access {
        addr: u64,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, MemoryError>;

/// Guest RAM and the private region.
#[derive(Debug)]
pub struct GuestRam {
    /// All regions: guest RAM in order, then the private region.
    pub mem: GuestMemoryMmap,
    /// The guest RAM regions (without the private region).
    pub regions: Vec<GuestRegion>,
    /// How the first region came to be mapped.
    pub mapping: RamMapping,
}

/// How guest RAM came to be mapped (logged once the guest runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RamMapping {
    /// The memfd made ahead for this pooled VMM, mapped before the
    /// Welcome under its ready KVM slot.
    Ahead,
    /// Mapped at the Welcome over the reservation under its ready slot.
    OverReservation,
    /// Mapped at the Welcome (or anonymous), its slot set then.
    AtStart,
}

/// Address space kept for guest RAM of one size before the RAM arrives.
///
/// A pooled VMM sets KVM's memory slot for guest RAM over it while it
/// waits (see the `--ram-hint-mib` argument): for 256 MiB, KVM takes
/// 0.15–0.3 ms to set up a slot on this kind of host, sometimes several
/// ms, and 1 GiB takes four times as long.
///
/// With the memfd the server made ahead for this VMM (`--ram-fd`), the
/// reservation is that memfd, mapped before the slot is set
/// ([`Reserved::with_file`]); a Welcome that brings the same file finds
/// guest RAM mapped and its slot set ([`GuestRam::from_memfds`]). Any
/// other RAM of this size is mapped over the reservation (MAP_FIXED):
/// replacing a mapping under a KVM slot costs KVM a walk of the whole slot
/// (0.13–0.18 ms for 256 MiB here), which is what the server's memfd
/// saves. Without a file, the reservation is address space only, with no
/// access and no memory behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    /// Where it starts (2 MiB-aligned, so hugetlb memory fits it).
    pub host: u64,
    /// Its length in bytes.
    pub size: u64,
    /// The memfd mapped in it, if any: its device and inode.
    pub file: Option<(u64, u64)>,
}

impl Reserved {
    /// Reserve `size` bytes of address space.
    pub fn new(size: u64) -> std::io::Result<Self> {
        use nix::sys::mman::{mmap_anonymous, munmap, MapFlags, ProtFlags};
        let align = layout::TWO_MIB;
        let len = size
            .checked_add(align)
            .and_then(|n| usize::try_from(n).ok())
            .and_then(std::num::NonZeroUsize::new)
            .ok_or_else(|| std::io::Error::other("reservation size"))?;
        // SAFETY: a new anonymous mapping with no access replaces nothing.
        let base = unsafe {
            mmap_anonymous(
                None,
                len,
                ProtFlags::PROT_NONE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE,
            )
        }?;
        let start = base.as_ptr() as u64;
        let host = start.next_multiple_of(align);
        // Give back the slack before and after the aligned part.
        let trim = |at: u64, n: u64| -> std::io::Result<()> {
            if let (Some(p), true) = (std::ptr::NonNull::new(at as *mut libc::c_void), n > 0) {
                // SAFETY: `at..at + n` is part of the mapping just made,
                // outside the part kept.
                unsafe { munmap(p, usize::try_from(n).unwrap_or(0)) }?;
            }
            Ok(())
        };
        trim(start, host - start)?;
        trim(host + size, start + size + align - (host + size))?;
        Ok(Self {
            host,
            size,
            file: None,
        })
    }

    /// Reserve room for `file` (all of it) and map it there, shared: the
    /// guest RAM the server made ahead for this VMM.
    pub fn with_file(file: &File) -> std::io::Result<Self> {
        let meta = file.metadata()?;
        let mut r = Self::new(meta.len())?;
        let size = usize::try_from(r.size).map_err(std::io::Error::other)?;
        let file_offset = FileOffset::new(file.try_clone()?, 0);
        // The region handle is not kept: the mapping lives as long as the
        // process (guest memory is never unmapped), and the Welcome builds
        // guest memory over it again.
        map_fixed(file_offset, size, r.host, MemoryKind::Own).map_err(std::io::Error::other)?;
        r.file = Some(file_id(&meta));
        Ok(r)
    }

    /// Give the address space back.
    ///
    /// # Safety
    /// Nothing may use the reservation any more (no KVM slot over it).
    pub unsafe fn release(self) {
        if let Some(p) = std::ptr::NonNull::new(self.host as *mut libc::c_void) {
            // SAFETY: the caller guarantees nothing uses it.
            let _ = unsafe { nix::sys::mman::munmap(p, usize::try_from(self.size).unwrap_or(0)) };
        }
    }

    /// Whether guest RAM `r` goes in this reservation.
    pub fn fits(&self, r: &GuestRegion) -> bool {
        r.guest_phys == 0 && r.size == self.size
    }
}

/// [`PAGE_SIZE`] as a buffer length.
const PAGE_BYTES: usize = 4096;
const _: () = assert!(PAGE_BYTES as u64 == PAGE_SIZE);

fn usize_of(n: u64) -> Result<usize> {
    usize::try_from(n).map_err(|_| MemoryError::Size(n))
}

/// A file's identity: its device and inode.
fn file_id(meta: &std::fs::Metadata) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    (meta.dev(), meta.ino())
}

/// Guest memory over the mapping of `file` that is already at `host` (see
/// [`Reserved::with_file`]).
fn mapped_at(
    file: FileOffset,
    size: usize,
    host: u64,
) -> std::result::Result<MmapRegion, vm_memory::mmap::MmapRegionError> {
    use nix::sys::mman::{MapFlags, ProtFlags};
    let prot = ProtFlags::PROT_READ | ProtFlags::PROT_WRITE;
    // SAFETY: `host..host + size` maps this same file (device and inode
    // checked by the caller) shared, read-write, for the life of the
    // process.
    unsafe {
        vm_memory::mmap::MmapRegionBuilder::new(size)
            .with_raw_mmap_pointer(host as *mut u8)
            .with_file_offset(file)
            .with_mmap_prot(prot.bits())
            .with_mmap_flags(MapFlags::MAP_SHARED.bits())
            .build()
    }
}

/// The mmap flags of guest RAM of `kind`: a base is mapped private, so the
/// guest's writes stay in this process, and without a reservation of
/// memory for them (hugetlb would otherwise set aside the whole size for
/// every VM on a base).
fn ram_flags(kind: MemoryKind) -> nix::sys::mman::MapFlags {
    use nix::sys::mman::MapFlags;
    match kind {
        MemoryKind::Own => MapFlags::MAP_SHARED,
        MemoryKind::Base => MapFlags::MAP_PRIVATE | MapFlags::MAP_NORESERVE,
    }
}

/// Map `file` as guest RAM of `kind` over `size` bytes of address space
/// at `host` (a reservation, or guest RAM being rebased).
fn map_fixed(
    file: FileOffset,
    size: usize,
    host: u64,
    kind: MemoryKind,
) -> std::result::Result<MmapRegion, vm_memory::mmap::MmapRegionError> {
    use nix::sys::mman::{mmap, MapFlags, ProtFlags};
    use vm_memory::mmap::MmapRegionError;
    let len = std::num::NonZeroUsize::new(size).ok_or(MmapRegionError::InvalidPointer)?;
    let file_len = file.file().metadata().map_err(MmapRegionError::Mmap)?.len();
    if file_len < size as u64 {
        return Err(MmapRegionError::MappingPastEof);
    }
    let prot = ProtFlags::PROT_READ | ProtFlags::PROT_WRITE;
    let flags = ram_flags(kind) | MapFlags::MAP_FIXED;
    // SAFETY: MAP_FIXED replaces only the reservation made for this RAM,
    // or guest RAM itself while its vCPUs are paused (a rebase), which
    // nothing else maps or uses.
    let at = unsafe {
        mmap(
            std::num::NonZeroUsize::new(usize::try_from(host).unwrap_or(0)),
            len,
            prot,
            flags,
            file.file(),
            0,
        )
    }
    .map_err(|e| MmapRegionError::Mmap(e.into()))?;
    // SAFETY: `at..at + size` was just mapped with these flags, and stays
    // mapped for the life of the process (the region does not own it, and
    // guest memory is never unmapped).
    unsafe {
        vm_memory::mmap::MmapRegionBuilder::new(size)
            .with_raw_mmap_pointer(at.as_ptr().cast())
            .with_file_offset(file)
            .with_mmap_prot(prot.bits())
            .with_mmap_flags(flags.bits())
            .build()
    }
}

impl GuestRam {
    /// Map the server's memfds, one per region: shared when they are the
    /// VM's own RAM, private over them when they are bases (`kind`).
    /// A region that fits `reserved` is mapped over it (MAP_FIXED).
    pub fn from_memfds(
        regions: &[GuestRegion],
        fds: Vec<OwnedFd>,
        reserved: Option<Reserved>,
        kind: MemoryKind,
    ) -> Result<Self> {
        if fds.len() != regions.len() {
            return Err(MemoryError::FdCount {
                want: regions.len(),
                got: fds.len(),
            });
        }
        let mut maps = Vec::with_capacity(regions.len());
        let mut mapping = RamMapping::AtStart;
        for (r, fd) in regions.iter().zip(fds) {
            let file = FileOffset::new(File::from(fd), 0);
            let size = usize_of(r.size)?;
            let same_file = |res: &Reserved| {
                res.file.is_some() && res.file == file.file().metadata().ok().map(|m| file_id(&m))
            };
            let map = match reserved.filter(|res| res.fits(r)) {
                // The memfd made ahead is mapped shared: only the VM's own
                // RAM can use that mapping as it is.
                Some(res) if kind == MemoryKind::Own && same_file(&res) => {
                    mapping = RamMapping::Ahead;
                    mapped_at(file, size, res.host)
                }
                Some(res) => {
                    mapping = RamMapping::OverReservation;
                    map_fixed(file, size, res.host, kind)
                }
                // No reservation of memory behind the mapping (as
                // `MmapRegion::from_file` maps): hugetlb guest RAM larger
                // than the free pool maps, and a block the pool cannot give
                // fails when it is installed, not at the start.
                None => MmapRegion::build(
                    Some(file),
                    size,
                    libc::PROT_READ | libc::PROT_WRITE,
                    (ram_flags(kind) | nix::sys::mman::MapFlags::MAP_NORESERVE).bits(),
                ),
            }
            .map_err(|source| MemoryError::MapRegion {
                guest_phys: r.guest_phys,
                source,
            })?;
            maps.push(map);
        }
        let mut ram = Self::build(regions, maps)?;
        ram.mapping = mapping;
        Ok(ram)
    }

    /// Map guest RAM private over `fds` (one base per region) in place of
    /// what it maps now (`Request::Rebase`): every page mapped before, the
    /// guest's private ones included, is gone from this process. The
    /// vCPUs must be paused; the KVM slots keep their host addresses and
    /// follow the new mapping. The caller registers the new mapping with
    /// the userfaultfd before anything touches it.
    pub fn rebase(&self, fds: Vec<OwnedFd>) -> Result<()> {
        let ranges = self.ram_host_ranges();
        if fds.len() != ranges.len() {
            return Err(MemoryError::FdCount {
                want: ranges.len(),
                got: fds.len(),
            });
        }
        for ((r, (host, len)), fd) in self.regions.iter().zip(ranges).zip(fds) {
            let file = FileOffset::new(File::from(fd), 0);
            // The region handle is not kept: the mapping replaces the one
            // the guest memory object was built over, at the same address.
            map_fixed(file, len, host as u64, MemoryKind::Base).map_err(|source| {
                MemoryError::MapRegion {
                    guest_phys: r.guest_phys,
                    source,
                }
            })?;
        }
        Ok(())
    }

    /// Anonymous guest RAM (standalone mode).
    pub fn anonymous(regions: &[GuestRegion]) -> Result<Self> {
        let mut maps = Vec::with_capacity(regions.len());
        for r in regions {
            let map =
                MmapRegion::new(usize_of(r.size)?).map_err(|source| MemoryError::MapRegion {
                    guest_phys: r.guest_phys,
                    source,
                })?;
            maps.push(map);
        }
        Self::build(regions, maps)
    }

    fn build(regions: &[GuestRegion], maps: Vec<MmapRegion>) -> Result<Self> {
        layout::ram_end(regions)?;
        let mut all = Vec::with_capacity(maps.len() + 1);
        for (r, map) in regions.iter().zip(maps) {
            all.push(
                GuestRegionMmap::new(map, GuestAddress(r.guest_phys))
                    .ok_or(MemoryError::Size(r.size))?,
            );
        }
        let private = crate::fixed::take_region().map_err(|source| MemoryError::MapRegion {
            guest_phys: PRIV_BASE,
            source,
        })?;
        all.push(
            GuestRegionMmap::new(private, GuestAddress(PRIV_BASE))
                .ok_or(MemoryError::Size(PRIV_SIZE))?,
        );
        let mem = GuestMemoryMmap::from_regions(all).map_err(MemoryError::Collect)?;
        Ok(GuestRam {
            mem,
            regions: regions.to_vec(),
            mapping: RamMapping::AtStart,
        })
    }

    /// Whether the first guest RAM region is mapped over `r`.
    pub fn uses(&self, r: &Reserved) -> bool {
        self.mem.iter().next().is_some_and(|m| {
            m.start_addr().0 == 0 && m.as_ptr() as u64 == r.host && m.len() == r.size
        })
    }

    /// Host address and length of every guest RAM region, in order.
    pub fn ram_host_ranges(&self) -> Vec<(*mut u8, usize)> {
        self.mem
            .iter()
            .take(self.regions.len())
            .map(|r| (r.as_ptr(), r.size()))
            .collect()
    }

    /// KVM slot description of every region: (guest address, size, host address).
    pub fn slots(&self) -> Vec<(u64, u64, u64)> {
        self.mem
            .iter()
            .map(|r| (r.start_addr().0, r.len(), r.as_ptr() as u64))
            .collect()
    }

    /// Where guest RAM ends.
    pub fn ram_end(&self) -> u64 {
        self.regions.last().map_or(0, |r| r.guest_phys + r.size)
    }

    /// Check that pages `[start, start + pages)` lie inside one RAM region.
    pub fn check_pages(&self, start: u64, pages: u64) -> std::result::Result<(), RequestError> {
        let ok = self.regions.iter().any(|r| {
            let first = r.guest_phys / PAGE_SIZE;
            start >= first && r.contains_pages(start - first, pages)
        });
        if ok {
            Ok(())
        } else {
            let outside = MemoryError::PagesOutsideRam {
                start,
                end: start.saturating_add(pages),
                ram_pages: self.regions.iter().map(GuestRegion::pages).sum::<u64>(),
                ram_end_page: self.ram_end() / PAGE_SIZE,
            };
            Err(RequestError::InvalidOp(outside.to_string()))
        }
    }

    /// Whether `[addr, addr + len)` lies inside one guest RAM region.
    pub fn is_ram(&self, addr: u64, len: usize) -> bool {
        let len = len as u64;
        self.regions.iter().any(|r| {
            addr >= r.guest_phys
                && addr
                    .checked_add(len)
                    .is_some_and(|end| end <= r.guest_phys + r.size)
        })
    }

    /// Write bytes at a guest-physical address (private region set-up).
    pub fn write(&self, addr: u64, bytes: &[u8]) -> Result<()> {
        self.mem
            .write_slice(bytes, GuestAddress(addr))
            .map_err(|source| MemoryError::Access { addr, source })
    }

    /// Read bytes at a guest-physical address.
    pub fn read(&self, addr: u64, bytes: &mut [u8]) -> Result<()> {
        self.mem
            .read_slice(bytes, GuestAddress(addr))
            .map_err(|source| MemoryError::Access { addr, source })
    }

    /// Read a little-endian u64.
    pub fn read_u64(&self, addr: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Write a little-endian u64.
    pub fn write_u64(&self, addr: u64, value: u64) -> Result<()> {
        self.write(addr, &value.to_le_bytes())
    }

    /// [`pattern::digest`] of pages `[start, start + pages)`, read through
    /// the VMM's mapping (which faults through the userfaultfd).
    pub fn digest(&self, start: u64, pages: u64) -> Result<u64> {
        let mut page = vec![0u8; PAGE_BYTES];
        let mut h = 0;
        for p in start..start.saturating_add(pages) {
            self.read(p * PAGE_SIZE, &mut page)?;
            h = pattern::digest_page(h, &page);
        }
        Ok(h)
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;

    fn ram(pages: u64) -> GuestRam {
        GuestRam::anonymous(&[GuestRegion {
            guest_phys: 0,
            size: pages * PAGE_SIZE,
        }])
        .unwrap()
    }

    #[test]
    fn digest_matches_reference_over_the_mapping() {
        let ram = ram(8);
        let mut image = vec![0u8; 8 * PAGE_SIZE as usize];
        for p in [1u64, 5] {
            let b = (p * PAGE_SIZE) as usize;
            pattern::fill_page(&mut image[b..b + PAGE_SIZE as usize], p, 3);
        }
        ram.write(0, &image).unwrap();
        assert_eq!(ram.digest(0, 8).unwrap(), pattern::digest(&image, 0, 0, 8));
        assert_eq!(ram.digest(2, 4).unwrap(), pattern::digest(&image, 0, 2, 4));
    }

    #[test]
    fn check_pages_rejects_ranges_outside_ram() {
        let ram = ram(16);
        assert!(ram.check_pages(0, 16).is_ok());
        assert!(ram.check_pages(15, 2).is_err());
        assert!(ram.check_pages(u64::MAX, 2).is_err());
    }
}
