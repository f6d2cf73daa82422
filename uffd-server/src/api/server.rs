//! REST handlers for the server itself: its health, and a handover to a
//! new process.
//!
//! ```text
//! GET    /v1/health              the serving process: pid, start, adopted VMs
//! POST   /v1/server/upgrade      Upgrade: hand every VM to a new process
//! ```

use axum::extract::State;
use proto::api::{Health, Upgrade, UpgradeStarted};
use utoipa_axum::router::OpenApiRouter;

use super::body::Json;
use super::openapi::routes;
use crate::core::{CoreHandle, Error};

/// The server routes.
pub fn routes() -> OpenApiRouter<CoreHandle> {
    OpenApiRouter::default()
        .routes(routes!(health))
        .routes(routes!(upgrade))
}

/// The server answers: which process serves, since when, and what it
/// took back when it started.
#[utoipa::path(get, path = "/v1/health")]
async fn health(State(core): State<CoreHandle>) -> Result<Json<Health>, Error> {
    core.run(|c| async move { Ok(c.restart.health()) })
        .await
        .map(Json)
}

/// Hand every VM to a new server process (the same or another binary)
/// without stopping any: the answer comes just before this process
/// exits; `GET /v1/health` then names the new one.
#[utoipa::path(post, path = "/v1/server/upgrade")]
async fn upgrade(
    State(core): State<CoreHandle>,
    body: Option<Json<Upgrade>>,
) -> Result<Json<UpgradeStarted>, Error> {
    let req = body.map(|Json(b)| b).unwrap_or_default();
    core.run(move |c| crate::core::restart::upgrade::upgrade(c, req))
        .await
        .map(Json)
}
