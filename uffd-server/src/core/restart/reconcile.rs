//! A page the dead process installed and had not yet recorded.
//!
//! Serving a fault installs the page (UFFDIO_COPY, into the VM's memfd
//! and the VMM's page tables) and then sets the table entry. A SIGKILL
//! between the two leaves a page the VM holds while its table says it
//! comes from elsewhere. The guest reads its own page either way, but it
//! may write it next without a fault, and then a fork child or a snapshot
//! would read the page from where the table says instead. So before an
//! adopted VM is served again, every page present in its memfd that its
//! table does not name as its own is looked up in its VMM's page tables
//! (`/proc/PID/pagemap`): mapped, it was installed, and is its own.
//!
//! Pages present but not mapped are left as the table says: a rollback's
//! stale pages (its discard unmapped them; the next access faults MINOR
//! and replaces them), or a pre-write copy cut short (the next write of
//! the VM it was copied from finds it there; see `fault::dependents`).
//! A hugepage VM is looked at block by block: SEEK_DATA sees every block
//! of a hugetlb memfd as data, so every block whose pages are not all its
//! own is looked up, by its first page (the kernel installs and maps a
//! block whole), and a block mapped becomes its own whole. A VM on a base
//! (its own pages are its VMM's, not in a memfd) is left as it is.

use std::os::unix::fs::FileExt;

use crate::core::vm::Vm;

/// Bit 63 of a pagemap entry: the page is present.
const PRESENT: u64 = 1 << 63;

/// Make every page `v`'s VMM maps from its memfd its own in its table.
/// Returns how many entries it set.
pub(super) fn own_pages(v: &mut Vm) -> u64 {
    if v.base.on.is_some() || v.is_deleted() || v.faults.vmm_base == 0 {
        return 0;
    }
    let Some(pid) = v.link.pid else {
        return 0;
    };
    let me = v.self_src;
    let unit = v.memory.unit_pages();
    // Runs `(first, n)` to look up by their first page, each set whole.
    let candidates: Vec<(u64, u64)> = if unit > 1 {
        let pages = v.memory.pages();
        (0..pages)
            .step_by(shared::geometry::usize_of(unit))
            .map(|lo| (lo, unit.min(pages - lo)))
            .filter(|&(lo, n)| (lo..lo + n).any(|p| v.table.get(p) != me))
            .collect()
    } else {
        let Some(ranges) = v.memory.present_ranges() else {
            return 0;
        };
        ranges
            .iter()
            .flat_map(|&(first, n)| first..first + n)
            .filter(|p| v.table.get(*p) != me)
            .map(|p| (p, 1))
            .collect()
    };
    if candidates.is_empty() {
        return 0;
    }
    let Ok(map) = std::fs::File::open(format!("/proc/{pid}/pagemap")) else {
        return 0;
    };
    let first_vpn = v.faults.vmm_base / shared::PAGE_SIZE;
    let mut set = 0;
    for (p, n) in candidates {
        let mut entry = [0u8; 8];
        if map.read_exact_at(&mut entry, (first_vpn + p) * 8).is_err() {
            continue;
        }
        if u64::from_ne_bytes(entry) & PRESENT != 0 {
            set += (p..p + n).filter(|q| v.table.get(*q) != me).count() as u64;
            v.table.set_range(p, n, me);
        }
    }
    if set > 0 {
        tracing::info!(
            "{}: {set} page(s) installed just before the crash recorded as its own",
            v.id
        );
    }
    set
}
