//! Guest-physical layout: where the VMM-private region lives and what it
//! holds (page tables, GDT, mailbox, stack, agent code, block device
//! buffers).
//!
//! Invariant: guest RAM holds only data. Everything the VMM writes at set-up
//! lives in the private region at [`PRIV_BASE`], which is anonymous VMM
//! memory in its own KVM slot, well above any guest RAM. The page tables
//! identity-map `[0, MAX_RAM_END)` and the private region with 2 MiB
//! pages, their accessed and dirty bits set ahead; the guest never rewrites
//! them (an access above guest RAM has no KVM slot and stops the VM).
//!
//! The tables, the GDT and the agent code are the same in every VMM (see
//! [`crate::fixed`]).
//!
//! ```text
//!  PRIV_BASE +0x0000  PML4, PDPT, PD_PRIV, GDT
//!            +0x4000  mailbox          ┐ device state (see crate::devices)
//!            +0x5000  (reserved)       │
//!            +0x6000  stack            ┘
//!            +0x8000  agent code
//!           +0x10000  PD_RAM: one page directory per GiB of guest RAM
//!          +0x200000  DISK_WRITE_BUF: 1 MiB, zero but for the first word
//!                     of each sector
//!          +0x300000  DISK_READ_BUF: 1 MiB
//! ```

use shared::GuestRegion;

/// Guest-physical (and, identity-mapped, virtual) base of the private region.
pub const PRIV_BASE: u64 = 0x10_0000_0000;
/// Size of the private region: two 2 MiB pages.
pub const PRIV_SIZE: u64 = PRIV_BYTES as u64;
/// [`PRIV_SIZE`] as a length.
pub const PRIV_BYTES: usize = 4 << 20;
/// Guest RAM must end at or below this address.
pub const MAX_RAM_END: u64 = PRIV_BASE;

/// Top-level page table.
pub const PML4: u64 = PRIV_BASE;
/// The one page-directory-pointer table (covers the low 512 GiB).
pub const PDPT: u64 = PRIV_BASE + 0x1000;
/// Page directory mapping the private region's GiB.
pub const PD_PRIV: u64 = PRIV_BASE + 0x2000;
/// Global descriptor table.
pub const GDT: u64 = PRIV_BASE + 0x3000;
/// Mailbox page shared by the VMM and the agent (see [`crate::agent`]).
pub const MAILBOX: u64 = PRIV_BASE + 0x4000;
/// Initial stack pointer; the stack grows down to `PRIV_BASE + 0x6000`.
pub const STACK_TOP: u64 = PRIV_BASE + 0x8000;
/// Start of the agent code.
pub const CODE: u64 = PRIV_BASE + 0x8000;
/// Room for agent code.
pub const CODE_MAX: u64 = 0x8000;
/// Page directories for guest RAM, one per GiB, from here on.
pub const PD_RAM: u64 = PRIV_BASE + 0x10000;
/// Bytes of one block device bounce buffer: the largest request.
pub const DISK_BUF_SIZE: u64 = shared::pattern::MAX_SECTORS_PER_IO * shared::pattern::SECTOR_SIZE;
/// Bounce buffer the agent writes to the disk from. Only the agent writes
/// it, and only the first word of each sector, so everything else in it
/// stays zero and `disk_fill` never has to clear it.
pub const DISK_WRITE_BUF: u64 = PRIV_BASE + 0x20_0000;
/// Bounce buffer the disk is read into.
pub const DISK_READ_BUF: u64 = DISK_WRITE_BUF + DISK_BUF_SIZE;
/// The block device moves data only within `[DISK_BUF_START, DISK_BUF_END)`.
pub const DISK_BUF_START: u64 = DISK_WRITE_BUF;
/// End of the block device's buffer window.
pub const DISK_BUF_END: u64 = DISK_READ_BUF + DISK_BUF_SIZE;
const _: () = assert!(DISK_BUF_END <= PRIV_BASE + PRIV_SIZE);
const _: () = assert!(PD_RAM + (MAX_RAM_END / GIB) * 0x1000 <= DISK_BUF_START);

/// Code segment selector (GDT entry 1).
pub const CS_SELECTOR: u16 = 0x8;
/// Data segment selector (GDT entry 2).
pub const DS_SELECTOR: u16 = 0x10;
/// The GDT: null, 64-bit code, data.
pub const GDT_ENTRIES: [u64; 3] = [0, 0x00af_9b00_0000_ffff, 0x00cf_9300_0000_ffff];

/// Page-table entry bits.
pub const PTE_PRESENT: u64 = 1;
pub const PTE_WRITE: u64 = 2;
pub const PTE_ACCESSED: u64 = 1 << 5;
pub const PTE_DIRTY: u64 = 1 << 6;
pub const PTE_HUGE: u64 = 1 << 7;
pub const GIB: u64 = 1 << 30;
pub const TWO_MIB: u64 = 2 << 20;

/// Errors of laying out the guest.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("guest RAM has no regions")]
    NoRegions,
    #[error("guest RAM region at {guest_phys:#x} of {size:#x} bytes is not page aligned")]
    Unaligned { guest_phys: u64, size: u64 },
    #[error("guest RAM ends at {0:#x}, above the VMM's limit of {MAX_RAM_END:#x}")]
    TooLarge(u64),
    #[error("guest RAM regions overlap or are not sorted by address")]
    Overlap,
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, LayoutError>;

/// Byte offset of `gpa` inside the private region.
pub fn offset(gpa: u64) -> usize {
    usize::try_from(gpa - PRIV_BASE).unwrap_or(usize::MAX)
}

/// Check guest RAM regions and return where RAM ends.
pub fn ram_end(regions: &[GuestRegion]) -> Result<u64> {
    let mut end = 0u64;
    if regions.is_empty() {
        return Err(LayoutError::NoRegions);
    }
    for r in regions {
        if r.guest_phys % shared::PAGE_SIZE != 0 || r.size % shared::PAGE_SIZE != 0 || r.size == 0 {
            return Err(LayoutError::Unaligned {
                guest_phys: r.guest_phys,
                size: r.size,
            });
        }
        if r.guest_phys < end {
            return Err(LayoutError::Overlap);
        }
        end = r
            .guest_phys
            .checked_add(r.size)
            .ok_or(LayoutError::TooLarge(u64::MAX))?;
    }
    if end > MAX_RAM_END {
        return Err(LayoutError::TooLarge(end));
    }
    Ok(end)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_end_rejects_overlap_and_too_large() {
        let r = |guest_phys, size| GuestRegion { guest_phys, size };
        assert_eq!(ram_end(&[r(0, 0x1000), r(0x2000, 0x1000)]).unwrap(), 0x3000);
        assert!(matches!(
            ram_end(&[r(0, 0x2000), r(0x1000, 0x1000)]),
            Err(LayoutError::Overlap)
        ));
        assert!(matches!(
            ram_end(&[r(0, MAX_RAM_END + 0x1000)]),
            Err(LayoutError::TooLarge(_))
        ));
        assert!(matches!(ram_end(&[]), Err(LayoutError::NoRegions)));
    }
}
