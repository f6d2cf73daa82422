//! REST handlers for memory-source debugging.
//!
//! ```text
//! GET /v1/vms/{id}/sources             pages per source, the table as extents
//! GET /v1/vms/{id}/pages/{page}        one page's source (?explain=true: its chain)
//! GET /v1/tree                         the fork tree
//! GET /v1/debug/invariant              the table-vs-memfd check
//! ```

use axum::extract::State;
use proto::api::{Invariant, PageInfo, PageQuery, Sources, Tree};
use utoipa_axum::router::OpenApiRouter;

use super::body::{Json, Path, Query};
use super::openapi::routes;
use super::params::{PagePath, VmPath};
use crate::core::{CoreHandle, Error};

/// The debugging routes.
pub fn routes() -> OpenApiRouter<CoreHandle> {
    OpenApiRouter::default()
        .routes(routes!(sources))
        .routes(routes!(page))
        .routes(routes!(tree))
        .routes(routes!(invariant))
}

/// How many pages of the VM read from each source, and its page table as
/// extents.
#[utoipa::path(get, path = "/v1/vms/{id}/sources")]
async fn sources(
    State(core): State<CoreHandle>,
    Path(p): Path<VmPath>,
) -> Result<Json<Sources>, Error> {
    let id = p.vm()?;
    core.run(move |c| async move { c.sources(id) })
        .await
        .map(Json)
}

/// Where one page's bytes come from; with `?explain=true`, the whole chain.
#[utoipa::path(get, path = "/v1/vms/{id}/pages/{page}")]
async fn page(
    State(core): State<CoreHandle>,
    Path(p): Path<PagePath>,
    Query(q): Query<PageQuery>,
) -> Result<Json<PageInfo>, Error> {
    let (id, page) = p.vm_page()?;
    core.run(move |c| async move { c.page(id, page, q.explain) })
        .await
        .map(Json)
}

/// The fork tree: which VM forked or restored from which.
#[utoipa::path(get, path = "/v1/tree")]
async fn tree(State(core): State<CoreHandle>) -> Result<Json<Tree>, Error> {
    core.run(|c| async move { Ok(c.tree()) }).await.map(Json)
}

/// Check every VM's page table against its memfd.
#[utoipa::path(get, path = "/v1/debug/invariant")]
async fn invariant(State(core): State<CoreHandle>) -> Result<Json<Invariant>, Error> {
    core.run(|c| async move { Ok(c.check_invariant()) })
        .await
        .map(Json)
}
