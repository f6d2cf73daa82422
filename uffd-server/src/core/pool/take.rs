//! Taking from the warm VMM pool: guest RAM for a new VM (the memfd of a
//! ready pooled VMM, which is then set aside for the VM), a VMM for a VM's
//! launch (bound to the VM, its Welcome sent at once), and a pooled VMM's
//! hello and end.

use std::rc::Rc;
use std::sync::Arc;

use shared::VmId;
use tracing::{info, warn};

use super::refill::{pool_log_path, schedule_refill};
use super::state::{SetAside, POOL_BASE};
use crate::conn::VmmWriter;
use crate::core::link::welcome::welcome;
use crate::core::state::Core;
use crate::memory::{GuestMemory, MemoryError, PageSize};

/// Guest RAM for a new VM `id`: the memfd of a ready pooled VMM when
/// one has RAM of this size and kind (the VMM is set aside for the
/// VM's launch), else a new memfd.
pub(crate) fn new_guest_memory(
    core: &Core,
    id: VmId,
    size: u64,
    page_size: PageSize,
) -> Result<(GuestMemory, Option<SetAside>), MemoryError> {
    if page_size == PageSize::Small {
        if let Some((memory, p)) = core.pool.borrow_mut().take_with_memory(size) {
            return Ok((memory, Some(SetAside(Some(p)))));
        }
    }
    let memory = GuestMemory::create_with(&format!("pagefork-{id}"), size, page_size)?;
    Ok((memory, None))
}

/// Launch a VMM for `id` from the pool: the one set aside for it, else
/// a ready one if there is any; bind it to `id` and send its Welcome.
/// Returns whether it did.
pub(crate) fn launch_from_pool(core: &Rc<Core>, id: VmId) -> bool {
    let set_aside = core
        .reg
        .borrow_mut()
        .vms
        .get_mut(&id)
        .and_then(|v| v.pooled.take())
        .and_then(|mut s| s.0.take());
    let taken = match set_aside {
        Some(p) => Some(p),
        None => core.pool.borrow_mut().take(),
    };
    let Some(p) = taken else {
        // A launch asks for a VMM: worth trying again after a give-up.
        core.pool.borrow_mut().stopped = false;
        schedule_refill(core);
        return false;
    };
    let Some(writer) = p.writer else {
        return false;
    };
    p.binding.bind(id);
    welcome(core, id, writer, p.pid);
    // After the Welcome, which the start waits for: the log follows the
    // VMM (its open fd keeps writing to the file), and this core thread
    // handles whatever the VMM says only after this returns.
    let log = core.settings.log_path(id);
    if let Err(e) = std::fs::rename(pool_log_path(&core.settings, p.id), &log) {
        warn!("{id}: cannot rename the pooled vmm's log: {e}");
    }
    info!("{id}: took pooled vmm pid {}", p.pid);
    schedule_refill(core);
    true
}

/// A VMM's hello for pool id `id`: keep its writer; false if `id` is
/// not (or no longer) in the pool.
pub(crate) fn hello(core: &Core, id: VmId, writer: Arc<VmmWriter>, pid: u32) -> bool {
    core.pool.borrow_mut().hello(id, writer, pid)
}

/// The pooled VMM `id` exited or hung up before it was used.
pub(crate) fn gone(core: &Rc<Core>, id: VmId, reason: &str) {
    // One set aside for a VM: that VM's launch starts a VMM of its own.
    let set_aside = core.reg.borrow_mut().vms.values_mut().find_map(|v| {
        v.pooled
            .as_ref()
            .is_some_and(|s| s.0.as_ref().is_some_and(|p| p.id == id))
            .then(|| v.pooled.take())
            .flatten()
    });
    if let Some(s) = set_aside {
        warn!(
            "pooled vmm {} went away before the VM it was set aside for started: {reason}",
            id.0 - POOL_BASE
        );
        drop(s);
        return;
    }
    let gone = core.pool.borrow_mut().gone(id);
    if let Some(p) = gone {
        if let Some(w) = p.writer {
            w.shutdown();
        }
        warn!(
            "pooled vmm {} (pid {}) went away unused: {reason}",
            p.id.0 - POOL_BASE,
            p.pid
        );
        schedule_refill(core);
    }
}
