//! Restoring a VM from a snapshot in the object store (`POST /v1/vms`
//! with `"from_snapshot": "remote:NAME"`), as a short list of steps:
//!
//! 1. read and check the manifest (on the store's runtime; the core only
//!    awaits it), and refuse a snapshot this host cannot run (another
//!    pagefork version, CPU features this host lacks);
//! 2. queue the chunks of its recorded working set, in first-touch order,
//!    so they are fetched while the VMM starts;
//! 3. register the VM: its table reads a [`RemoteSource`] (holes are
//!    `Uninitialized`), its VMM starts from the saved state;
//! 4. write its volume snapshot whole into a volume of its own (the disk
//!    travels with the snapshot and is pulled at restore).
//!
//! The VM then starts like any restore (`launch/create.rs`); its pages come
//! in fault by fault, each fault on a chunk not yet here parked until a
//! fetcher has it, the working set installed ahead of the guest.

use std::rc::Rc;
use std::sync::Arc;

use pagefork_remote::Manifest;
use proto::api::CreateVm;
use shared::VmId;
use tokio::sync::oneshot;
use tracing::debug;

use super::error::RemoteError;
use crate::core::error::{Error, Result};
use crate::core::launch::delete::discard_vms;
use crate::core::launch::make::{make, reserve, Origin, VmSpec};
use crate::core::state::Core;
use crate::pages::{PageSource, RemoteSource};
use crate::remote::chunks::Priority;
use crate::remote::image::RemoteImage;
use crate::remote::RemoteService;

/// Register a VM that starts from snapshot `name` in the store.
pub(crate) async fn prepare(
    core: &Rc<Core>,
    req: &CreateVm,
    name: &str,
) -> Result<(VmId, oneshot::Receiver<Result<()>>)> {
    let service = Arc::clone(core.remote.service()?);
    check_request(req)?;
    let m = manifest(&service, name).await?;
    if let Some(reason) = crate::snapshot::origin::mismatch(&m.state) {
        return Err(Error::Incompatible {
            name: format!("remote:{name}"),
            reason,
        });
    }
    let size = m.state.memory_bytes;
    if req.memory_mib != 0 && req.memory_mib << 20 != size {
        return Err(Error::BadRequest(format!(
            "snapshot remote:{name} has {} MiB of memory; leave memory_mib out",
            size >> 20
        )));
    }
    let image = Arc::new(RemoteImage::new(
        &m,
        service.url(),
        Arc::clone(&service.chunks),
    ));
    let runs = m
        .working_set
        .clone()
        .filter(|_| core.settings.prefetch_working_set);
    if let Some(runs) = &runs {
        queue_working_set(&image, runs);
    }
    let (id, ready_rx) = register(core, req, &m, image)?;
    if let Some(runs) = runs {
        core.worksets.borrow_mut().pending.insert(id, Rc::new(runs));
    }
    if m.volume.is_some() {
        if let Err(e) = attach_volume(core, &service, &m, id).await {
            core.worksets.borrow_mut().pending.remove(&id);
            discard_vms(core, &[id]);
            return Err(e);
        }
    }
    debug!("{id}: restoring from remote snapshot {name}");
    Ok((id, ready_rx))
}

/// What a restore takes from the snapshot it must not be given.
fn check_request(req: &CreateVm) -> Result<()> {
    if req.memory_source.is_some() || req.volume.is_some() || req.prefetch {
        return Err(Error::BadRequest(
            "from_snapshot takes memory and volume from the snapshot; \
             leave memory_source, volume and prefetch out"
                .into(),
        ));
    }
    Ok(())
}

/// Snapshot `name`'s manifest, read on the store's runtime.
pub(crate) async fn manifest(service: &Arc<RemoteService>, name: &str) -> Result<Manifest> {
    check_name(name)?;
    let s = Arc::clone(service);
    let name = name.to_owned();
    let m = service
        .spawn(async move { s.remote.manifest(&name).await })
        .await
        .map_err(|e| RemoteError::Worker(e.to_string()))?
        .map_err(RemoteError::from)?;
    Ok(m)
}

