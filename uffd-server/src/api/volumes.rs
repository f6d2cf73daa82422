//! REST handlers for volumes and snapshots.
//!
//! Routes (documented in `volumes_openapi.json`):
//!
//! ```text
//! GET    /v1/volumes                          list volumes
//! POST   /v1/volumes                          {"name", "size_mib"} | {"name", "from_snapshot"}
//! GET    /v1/volumes/{name}                   one volume
//! DELETE /v1/volumes/{name}                   delete (its snapshots stay)
//! POST   /v1/volumes/{name}/grow              {"size_mib"}
//! GET    /v1/volumes/{name}/snapshots         its snapshots, oldest first
//! POST   /v1/volumes/{name}/snapshots         {"name"}
//! POST   /v1/volumes/{name}/rollback          {"snapshot", "delete_newer"}
//! GET    /v1/snapshots                        every snapshot
//! GET    /v1/snapshots/{name}                 one snapshot
//! DELETE /v1/snapshots/{name}                 delete a snapshot
//! POST   /v1/snapshots/{name}/snapshots       {"name"}: snapshot of a snapshot
//! ```
//!
//! Errors are `{"error": "..."}`: 400 bad input, 404 unknown name, 409 name
//! taken, 503 when the state directory cannot reflink (a server condition
//! the client cannot fix by changing the request), 500 filesystem failure.
//! Engine calls do blocking file I/O and run on the blocking pool.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::volume::{ErrorKind, VolumeEngine, VolumeError};

const MIB: u64 = 1 << 20;

/// The volume routes, to merge into the API router.
pub fn router(engine: Arc<VolumeEngine>) -> Router {
    Router::new()
        .route("/v1/volumes", get(list_volumes).post(create_volume))
        .route("/v1/volumes/{name}", get(get_volume).delete(delete_volume))
        .route("/v1/volumes/{name}/grow", post(grow_volume))
        .route(
            "/v1/volumes/{name}/snapshots",
            get(list_volume_snapshots).post(snapshot_volume),
        )
        .route("/v1/volumes/{name}/rollback", post(rollback_volume))
        .route("/v1/snapshots", get(list_snapshots))
        .route(
            "/v1/snapshots/{name}",
            get(get_snapshot).delete(delete_snapshot),
        )
        .route("/v1/snapshots/{name}/snapshots", post(snapshot_volume))
        .with_state(engine)
}

/// An error answer: status and message.
#[derive(Debug)]
pub struct VolumeApiError {
    status: StatusCode,
    message: String,
}

impl VolumeApiError {
    fn bad_request(message: impl Into<String>) -> Self {
        VolumeApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }
}

impl From<VolumeError> for VolumeApiError {
    fn from(e: VolumeError) -> Self {
        VolumeApiError {
            status: status_of(e.kind()),
            message: e.chain(),
        }
    }
}

impl IntoResponse for VolumeApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({ "error": self.message }))).into_response()
    }
}

/// The HTTP status of an engine error class.
pub fn status_of(kind: ErrorKind) -> StatusCode {
    match kind {
        ErrorKind::BadRequest => StatusCode::BAD_REQUEST,
        ErrorKind::NotFound => StatusCode::NOT_FOUND,
        ErrorKind::Conflict => StatusCode::CONFLICT,
        ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorKind::Io => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

type ApiResult = Result<(StatusCode, Json<Value>), VolumeApiError>;

/// `POST /v1/volumes`: exactly one of `size_mib` and `from_snapshot`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateVolume {
    pub name: String,
    pub size_mib: Option<u64>,
    pub from_snapshot: Option<String>,
}

/// `POST /v1/volumes/{name}/grow`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrowVolume {
    pub size_mib: u64,
}

/// `POST .../snapshots`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    pub name: String,
}

/// `POST /v1/volumes/{name}/rollback`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackVolume {
    pub snapshot: String,
    #[serde(default)]
    pub delete_newer: bool,
}

fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, VolumeApiError> {
    if body.is_empty() {
        return Err(VolumeApiError::bad_request(
            "request body is empty; send a JSON object",
        ));
    }
    serde_json::from_slice(body)
        .map_err(|e| VolumeApiError::bad_request(format!("invalid request body: {e}")))
}

fn mib_to_bytes(mib: u64) -> Result<u64, VolumeApiError> {
    mib.checked_mul(MIB)
        .ok_or_else(|| VolumeApiError::bad_request(format!("size_mib {mib} is too large")))
}

/// Run `op` on the blocking pool and answer `status` with its JSON.
async fn blocking<T, F>(engine: Arc<VolumeEngine>, status: StatusCode, op: F) -> ApiResult
where
    T: Serialize + Send + 'static,
    F: FnOnce(&VolumeEngine) -> crate::volume::Result<T> + Send + 'static,
{
    let out = tokio::task::spawn_blocking(move || op(&engine))
        .await
        .map_err(|e| VolumeApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!("volume operation did not complete: {e}"),
        })??;
    let value = serde_json::to_value(out).map_err(|e| VolumeApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message: format!("cannot encode the answer: {e}"),
    })?;
    Ok((status, Json(value)))
}

async fn list_volumes(State(engine): State<Arc<VolumeEngine>>) -> ApiResult {
    blocking(engine, StatusCode::OK, |e| e.list()).await
}

