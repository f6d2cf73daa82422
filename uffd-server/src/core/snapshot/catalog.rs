//! The snapshots of the state directory as the API sees them: list, show
//! (sizes on disk, readers), delete (refused while a VM reads from one).
//! The files and the catalog are the [`crate::snapshot`] module's.

use std::path::PathBuf;

use proto::api::{SnapshotDeleted, SnapshotInfo, SnapshotList, SnapshotPages};
use shared::PAGE_SIZE;
use tracing::{info, warn};

use crate::core::error::Result;
use crate::core::registry::Registry;
use crate::core::state::Core;
use crate::pages::SourceId;
use crate::snapshot::{image, SnapshotError};

/// `GET /v1/snapshots`.
pub(crate) fn list_snapshots(core: &Core) -> SnapshotList {
    let names: Vec<String> = core
        .snapshots
        .borrow()
        .iter()
        .map(|s| s.name.clone())
        .collect();
    SnapshotList {
        snapshots: names
            .iter()
            .filter_map(|n| snapshot_info(core, n).ok())
            .collect(),
        quarantined: core.snapshots.borrow().quarantined().to_vec(),
    }
}

/// `GET /v1/snapshots/{name}`.
pub(crate) fn snapshot_info(core: &Core, name: &str) -> Result<SnapshotInfo> {
    let cat = core.snapshots.borrow();
    let s = cat.get(name)?;
    let path = cat.image_of(name);
    let file = image::open_read(&path)?;
    let data: u64 = image::data_pages(&file, s.memory_bytes)
        .map_err(SnapshotError::io("read", &path))?
        .iter()
        .map(|(_, n)| n)
        .sum();
    let total = s.memory_bytes / PAGE_SIZE;
    let on_disk = |p: PathBuf| {
        std::fs::metadata(p).map_or(0, |m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
    };
    Ok(SnapshotInfo {
        name: s.name.clone(),
        vm: s.vm.clone(),
        mode: s.mode,
        parent: s.parent.clone(),
        memory_mib: s.memory_bytes >> 20,
        vcpus: s.vcpus(),
        page_size: s.page_size,
        pages: SnapshotPages {
            data,
            zero_hole: total.saturating_sub(data),
        },
        bytes_on_disk: on_disk(path.clone())
            + on_disk(cat.dir_of(name).join(crate::snapshot::STATE_FILE))
            + on_disk(cat.dir_of(name).join(crate::snapshot::ZSTD_FILE)),
        exclusive_bytes: image::exclusive_bytes(&file),
        image_extents: image::extent_count(&file),
        volume_snapshot: s.volume_snapshot.clone(),
        created: s.created,
        readers: readers_of(&core.reg.borrow(), name),
        compressed_bytes: s.files.get(crate::snapshot::ZSTD_FILE).map(|f| f.bytes),
        working_set_pages: crate::snapshot::workset::read(&cat.dir_of(name), total)
            .ok()
            .flatten()
            .map_or(0, |w| crate::snapshot::workset::page_count(&w)),
        push: core.remote.push_status(name),
    })
}

/// `DELETE /v1/snapshots/{name}`: refused while a VM reads from it.
pub(crate) fn delete_snapshot(core: &Core, name: &str) -> Result<SnapshotDeleted> {
    core.snapshots.borrow().get(name)?;
    let readers = {
        let mut reg = core.reg.borrow_mut();
        reg.collect_garbage();
        readers_of(&reg, name)
    };
    if !readers.is_empty() {
        return Err(SnapshotError::InUse {
            name: name.to_owned(),
            vms: readers,
        }
        .into());
    }
    let state = core.snapshots.borrow_mut().remove(name)?;
    if let (Some(vs), Some(engine)) = (&state.volume_snapshot, core.volumes.as_ref()) {
        if let Err(e) = engine.delete_snapshot(vs) {
            warn!(
                "snapshot {name}: cannot delete its volume snapshot {vs}: {}",
                e.chain()
            );
        }
    }
    info!("snapshot {name} deleted");
    Ok(SnapshotDeleted {
        name: name.to_owned(),
        deleted: true,
    })
}

/// VMs whose tables read pages from snapshot `name`'s image.
pub(crate) fn readers_of(reg: &Registry, name: &str) -> Vec<String> {
    let sources: Vec<SourceId> = reg
        .arena
        .image_ids()
        .filter(|id| {
            reg.arena
                .get(*id)
                .and_then(|s| s.snapshot())
                .is_some_and(|s| s == name)
        })
        .collect();
    reg.vms
        .values()
        .filter(|v| sources.iter().any(|s| v.table.count_of(*s) > 0))
        .map(|v| v.id.to_string())
        .collect()
}
