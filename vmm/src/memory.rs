//! The VM's memory: guest RAM (memfds from the server, or anonymous in
//! standalone mode) plus the VMM-private region, as one vm-memory
//! `GuestMemoryMmap`.
//!
//! Guest RAM is never written at set-up; only the private region is. Reads
//! of guest RAM by the VMM (digest, the block device's buffers) go through
//! the same mapping KVM uses, so they fault through the userfaultfd.

use proto::vmm::RequestError;
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
}

/// [`PAGE_SIZE`] as a buffer length.
const PAGE_BYTES: usize = 4096;
const _: () = assert!(PAGE_BYTES as u64 == PAGE_SIZE);

fn usize_of(n: u64) -> Result<usize> {
    usize::try_from(n).map_err(|_| MemoryError::Size(n))
}

impl GuestRam {
    /// Map the server's memfds, one per region, MAP_SHARED.
    pub fn from_memfds(regions: &[GuestRegion], fds: Vec<OwnedFd>) -> Result<Self> {
        if fds.len() != regions.len() {
            return Err(MemoryError::FdCount {
                want: regions.len(),
                got: fds.len(),
            });
        }
        let mut maps = Vec::with_capacity(regions.len());
        for (r, fd) in regions.iter().zip(fds) {
            let map = MmapRegion::from_file(FileOffset::new(File::from(fd), 0), usize_of(r.size)?)
                .map_err(|source| MemoryError::MapRegion {
                    guest_phys: r.guest_phys,
                    source,
                })?;
            maps.push(map);
        }
        Self::build(regions, maps)
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