async fn create_volume(State(engine): State<Arc<VolumeEngine>>, body: Bytes) -> ApiResult {
    let req: CreateVolume = parse(&body)?;
    match (req.size_mib, req.from_snapshot) {
        (Some(mib), None) => {
            let size = mib_to_bytes(mib)?;
            blocking(engine, StatusCode::CREATED, move |e| {
                e.create(&req.name, size)
            })
            .await
        }
        (None, Some(snap)) => {
            blocking(engine, StatusCode::CREATED, move |e| {
                e.clone_snapshot(&snap, &req.name)
            })
            .await
        }
        _ => Err(VolumeApiError::bad_request(
            "give exactly one of \"size_mib\" (new empty volume) and \"from_snapshot\" (clone)",
        )),
    }
}

async fn get_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
) -> ApiResult {
    blocking(engine, StatusCode::OK, move |e| e.show(&name)).await
}

async fn delete_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
) -> ApiResult {
    blocking(engine, StatusCode::OK, move |e| {
        e.delete(&name).map(|()| json!({ "deleted": name }))
    })
    .await
}

async fn grow_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: GrowVolume = parse(&body)?;
    let size = mib_to_bytes(req.size_mib)?;
    blocking(engine, StatusCode::OK, move |e| e.grow(&name, size)).await
}

/// Snapshot a volume (`/v1/volumes/{name}/snapshots`) or a snapshot
/// (`/v1/snapshots/{name}/snapshots`, recorded against its volume).
async fn snapshot_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(from): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: CreateSnapshot = parse(&body)?;
    blocking(engine, StatusCode::CREATED, move |e| {
        e.snapshot(&from, &req.name)
    })
    .await
}

async fn list_volume_snapshots(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
) -> ApiResult {
    blocking(engine, StatusCode::OK, move |e| e.list_snapshots(&name)).await
}

async fn rollback_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
    body: Bytes,
) -> ApiResult {
    let req: RollbackVolume = parse(&body)?;
    blocking(engine, StatusCode::OK, move |e| {
        e.rollback(&name, &req.snapshot, req.delete_newer)
    })
    .await
}

async fn list_snapshots(State(engine): State<Arc<VolumeEngine>>) -> ApiResult {
    blocking(engine, StatusCode::OK, |e| e.list_all_snapshots()).await
}

async fn get_snapshot(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
) -> ApiResult {
    blocking(engine, StatusCode::OK, move |e| e.snapshot_info(&name)).await
}

async fn delete_snapshot(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
) -> ApiResult {
    blocking(engine, StatusCode::OK, move |e| {
        e.delete_snapshot(&name)
            .map(|()| json!({ "deleted": name }))
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine() -> (tempfile::TempDir, Arc<VolumeEngine>) {
        let dir = tempfile::tempdir().unwrap();
        let engine = Arc::new(VolumeEngine::open(dir.path()).unwrap());
        (dir, engine)
    }

    #[test]
    fn openapi_fragment_documents_every_route() {
        let doc: Value = serde_json::from_str(include_str!("volumes_openapi.json")).unwrap();
        for (path, methods) in [
            ("/v1/volumes", &["get", "post"][..]),
            ("/v1/volumes/{name}", &["get", "delete"]),
            ("/v1/volumes/{name}/grow", &["post"]),
            ("/v1/volumes/{name}/snapshots", &["get", "post"]),
            ("/v1/volumes/{name}/rollback", &["post"]),
            ("/v1/snapshots", &["get"]),
            ("/v1/snapshots/{name}", &["get", "delete"]),
            ("/v1/snapshots/{name}/snapshots", &["post"]),
        ] {
            for m in methods {
                assert!(
                    doc[path][m].is_object(),
                    "{m} {path} missing from volumes_openapi.json"
                );
            }
        }
    }

    #[test]
    fn every_error_class_has_a_distinct_status() {
        assert_eq!(status_of(ErrorKind::BadRequest), StatusCode::BAD_REQUEST);
        assert_eq!(status_of(ErrorKind::NotFound), StatusCode::NOT_FOUND);
        assert_eq!(status_of(ErrorKind::Conflict), StatusCode::CONFLICT);
        assert_eq!(
            status_of(ErrorKind::Unavailable),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(status_of(ErrorKind::Io), StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[tokio::test]
    async fn create_needs_exactly_one_of_size_and_snapshot() {
        let (_dir, engine) = engine();
        for body in [
            r#"{"name":"v"}"#,
            r#"{"name":"v","size_mib":1,"from_snapshot":"s"}"#,
            "",
            "{",
            r#"{"name":"v","size":1}"#,
        ] {
            let err = create_volume(State(engine.clone()), Bytes::from(body))
                .await
                .unwrap_err();
            assert_eq!(
                err.status,
                StatusCode::BAD_REQUEST,
                "{body}: {}",
                err.message
            );
        }
        let err = create_volume(
            State(engine),
            Bytes::from(format!(r#"{{"name":"v","size_mib":{}}}"#, u64::MAX)),
        )
        .await
        .unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
    }

    /// /tmp is not expected to reflink; where it does, the engine works.
    #[tokio::test]
    async fn engine_errors_become_json_with_their_status() {
        let (_dir, engine) = engine();
        let unavailable = engine.reflink() != &crate::volume::Reflink::Supported;
        let res = get_volume(State(engine), Path("nope".into()))
            .await
            .unwrap_err();
        let want = if unavailable {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::NOT_FOUND
        };
        assert_eq!(res.status, want, "{}", res.message);
        if unavailable {
            assert!(
                res.message.contains("use XFS with reflink=1 or btrfs"),
                "{}",
                res.message
            );
        }
        let resp = res.into_response();
        assert_eq!(resp.status(), want);
    }
}
