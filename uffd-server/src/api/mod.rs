//! The REST control API (JSON over a Unix socket), built on axum.
//!
//! A route is its request and answer types (`proto::api`), its handler
//! and its line in a router:
//!
//! ```text
//! #[utoipa::path(get, path = "/v1/vms/{id}")]                  // handler
//! async fn get_vm(
//!     State(core): State<CoreHandle>,
//!     Path(p): Path<VmPath>,                                   // request
//! ) -> Result<Json<VmInfo>, Error> {                           // answer
//!     let id = p.vm()?;
//!     core.run(move |c| async move { c.info(id) }).await.map(Json)
//! }
//!     .routes(routes!(get_vm, delete_vm))                      // router
//! ```
//!
//! The handler's arguments and return type make its operation in the
//! OpenAPI document (`body.rs`, `openapi.rs`), and the router that serves
//! it makes the document, so the two cannot disagree. A handler parses
//! the request, then hands the work to the core with [`CoreHandle::run`],
//! a closure the core thread runs; it never touches VM state itself. The
//! core answers typed values or a [`core::Error`](crate::core::Error);
//! only this layer turns them into JSON. Every error is an
//! [`ErrorBody`](proto::api::ErrorBody) with the status `Error::status`
//! decides (`error.rs`).
//!
//! - `vms.rs`, `debug.rs`, `observe.rs`, `firecracker.rs`, `snapshots.rs`,
//!   `remote.rs`, `volumes.rs`, `server.rs`: the handlers, one file per part of
//!   `proto::api`;
//! - `params.rs`: the path parameters they share;
//! - `serve.rs`: the socket, with limits on connections and headers.

pub mod body;
pub mod debug;
pub mod error;
pub mod firecracker;
pub mod memory;
pub mod observe;
pub mod openapi;
pub mod params;
pub mod remote;
pub mod serve;
pub mod server;
pub mod snapshots;
pub mod vms;
pub mod volumes;

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::header;
use axum::routing::get;
use axum::Router;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;

use crate::core::{CoreHandle, Error};
use volume::VolumeEngine;

pub use body::MAX_BODY;

/// The routes served by the core.
pub(crate) fn core_routes() -> OpenApiRouter<CoreHandle> {
    OpenApiRouter::default()
        .merge(vms::routes())
        .merge(debug::routes())
        .merge(observe::routes())
        .merge(firecracker::routes())
        .merge(snapshots::routes())
        .merge(remote::routes())
        .merge(server::routes())
        .merge(memory::routes())
}

/// The whole API, and its document at `/v1/openapi.json`. Without a
/// volume engine there are no volume routes (and the document says so).
pub fn router(core: CoreHandle, volumes: Option<Arc<VolumeEngine>>) -> Router {
    let mut api = OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .merge(core_routes().with_state(core));
    if let Some(engine) = volumes {
        api = api.merge(volumes::routes().with_state(engine));
    }
    let (router, doc) = api.split_for_parts();
    let doc = Bytes::from(openapi::finish(doc).to_string());
    router
        .route(
            "/v1/openapi.json",
            get(move || async move { ([(header::CONTENT_TYPE, "application/json")], doc) }),
        )
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
}

/// Only `/metrics`, for `--metrics-addr`.
pub fn metrics_router(core: CoreHandle) -> Router {
    Router::new()
        .route("/metrics", get(observe::metrics))
        .with_state(core)
        .fallback(not_found)
}

async fn not_found() -> Error {
    Error::NoSuchRoute
}
