//! Operations that pause, capture and resume a VM themselves (a fork, a
//! snapshot, a rollback) run one at a time per VM: `begin` marks the VM
//! busy until its guard drops, and pause, resume and another such
//! operation are refused meanwhile (guest ops may run: a pause stops the
//! vCPUs at an instruction boundary). And the state checks every action
//! starts with.
//!
//! A reclaim pass over a VM on a shared base (`core::reclaim::based`) is
//! such an operation too, but one the server starts on its own, for one
//! step of a few milliseconds: an operation that finds one waits for it
//! to end ([`wait_out_reclaim`]) instead of being refused, and no new pass
//! begins on that VM while it waits ([`begin_reclaim`]).

pub mod state;

use std::rc::Rc;
use std::time::{Duration, Instant};

use shared::VmId;

use crate::core::error::{Error, Result};
use crate::core::state::Core;
use crate::core::vm::RunState;

/// What a reclaim pass marks its VM busy with.
pub(crate) const RECLAIM: &str = "a reclaim";

/// How often an operation waiting for a reclaim pass looks again.
pub(crate) const RECLAIM_POLL: Duration = Duration::from_millis(1);

/// Wait while a reclaim pass runs on `vm`, or a layer a fork of it froze
/// is still being filled from it (an operation that pauses, rolls back or
/// saves the parent would otherwise race the fill for pages it has not
/// copied yet; fills are short: see `fork::layer`). A pass pauses and
/// resumes its VM within a step; one that outlasts twice the VMM deadline
/// (its VMM not answering) gets `action` refused as busy.
pub(crate) async fn wait_out_reclaim(
    core: &Rc<Core>,
    vm: VmId,
    action: &'static str,
) -> Result<()> {
    let _waiting = Waiting::new(core, vm);
    let give_up = Instant::now() + 2 * core.settings.vmm_deadline;
    loop {
        let (busy, filling) = match core.reg.borrow().vms.get(&vm) {
            Some(v) => (v.busy.running, v.fork.layering.is_some()),
            None => return Err(Error::NoSuchVm(vm)),
        };
        if filling {
            tokio::time::sleep(RECLAIM_POLL).await;
            continue;
        }
        if busy != Some(RECLAIM) {
            return Ok(());
        }
        if Instant::now() >= give_up {
            return Err(Error::Busy {
                vm,
                action,
                running: RECLAIM,
            });
        }
        tokio::time::sleep(RECLAIM_POLL).await;
    }
}

/// Mark `vm` busy with a reclaim pass, unless it is busy already or an
/// operation waits for it (`None`: the pass leaves it alone this time).
pub(crate) fn begin_reclaim(core: &Rc<Core>, vm: VmId) -> Option<BusyGuard> {
    {
        let reg = core.reg.borrow();
        let v = reg.vms.get(&vm)?;
        if v.busy.running.is_some() || v.busy.waiters > 0 {
            return None;
        }
    }
    begin(core, vm, "reclaim", RECLAIM).ok()
}

/// Counts an operation among `vm`'s waiters for a reclaim pass while
/// alive.
struct Waiting {
    core: Rc<Core>,
    vm: VmId,
}

impl Waiting {
    fn new(core: &Rc<Core>, vm: VmId) -> Self {
        if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
            v.busy.waiters += 1;
        }
        Waiting {
            core: Rc::clone(core),
            vm,
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(v) = self.core.reg.borrow_mut().vms.get_mut(&self.vm) {
            v.busy.waiters = v.busy.waiters.saturating_sub(1);
        }
    }
}

/// Mark `vm` as running `running` (a fork, a snapshot, a rollback:
/// operations that pause and resume the VM themselves) until the guard
/// drops; refuse if one is under way already. (Guest ops may run
/// meanwhile: a pause stops the vCPUs at an instruction boundary.)
pub(crate) fn begin(
    core: &Rc<Core>,
    vm: VmId,
    action: &'static str,
    running: &'static str,
) -> Result<BusyGuard> {
    refuse_while_busy(core, vm, action)?;
    if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
        v.busy.running = Some(running);
        if action != "fork" {
            v.fork.forget_template();
        }
    }
    Ok(BusyGuard {
        core: core.clone(),
        vm,
    })
}

/// Refuse `action` while `vm` runs an operation that pauses and
/// resumes it itself.
pub(crate) fn refuse_while_busy(core: &Core, vm: VmId, action: &'static str) -> Result<()> {
    let reg = core.reg.borrow();
    match reg.vms.get(&vm) {
        Some(v) => match v.busy.running {
            Some(running) => Err(Error::Busy {
                vm,
                action,
                running,
            }),
            None => Ok(()),
        },
        None => Err(Error::NoSuchVm(vm)),
    }
}

/// Refuse `action` unless `id` is in state `want`.
pub(crate) fn expect_state(
    core: &Core,
    id: VmId,
    want: RunState,
    action: &'static str,
) -> Result<()> {
    let reg = core.reg.borrow();
    let v = reg.vm(id)?;
    let state = v.api_state();
    if state != want {
        return Err(Error::WrongState {
            vm: id,
            state,
            action,
        });
    }
    Ok(())
}

/// Marks a VM as busy (see `begin`) while alive.
#[derive(Debug)]
pub(crate) struct BusyGuard {
    core: Rc<Core>,
    vm: VmId,
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        if let Some(v) = self.core.reg.borrow_mut().vms.get_mut(&self.vm) {
            v.busy.running = None;
        }
    }
}
