//! REST handlers for volumes and snapshots.
//!
//! Routes (described in the OpenAPI document, see `openapi.rs`):
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
//! POST   /v1/volumes/import                   {"name", "path", "snapshot_prefix"}: from qcow2
//! POST   /v1/volumes/{name}/export            {"path"}: to a new qcow2 file
//! GET    /v1/volume-snapshots                 every volume snapshot
//! GET    /v1/volume-snapshots/{name}          one volume snapshot
//! DELETE /v1/volume-snapshots/{name}          delete a volume snapshot
//! POST   /v1/volume-snapshots/{name}/snapshots {"name"}: snapshot of a snapshot
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
use axum::routing::{get, post};
use axum::{Json, Router};
use proto::api::{
    CreateVolume, CreateVolumeSnapshot, Deleted, ExportVolume, ExportedVolume, GrowVolume,
    ImportVolume, ImportedVolume, RollbackVolume, VolumeInfo, VolumeRollback, VolumeSnapshotInfo,
};
use serde::Serialize;

use super::parse_body as parse;
use crate::core::Error;
use volume::VolumeEngine;

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
        .route("/v1/volumes/import", post(import_volume))
        .route("/v1/volumes/{name}/export", post(export_volume))
        .route("/v1/volume-snapshots", get(list_snapshots))
        .route(
            "/v1/volume-snapshots/{name}",
            get(get_snapshot).delete(delete_snapshot),
        )
        .route(
            "/v1/volume-snapshots/{name}/snapshots",
            post(snapshot_snapshot),
        )
        .with_state(engine)
}

type ApiResult<T> = Result<(StatusCode, Json<T>), Error>;

fn mib_to_bytes(mib: u64) -> Result<u64, Error> {
    mib.checked_mul(MIB)
        .ok_or_else(|| Error::BadRequest(format!("size_mib {mib} is too large")))
}

/// Run `op` on the blocking pool and answer `status` with its JSON.
async fn blocking<T, F>(engine: Arc<VolumeEngine>, status: StatusCode, op: F) -> ApiResult<T>
where
    T: Serialize + Send + 'static,
    F: FnOnce(&VolumeEngine) -> volume::Result<T> + Send + 'static,
{
    let out = tokio::task::spawn_blocking(move || op(&engine))
        .await
        .map_err(|_| Error::ShuttingDown)??;
    Ok((status, Json(out)))
}

