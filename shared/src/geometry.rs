//! Page geometry of guest RAM.

use serde::{Deserialize, Serialize};

/// Base page size of guest RAM served by pagefork.
pub const PAGE_SIZE: u64 = 4096;
/// log2 of [`PAGE_SIZE`].
pub const PAGE_SHIFT: u32 = 12;

/// One contiguous region of guest-physical memory backed by one memfd.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestRegion {
    /// Guest-physical address of the first byte.
    pub guest_phys: u64,
    /// Size in bytes, a multiple of [`PAGE_SIZE`].
    pub size: u64,
}

impl GuestRegion {
    /// Number of pages in the region.
    pub fn pages(&self) -> u64 {
        self.size >> PAGE_SHIFT
    }

    /// Whether `[start_page, start_page + pages)` lies inside the region,
    /// counted in pages from the region's start.
    pub fn contains_pages(&self, start_page: u64, pages: u64) -> bool {
        start_page
            .checked_add(pages)
            .is_some_and(|end| end <= self.pages())
    }
}

// pagefork runs on 64-bit hosts only (x86-64 KVM): a u64 byte count or
// page offset always fits a usize there.
const _: () = assert!(usize::BITS == 64);

/// A u64 size or offset as a usize (lossless on the 64-bit hosts pagefork
/// supports; checked at compile time above).
#[inline]
#[allow(clippy::cast_possible_truncation)]
pub const fn usize_of(v: u64) -> usize {
    v as usize
}

/// Bytes to whole pages, rounding up.
pub fn pages_for(bytes: u64) -> u64 {
    bytes.div_ceil(PAGE_SIZE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contains_pages_rejects_overflow_and_overrun() {
        let r = GuestRegion {
            guest_phys: 0,
            size: 16 * PAGE_SIZE,
        };
        assert!(r.contains_pages(0, 16));
        assert!(r.contains_pages(15, 1));
        assert!(!r.contains_pages(15, 2));
        assert!(!r.contains_pages(u64::MAX, 2));
        assert_eq!(pages_for(1), 1);
        assert_eq!(pages_for(PAGE_SIZE), 1);
    }
}
