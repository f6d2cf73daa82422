//! REST handlers for listeners serving Firecracker's Uffd memory backend.
//!
//! ```text
//! POST   /v1/firecracker/listeners        CreateListener: listen on a socket
//! GET    /v1/firecracker/listeners        every listener
//! GET    /v1/firecracker/listeners/{id}   one listener
//! DELETE /v1/firecracker/listeners/{id}   stop accepting (connected VMs stay served)
//! ```

use axum::extract::State;
use proto::api::{CreateListener, ListenerDeleted, ListenerInfo, ListenerList};
use utoipa_axum::router::OpenApiRouter;

use super::body::{Created, Json, Path};
use super::openapi::routes;
use super::params::ListenerPath;
use crate::core::{CoreHandle, Error};

/// The listener routes.
pub fn routes() -> OpenApiRouter<CoreHandle> {
    OpenApiRouter::default()
        .routes(routes!(add_listener, list_listeners))
        .routes(routes!(get_listener, delete_listener))
}

/// Listen for Firecracker VMs on a Unix socket, serving them one memory
/// snapshot file.
#[utoipa::path(post, path = "/v1/firecracker/listeners")]
async fn add_listener(
    State(core): State<CoreHandle>,
    Json(req): Json<CreateListener>,
) -> Result<Created<ListenerInfo>, Error> {
    core.run(move |c| async move { c.add_fc_listener(req) })
        .await
        .map(Created)
}

/// Every listener.
#[utoipa::path(get, path = "/v1/firecracker/listeners")]
async fn list_listeners(State(core): State<CoreHandle>) -> Result<Json<ListenerList>, Error> {
    core.run(|c| async move { Ok(c.fc_listeners()) })
        .await
        .map(Json)
}

/// One listener.
#[utoipa::path(get, path = "/v1/firecracker/listeners/{id}")]
async fn get_listener(
    State(core): State<CoreHandle>,
    Path(p): Path<ListenerPath>,
) -> Result<Json<ListenerInfo>, Error> {
    let id = p.listener()?;
    core.run(move |c| async move { c.fc_listener_info(id) })
        .await
        .map(Json)
}

/// Stop accepting on a listener; the VMs connected to it stay served.
#[utoipa::path(delete, path = "/v1/firecracker/listeners/{id}")]
async fn delete_listener(
    State(core): State<CoreHandle>,
    Path(p): Path<ListenerPath>,
) -> Result<Json<ListenerDeleted>, Error> {
    let id = p.listener()?;
    core.run(move |c| async move { c.delete_fc_listener(id) })
        .await
        .map(Json)
}
