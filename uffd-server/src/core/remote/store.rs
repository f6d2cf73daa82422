//! The store's snapshots as the API sees them: list, show (what the
//! manifest says), delete, collect garbage, and the store's counters. Each
//! request runs on the store's runtime; the core awaits it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, UNIX_EPOCH};

use proto::api::{
    ChunkCacheStatus, PushState, RemoteGc, RemoteSnapshotDeleted, RemoteSnapshotInfo,
    RemoteSnapshotList, RemoteSnapshotSummary, RemoteStatus,
};
use tracing::info;

use super::error::RemoteError;
use super::restore::{check_name, manifest};
use crate::core::error::Result;
use crate::core::state::Core;
use crate::remote::RemoteService;

/// Run `f(remote)` on the store's runtime and await it.
async fn on_store<T, F, Fut>(service: &Arc<RemoteService>, f: F) -> Result<T>
where
    F: FnOnce(pagefork_remote::Remote) -> Fut,
    Fut: std::future::Future<Output = pagefork_remote::Result<T>> + Send + 'static,
    T: Send + 'static,
{
    let fut = f(service.remote.clone());
    Ok(service
        .spawn(fut)
        .await
        .map_err(|e| RemoteError::Worker(e.to_string()))?
        .map_err(RemoteError::from)?)
}

/// `GET /v1/remote/snapshots`.
pub(crate) async fn list(core: &Core) -> Result<RemoteSnapshotList> {
    let service = Arc::clone(core.remote.service()?);
    let listed = on_store(&service, |r| async move { r.list_snapshots().await }).await?;
    Ok(RemoteSnapshotList {
        url: service.url(),
        snapshots: listed
            .into_iter()
            .map(|s| RemoteSnapshotSummary {
                name: s.name,
                committed: s
                    .committed
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                manifest_bytes: s.manifest_bytes,
            })
            .collect(),
    })
}

/// `GET /v1/remote/snapshots/{name}`.
pub(crate) async fn info(core: &Core, name: &str) -> Result<RemoteSnapshotInfo> {
    let service = Arc::clone(core.remote.service()?);
    let m = manifest(&service, name).await?;
    let chunks = m.memory_chunks();
    let holes = chunks.iter().filter(|c| c.stored.is_none()).count() as u64;
    let stored_bytes = chunks.iter().filter_map(|c| c.stored).map(u64::from).sum();
    Ok(RemoteSnapshotInfo {
        name: m.name.clone(),
        url: service.url(),
        pushed: m.pushed,
        vm: m.state.vm.clone(),
        memory_mib: m.state.memory_bytes >> 20,
        vcpus: m.state.vcpus(),
        hugepages: m.state.hugepages,
        chunks: chunks.len() as u64,
        holes,
        stored_bytes,
        volume_snapshot: m.volume.as_ref().map(|v| v.name.clone()),
        volume_bytes: m.volume.as_ref().map_or(0, |v| v.sum.bytes),
        working_set_pages: m
            .working_set
            .as_ref()
            .map_or(0, |w| crate::snapshot::workset::page_count(w)),
        pagefork_version: m.state.origin.as_ref().map(|o| o.pagefork_version.clone()),
    })
}

/// `DELETE /v1/remote/snapshots/{name}`.
pub(crate) async fn delete(core: &Core, name: &str) -> Result<RemoteSnapshotDeleted> {
    let service = Arc::clone(core.remote.service()?);
    check_name(name)?;
    let n = name.to_owned();
    let deleted = on_store(&service, |r| async move { r.delete(&n).await }).await?;
    if deleted {
        info!("remote snapshot {name} deleted from {}", service.url());
    }
    Ok(RemoteSnapshotDeleted {
        name: name.to_owned(),
        deleted,
    })
}

/// `POST /v1/remote/gc`.
pub(crate) async fn gc(core: &Core) -> Result<RemoteGc> {
    let service = Arc::clone(core.remote.service()?);
    let t0 = Instant::now();
    let r = on_store(&service, |r| async move { r.gc().await }).await?;
    info!(
        "gc of {}: {} chunks deleted ({} bytes), {} kept",
        service.url(),
        r.chunks_deleted,
        r.bytes_deleted,
        r.chunks_kept
    );
    Ok(RemoteGc {
        manifests: r.manifests,
        chunks_kept: r.chunks_kept,
        chunks_deleted: r.chunks_deleted,
        bytes_deleted: r.bytes_deleted,
        stale_locks_deleted: r.stale_locks_deleted,
        duration_us: u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX),
    })
}

/// `GET /v1/remote`.
pub(crate) fn status(core: &Core) -> Result<RemoteStatus> {
    let service = core.remote.service()?;
    let pool = &service.chunks;
    let c = pool.cache().stats();
    let (memory_chunks, memory_bytes, memory_capacity_bytes) = pool.memory();
    let pushes_running = core
        .remote
        .pushes
        .borrow()
        .values()
        .filter(|p| {
            p.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .state
                == PushState::Running
        })
        .count() as u64;
    Ok(RemoteStatus {
        url: service.url(),
        endpoint: service.remote.endpoint().to_owned(),
        fetched_chunks: pool.stats.fetched_chunks.load(Ordering::Relaxed),
        fetched_bytes: pool.stats.fetched_bytes.load(Ordering::Relaxed),
        fetch_failures: pool.stats.failures.load(Ordering::Relaxed),
        memory_chunks,
        memory_bytes,
        memory_capacity_bytes,
        cache: ChunkCacheStatus {
            chunks: c.entries,
            bytes: c.bytes,
            capacity_bytes: pool.cache().capacity(),
            hits: c.hits,
            fetches: c.fetches,
            waits: c.waits,
            evictions: c.evictions,
            damaged: c.damaged,
        },
        pushes_running,
        pulls: core
            .remote
            .pulls
            .borrow()
            .values()
            .map(|p| {
                p.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clone()
            })
            .collect(),
    })
}
