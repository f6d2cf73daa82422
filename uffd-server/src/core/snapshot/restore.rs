//! Restoring a VM from a snapshot (`POST /v1/vms` with `from_snapshot`):
//! its table reads the snapshot's image (holes are `Uninitialized` up
//! front, a compressed image's zero frames too), its volume is a reflink
//! of the snapshot's, and its VMM starts from the saved vCPU and device
//! state. Pages come in lazily, fault by fault.

use proto::api::CreateVm;
use shared::VmId;
use tokio::sync::oneshot;
use tracing::debug;

use crate::core::error::{Error, Result};
use crate::core::launch::make::{make, reserve, Origin, VmSpec};
use crate::core::sources::open_snapshot_memory;
use crate::core::state::Core;

/// Register a VM that starts from snapshot `name` (`POST /v1/vms`
/// with `from_snapshot`): its table reads the snapshot's image (holes
/// are `Uninitialized` up front), its VMM starts from the saved state.
pub(crate) fn prepare_restore(
    core: &Core,
    req: &CreateVm,
    name: &str,
) -> Result<(VmId, oneshot::Receiver<Result<()>>)> {
    // What a restore needs of the snapshot, not all of it (the
    // checksums of every chunk stay in the catalog).
    let (size, hugepages, compressed, volume_snapshot, vm_state, path) = {
        let cat = core.snapshots.borrow();
        let st = cat.get(name)?;
        (
            st.memory_bytes,
            st.hugepages,
            st.files.contains_key(crate::snapshot::ZSTD_FILE),
            st.volume_snapshot.clone(),
            st.vm_state.clone(),
            cat.image_of(name),
        )
    };
    if let Some(reason) = core
        .snapshots
        .borrow()
        .get(name)
        .ok()
        .and_then(crate::snapshot::origin::mismatch)
    {
        return Err(Error::Incompatible {
            name: name.to_owned(),
            reason,
        });
    }
    if req.memory_mib != 0 && req.memory_mib << 20 != size {
        return Err(Error::BadRequest(format!(
            "snapshot {name} has {} MiB of memory; leave memory_mib out",
            size >> 20
        )));
    }
    if req.memory_source.is_some() || req.volume.is_some() || req.prefetch {
        return Err(Error::BadRequest(
            "from_snapshot takes memory and volume from the snapshot; \
             leave memory_source, volume and prefetch out"
                .into(),
        ));
    }
    let fault_around = req
        .fault_around_kib
        .map(crate::pages::FaultAround::from_kib)
        .transpose()
        .map_err(|e| Error::BadRequest(format!("fault_around_kib {e}")))?;
    // Backed like the VM the snapshot was taken of, unless asked.
    let page_size = core
        .settings
        .page_size_for(req.hugepages.or(Some(hugepages)), size)?;
    let (source, data) = open_snapshot_memory(core, name, compressed, &path)?;
    let mut reg = core.reg.borrow_mut();
    let id = reserve(core, &mut reg, size)?;
    let volume = match (&volume_snapshot, core.volumes.as_ref()) {
        (Some(vs), Some(engine)) => {
            let vol = format!("{name}-{id}");
            engine.clone_snapshot(vs, &vol)?;
            Some(vol)
        }
        (Some(_), None) => return Err(Error::NoVolumes),
        (None, _) => None,
    };
    let spec = VmSpec {
        size,
        page_size,
        vcpus: u8::try_from(vm_state.vcpus.len()).unwrap_or(u8::MAX),
        origin: Some(Origin {
            source,
            data: Some(data),
        }),
        fault_around_pages: fault_around.map_or(core.settings.fault_around_pages, |f| f.pages()),
        readahead_pages: req
            .readahead_kib
            .map_or(core.settings.readahead_pages, |k| k / 4),
        start_state: Some(vm_state),
        volume: volume.clone().map(|v| (v, true)),
        restores: Some(name.to_owned()),
        shared_base: true,
        reclaim: req.reclaim.clone(),
    };
    let ready_rx = match make(core, &mut reg, id, spec) {
        Ok(r) => r,
        Err(e) => {
            if let (Some(vol), Some(engine)) = (&volume, core.volumes.as_ref()) {
                let _ = engine.delete(vol);
            }
            return Err(e);
        }
    };
    // Logged with the start (`create_vm`): one line per VM started.
    debug!("{id}: restoring from snapshot {name}");
    Ok((id, ready_rx))
}
