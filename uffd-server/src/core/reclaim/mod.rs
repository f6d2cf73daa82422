//! Reclaim under memory pressure: the server keeps the VMs' resident
//! memory under a watermark below the limit that applies to it (its
//! memory cgroup's, or the host's memory), by giving back pages the VMs
//! hold: first pages whose source holds the same bytes (zeroes, an
//! image, a frozen template), dropped and served again on their next
//! fault; then pages a VM wrote, compressed into the swap store under the
//! state directory (`crate::reclaim::store`) and served back from it like
//! a compressed image.
//!
//! - [`state`]: the server's reclaim state ([`state::Reclaimer`]) and each
//!   VM's ([`state::VmReclaim`]).
//! - [`pass`]: one pass over one VM (how a page is taken safely while the
//!   guest runs).
//! - [`based`]: the same over a VM on a shared base, whose own pages its
//!   VMM holds (paused, read out, dropped by the VMM).
//! - [`tick`]: the loop that decides when and from whom.
//! - [`gate`]: the page budget that holds faults while reclaim catches up.
//!
//! Invariants: a page is taken only while write-protected and mapped in
//! its VMM, and its table entry names where its bytes are before it
//! leaves memory; a page another VM still reads from this one is never
//! taken; a frame of the swap store lives while some table names it.
//! Which pages are cold: the server sees faults, not accesses (no idle
//! page tracking on these hosts, and KVM's accessed bits are not
//! visible to it). VMs whose faults stopped longest ago go first; within
//! a VM a clock hand walks its pages; a page faulted back soon after it
//! was taken is hot and skipped for the next two windows.

pub mod based;
pub mod gate;
pub mod pass;
pub mod state;
pub mod tick;

use std::rc::Rc;

use shared::VmId;

use crate::core::error::{Error, Result};
use crate::core::state::Core;

/// Pages one step of `reclaim_now` takes at most before it yields.
const STEP_PAGES: u64 = 4096;

/// `POST /v1/vms/{id}/reclaim`: give back every page of `vm` that can be
/// given back now, hot or not.
pub(crate) async fn reclaim_now(core: &Rc<Core>, vm: VmId) -> Result<proto::api::VmReclaimed> {
    {
        let reg = core.reg.borrow();
        let v = reg.vm(vm)?;
        if !core.reclaim.borrow().on() {
            return Err(Error::ReclaimRefused {
                vm,
                why: "reclaim is off (--reclaim off)".to_owned(),
            });
        }
        if let Some(why) = pass::ineligible(v) {
            return Err(Error::ReclaimRefused {
                vm,
                why: why.to_owned(),
            });
        }
    }
    let pages = {
        let mut reg = core.reg.borrow_mut();
        let v = reg.vm_mut(vm)?;
        v.reclaim.hand = 0;
        v.memory.pages()
    };
    let mut total = pass::Took::default();
    let mut busy_since = None;
    while total.examined < pages {
        let took = step(core, vm, STEP_PAGES, true).await;
        if took.busy {
            // An operation runs on it, or waits to: it goes first, and
            // the reclaim goes on after it (for as long as a pass would
            // wait for one).
            let since = *busy_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() >= 2 * core.settings.vmm_deadline {
                break;
            }
            tokio::time::sleep(crate::core::busy::RECLAIM_POLL).await;
            continue;
        }
        busy_since = None;
        if took.examined == 0 {
            break;
        }
        total.examined += took.examined;
        total.dropped += took.dropped;
        total.swapped += took.swapped;
        total.kept += took.kept;
        tokio::task::yield_now().await;
    }
    Ok(proto::api::VmReclaimed {
        vm: vm.to_string(),
        dropped_pages: total.dropped,
        swapped_pages: total.swapped,
        kept_pages: total.kept,
        freed_bytes: total.freed() * shared::PAGE_SIZE,
    })
}

/// One pass over `vm`: up to `max` pages from its clock hand on (hot ones
/// too if `all`). Its `Swap` source is made first (the arena's hook
/// journals it before a table can name it).
pub(crate) async fn step(core: &Rc<Core>, vm: VmId, max: u64, all: bool) -> pass::Took {
    pass::swap_source(&mut core.reg.borrow_mut(), &core.reclaim.borrow(), vm);
    if core.reg.borrow().is_based(vm) {
        return based::reclaim_based(core, vm, max, all).await;
    }
    let mut reg = core.reg.borrow_mut();
    let mut rc = core.reclaim.borrow_mut();
    pass::reclaim_vm(&mut reg, &mut rc, vm, max, all)
}

/// Refuse a new VM while reclaim cannot keep up (503, with why).
pub(crate) fn admit(core: &Core) -> Result<()> {
    match core.reclaim.borrow().behind() {
        Some(why) => Err(Error::MemoryPressure(why.to_owned())),
        None => Ok(()),
    }
}

/// `GET /v1/memory`.
pub(crate) fn status(core: &Core) -> proto::api::MemoryStatus {
    let reg = core.reg.borrow();
    let resident: u64 = reg.vms.values().map(|v| pass::held_bytes(&reg, v)).sum();
    let thrashing = reg
        .vms
        .values()
        .filter(|v| v.reclaim.thrashing())
        .map(|v| v.id.to_string())
        .collect();
    drop(reg);
    let mut rc = core.reclaim.borrow_mut();
    rc.read();
    rc.to_api(resident, thrashing)
}
