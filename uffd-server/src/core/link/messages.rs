//! What a VM's VMM says once it runs: `Running` (the start is done), the
//! replies to requests, console lines, its last words before it exits.

use proto::vmm::VmmMsg;
use shared::VmId;
use tracing::{info, warn};

use super::error::LinkError;
use super::exit::protocol_error;
use crate::core::state::Core;

/// A message from `vm`'s VMM (its uffd, `UffdReady`, goes to the fault
/// path: `fault::serve::on_uffd_ready`).
pub(crate) fn on_message(core: &Core, vm: VmId, msg: VmmMsg) {
    match msg {
        VmmMsg::UffdReady { .. } => protocol_error(core, vm, "uffd-ready handled as a message"),
        VmmMsg::Running => {
            let mut reg = core.reg.borrow_mut();
            if let Some(v) = reg.vms.get_mut(&vm) {
                if v.faults.uffd.is_none() {
                    drop(reg);
                    return protocol_error(core, vm, "running before uffd-ready");
                }
                v.started();
                if let Some(tx) = v.link.ready.take() {
                    let _ = tx.send(Ok(()));
                }
            }
        }
        VmmMsg::Reply { seq, result } => {
            let mut reg = core.reg.borrow_mut();
            if let Some(tx) = reg
                .vms
                .get_mut(&vm)
                .and_then(|v| v.link.pending.remove(&seq))
            {
                let _ = tx.send(result.map_err(|source| LinkError::Vmm { vm, source }.into()));
            }
        }
        VmmMsg::Console { text } => info!("{vm} console: {}", text.trim_end()),
        VmmMsg::Exited { code, reason } => {
            info!("{vm}: vmm exiting with code {code}: {reason}");
            if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
                v.link.exit_reason = Some(format!("vmm exited ({code}): {reason}"));
            }
        }
        VmmMsg::Anchor { pid } => {
            let mut reg = core.reg.borrow_mut();
            let taken = reg.vm_mut(vm).and_then(|v| {
                v.link.take_anchor(vm, pid)?;
                Ok(v.faults.uffd.is_some())
            });
            match taken {
                // A VMM that rejoined: its pages are read by its anchor
                // from now on.
                Ok(true) => crate::core::base::on_uffd_ready(&mut reg, vm),
                Ok(false) => {}
                // An anchor that is not one (gone, or another process's
                // pid): the VM goes on without one, its pages read by its
                // VMM's pid as they were before anchors.
                Err(e) => warn!("{vm}: {}", e.message()),
            }
        }
        VmmMsg::Hello { .. } => protocol_error(core, vm, "hello sent twice"),
        VmmMsg::Rejoin { .. } => protocol_error(core, vm, "rejoin after the first message"),
    }
}
