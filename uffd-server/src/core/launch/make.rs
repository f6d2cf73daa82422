//! The one way a VM comes to be: [`make`] builds it from a [`VmSpec`]
//! (a create, fresh or from an image; a restore from a local or a remote
//! snapshot, which a clone is too) and [`enlist`] enters it in the
//! registry, the one place any VM does (a fork's children and a VM taken
//! back after a restart of the server too). An option every VM takes at
//! its start is one field of `VmSpec`, read in one place.

use std::rc::Rc;

use shared::{VmId, VmState, PAGE_SIZE};
use tokio::sync::oneshot;

use crate::core::error::{Error, Result};
use crate::core::pool::take::new_guest_memory;
use crate::core::reclaim::state::VmReclaim;
use crate::core::registry::Registry;
use crate::core::state::Core;
use crate::core::vm::{Vm, VmParts};
use crate::memory::PageSize;
use crate::pages::{PageSource, PageTable, UNINITIALIZED};

/// Where a new VM's pages come from until it writes them.
#[derive(Debug)]
pub(crate) struct Origin {
    pub source: PageSource,
    /// The runs of pages the source holds, `(first, count)`; the rest read
    /// as zero. `None`: every page.
    pub data: Option<Vec<(u64, u64)>>,
}

/// Everything a new VM is made of.
#[derive(Debug)]
pub(crate) struct VmSpec {
    pub size: u64,
    pub page_size: PageSize,
    pub vcpus: u8,
    /// `None`: every page starts as zero.
    pub origin: Option<Origin>,
    pub fault_around_pages: u64,
    pub readahead_pages: u64,
    /// The vCPU and device state it starts from (a restore).
    pub start_state: Option<VmState>,
    /// Its disk, and whether it was made for it (and goes with it).
    pub volume: Option<(String, bool)>,
    /// The snapshot it restores: its incremental snapshots start there.
    pub restores: Option<String>,
    /// Map the origin's clean pages from a shared base (one copy per
    /// host) instead of copying them in.
    pub shared_base: bool,
    /// How its memory may be given back under pressure.
    pub reclaim: Option<proto::api::ReclaimPolicy>,
}

/// Admit a VM of `size` bytes against the budget and give it an id.
pub(crate) fn reserve(core: &Core, reg: &mut Registry, size: u64) -> Result<VmId> {
    crate::core::reclaim::admit(core)?;
    reg.admit(&core.settings, 1, size)?;
    Ok(reg.alloc_id(&core.settings.state_dir))
}

/// Make VM `id` (from [`reserve`]) of `spec`, waiting for its VMM.
/// Returns what fires when its guest runs.
pub(crate) fn make(
    core: &Core,
    reg: &mut Registry,
    id: VmId,
    spec: VmSpec,
) -> Result<oneshot::Receiver<Result<()>>> {
    let (memory, pooled) =
        new_guest_memory(core, id, spec.size, spec.page_size).map_err(Error::CreateMemory)?;
    let memory = Rc::new(memory);
    let self_src = reg.arena.vm_with_memory(id, Rc::clone(&memory));
    let pages = spec.size / PAGE_SIZE;
    let mut table = PageTable::new(pages, UNINITIALIZED);
    let src = spec.origin.map(|o| {
        let src = reg.arena.insert(o.source);
        match o.data {
            None => table.set_range(0, pages, src),
            Some(runs) => {
                for (first, n) in runs {
                    table.set_range(first, n.min(pages.saturating_sub(first)), src);
                }
            }
        }
        src
    });
    let (ready, ready_rx) = oneshot::channel();
    let mut vm = Vm::new(VmParts {
        id,
        memory,
        table,
        self_src,
        vcpus: spec.vcpus,
        fault_around_pages: spec.fault_around_pages,
        readahead_pages: spec.readahead_pages,
        ready,
    });
    vm.start_state = spec.start_state.map(Rc::new);
    if let (Some(name), Some(src)) = (spec.restores, src) {
        vm.snapshot.base = Some((name, src));
    }
    if let Some((volume, owns)) = spec.volume {
        vm.volume = Some(volume);
        vm.owns_volume = owns;
    }
    vm.pooled = pooled;
    vm.reclaim = VmReclaim::new(spec.reclaim.as_ref(), pages, Some(&vm.table));
    enlist(reg, vm);
    if let Some(src) = src.filter(|_| spec.shared_base && core.settings.shared_bases) {
        crate::core::base::attach_image(reg, id, src);
    }
    Ok(ready_rx)
}

/// Enter `vm` in the registry.
pub(crate) fn enlist(reg: &mut Registry, vm: Vm) {
    reg.vms.insert(vm.id, vm);
}
