//! Operations that pause, capture and resume a VM themselves (a fork, a
//! snapshot, a rollback) run one at a time per VM: `begin` marks the VM
//! busy until its guard drops, and pause, resume and another such
//! operation are refused meanwhile (guest ops may run: a pause stops the
//! vCPUs at an instruction boundary). And the state checks every action
//! starts with.

use std::rc::Rc;

use shared::VmId;

use crate::core::error::{Error, Result};
use crate::core::state::Core;
use crate::core::vm::RunState;

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
        v.busy = Some(running);
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
        Some(v) => match v.busy {
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
    let v = reg.vms.get(&id).ok_or(Error::NoSuchVm(id))?;
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
            v.busy = None;
        }
    }
}
