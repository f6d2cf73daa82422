//! One reclaim pass over a VM on a shared base: its own pages are private
//! pages of its VMM (what the guest wrote over the base, what the server
//! copied in), not pages of a memfd the server could punch.
//!
//! The pass pauses the VM (unless it is paused already), so nothing
//! writes its memory while the pass reads it; finds the pages its VMM
//! holds privately (`PAGEMAP_SCAN`, `core::base::sync_private_runs`
//! first, so the table calls them the VM's own); reads them with
//! `process_vm_readv`; decides where each goes as a pass over a memfd does
//! ([`pass::destination`]: zeroes, back to the image the base reads, or
//! the swap store); sets the entries; then asks the VMM to drop them
//! (`Request::Discard`, `MADV_DONTNEED`) and resumes it. The next access
//! to such a page faults (MINOR where the base holds the page, MISSING
//! where it does not) and the fault path installs it from the table: a
//! page dropped back to the image is mapped from the base, shared again.
//!
//! A page the VMM could not drop keeps its bytes there: its entry goes
//! back to the VM's own. A crash between the entries and the discard
//! leaves pages the VMM still holds with entries that name where their
//! bytes were saved: both hold the same bytes (the VM was paused), the
//! next `sync_private` calls them the VM's own again, and the frames
//! nothing names are collected.

use std::rc::Rc;
use std::time::Instant;

use proto::vmm::Request;
use shared::{VmId, PAGE_SIZE};
use tracing::{debug, warn};
use vm_memory::VolatileSlice;

use super::pass::{self, Took};
use crate::core::busy;
use crate::core::link::requests::request;
use crate::core::rollback::discard::discard;
use crate::core::state::Core;
use crate::core::vm::RunState;
use crate::pages::{SourceId, VmPages};

/// Give back up to `max` pages of `vm`, a VM on a shared base, from its
/// clock hand on (hot pages too, if `all`).
pub(crate) async fn reclaim_based(core: &Rc<Core>, vm: VmId, max: u64, all: bool) -> Took {
    let mut took = Took::default();
    let running = {
        let reg = core.reg.borrow();
        match reg.vms.get(&vm) {
            Some(v) if v.base.is_based() && pass::ineligible(v).is_none() => {
                v.state() == RunState::Running
            }
            _ => return took,
        }
    };
    let Some(_busy) = busy::begin_reclaim(core, vm) else {
        took.busy = true;
        return took;
    };
    if running {
        // None of its threads may wait at the fault gate while it pauses.
        core.reg.borrow_mut().gate.release();
        if let Err(e) = request(core, vm, Request::Pause, core.settings.vmm_deadline).await {
            warn!("{vm}: cannot pause it to reclaim its pages: {e}");
            return took;
        }
    }
    let paused = Instant::now();
    let taken = take(core, vm, max, all, &mut took);
    if !taken.is_empty() {
        drop_from_vmm(core, vm, taken, &mut took).await;
    }
    if running {
        if let Err(e) = request(core, vm, Request::Resume, core.settings.vmm_deadline).await {
            warn!("{vm}: cannot resume it after a reclaim: {e}");
        }
    }
    debug!(
        "{vm}: {} of its VMM's pages given back ({} swapped, {} kept), paused {} us",
        took.freed(),
        took.swapped,
        took.kept,
        paused.elapsed().as_micros()
    );
    took
}

/// With the VM paused: pick, read and save up to `max` of its private
/// pages, and point their entries at where their bytes are now. Returns
/// the pages taken and their new sources.
fn take(core: &Core, vm: VmId, max: u64, all: bool, took: &mut Took) -> Vec<(u64, SourceId)> {
    let mut reg = core.reg.borrow_mut();
    if let Err(e) = crate::core::base::sync_private_runs(&mut reg, vm) {
        warn!("{vm}: cannot tell which pages its VMM holds: {e}");
        return Vec::new();
    }
    let Some(VmPages::Process(process)) = reg.arena.memory_of(vm) else {
        return Vec::new();
    };
    let Some(pages) = reg.vms.get(&vm).map(|v| v.memory.pages()) else {
        return Vec::new();
    };
    let private = match process.private_runs(pages) {
        Ok(r) => r,
        Err(e) => {
            warn!("{vm}: cannot tell which pages its VMM holds: {e}");
            return Vec::new();
        }
    };
    let chosen = pass::candidates_in(&mut reg, vm, &private, max, all, took);
    if chosen.is_empty() {
        return Vec::new();
    }
    let mut rc = core.reclaim.borrow_mut();
    let reg = &mut *reg;
    let Some(v) = reg.vms.get_mut(&vm) else {
        return Vec::new();
    };
    let page = shared::geometry::usize_of(PAGE_SIZE);
    let mut scratch = vec![0u8; page];
    let mut gone = Vec::with_capacity(chosen.len());
    for (first, n) in pass::runs_of(&chosen) {
        let mut buf = vec![0u8; page * shared::geometry::usize_of(n)];
        if let Err(e) = process.read(first, &VolatileSlice::from(&mut buf[..])) {
            warn!(
                "{vm}: cannot read pages {first}..{} to reclaim them: {e}",
                first + n
            );
            took.kept += n;
            continue;
        }
        for (i, bytes) in buf.chunks_exact(page).enumerate() {
            let p = first + i as u64;
            match pass::destination(&reg.arena, &mut rc, v, p, bytes, &mut scratch) {
                Some(src) => gone.push((p, src)),
                None => took.kept += 1,
            }
        }
    }
    // The entries first: once the VMM drops a page, its next access
    // faults and reads the table.
    for &(p, src) in &gone {
        v.table.set(p, src);
    }
    gone
}

/// Ask the VMM to drop the pages `gone` names, then count them; if it
/// cannot, they stay its own.
async fn drop_from_vmm(core: &Rc<Core>, vm: VmId, gone: Vec<(u64, SourceId)>, took: &mut Took) {
    let ranges = {
        let reg = core.reg.borrow();
        let Some(v) = reg.vms.get(&vm) else {
            return;
        };
        let pages: Vec<u64> = gone.iter().map(|(p, _)| *p).collect();
        pass::runs_of(&pages)
            .into_iter()
            .map(|(first, n)| (v.addr_of(first) as u64, n * PAGE_SIZE))
            .collect::<Vec<_>>()
    };
    let dropped = discard(core, vm, ranges).await;
    let mut reg = core.reg.borrow_mut();
    let Some(v) = reg.vms.get_mut(&vm) else {
        return;
    };
    if !dropped {
        let me = v.self_src;
        for &(p, _) in &gone {
            v.table.set(p, me);
        }
        took.kept += gone.len() as u64;
        return;
    }
    pass::account(&mut core.reclaim.borrow_mut(), v, &gone, took);
}
