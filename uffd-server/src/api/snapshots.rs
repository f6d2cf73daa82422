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

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;

use super::{call, parse_body, vm_id, ApiResult};
use crate::core::{CommandKind, CoreHandle};

/// The snapshot routes, to merge into the VM router.
pub fn routes() -> Router<CoreHandle> {
    Router::new()
        .route("/v1/vms/{id}/snapshots", post(create_snapshot))
        .route("/v1/vms/{id}/rollback", post(rollback_vm))
        .route("/v1/vms/{id}/clone", post(clone_vm))
        .route("/v1/snapshots", get(list_snapshots))
        .route(
            "/v1/snapshots/{name}",
            get(get_snapshot).delete(delete_snapshot),
        )
}

#[utoipa::path(
    post,
    path = "/v1/vms/{id}/snapshots",
    params(("id" = String, description = "a VM id (vm-N)")),
    request_body = proto::api::CreateSnapshot,
    responses(
        (status = 201, description = "the snapshot is complete on disk", body = proto::api::SnapshotCreated),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
pub(super) async fn create_snapshot(
    State(core): State<CoreHandle>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    let id = vm_id(&id)?;
    let req = parse_body(&body)?;
    call(&core, CommandKind::Snapshot(id, req), StatusCode::CREATED).await
}

#[utoipa::path(
    get,
    path = "/v1/snapshots",
    responses(
        (status = 200, description = "every complete snapshot", body = proto::api::SnapshotList),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
pub(super) async fn list_snapshots(State(core): State<CoreHandle>) -> ApiResult {
    call(&core, CommandKind::ListSnapshots, StatusCode::OK).await
}

#[utoipa::path(
    get,
    path = "/v1/snapshots/{name}",
    params(("name" = String, description = "a snapshot name")),
    responses(
        (status = 200, description = "the snapshot", body = proto::api::SnapshotInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
pub(super) async fn get_snapshot(
    State(core): State<CoreHandle>,
    Path(name): Path<String>,
) -> ApiResult {
    call(&core, CommandKind::GetSnapshot(name), StatusCode::OK).await
}

#[utoipa::path(
    delete,
    path = "/v1/snapshots/{name}",
    params(("name" = String, description = "a snapshot name")),
    responses(
        (status = 200, description = "deleted", body = proto::api::SnapshotDeleted),
        (status = "4XX", description = "the request is wrong (409: VMs still read from it)", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
pub(super) async fn delete_snapshot(
    State(core): State<CoreHandle>,
    Path(name): Path<String>,
) -> ApiResult {
    call(&core, CommandKind::DeleteSnapshot(name), StatusCode::OK).await
}

#[utoipa::path(
    post,
    path = "/v1/vms/{id}/rollback",
    params(("id" = String, description = "a VM id (vm-N)")),
    request_body = proto::api::RollbackVm,
    responses(
        (status = 200, description = "the VM runs from the snapshot's moment", body = proto::api::VmRolledBack),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
pub(super) async fn rollback_vm(
    State(core): State<CoreHandle>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    let id = vm_id(&id)?;
    let req = parse_body(&body)?;
    call(&core, CommandKind::Rollback(id, req), StatusCode::OK).await
}

#[utoipa::path(
    post,
    path = "/v1/vms/{id}/clone",
    params(("id" = String, description = "a VM id (vm-N)")),
    request_body = proto::api::CloneVm,
    responses(
        (status = 201, description = "every clone runs", body = proto::api::ClonedVms),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed; no clone was kept", body = proto::api::ErrorBody)
    )
)]
pub(super) async fn clone_vm(
    State(core): State<CoreHandle>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    let id = vm_id(&id)?;
    let req = parse_body(&body)?;
    call(&core, CommandKind::Clone(id, req), StatusCode::CREATED).await
}
