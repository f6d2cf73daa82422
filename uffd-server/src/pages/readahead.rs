//! How much of an image to install around a fault: the fault-around block
//! and the readahead window that grows for sequential readers.
//!
//! A fault on an image page installs the run of image pages around it in
//! its aligned fault-around block. A fault right where the last install
//! ended is a sequential reader: its window doubles each time, up to the
//! readahead limit, as the page cache does. Both kinds of VM (ours and
//! Firecracker's) use these types through [`super::resolve`].

use shared::PAGE_SIZE;

/// Largest fault-around block in KiB (4 MiB, 1024 pages): a bigger block
/// would make a single fault copy more than a 2 MiB huge page's worth twice
/// over while holding the core thread; sequential readers get larger runs
/// through readahead instead.
pub const MAX_FAULT_AROUND_KIB: u64 = 4096;

/// A validated fault-around block: how many pages a fault on an image
/// installs at most (1 = off, only the faulting page).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultAround {
    pages: u64,
}

/// Why a fault-around size was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FaultAroundError {
    #[error(
        "must be 0 (off) or a power-of-two multiple of 4 up to {MAX_FAULT_AROUND_KIB}; \
         {0} is not a power-of-two number of 4 KiB pages"
    )]
    NotPowerOfTwoPages(u64),
    #[error(
        "must be 0 (off) or a power-of-two multiple of 4 up to {MAX_FAULT_AROUND_KIB}; \
         {0} is too large"
    )]
    TooLarge(u64),
}

impl FaultAround {
    /// Fault-around off: one page per fault.
    pub const OFF: FaultAround = FaultAround { pages: 1 };

    /// The one validation of a fault-around size in KiB: 0 turns it off,
    /// anything else must be a power-of-two multiple of 4 KiB up to
    /// [`MAX_FAULT_AROUND_KIB`].
    pub fn from_kib(kib: u64) -> Result<FaultAround, FaultAroundError> {
        let page_kib = PAGE_SIZE / 1024;
        if kib == 0 {
            return Ok(FaultAround::OFF);
        }
        if !kib.is_multiple_of(page_kib) || !(kib / page_kib).is_power_of_two() {
            return Err(FaultAroundError::NotPowerOfTwoPages(kib));
        }
        if kib > MAX_FAULT_AROUND_KIB {
            return Err(FaultAroundError::TooLarge(kib));
        }
        Ok(FaultAround {
            pages: kib / page_kib,
        })
    }

    /// The block in pages (at least 1).
    pub fn pages(self) -> u64 {
        self.pages
    }
}

/// Sequential-fault detection for image-backed pages.
#[derive(Debug, Clone, Copy, Default)]
pub struct Readahead {
    /// The page right after the last install.
    pub next: u64,
    /// The last install's window in pages.
    pub window: u64,
    /// Largest window in pages (at most the fault-around block disables it).
    pub max_pages: u64,
}

impl Readahead {
    /// No install seen yet; windows grow up to `max_pages`.
    pub fn new(max_pages: u64) -> Readahead {
        Readahead {
            next: u64::MAX,
            window: 0,
            max_pages,
        }
    }

    /// The window for a fault at `page` with fault-around `block` pages,
    /// and whether the fault continues a sequential read. Only faults that
    /// `track` readahead can be sequential (a bulk prefetch does not).
    pub fn window(&self, page: u64, block: u64, track: bool) -> (u64, bool) {
        let block = block.max(1);
        let sequential = track && block > 1 && page == self.next;
        let window = if sequential {
            (self.window * 2).clamp(block, self.max_pages.max(block))
        } else {
            block
        };
        (window, sequential)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_around_accepts_zero_and_power_of_two_pages() {
        assert_eq!(FaultAround::from_kib(0).map(FaultAround::pages), Ok(1));
        assert_eq!(FaultAround::from_kib(4).map(FaultAround::pages), Ok(1));
        assert_eq!(FaultAround::from_kib(64).map(FaultAround::pages), Ok(16));
        assert_eq!(
            FaultAround::from_kib(MAX_FAULT_AROUND_KIB).map(FaultAround::pages),
            Ok(1024)
        );
    }

    #[test]
    fn fault_around_refuses_odd_sizes_and_too_large_blocks() {
        for kib in [1, 2, 6, 12, 100] {
            assert_eq!(
                FaultAround::from_kib(kib),
                Err(FaultAroundError::NotPowerOfTwoPages(kib))
            );
        }
        assert_eq!(
            FaultAround::from_kib(8192),
            Err(FaultAroundError::TooLarge(8192))
        );
    }

    #[test]
    fn sequential_faults_double_the_window_up_to_the_limit() {
        let mut ra = Readahead::new(64);
        assert_eq!(ra.window(0, 16, true), (16, false), "first fault");
        ra.next = 16;
        ra.window = 16;
        assert_eq!(ra.window(16, 16, true), (32, true));
        ra.window = 64;
        assert_eq!(ra.window(16, 16, true), (64, true), "capped");
        assert_eq!(ra.window(16, 16, false), (16, false), "untracked");
        assert_eq!(ra.window(17, 16, true), (16, false), "not where it ended");
        assert_eq!(ra.window(16, 1, true), (1, false), "fault-around off");
    }
}
