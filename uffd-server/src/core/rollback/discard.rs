//! A rollback's discard and the scrub after it: the paused VMM unmaps the
//! reset pages and leaves them in the memfd, stale (`state.rs`); a task
//! punches them after the resume, a few at a time, unless a fault got to
//! one first.

use std::rc::Rc;

use proto::vmm::Request;
use shared::VmId;
use tracing::{info, warn};

use crate::core::link::requests::request;
use crate::core::state::Core;

/// Ask `vm`'s paused VMM to unmap `ranges` (host address, bytes) and
/// leave their pages in the memfd (`Request::Discard`). Returns whether
/// it did; a VMM that cannot (no MINOR on this kernel) is not asked
/// again, and the rollback punches instead.
pub(crate) async fn discard(core: &Rc<Core>, vm: VmId, ranges: Vec<(u64, u64)>) -> bool {
    if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
        v.rollback.discarding = true;
    }
    let r = request(
        core,
        vm,
        Request::Discard(ranges),
        core.settings.vmm_deadline,
    )
    .await;
    let mut reg = core.reg.borrow_mut();
    let Some(v) = reg.vms.get_mut(&vm) else {
        return false;
    };
    v.rollback.discarding = false;
    match r {
        Ok(_) => true,
        Err(e) => {
            info!(
                "{vm}: the VMM cannot discard pages ({}); rollbacks punch them",
                e.message()
            );
            v.rollback.no_discard = true;
            false
        }
    }
}

/// Punch `vm`'s stale pages out of its memfd a few at a time, letting
/// faults and requests run in between, until none is left (or the VM
/// is gone), after `--rollback-scrub-delay-ms`. A fault on a stale
/// page meanwhile punches that page itself.
pub(crate) fn spawn_scrub(core: &Rc<Core>, vm: VmId) {
    /// Pages punched per step: ~0.1-0.2 ms of the core thread.
    const STEP: u64 = 256;
    let core = Rc::clone(core);
    let delay = core.settings.rollback_scrub_delay;
    tokio::task::spawn_local(async move {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        loop {
            let left = {
                let mut reg = core.reg.borrow_mut();
                let Some(v) = reg.vms.get_mut(&vm) else {
                    return;
                };
                match v.rollback.scrub_some(&v.memory, STEP) {
                    Ok(left) => left,
                    Err(e) => {
                        warn!("{vm}: cannot punch stale pages: {e}");
                        return;
                    }
                }
            };
            if left == 0 {
                return;
            }
            tokio::task::yield_now().await;
        }
    });
}
