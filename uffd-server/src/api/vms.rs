//! REST handlers for VMs: create, list, show, delete, pause, resume, guest
//! ops, live fork.
//!
//! ```text
//! POST   /v1/vms                 CreateVm: start a VM
//! GET    /v1/vms                 every VM
//! GET    /v1/vms/{id}            one VM
//! DELETE /v1/vms/{id}            delete (kept frozen while others read from it)
//! POST   /v1/vms/{id}/pause      pause its vCPUs
//! POST   /v1/vms/{id}/resume     run them again
//! POST   /v1/vms/{id}/exec       ExecRequest: a guest op
//! POST   /v1/vms/{id}/fork       ForkRequest (optional): live fork
//! ```

use axum::extract::State;
use proto::api::{
    BaseList, CreateVm, ExecRequest, ExecResponse, ForkRequest, ForkResponse, VmDeleted, VmInfo,
    VmList,
};
use utoipa_axum::router::OpenApiRouter;

use super::body::{Created, Json, Path};
use super::openapi::routes;
use super::params::VmPath;
use crate::core::{CoreHandle, Error};

/// The VM routes.
pub fn routes() -> OpenApiRouter<CoreHandle> {
    OpenApiRouter::default()
        .routes(routes!(create_vm, list_vms))
        .routes(routes!(get_vm, delete_vm))
        .routes(routes!(pause))
        .routes(routes!(resume))
        .routes(routes!(exec))
        .routes(routes!(fork))
        .routes(routes!(list_bases))
}

/// Every shared base: what it holds, its memory, the VMs that map it.
#[utoipa::path(get, path = "/v1/bases")]
async fn list_bases(State(core): State<CoreHandle>) -> Result<Json<BaseList>, Error> {
    core.run(|c| async move { Ok(c.list_bases()) })
        .await
        .map(Json)
}

/// Start a VM; it answers once the guest runs.
#[utoipa::path(post, path = "/v1/vms")]
async fn create_vm(
    State(core): State<CoreHandle>,
    Json(req): Json<CreateVm>,
) -> Result<Created<VmInfo>, Error> {
    core.run(move |c| c.create_vm(req)).await.map(Created)
}

/// Every VM.
#[utoipa::path(get, path = "/v1/vms")]
async fn list_vms(State(core): State<CoreHandle>) -> Result<Json<VmList>, Error> {
    core.run(|c| async move { Ok(c.list_vms()) })
        .await
        .map(Json)
}

/// One VM.
#[utoipa::path(get, path = "/v1/vms/{id}")]
async fn get_vm(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
) -> Result<Json<VmInfo>, Error> {
    let id = p.vm()?;
    core.run(move |c| async move { c.info(id) }).await.map(Json)
}

/// Delete a VM: its VMM stops; its memory stays, frozen, while other VMs
/// read from it.
#[utoipa::path(delete, path = "/v1/vms/{id}")]
async fn delete_vm(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
) -> Result<Json<VmDeleted>, Error> {
    let id = p.vm()?;
    core.run(move |c| c.delete_vm(id)).await.map(Json)
}

/// Pause a running VM's vCPUs.
#[utoipa::path(post, path = "/v1/vms/{id}/pause")]
async fn pause(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
) -> Result<Json<VmInfo>, Error> {
    let id = p.vm()?;
    core.run(move |c| c.pause(id)).await.map(Json)
}

/// Run a paused VM again.
#[utoipa::path(post, path = "/v1/vms/{id}/resume")]
async fn resume(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
) -> Result<Json<VmInfo>, Error> {
    let id = p.vm()?;
    core.run(move |c| c.resume(id)).await.map(Json)
}

/// Run one op in the guest and answer its result.
#[utoipa::path(post, path = "/v1/vms/{id}/exec")]
async fn exec(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
    Json(req): Json<ExecRequest>,
) -> Result<Json<ExecResponse>, Error> {
    let id = p.vm()?;
    core.run(move |c| async move { c.exec(id, req).await })
        .await
        .map(Json)
}

/// Fork a running VM live into `count` children (one without a body);
/// it answers once they run.
#[utoipa::path(post, path = "/v1/vms/{id}/fork")]
async fn fork(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
    req: Option<Json<ForkRequest>>,
) -> Result<Created<ForkResponse>, Error> {
    let id = p.vm()?;
    let req = req.map(|Json(r)| r).unwrap_or_default();
    core.run(move |c| async move { c.fork(id, req.count).await })
        .await
        .map(Created)
}