/// Refuse a name no snapshot in the store can have (a 400, not a
/// request the store answers).
pub(crate) fn check_name(name: &str) -> Result<()> {
    proto::manifest::check_name(name).map_err(|e| Error::BadRequest(e.to_string()))
}

/// Ask for the chunks of working set `runs`, in first-touch order.
fn queue_working_set(image: &RemoteImage, runs: &[pagefork_remote::PageRun]) {
    let mut order: Vec<u64> = Vec::new();
    for r in runs {
        for c in image.chunks_of(r.first..r.first + r.pages) {
            if order.last() != Some(&c) && !order.contains(&c) {
                order.push(c);
            }
        }
    }
    image.prefetch(order, Priority::Bulk);
}

/// Step 3: the VM, its memory and its table over the remote image.
fn register(
    core: &Core,
    req: &CreateVm,
    m: &Manifest,
    image: Arc<RemoteImage>,
) -> Result<(VmId, oneshot::Receiver<Result<()>>)> {
    let size = m.state.memory_bytes;
    let fault_around = req
        .fault_around_kib
        .map(crate::pages::FaultAround::from_kib)
        .transpose()
        .map_err(|e| Error::BadRequest(format!("fault_around_kib {e}")))?;
    let page_size = core
        .settings
        .page_size_for(req.hugepages.or(Some(m.state.hugepages)), size)?;
    let data = image.data_pages();
    let spec = VmSpec {
        size,
        page_size,
        vcpus: m.state.vcpus(),
        origin: Some(Origin {
            source: PageSource::Remote(RemoteSource { image }),
            data: Some(data),
        }),
        fault_around_pages: fault_around.map_or(core.settings.fault_around_pages, |f| f.pages()),
        readahead_pages: req
            .readahead_kib
            .map_or(core.settings.readahead_pages, |k| k / 4),
        start_state: Some(m.state.vm_state.clone()),
        // Its volume is written after (`attach_volume`).
        volume: None,
        restores: None,
        // Its clean pages map from the snapshot's base on this host,
        // filled from the chunks as VMs fault: N restores hold the
        // memory once.
        shared_base: true,
        reclaim: req.reclaim.clone(),
    };
    let mut reg = core.reg.borrow_mut();
    let id = reserve(core, &mut reg, size)?;
    let ready_rx = make(core, &mut reg, id, spec)?;
    Ok((id, ready_rx))
}

/// Step 4: a volume of `id`'s own holding the snapshot's volume snapshot,
/// written whole through the chunk cache.
async fn attach_volume(
    core: &Core,
    service: &Arc<RemoteService>,
    m: &Manifest,
    id: VmId,
) -> Result<()> {
    let engine = core.volumes.as_ref().ok_or(Error::NoVolumes)?;
    let Some(v) = &m.volume else {
        return Ok(());
    };
    let vol = format!("{}-{id}", m.name);
    engine.create(&vol, v.sum.bytes)?;
    let path = engine.volume_path(&vol);
    let bad = |reason: String| RemoteError::Volume {
        name: m.name.clone(),
        reason,
    };
    let written = match std::fs::OpenOptions::new().write(true).open(&path) {
        Ok(file) => crate::remote::volume::spawn_write(
            Arc::clone(&service.chunks),
            crate::remote::volume::volume_chunks(m),
            file,
            path.clone(),
        )
        .await
        .map_err(|_| bad("its writer thread stopped".into()))
        .and_then(|r| r.map_err(|e| bad(shared::error_chain(&e)))),
        Err(e) => Err(bad(format!("cannot open {}: {e}", path.display()))),
    };
    if let Err(e) = written {
        let _ = engine.delete(&vol);
        return Err(e.into());
    }
    if let Some(vm) = core.reg.borrow_mut().vms.get_mut(&id) {
        vm.volume = Some(vol);
        vm.owns_volume = true;
    }
    Ok(())
}
