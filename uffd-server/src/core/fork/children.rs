//! A fork's children: registered with a fork of the parent's table (so
//! `Vm(parent)` reads from the parent), a reflink of its volume each, and
//! stopped and forgotten together if the fork fails half-way.

use std::rc::Rc;

use shared::VmId;
use tokio::sync::oneshot;

use crate::core::error::{Error, Result};
use crate::core::launch::delete::discard_vms;
use crate::core::link::process::stop_vmm;
use crate::core::pool::take::new_guest_memory;
use crate::core::reclaim::state::VmReclaim;
use crate::core::state::Core;
use crate::core::vm::{Vm, VmParts};

/// Fulfilled when a child's VMM runs.
pub(crate) type Ready = oneshot::Receiver<Result<()>>;

/// Register `count` children of `parent` sharing its table.
pub(crate) fn create_children(
    core: &Core,
    parent: VmId,
    count: u32,
    state: Rc<shared::VmState>,
) -> Result<Vec<(VmId, Ready)>> {
    let mut reg = core.reg.borrow_mut();
    let (table, (size, page_size), vcpus, fault_around) = {
        let p = reg.vm(parent)?;
        (
            p.table.fork(),
            (p.memory.size(), p.memory.page_size()),
            p.vcpus,
            p.faults.fault_around_pages,
        )
    };
    let readahead_pages = reg
        .vms
        .get(&parent)
        .map_or(0, |p| p.faults.readahead.max_pages);
    // Children are reclaimed as their parent is.
    let reclaim = reg.vms.get(&parent).map(|p| p.reclaim.policy());
    // A paused parent forks as a template (its memfd frozen as the
    // children's base, or its own base passed on).
    let template = reg
        .vms
        .get(&parent)
        .is_some_and(|p| p.state() == crate::core::vm::RunState::Paused);
    let on_base = if core.settings.shared_bases {
        crate::core::base::for_children(&mut reg, parent, template)
    } else {
        None
    };
    let mut out = Vec::new();
    for _ in 0..count {
        let id = reg.alloc_id(&core.settings.state_dir);
        let (memory, pooled) = match new_guest_memory(core, id, size, page_size) {
            Ok(m) => m,
            Err(e) => {
                for (id, _) in out {
                    reg.forget(id);
                }
                return Err(Error::CreateMemory(e));
            }
        };
        let memory = Rc::new(memory);
        let self_src = reg.arena.vm_with_memory(id, Rc::clone(&memory));
        let (tx, rx) = oneshot::channel();
        let mut vm = Vm::new(VmParts {
            id,
            memory,
            table: table.fork(),
            self_src,
            vcpus,
            fault_around_pages: fault_around,
            readahead_pages,
            ready: tx,
        });
        vm.fork.parent = Some(parent);
        vm.start_state = Some(state.clone());
        vm.pooled = pooled;
        vm.base.on = on_base.clone();
        vm.reclaim = VmReclaim::new(reclaim.as_ref(), vm.memory.pages(), Some(&vm.table));
        crate::core::launch::make::enlist(&mut reg, vm);
        out.push((id, rx));
    }
    Ok(out)
}

/// Give each child a reflink of the parent's volume.
pub(crate) fn fork_volumes(
    core: &Core,
    parent: VmId,
    children: Vec<(VmId, Ready)>,
) -> Result<Vec<(VmId, Ready)>> {
    let parent_vol = core
        .reg
        .borrow()
        .vms
        .get(&parent)
        .and_then(|v| v.volume.clone());
    let (Some(vol), Some(engine)) = (parent_vol, core.volumes.as_ref()) else {
        return Ok(children);
    };
    for (id, _) in &children {
        let name = format!("{vol}-{id}");
        if let Err(source) = engine.reflink_volume(&vol, &name) {
            discard_vms(
                core,
                &children.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            );
            return Err(Error::ForkVolume {
                vm: *id,
                volume: vol,
                source,
            });
        }
        if let Some(v) = core.reg.borrow_mut().vms.get_mut(id) {
            v.volume = Some(name);
        }
    }
    Ok(children)
}

/// Stop and forget children of a fork that failed half-way.
pub(crate) async fn abort_children(core: &Rc<Core>, ids: &[VmId]) {
    for id in ids {
        stop_vmm(core, *id).await;
    }
    discard_vms(core, ids);
}
