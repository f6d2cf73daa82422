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
//! A VM on a base (its own pages are its VMM's, not in a memfd) and a
//! hugepage VM (SEEK_DATA sees every block of a hugetlb memfd) are left
//! as they are.

use std::os::unix::fs::FileExt;

use crate::core::vm::Vm;

/// Bit 63 of a pagemap entry: the page is present.
const PRESENT: u64 = 1 << 63;

/// Make every page `v`'s VMM maps from its memfd its own in its table.
/// Returns how many entries it set.
pub(super) fn own_pages(v: &mut Vm) -> u64 {
    if v.base.on.is_some() || v.deleted || v.faults.vmm_base == 0 {
        return 0;
    }
    let Some(pid) = v.link.pid else {
        return 0;
    };
    let Some(ranges) = v.memory.present_ranges() else {
        return 0;
    };
    let me = v.self_src;
    let candidates: Vec<u64> = ranges
        .iter()
        .flat_map(|&(first, n)| first..first + n)
        .filter(|p| v.table.get(*p) != me)
        .collect();
    if candidates.is_empty() {
        return 0;
    }
    let Ok(map) = std::fs::File::open(format!("/proc/{pid}/pagemap")) else {
        return 0;
    };
    let first_vpn = v.faults.vmm_base / shared::PAGE_SIZE;
    let mut set = 0;
    for p in candidates {
        let mut entry = [0u8; 8];
        if map.read_exact_at(&mut entry, (first_vpn + p) * 8).is_err() {
            continue;
        }
        if u64::from_ne_bytes(entry) & PRESENT != 0 {
            v.table.set(p, me);
            set += 1;
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
