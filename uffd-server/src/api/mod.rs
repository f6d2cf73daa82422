//! The REST control API (JSON over a Unix socket), built on axum.
//!
//! Handlers parse the request into its `proto::api` type, then hand it to
//! the core through a [`CoreHandle`]; they never touch VM state
//! themselves. The core answers typed values ([`Answer`]) or a
//! [`core::Error`](crate::core::Error); this is the only layer that turns
//! them into JSON. Every error is [`ErrorBody`] with the status
//! `Error::status` decides.

pub mod observe;
pub mod openapi;
pub mod serve;
pub mod snapshots;
pub mod volumes;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use proto::api::{ErrorBody, ForkRequest, Health};
use serde::de::DeserializeOwned;
use shared::VmId;

use crate::core::{Answer, CommandKind, CoreHandle, Error};

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = ErrorBody {
            error: self.message(),
        };
        (status, Json(body)).into_response()
    }
}

/// Parse a JSON body with a message that says what is wrong.
pub fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, Error> {
    if body.is_empty() {
        return Err(Error::BadRequest(
            "request body is empty; send a JSON object".into(),
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| Error::BadRequest(format!("invalid request body: {e}")))
}

fn vm_id(s: &str) -> Result<VmId, Error> {
    s.parse().map_err(|_| Error::BadVmId(s.to_owned()))
}

type ApiResult = Result<(StatusCode, Json<Answer>), Error>;

async fn call(core: &CoreHandle, kind: CommandKind, status: StatusCode) -> ApiResult {
    core.call(kind).await.map(|v| (status, Json(v)))
}

#[utoipa::path(
    get,
    path = "/v1/health",
    responses(
        (status = 200, description = "the server answers", body = proto::api::Health),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn health() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
    })
}

