//! REST handlers for memory under pressure: the limit the server keeps
//! its VMs under and what it gave back, and giving back a VM's memory
//! now.
//!
//! ```text
//! GET    /v1/memory              MemoryStatus: limit, watermark, usage, swap store
//! POST   /v1/vms/{id}/reclaim    give back every page of the VM that can be now
//! ```

use axum::extract::State;
use proto::api::{MemoryStatus, VmReclaimed};
use utoipa_axum::router::OpenApiRouter;

use super::body::{Json, Path};
use super::openapi::routes;
use super::params::VmPath;
use crate::core::{CoreHandle, Error};

/// The memory routes.
pub fn routes() -> OpenApiRouter<CoreHandle> {
    OpenApiRouter::default()
        .routes(routes!(memory))
        .routes(routes!(reclaim_vm))
}

/// The memory limit that applies to the server and its VMs, the
/// watermark it keeps them under, what is in use, what it gave back and
/// its swap store.
#[utoipa::path(get, path = "/v1/memory")]
async fn memory(State(core): State<CoreHandle>) -> Result<Json<MemoryStatus>, Error> {
    core.run(|c| async move { Ok(crate::core::reclaim::status(&c)) })
        .await
        .map(Json)
}

/// Give back every page of a VM that can be given back now, hot or not:
/// pages equal to their source are dropped, written pages go to the swap
/// store; each comes back on its next access (409 if the VM cannot be
/// reclaimed: opted out, on a shared base or hugepages, busy).
#[utoipa::path(post, path = "/v1/vms/{id}/reclaim")]
async fn reclaim_vm(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
) -> Result<Json<VmReclaimed>, Error> {
    let id = p.vm()?;
    core.run(move |c| async move { crate::core::reclaim::reclaim_now(&c, id).await })
        .await
        .map(Json)
}
