//! Deleting a VM (`DELETE /v1/vms/{id}`): its VMM is stopped; a VM other
//! tables still read from stays, frozen (`deleted`), holding only its own
//! pages until nothing reads them. And forgetting VMs whose VMM never ran
//! (a create or fork that failed half-way).

use std::rc::Rc;

use proto::api::VmDeleted;
use shared::VmId;
use tracing::{info, warn};

use crate::core::error::{Error, Result};
use crate::core::link::process::{prune_logs, stop_vmm};
use crate::core::state::Core;
use crate::core::vm::Vm;
use crate::pages::{PageTable, UNINITIALIZED};

/// `DELETE /v1/vms/{id}`.
pub(crate) async fn delete_vm(core: Rc<Core>, id: VmId) -> Result<VmDeleted> {
    if let Some(v) = crate::core::firecracker::client::delete_fc_vm(&core, id) {
        return Ok(v);
    }
    if !core.reg.borrow().vms.contains_key(&id) {
        return Err(Error::NoSuchVm(id));
    }
    // A recording of its snapshot's working set ends with it.
    crate::core::workset::record::finish(&core, id);
    stop_vmm(&core, id).await;
    let frozen = {
        let mut reg = core.reg.borrow_mut();
        if let Some(v) = reg.vms.get_mut(&id) {
            v.mark_deleted();
            forget_borrowed_pages(v);
            if let (Some(vol), Some(engine)) = (v.volume.take(), core.volumes.as_ref()) {
                if v.owns_volume || (v.fork.parent.is_some() && vol.ends_with(&format!("-{id}"))) {
                    // A fork child's (or a restored VM's) own reflinked
                    // disk goes with it.
                    let _ = engine.delete(&vol);
                }
            }
        }
        reg.collect_garbage();
        (
            reg.vms.contains_key(&id),
            crate::core::kept::kept_of(&reg, id),
        )
    };
    let (frozen, kept) = frozen;
    if !kept.is_empty() {
        let what: Vec<String> = kept
            .iter()
            .map(|k| {
                let readers: Vec<&str> = k.readers.iter().map(|r| r.vm.as_str()).collect();
                format!("{} for {}", k.memfd, readers.join(", "))
            })
            .collect();
        info!(
            "{id}: deleted; memory kept while other VMs read from it: {}",
            what.join("; ")
        );
    } else {
        info!("{id}: deleted");
    }
    prune_logs(&core);
    Ok(VmDeleted {
        id: id.to_string(),
        deleted: true,
        frozen,
        kept,
    })
}

/// A deleted VM serves only the pages it holds; its entries that point
/// elsewhere are read by nobody (a fork child reads from the holder
/// directly), so drop them: otherwise a frozen VM would keep the VMs it
/// read from alive, and WP faults would still copy pages into it.
fn forget_borrowed_pages(v: &mut Vm) {
    let mut table = PageTable::new(v.table.pages(), UNINITIALIZED);
    for (start, pages) in v.table.ranges_of(v.self_src) {
        table.set_range(start, pages, v.self_src);
    }
    v.table.replace(table);
}

/// Forget VMs whose VMM never ran (a create or fork that failed
/// half-way): their memory, sources and the volumes made for them.
pub(crate) fn discard_vms(core: &Core, ids: &[VmId]) {
    let mut reg = core.reg.borrow_mut();
    for id in ids {
        let vol = reg.vms.get_mut(id).and_then(|v| {
            // Only a fork child's (or a restored VM's) own reflinked
            // disk goes with it.
            if v.fork.parent.is_some() || v.owns_volume {
                v.volume.take()
            } else {
                None
            }
        });
        if let (Some(vol), Some(engine)) = (vol, core.volumes.as_ref()) {
            if let Err(e) = engine.delete(&vol) {
                warn!("{id}: cannot delete its volume {vol}: {}", e.chain());
            }
        }
        reg.forget(*id);
    }
    reg.release_unused_sources();
}