#[utoipa::path(
    post,
    path = "/v1/vms",
    request_body = proto::api::CreateVm,
    responses(
        (status = 201, description = "the VM runs", body = proto::api::VmInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn create_vm(State(core): State<CoreHandle>, body: Bytes) -> ApiResult {
    let req = parse_body(&body)?;
    call(&core, CommandKind::CreateVm(req), StatusCode::CREATED).await
}

#[utoipa::path(
    get,
    path = "/v1/vms",
    responses(
        (status = 200, description = "every VM", body = proto::api::VmList),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn list_vms(State(core): State<CoreHandle>) -> ApiResult {
    call(&core, CommandKind::ListVms, StatusCode::OK).await
}

#[utoipa::path(
    get,
    path = "/v1/vms/{id}",
    params(("id" = String, description = "a VM id (vm-N) or a listener id (fc-N)")),
    responses(
        (status = 200, description = "the VM", body = proto::api::VmInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn get_vm(State(core): State<CoreHandle>, Path(id): Path<String>) -> ApiResult {
    call(&core, CommandKind::GetVm(vm_id(&id)?), StatusCode::OK).await
}

#[utoipa::path(
    delete,
    path = "/v1/vms/{id}",
    params(("id" = String, description = "a VM id (vm-N) or a listener id (fc-N)")),
    responses(
        (status = 200, description = "deleted (kept frozen while others read from it)", body = proto::api::VmDeleted),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn delete_vm(State(core): State<CoreHandle>, Path(id): Path<String>) -> ApiResult {
    call(&core, CommandKind::DeleteVm(vm_id(&id)?), StatusCode::OK).await
}

#[utoipa::path(
    post,
    path = "/v1/vms/{id}/pause",
    params(("id" = String, description = "a VM id (vm-N) or a listener id (fc-N)")),
    responses(
        (status = 200, description = "paused", body = proto::api::VmInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn pause(State(core): State<CoreHandle>, Path(id): Path<String>) -> ApiResult {
    call(&core, CommandKind::Pause(vm_id(&id)?), StatusCode::OK).await
}

#[utoipa::path(
    post,
    path = "/v1/vms/{id}/resume",
    params(("id" = String, description = "a VM id (vm-N) or a listener id (fc-N)")),
    responses(
        (status = 200, description = "running again", body = proto::api::VmInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn resume(State(core): State<CoreHandle>, Path(id): Path<String>) -> ApiResult {
    call(&core, CommandKind::Resume(vm_id(&id)?), StatusCode::OK).await
}

#[utoipa::path(
    post,
    path = "/v1/vms/{id}/exec",
    params(("id" = String, description = "a VM id (vm-N) or a listener id (fc-N)")),
    request_body = proto::api::ExecRequest,
    responses(
        (status = 200, description = "the op's result", body = proto::api::ExecResponse),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn exec(State(core): State<CoreHandle>, Path(id): Path<String>, body: Bytes) -> ApiResult {
    let id = vm_id(&id)?;
    let req = parse_body(&body)?;
    call(&core, CommandKind::Exec(id, req), StatusCode::OK).await
}

#[utoipa::path(
    post,
    path = "/v1/vms/{id}/fork",
    params(("id" = String, description = "a VM id (vm-N) or a listener id (fc-N)")),
    request_body = Option<proto::api::ForkRequest>,
    responses(
        (status = 201, description = "the children run", body = proto::api::ForkResponse),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn fork(State(core): State<CoreHandle>, Path(id): Path<String>, body: Bytes) -> ApiResult {
    let id = vm_id(&id)?;
    let req = if body.is_empty() {
        ForkRequest::default()
    } else {
        parse_body(&body)?
    };
    call(&core, CommandKind::Fork(id, req), StatusCode::CREATED).await
}

#[utoipa::path(
    get,
    path = "/v1/vms/{id}/sources",
    params(("id" = String, description = "a VM id (vm-N) or a listener id (fc-N)")),
    responses(
        (status = 200, description = "pages per source and the table as extents", body = proto::api::Sources),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn sources(State(core): State<CoreHandle>, Path(id): Path<String>) -> ApiResult {
    call(&core, CommandKind::Sources(vm_id(&id)?), StatusCode::OK).await
}

#[utoipa::path(
    get,
    path = "/v1/vms/{id}/pages/{page}",
    params(("id" = String, description = "a VM id (vm-N) or a listener id (fc-N)"), ("page" = u64, description = "a page number"), proto::api::PageQuery),
    responses(
        (status = 200, description = "one page's source (with ?explain=true, its whole chain)", body = proto::api::PageInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn page(
    State(core): State<CoreHandle>,
    Path((id, page)): Path<(String, String)>,
    q: Result<
        axum::extract::Query<proto::api::PageQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> ApiResult {
    let page = page
        .parse()
        .map_err(|_| Error::BadRequest(format!("page '{page}' is not a page number")))?;
    let q = observe::query(q)?;
    call(
        &core,
        CommandKind::Page(vm_id(&id)?, page, q.explain),
        StatusCode::OK,
    )
    .await
}

#[utoipa::path(
    get,
    path = "/v1/tree",
    responses(
        (status = 200, description = "the fork tree", body = proto::api::Tree),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn tree(State(core): State<CoreHandle>) -> ApiResult {
    call(&core, CommandKind::Tree, StatusCode::OK).await
}

#[utoipa::path(
    get,
    path = "/v1/debug/invariant",
    responses(
        (status = 200, description = "the table-vs-memfd check", body = proto::api::Invariant),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn invariant(State(core): State<CoreHandle>) -> ApiResult {
    call(&core, CommandKind::CheckInvariant, StatusCode::OK).await
}

#[utoipa::path(
    post,
    path = "/v1/firecracker/listeners",
    request_body = proto::api::CreateListener,
    responses(
        (status = 201, description = "listening", body = proto::api::ListenerInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn add_listener(State(core): State<CoreHandle>, body: Bytes) -> ApiResult {
    let req = parse_body(&body)?;
    call(&core, CommandKind::AddFcListener(req), StatusCode::CREATED).await
}

#[utoipa::path(
    get,
    path = "/v1/firecracker/listeners",
    responses(
        (status = 200, description = "every listener", body = proto::api::ListenerList),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn list_listeners(State(core): State<CoreHandle>) -> ApiResult {
    call(&core, CommandKind::ListFcListeners, StatusCode::OK).await
}

#[utoipa::path(
    delete,
    path = "/v1/firecracker/listeners/{id}",
    params(("id" = String, description = "a VM id (vm-N) or a listener id (fc-N)")),
    responses(
        (status = 200, description = "stopped accepting", body = proto::api::ListenerDeleted),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn delete_listener(State(core): State<CoreHandle>, Path(id): Path<String>) -> ApiResult {
    let n = id
        .strip_prefix("fc-")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| Error::NoSuchListener(id.clone()))?;
    call(&core, CommandKind::DeleteFcListener(n), StatusCode::OK).await
}

#[utoipa::path(
    get,
    path = "/metrics",
    responses(
        (status = 200, description = "Prometheus metrics (OpenMetrics text)", body = String,
         content_type = "application/openmetrics-text"),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server is stopping", body = proto::api::ErrorBody)
    )
)]
async fn metrics(State(core): State<CoreHandle>) -> Result<Response, Error> {
    let Answer::Metrics(sample) = core.call(CommandKind::Metrics).await? else {
        return Err(Error::ShuttingDown);
    };
    let body = crate::observe::metrics::render(&sample);
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            crate::observe::metrics::CONTENT_TYPE,
        )],
        body,
    )
        .into_response())
}

/// Only `/metrics`, for `--metrics-addr`.
pub fn metrics_router(core: CoreHandle) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(core)
        .fallback(not_found)
}

async fn openapi_doc() -> Json<serde_json::Value> {
    Json(openapi::document())
}

async fn not_found() -> Error {
    Error::NoSuchRoute
}

/// The whole API.
pub fn router(core: CoreHandle, volumes: Option<std::sync::Arc<volume::VolumeEngine>>) -> Router {
    let vms = Router::new()
        .route("/v1/health", get(health))
        .route("/v1/openapi.json", get(openapi_doc))
        .route("/v1/vms", get(list_vms).post(create_vm))
        .route("/v1/vms/{id}", get(get_vm).delete(delete_vm))
        .route("/v1/vms/{id}/pause", post(pause))
        .route("/v1/vms/{id}/resume", post(resume))
        .route("/v1/vms/{id}/exec", post(exec))
        .route("/v1/vms/{id}/fork", post(fork))
        .route("/v1/vms/{id}/sources", get(sources))
        .route("/v1/vms/{id}/pages/{page}", get(page))
        .route("/v1/tree", get(tree))
        .route("/v1/debug/invariant", get(invariant))
        .merge(snapshots::routes())
        .merge(observe::routes())
        .route("/metrics", get(metrics))
        .route(
            "/v1/firecracker/listeners",
            get(list_listeners).post(add_listener),
        )
        .route(
            "/v1/firecracker/listeners/{id}",
            axum::routing::delete(delete_listener),
        )
        .with_state(core);
    let vms = match volumes {
        Some(engine) => vms.merge(volumes::router(engine)),
        None => vms,
    };
    // Every body of this API is a small JSON object.
    vms.fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
}

/// Largest request body accepted.
pub const MAX_BODY: usize = 64 << 10;
