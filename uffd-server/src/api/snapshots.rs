//! REST handlers for VM snapshots.
//!
//! ```text
//! POST   /v1/vms/{id}/snapshots     {"name", "mode"}: snapshot a running VM
//! GET    /v1/snapshots              every complete snapshot
//! GET    /v1/snapshots/{name}       one snapshot
//! DELETE /v1/snapshots/{name}       delete (409 while a VM reads from it)
//! POST   /v1/vms/{id}/rollback      {"snapshot"}: roll the VM back in place
//! POST   /v1/vms/{id}/clone         {"count", "concurrency"}: n VMs, all or none
//! ```
//!
//! `POST /v1/vms` with `{"from_snapshot": "name"}` starts a VM from one.

use axum::extract::State;
use proto::api::{
    CloneVm, ClonedVms, CreateSnapshot, RollbackVm, SnapshotCreated, SnapshotDeleted, SnapshotInfo,
    SnapshotList, VmRolledBack,
};
use utoipa_axum::router::OpenApiRouter;

use super::body::{Created, Json, Path};
use super::openapi::routes;
use super::params::{SnapshotPath, VmPath};
use crate::core::{CoreHandle, Error};

/// The snapshot routes.
pub fn routes() -> OpenApiRouter<CoreHandle> {
    OpenApiRouter::default()
        .routes(routes!(create_snapshot))
        .routes(routes!(rollback_vm))
        .routes(routes!(clone_vm))
        .routes(routes!(list_snapshots))
        .routes(routes!(get_snapshot, delete_snapshot))
}

/// Snapshot a VM; it answers once the snapshot is complete on disk (507
/// when the disk has not the room for it).
#[utoipa::path(post, path = "/v1/vms/{id}/snapshots")]
async fn create_snapshot(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
    Json(req): Json<CreateSnapshot>,
) -> Result<Created<SnapshotCreated>, Error> {
    let id = p.vm()?;
    core.run(move |c| async move { c.snapshot(id, req).await })
        .await
        .map(Created)
}

/// Every complete snapshot.
#[utoipa::path(get, path = "/v1/snapshots")]
async fn list_snapshots(State(core): State<CoreHandle>) -> Result<Json<SnapshotList>, Error> {
    core.run(|c| async move { Ok(c.list_snapshots()) })
        .await
        .map(Json)
}

/// One snapshot.
#[utoipa::path(get, path = "/v1/snapshots/{name}")]
async fn get_snapshot(
    State(core): State<CoreHandle>,
    Path(p): Path<SnapshotPath>,
) -> Result<Json<SnapshotInfo>, Error> {
    core.run(move |c| async move { c.snapshot_info(&p.name) })
        .await
        .map(Json)
}

/// Delete a snapshot (409 while VMs read from it).
#[utoipa::path(delete, path = "/v1/snapshots/{name}")]
async fn delete_snapshot(
    State(core): State<CoreHandle>,
    Path(p): Path<SnapshotPath>,
) -> Result<Json<SnapshotDeleted>, Error> {
    core.run(move |c| async move { c.delete_snapshot(&p.name) })
        .await
        .map(Json)
}

/// Roll a VM back in place to a snapshot's moment; it answers once the VM
/// runs from there (409, the VM untouched, when the snapshot was taken of
/// a VM of another shape: vCPUs, memory size, volume).
#[utoipa::path(post, path = "/v1/vms/{id}/rollback")]
async fn rollback_vm(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
    Json(req): Json<RollbackVm>,
) -> Result<Json<VmRolledBack>, Error> {
    let id = p.vm()?;
    core.run(move |c| async move { c.rollback(id, req).await })
        .await
        .map(Json)
}

/// Clone a VM `count` times, all or none: once every clone runs, or none
/// is kept.
#[utoipa::path(post, path = "/v1/vms/{id}/clone")]
async fn clone_vm(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
    Json(req): Json<CloneVm>,
) -> Result<Created<ClonedVms>, Error> {
    let id = p.vm()?;
    core.run(move |c| async move { c.clone_vm(id, req).await })
        .await
        .map(Created)
}
