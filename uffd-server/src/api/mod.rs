//! The REST control API (JSON over a Unix socket), built on axum.
//!
//! Handlers parse and validate the request, then hand it to the core
//! through a [`CoreHandle`]; they never touch VM state themselves. Every
//! error is `{"error": "..."}` with a fitting status.

pub mod openapi;
pub mod volumes;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use shared::VmId;

use crate::core::{ApiError, CommandKind, CoreHandle};

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(json!({ "error": self.message }))).into_response()
    }
}

/// Parse a JSON body with a message that says what is wrong.
pub fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::bad_request(
            "request body is empty; send a JSON object",
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

fn vm_id(s: &str) -> Result<VmId, ApiError> {
    s.parse()
        .map_err(|e: shared::ParseVmIdError| ApiError::not_found(e.to_string()))
}

type ApiResult = ApiResponse;
type ApiResponse = Result<(StatusCode, Json<Value>), ApiError>;

async fn call(core: &CoreHandle, kind: CommandKind, status: StatusCode) -> ApiResponse {
    core.call(kind).await.map(|v| (status, Json(v)))
}

async fn health() -> Json<Value> {
    Json(json!({ "status": "ok", "version": env!("CARGO_PKG_VERSION") }))
}

async fn create_vm(State(core): State<CoreHandle>, body: Bytes) -> ApiResponse {
    let req = parse_body(&body)?;
    call(&core, CommandKind::CreateVm(req), StatusCode::CREATED).await
}

async fn list_vms(State(core): State<CoreHandle>) -> ApiResponse {
    call(&core, CommandKind::ListVms, StatusCode::OK).await
}

async fn get_vm(State(core): State<CoreHandle>, Path(id): Path<String>) -> ApiResponse {
    call(&core, CommandKind::GetVm(vm_id(&id)?), StatusCode::OK).await
}

async fn delete_vm(State(core): State<CoreHandle>, Path(id): Path<String>) -> ApiResponse {
    call(&core, CommandKind::DeleteVm(vm_id(&id)?), StatusCode::OK).await
}

async fn pause(State(core): State<CoreHandle>, Path(id): Path<String>) -> ApiResponse {
    call(&core, CommandKind::Pause(vm_id(&id)?), StatusCode::OK).await
}

async fn resume(State(core): State<CoreHandle>, Path(id): Path<String>) -> ApiResponse {
    call(&core, CommandKind::Resume(vm_id(&id)?), StatusCode::OK).await
}

async fn exec(State(core): State<CoreHandle>, Path(id): Path<String>, body: Bytes) -> ApiResponse {
    let id = vm_id(&id)?;
    let req = parse_body(&body)?;
    call(&core, CommandKind::Exec(id, req), StatusCode::OK).await
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ForkBody {
    #[serde(default = "one")]
    count: u32,
}

fn one() -> u32 {
    1
}

async fn fork(State(core): State<CoreHandle>, Path(id): Path<String>, body: Bytes) -> ApiResult {
    let id = vm_id(&id)?;
    let count = if body.is_empty() {
        1
    } else {
        parse_body::<ForkBody>(&body)?.count
    };
    call(&core, CommandKind::Fork(id, count), StatusCode::CREATED).await
}

async fn sources(State(core): State<CoreHandle>, Path(id): Path<String>) -> ApiResult {
    call(&core, CommandKind::Sources(vm_id(&id)?), StatusCode::OK).await
}

async fn page(
    State(core): State<CoreHandle>,
    Path((id, page)): Path<(String, String)>,
) -> ApiResult {
    let page = page
        .parse()
        .map_err(|_| ApiError::bad_request(format!("page '{page}' is not a page number")))?;
    call(&core, CommandKind::Page(vm_id(&id)?, page), StatusCode::OK).await
}

async fn tree(State(core): State<CoreHandle>) -> ApiResult {
    call(&core, CommandKind::Tree, StatusCode::OK).await
}

async fn invariant(State(core): State<CoreHandle>) -> ApiResult {
    call(&core, CommandKind::CheckInvariant, StatusCode::OK).await
}

async fn add_listener(State(core): State<CoreHandle>, body: Bytes) -> ApiResult {
    let req = parse_body(&body)?;
    call(&core, CommandKind::AddFcListener(req), StatusCode::CREATED).await
}

async fn list_listeners(State(core): State<CoreHandle>) -> ApiResult {
    call(&core, CommandKind::ListFcListeners, StatusCode::OK).await
}

async fn delete_listener(State(core): State<CoreHandle>, Path(id): Path<String>) -> ApiResult {
    let n = id
        .strip_prefix("fc-")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| {
            ApiError::not_found(format!("'{id}' is not a listener id; ids look like fc-1"))
        })?;
    call(&core, CommandKind::DeleteFcListener(n), StatusCode::OK).await
}

async fn openapi_doc() -> Json<Value> {
    Json(openapi::document())
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such route; see GET /v1/openapi.json")
}

/// The whole API.
pub fn router(
    core: CoreHandle,
    volumes: Option<std::sync::Arc<crate::volume::VolumeEngine>>,
) -> Router {
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
    vms.fallback(not_found)
}
