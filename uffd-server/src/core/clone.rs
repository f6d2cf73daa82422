//! `POST /v1/vms/{id}/clone`: clone(n, c) is one snapshot (`dirty` where
//! the VM has a base, else `full`), then n VMs restored from it, at most c
//! being created at once. All or nothing: if one fails, every clone made is
//! deleted, and the snapshot with them.

use std::rc::Rc;
use std::time::Instant;

use proto::api::{CloneVm, ClonedVms, CreateSnapshot, CreateVm, SnapshotMode, MAX_CLONE_COUNT};
use shared::VmId;
use tracing::{info, warn};

use crate::core::error::{Error, Result};
use crate::core::fd_budget::FdKind;
use crate::core::launch::create::create_vm;
use crate::core::launch::delete::delete_vm;
use crate::core::snapshot::catalog::delete_snapshot;
use crate::core::snapshot::save::snapshot;
use crate::core::state::Core;

fn us(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Clone `vm` `req.count` times.
pub(crate) async fn clone_vm(core: &Rc<Core>, vm: VmId, req: CloneVm) -> Result<ClonedVms> {
    check_request(&req)?;
    // Room for every clone before the snapshot is taken; each restore
    // claims its own as it starts.
    let fds = core.fds.admit(FdKind::Restore, u64::from(req.count))?;
    let t0 = Instant::now();
    // Clones are backed like their original.
    let hugepages = core
        .reg
        .borrow()
        .vms
        .get(&vm)
        .map(|v| v.memory.unit_pages() > 1);
    let name = snapshot_name(core, vm);
    let snap = snapshot(
        core,
        vm,
        CreateSnapshot {
            name: name.clone(),
            mode: SnapshotMode::Dirty,
            compress: false,
        },
    )
    .await?;
    let snapshot_us = us(t0);
    drop(fds);
    let t_create = Instant::now();
    let made = match restore_all(core, &name, &req, hugepages).await {
        Ok(made) => made,
        Err((index, made, source)) => {
            undo(core, vm, &name, &made, index, req.count).await;
            return Err(Error::CloneFailed {
                vm,
                index: u32::try_from(index + 1).unwrap_or(u32::MAX),
                count: req.count,
                source: Box::new(source),
            });
        }
    };
    let create_us = us(t_create);
    info!(
        "{vm}: {} clones from {name} ({}) in {} us",
        made.len(),
        snap.mode_used,
        us(t0)
    );
    Ok(ClonedVms {
        snapshot: name,
        clones: made,
        duration_us: us(t0),
        phases_us: [
            ("snapshot".to_owned(), snapshot_us),
            ("pause".to_owned(), snap.pause_us),
            ("create".to_owned(), create_us),
        ]
        .into_iter()
        .collect(),
    })
}

/// Refuse a clone request whose count or concurrency is out of range.
pub(crate) fn check_request(req: &CloneVm) -> Result<()> {
    if req.count == 0 || req.count > MAX_CLONE_COUNT {
        return Err(Error::BadRequest(format!(
            "count must be between 1 and {MAX_CLONE_COUNT}"
        )));
    }
    if req.concurrency == 0 {
        return Err(Error::BadRequest("concurrency must be at least 1".into()));
    }
    Ok(())
}

/// A failed clone: its index, the clones made, and why.
pub(crate) type Failed = (usize, Vec<String>, Error);

/// Restore `req.count` VMs from snapshot `name` (a local name or
/// `remote:NAME`), at most `req.concurrency` at once. Returns their ids; on
/// a failure, the first failed index, the clones made, and its error.
pub(crate) async fn restore_all(
    core: &Rc<Core>,
    name: &str,
    req: &CloneVm,
    hugepages: Option<bool>,
) -> std::result::Result<Vec<String>, Failed> {
    let gate = Rc::new(tokio::sync::Semaphore::new(
        usize::try_from(req.concurrency).unwrap_or(usize::MAX),
    ));
    let mut tasks = Vec::new();
    for _ in 0..req.count {
        let core = core.clone();
        let gate = gate.clone();
        let from = name.to_owned();
        tasks.push(tokio::task::spawn_local(async move {
            let _permit = gate.acquire().await.map_err(|_| Error::ShuttingDown)?;
            create_vm(
                core,
                CreateVm {
                    memory_mib: 0,
                    from_snapshot: Some(from),
                    vcpus: 1,
                    memory_source: None,
                    volume: None,
                    fault_around_kib: None,
                    readahead_kib: None,
                    prefetch: false,
                    hugepages,
                    reclaim: None,
                },
            )
            .await
        }));
    }
    let mut made = Vec::new();
    let mut failed = None;
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await {
            Ok(Ok(info)) => made.push(info.id),
            Ok(Err(e)) => {
                failed.get_or_insert((i, e));
            }
            Err(_) => {
                failed.get_or_insert((i, Error::ShuttingDown));
            }
        }
    }
    match failed {
        Some((index, e)) => Err((index, made, e)),
        None => Ok(made),
    }
}

/// Clone `index` of `count` failed: delete the clones `made` and snapshot
/// `name`.
async fn undo(core: &Rc<Core>, vm: VmId, name: &str, made: &[String], index: usize, count: u32) {
    warn!(
        "{vm}: clone {} of {count} failed; deleting the {} made and snapshot {name}",
        index + 1,
        made.len()
    );
    delete_clones(core, made).await;
    if let Err(e) = delete_snapshot(core, name) {
        warn!("cannot delete snapshot {name}: {}", e.message());
    }
}

/// Delete the clones `made` of a clone request that failed.
pub(crate) async fn delete_clones(core: &Rc<Core>, made: &[String]) {
    for id in made {
        if let Ok(id) = id.parse::<VmId>() {
            if let Err(e) = delete_vm(core.clone(), id).await {
                warn!("{id}: cannot delete a clone: {}", e.message());
            }
        }
    }
}

/// A snapshot name for a clone request of `vm` no snapshot has.
fn snapshot_name(core: &Core, vm: VmId) -> String {
    let cat = core.snapshots.borrow();
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let mut n = 0u32;
    loop {
        let name = format!("clone-{vm}-{ms}-{n}");
        if cat.get(&name).is_err() && !cat.tmp_dir(&name).exists() {
            return name;
        }
        n += 1;
    }
}