#[utoipa::path(
    get,
    path = "/v1/volumes",
    responses(
        (status = 200, description = "every volume", body = Vec<proto::api::VolumeInfo>),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn list_volumes(State(engine): State<Arc<VolumeEngine>>) -> ApiResult<Vec<VolumeInfo>> {
    blocking(engine, StatusCode::OK, |e| e.list()).await
}

#[utoipa::path(
    post,
    path = "/v1/volumes",
    request_body = proto::api::CreateVolume,
    responses(
        (status = 201, description = "the new volume", body = proto::api::VolumeInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn create_volume(
    State(engine): State<Arc<VolumeEngine>>,
    body: Bytes,
) -> ApiResult<VolumeInfo> {
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
        _ => Err(Error::BadRequest(
            "give exactly one of \"size_mib\" (new empty volume) and \"from_snapshot\" (clone)"
                .into(),
        )),
    }
}

#[utoipa::path(
    get,
    path = "/v1/volumes/{name}",
    params(("name" = String, description = "a volume or snapshot name")),
    responses(
        (status = 200, description = "the volume", body = proto::api::VolumeInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn get_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
) -> ApiResult<VolumeInfo> {
    blocking(engine, StatusCode::OK, move |e| e.show(&name)).await
}

#[utoipa::path(
    delete,
    path = "/v1/volumes/{name}",
    params(("name" = String, description = "a volume or snapshot name")),
    responses(
        (status = 200, description = "deleted; its snapshots stay", body = proto::api::Deleted),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn delete_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
) -> ApiResult<Deleted> {
    blocking(engine, StatusCode::OK, move |e| {
        e.delete(&name).map(|()| Deleted { deleted: name })
    })
    .await
}

#[utoipa::path(
    post,
    path = "/v1/volumes/{name}/grow",
    params(("name" = String, description = "a volume or snapshot name")),
    request_body = proto::api::GrowVolume,
    responses(
        (status = 200, description = "grown", body = proto::api::VolumeInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn grow_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
    body: Bytes,
) -> ApiResult<VolumeInfo> {
    let req: GrowVolume = parse(&body)?;
    let size = mib_to_bytes(req.size_mib)?;
    blocking(engine, StatusCode::OK, move |e| e.grow(&name, size)).await
}

/// Snapshot a volume (`/v1/volumes/{name}/snapshots`) or a snapshot
/// (`/v1/volume-snapshots/{name}/snapshots`, recorded against its volume).
#[utoipa::path(
    post,
    path = "/v1/volumes/{name}/snapshots",
    params(("name" = String, description = "a volume or snapshot name")),
    request_body = proto::api::CreateVolumeSnapshot,
    responses(
        (status = 201, description = "the snapshot", body = proto::api::VolumeSnapshotInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn snapshot_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(from): Path<String>,
    body: Bytes,
) -> ApiResult<VolumeSnapshotInfo> {
    let req: CreateVolumeSnapshot = parse(&body)?;
    blocking(engine, StatusCode::CREATED, move |e| {
        e.snapshot(&from, &req.name)
    })
    .await
}

/// A snapshot of a snapshot (recorded against its volume).
#[utoipa::path(
    post,
    path = "/v1/volume-snapshots/{name}/snapshots",
    params(("name" = String, description = "a volume or snapshot name")),
    request_body = proto::api::CreateVolumeSnapshot,
    responses(
        (status = 201, description = "the snapshot, recorded against the volume", body = proto::api::VolumeSnapshotInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn snapshot_snapshot(
    engine: State<Arc<VolumeEngine>>,
    from: Path<String>,
    body: Bytes,
) -> ApiResult<VolumeSnapshotInfo> {
    snapshot_volume(engine, from, body).await
}

#[utoipa::path(
    get,
    path = "/v1/volumes/{name}/snapshots",
    params(("name" = String, description = "a volume or snapshot name")),
    responses(
        (status = 200, description = "its snapshots, oldest first", body = Vec<proto::api::VolumeSnapshotInfo>),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn list_volume_snapshots(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
) -> ApiResult<Vec<VolumeSnapshotInfo>> {
    blocking(engine, StatusCode::OK, move |e| e.list_snapshots(&name)).await
}

#[utoipa::path(
    post,
    path = "/v1/volumes/{name}/rollback",
    params(("name" = String, description = "a volume or snapshot name")),
    request_body = proto::api::RollbackVolume,
    responses(
        (status = 200, description = "rolled back", body = proto::api::VolumeRollback),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn rollback_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
    body: Bytes,
) -> ApiResult<VolumeRollback> {
    let req: RollbackVolume = parse(&body)?;
    blocking(engine, StatusCode::OK, move |e| {
        e.rollback(&name, &req.snapshot, req.delete_newer)
    })
    .await
}

#[utoipa::path(
    get,
    path = "/v1/volume-snapshots",
    responses(
        (status = 200, description = "every snapshot", body = Vec<proto::api::VolumeSnapshotInfo>),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn list_snapshots(
    State(engine): State<Arc<VolumeEngine>>,
) -> ApiResult<Vec<VolumeSnapshotInfo>> {
    blocking(engine, StatusCode::OK, |e| e.list_all_snapshots()).await
}

#[utoipa::path(
    get,
    path = "/v1/volume-snapshots/{name}",
    params(("name" = String, description = "a volume or snapshot name")),
    responses(
        (status = 200, description = "the snapshot", body = proto::api::VolumeSnapshotInfo),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn get_snapshot(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
) -> ApiResult<VolumeSnapshotInfo> {
    blocking(engine, StatusCode::OK, move |e| e.snapshot_info(&name)).await
}

#[utoipa::path(
    delete,
    path = "/v1/volume-snapshots/{name}",
    params(("name" = String, description = "a volume or snapshot name")),
    responses(
        (status = 200, description = "deleted", body = proto::api::Deleted),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn delete_snapshot(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
) -> ApiResult<Deleted> {
    blocking(engine, StatusCode::OK, move |e| {
        e.delete_snapshot(&name).map(|()| Deleted { deleted: name })
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
            assert_eq!(err.status(), 400, "{body}: {err}");
        }
        let err = create_volume(
            State(engine),
            Bytes::from(format!(r#"{{"name":"v","size_mib":{}}}"#, u64::MAX)),
        )
        .await
        .unwrap_err();
        assert_eq!(err.status(), 400);
    }

    /// /tmp is not expected to reflink; where it does, the engine works.
    #[tokio::test]
    async fn engine_errors_become_json_with_their_status() {
        let (_dir, engine) = engine();
        let unavailable = engine.reflink() != &volume::Reflink::Supported;
        let res = get_volume(State(engine), Path("nope".into()))
            .await
            .unwrap_err();
        let want = if unavailable { 503 } else { 404 };
        assert_eq!(res.status(), want, "{res}");
        if unavailable {
            let message = res.message();
            assert!(
                message.contains("use XFS with reflink=1 or btrfs"),
                "{message}"
            );
        }
        let resp = axum::response::IntoResponse::into_response(res);
        assert_eq!(resp.status().as_u16(), want);
    }
}

#[utoipa::path(
    post,
    path = "/v1/volumes/import",
    request_body = proto::api::ImportVolume,
    responses(
        (status = 201, description = "the new volume and its snapshots", body = proto::api::ImportedVolume),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn import_volume(
    State(engine): State<Arc<VolumeEngine>>,
    body: Bytes,
) -> ApiResult<ImportedVolume> {
    let req: ImportVolume = parse(&body)?;
    let path = std::path::PathBuf::from(&req.path);
    if !path.is_absolute() {
        return Err(Error::BadRequest(format!(
            "path {:?} is not absolute; give the qcow2 file's absolute path on the server's host",
            req.path
        )));
    }
    blocking(engine, StatusCode::CREATED, move |e| {
        e.import_qcow2(&path, &req.name, &req.snapshot_prefix)
    })
    .await
}

#[utoipa::path(
    post,
    path = "/v1/volumes/{name}/export",
    params(("name" = String, description = "a volume name")),
    request_body = proto::api::ExportVolume,
    responses(
        (status = 200, description = "the file written", body = proto::api::ExportedVolume),
        (status = "4XX", description = "the request is wrong: the message says how", body = proto::api::ErrorBody),
        (status = "5XX", description = "the server or a VMM failed", body = proto::api::ErrorBody)
    )
)]
async fn export_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(name): Path<String>,
    body: Bytes,
) -> ApiResult<ExportedVolume> {
    let req: ExportVolume = parse(&body)?;
    let path = std::path::PathBuf::from(req.path);
    blocking(engine, StatusCode::OK, move |e| {
        e.export_qcow2(&name, &path)
    })
    .await
}
