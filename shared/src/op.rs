//! Guest agent operations: what a control client can ask a running guest to
//! do, and what comes back.
//!
//! Page numbers are guest pages counted from guest-physical address 0.
//! Every operation works at page granularity (one or two words per page),
//! because guest code is slow on nested KVM; whole-page checks are done by
//! [`GuestOp::Digest`], which the VMM computes over its own mapping of guest
//! RAM (still served through the userfaultfd path).

use serde::{Deserialize, Serialize};

/// One command for the guest agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GuestOp {
    /// Write [`crate::pattern::pattern_word`] at word 0 and at the sample
    /// word of every page.
    Fill {
        start_page: u64,
        pages: u64,
        seed: u64,
    },
    /// Read (or read and write back unchanged) the first byte of every page.
    Touch {
        start_page: u64,
        pages: u64,
        write: bool,
    },
    /// Fold the sample word of every page (guest side); zero pages give 0.
    Checksum { start_page: u64, pages: u64 },
    /// Count pages whose fill words differ from the pattern for `seed`.
    Verify {
        start_page: u64,
        pages: u64,
        seed: u64,
    },
    /// Fold every word of every page (VMM side, over its mapping).
    Digest { start_page: u64, pages: u64 },
    /// The guest reads its VM's id from the identity port.
    Identity,
    /// Write [`crate::pattern::disk_word`] into every 512-byte sector.
    DiskFill {
        sector: u64,
        count: u64,
        seed: u64,
        /// Sectors per block device request, 1 to
        /// [`crate::pattern::MAX_SECTORS_PER_IO`] (`None`: the most).
        #[serde(default)]
        sectors_per_io: Option<u32>,
    },
    /// Write guest pages `start_page..start_page + pages` to the disk from
    /// `sector` on: the block device reads them straight from guest RAM,
    /// as a DMA from the guest's own pages would, and the guest computes
    /// nothing per sector.
    DiskWritePages {
        start_page: u64,
        pages: u64,
        sector: u64,
        /// As in [`GuestOp::DiskFill`].
        #[serde(default)]
        sectors_per_io: Option<u32>,
    },
    /// Fold the first word of every sector.
    DiskChecksum {
        sector: u64,
        count: u64,
        /// As in [`GuestOp::DiskFill`].
        #[serde(default)]
        sectors_per_io: Option<u32>,
    },
}

impl GuestOp {
    /// The operation's name as the API spells it.
    pub fn name(&self) -> &'static str {
        match self {
            GuestOp::Fill { .. } => "fill",
            GuestOp::Touch { .. } => "touch",
            GuestOp::Checksum { .. } => "checksum",
            GuestOp::Verify { .. } => "verify",
            GuestOp::Digest { .. } => "digest",
            GuestOp::Identity => "identity",
            GuestOp::DiskFill { .. } => "disk_fill",
            GuestOp::DiskChecksum { .. } => "disk_checksum",
            GuestOp::DiskWritePages { .. } => "disk_write_pages",
        }
    }

    /// Sectors per block device request of a disk op: its
    /// `sectors_per_io`, or the most the device takes.
    pub fn sectors_per_io(&self) -> Option<u64> {
        match *self {
            GuestOp::DiskFill { sectors_per_io, .. }
            | GuestOp::DiskChecksum { sectors_per_io, .. }
            | GuestOp::DiskWritePages { sectors_per_io, .. } => {
                Some(sectors_per_io.map_or(crate::pattern::MAX_SECTORS_PER_IO, u64::from))
            }
            _ => None,
        }
    }

    /// The disk sectors `(first, count)` the operation reads or writes, if
    /// any.
    pub fn sector_range(&self) -> Option<(u64, u64)> {
        match *self {
            GuestOp::DiskFill { sector, count, .. }
            | GuestOp::DiskChecksum { sector, count, .. } => Some((sector, count)),
            GuestOp::DiskWritePages { sector, pages, .. } => Some((
                sector,
                pages.saturating_mul(crate::geometry::PAGE_SIZE / crate::pattern::SECTOR_SIZE),
            )),
            _ => None,
        }
    }

    /// The guest page range the operation reads or writes, if any.
    pub fn page_range(&self) -> Option<(u64, u64)> {
        match *self {
            GuestOp::Fill {
                start_page, pages, ..
            }
            | GuestOp::Touch {
                start_page, pages, ..
            }
            | GuestOp::Checksum { start_page, pages }
            | GuestOp::Verify {
                start_page, pages, ..
            }
            | GuestOp::Digest { start_page, pages }
            | GuestOp::DiskWritePages {
                start_page, pages, ..
            } => Some((start_page, pages)),
            _ => None,
        }
    }
}

/// What an operation returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpResult {
    /// The op's value: a checksum, a mismatch count, an id, or 0.
    pub value: u64,
    /// Wall time the VMM spent on the op, in microseconds.
    pub elapsed_us: u64,
}
