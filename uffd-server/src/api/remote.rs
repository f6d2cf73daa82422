//! REST handlers for snapshots in the object store (`--remote`; without
//! it every route answers 400 and says how to configure one).
//!
//! ```text
//! POST   /v1/snapshots/{name}/push          push a local snapshot (202; progress in
//!                                           GET /v1/snapshots/{name}: "push")
//! GET    /v1/remote                         the store and what was fetched from it
//! GET    /v1/remote/snapshots               every snapshot in the store
//! GET    /v1/remote/snapshots/{name}        one (what its manifest says)
//! DELETE /v1/remote/snapshots/{name}        delete it (its chunks go at the next gc)
//! POST   /v1/remote/snapshots/{name}/pull   {"name"}: into the local catalog
//! POST   /v1/remote/snapshots/{name}/clone  {"count", "concurrency"}: n VMs, all or none
//! POST   /v1/remote/gc                      delete chunks no manifest names
//! ```
//!
//! `POST /v1/vms` with `{"from_snapshot": "remote:NAME"}` restores one
//! VM lazily.

use axum::extract::State;
use proto::api::{
    CloneVm, ClonedVms, PullSnapshot, RemoteGc, RemoteSnapshotDeleted, RemoteSnapshotInfo,
    RemoteSnapshotList, RemoteStatus, SnapshotInfo, SnapshotPulled,
};
use utoipa_axum::router::OpenApiRouter;

use super::body::{Accepted, Created, Json, Path};
use super::openapi::routes;
use super::params::SnapshotPath;
use crate::core::{CoreHandle, Error};

/// The object-store routes.
pub fn routes() -> OpenApiRouter<CoreHandle> {
    OpenApiRouter::default()
        .routes(routes!(push_snapshot))
        .routes(routes!(remote_status))
        .routes(routes!(list_remote))
        .routes(routes!(get_remote, delete_remote))
        .routes(routes!(pull_remote))
        .routes(routes!(clone_remote))
        .routes(routes!(remote_gc))
}

/// Push a local snapshot to the object store, with its volume snapshot
/// and recorded working set, in the background: it answers at once, and
/// `GET /v1/snapshots/{name}` shows the push's progress (`push`).
#[utoipa::path(post, path = "/v1/snapshots/{name}/push")]
async fn push_snapshot(
    State(core): State<CoreHandle>,
    Path(p): Path<SnapshotPath>,
) -> Result<Accepted<SnapshotInfo>, Error> {
    core.run(move |c| async move { c.push_snapshot(&p.name) })
        .await
        .map(Accepted)
}

/// The object store, and the chunks fetched from it.
#[utoipa::path(get, path = "/v1/remote")]
async fn remote_status(State(core): State<CoreHandle>) -> Result<Json<RemoteStatus>, Error> {
    core.run(|c| async move { c.remote_status() })
        .await
        .map(Json)
}

/// Every snapshot in the object store.
#[utoipa::path(get, path = "/v1/remote/snapshots")]
async fn list_remote(State(core): State<CoreHandle>) -> Result<Json<RemoteSnapshotList>, Error> {
    core.run(|c| async move { c.remote_snapshots().await })
        .await
        .map(Json)
}

/// One snapshot in the object store, as its manifest describes it.
#[utoipa::path(get, path = "/v1/remote/snapshots/{name}")]
async fn get_remote(
    State(core): State<CoreHandle>,
    Path(p): Path<SnapshotPath>,
) -> Result<Json<RemoteSnapshotInfo>, Error> {
    core.run(move |c| async move { c.remote_snapshot(&p.name).await })
        .await
        .map(Json)
}

/// Delete a snapshot from the object store: it is no longer listed, and
/// the chunks no other snapshot names go at the next gc.
#[utoipa::path(delete, path = "/v1/remote/snapshots/{name}")]
async fn delete_remote(
    State(core): State<CoreHandle>,
    Path(p): Path<SnapshotPath>,
) -> Result<Json<RemoteSnapshotDeleted>, Error> {
    core.run(move |c| async move { c.delete_remote_snapshot(&p.name).await })
        .await
        .map(Json)
}

/// Pull a whole snapshot from the object store into the local catalog
/// (and its volume snapshot into the volume engine).
#[utoipa::path(post, path = "/v1/remote/snapshots/{name}/pull")]
async fn pull_remote(
    State(core): State<CoreHandle>,
    Path(p): Path<SnapshotPath>,
    req: Option<Json<PullSnapshot>>,
) -> Result<Created<SnapshotPulled>, Error> {
    let req = req.map(|Json(r)| r).unwrap_or_default();
    core.run(move |c| async move { c.pull_snapshot(&p.name, req).await })
        .await
        .map(Created)
}

/// Start `count` VMs from a snapshot in the object store, all or none,
/// each before its memory is here.
#[utoipa::path(post, path = "/v1/remote/snapshots/{name}/clone")]
async fn clone_remote(
    State(core): State<CoreHandle>,
    Path(p): Path<SnapshotPath>,
    Json(req): Json<CloneVm>,
) -> Result<Created<ClonedVms>, Error> {
    core.run(move |c| async move { c.clone_remote(&p.name, req).await })
        .await
        .map(Created)
}

/// Delete the chunks no snapshot in the object store names (left by
/// deleted snapshots and pushes that never committed); 409 while a push
/// runs.
#[utoipa::path(post, path = "/v1/remote/gc")]
async fn remote_gc(State(core): State<CoreHandle>) -> Result<Json<RemoteGc>, Error> {
    core.run(|c| async move { c.remote_gc().await })
        .await
        .map(Json)
}
