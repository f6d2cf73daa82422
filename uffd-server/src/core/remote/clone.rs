//! `POST /v1/remote/snapshots/{name}/clone`: clone(n, c) of a snapshot in
//! the object store: n VMs restored from it (each started before its
//! memory is here), at most c being created at once. All or nothing: if
//! one fails, every clone made is deleted. The clones read the same
//! chunks, which are fetched once and kept in memory for all of them.

use std::rc::Rc;
use std::time::Instant;

use proto::api::{CloneVm, ClonedVms, CreateVm, MAX_CLONE_COUNT, REMOTE_PREFIX};
use shared::VmId;
use tracing::{info, warn};

use super::restore::check_name;
use crate::core::error::{Error, Result};
use crate::core::launch::create::create_vm;
use crate::core::launch::delete::delete_vm;
use crate::core::state::Core;

/// Clone remote snapshot `name` `req.count` times.
pub(crate) async fn clone_remote(core: &Rc<Core>, name: &str, req: CloneVm) -> Result<ClonedVms> {
    core.remote.service()?;
    check_name(name)?;
    if req.count == 0 || req.count > MAX_CLONE_COUNT {
        return Err(Error::BadRequest(format!(
            "count must be between 1 and {MAX_CLONE_COUNT}"
        )));
    }
    if req.concurrency == 0 {
        return Err(Error::BadRequest("concurrency must be at least 1".into()));
    }
    let t0 = Instant::now();
    let from = format!("{REMOTE_PREFIX}{name}");
    let gate = Rc::new(tokio::sync::Semaphore::new(
        usize::try_from(req.concurrency).unwrap_or(usize::MAX),
    ));
    let mut tasks = Vec::new();
    for _ in 0..req.count {
        let (core, gate, from) = (core.clone(), gate.clone(), from.clone());
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
                    hugepages: None,
                },
            )
            .await
        }));
    }
    let mut made = Vec::new();
    let mut failed = None;
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await {
            Ok(Ok(vm)) => made.push(vm.id),
            Ok(Err(e)) => {
                failed.get_or_insert((i, e));
            }
            Err(_) => {
                failed.get_or_insert((i, Error::ShuttingDown));
            }
        }
    }
    if let Some((index, e)) = failed {
        warn!(
            "clone {} of {} of remote snapshot {name} failed; deleting the {} made",
            index + 1,
            req.count,
            made.len()
        );
        for id in &made {
            if let Ok(id) = id.parse::<VmId>() {
                if let Err(err) = delete_vm(core.clone(), id).await {
                    warn!("{id}: cannot delete a clone: {}", err.message());
                }
            }
        }
        return Err(Error::RemoteCloneFailed {
            name: name.to_owned(),
            index: u32::try_from(index + 1).unwrap_or(u32::MAX),
            count: req.count,
            source: Box::new(e),
        });
    }
    let us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
    info!("{} clones of remote snapshot {name} in {us} us", made.len());
    Ok(ClonedVms {
        snapshot: from,
        clones: made,
        duration_us: us,
        phases_us: [("create".to_owned(), us)].into_iter().collect(),
    })
}
