//! REST handlers for volumes and snapshots.
//!
//! Routes (each handler's signature makes its entry in the OpenAPI
//! document, see `openapi.rs`):
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
//! the client cannot fix by changing the request), 507 out of disk space,
//! 500 other filesystem failures.
//! Engine calls do blocking file I/O and run on the blocking pool.

use std::sync::Arc;

use axum::extract::State;
use proto::api::{
    CreateVolume, CreateVolumeSnapshot, Deleted, ExportVolume, ExportedVolume, GrowVolume,
    ImportVolume, ImportedVolume, RollbackVolume, VolumeInfo, VolumeRollback, VolumeSnapshotInfo,
};
use utoipa_axum::router::OpenApiRouter;

use super::body::{Created, Json, JsonList, Path};
use super::openapi::routes;
use super::params::VolumePath;
use crate::core::Error;
use volume::VolumeEngine;

const MIB: u64 = 1 << 20;

/// The volume routes.
pub fn routes() -> OpenApiRouter<Arc<VolumeEngine>> {
    OpenApiRouter::default()
        .routes(routes!(list_volumes, create_volume))
        .routes(routes!(get_volume, delete_volume))
        .routes(routes!(grow_volume))
        .routes(routes!(list_volume_snapshots, snapshot_volume))
        .routes(routes!(rollback_volume))
        .routes(routes!(import_volume))
        .routes(routes!(export_volume))
        .routes(routes!(list_snapshots))
        .routes(routes!(get_snapshot, delete_snapshot))
        .routes(routes!(snapshot_snapshot))
}

fn mib_to_bytes(mib: u64) -> Result<u64, Error> {
    mib.checked_mul(MIB)
        .ok_or_else(|| Error::BadRequest(format!("size_mib {mib} is too large")))
}

/// Run `op` on the blocking pool.
async fn blocking<T, F>(engine: Arc<VolumeEngine>, op: F) -> Result<T, Error>
where
    T: Send + 'static,
    F: FnOnce(&VolumeEngine) -> volume::Result<T> + Send + 'static,
{
    Ok(tokio::task::spawn_blocking(move || op(&engine))
        .await
        .map_err(|_| Error::ShuttingDown)??)
}

/// Every volume.
#[utoipa::path(get, path = "/v1/volumes")]
async fn list_volumes(
    State(engine): State<Arc<VolumeEngine>>,
) -> Result<JsonList<VolumeInfo>, Error> {
    blocking(engine, |e| e.list()).await.map(JsonList)
}

/// Create a volume: empty of `size_mib`, or a copy of `from_snapshot`.
#[utoipa::path(post, path = "/v1/volumes")]
async fn create_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Json(req): Json<CreateVolume>,
) -> Result<Created<VolumeInfo>, Error> {
    let made = match (req.size_mib, req.from_snapshot) {
        (Some(mib), None) => {
            let size = mib_to_bytes(mib)?;
            blocking(engine, move |e| e.create(&req.name, size)).await
        }
        (None, Some(snap)) => blocking(engine, move |e| e.clone_snapshot(&snap, &req.name)).await,
        _ => Err(Error::BadRequest(
            "give exactly one of \"size_mib\" (new empty volume) and \"from_snapshot\" (clone)"
                .into(),
        )),
    };
    made.map(Created)
}

/// One volume.
#[utoipa::path(get, path = "/v1/volumes/{name}")]
async fn get_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(p): Path<VolumePath>,
) -> Result<Json<VolumeInfo>, Error> {
    blocking(engine, move |e| e.show(&p.name)).await.map(Json)
}

/// Delete a volume; its snapshots stay.
#[utoipa::path(delete, path = "/v1/volumes/{name}")]
async fn delete_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(p): Path<VolumePath>,
) -> Result<Json<Deleted>, Error> {
    let name = p.name;
    blocking(engine, move |e| {
        e.delete(&name).map(|()| Deleted { deleted: name })
    })
    .await
    .map(Json)
}

/// Grow a volume to `size_mib`.
#[utoipa::path(post, path = "/v1/volumes/{name}/grow")]
async fn grow_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(p): Path<VolumePath>,
    Json(req): Json<GrowVolume>,
) -> Result<Json<VolumeInfo>, Error> {
    let size = mib_to_bytes(req.size_mib)?;
    blocking(engine, move |e| e.grow(&p.name, size))
        .await
        .map(Json)
}

/// Snapshot a volume (`/v1/volumes/{name}/snapshots`) or a snapshot
/// (`/v1/volume-snapshots/{name}/snapshots`, recorded against its volume).
async fn take_snapshot(
    engine: Arc<VolumeEngine>,
    from: String,
    req: CreateVolumeSnapshot,
) -> Result<Created<VolumeSnapshotInfo>, Error> {
    blocking(engine, move |e| e.snapshot(&from, &req.name))
        .await
        .map(Created)
}

/// Snapshot a volume.
#[utoipa::path(post, path = "/v1/volumes/{name}/snapshots")]
async fn snapshot_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(p): Path<VolumePath>,
    Json(req): Json<CreateVolumeSnapshot>,
) -> Result<Created<VolumeSnapshotInfo>, Error> {
    take_snapshot(engine, p.name, req).await
}

/// A snapshot of a snapshot, recorded against its volume.
#[utoipa::path(post, path = "/v1/volume-snapshots/{name}/snapshots")]
async fn snapshot_snapshot(
    State(engine): State<Arc<VolumeEngine>>,
    Path(p): Path<VolumePath>,
    Json(req): Json<CreateVolumeSnapshot>,
) -> Result<Created<VolumeSnapshotInfo>, Error> {
    take_snapshot(engine, p.name, req).await
}

/// A volume's snapshots, oldest first.
#[utoipa::path(get, path = "/v1/volumes/{name}/snapshots")]
async fn list_volume_snapshots(
    State(engine): State<Arc<VolumeEngine>>,
    Path(p): Path<VolumePath>,
) -> Result<JsonList<VolumeSnapshotInfo>, Error> {
    blocking(engine, move |e| e.list_snapshots(&p.name))
        .await
        .map(JsonList)
}

/// Roll a volume back to one of its snapshots.
#[utoipa::path(post, path = "/v1/volumes/{name}/rollback")]
async fn rollback_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(p): Path<VolumePath>,
    Json(req): Json<RollbackVolume>,
) -> Result<Json<VolumeRollback>, Error> {
    blocking(engine, move |e| {
        e.rollback(&p.name, &req.snapshot, req.delete_newer)
    })
    .await
    .map(Json)
}

/// Every volume snapshot.
#[utoipa::path(get, path = "/v1/volume-snapshots")]
async fn list_snapshots(
    State(engine): State<Arc<VolumeEngine>>,
) -> Result<JsonList<VolumeSnapshotInfo>, Error> {
    blocking(engine, |e| e.list_all_snapshots())
        .await
        .map(JsonList)
}

/// One volume snapshot.
#[utoipa::path(get, path = "/v1/volume-snapshots/{name}")]
async fn get_snapshot(
    State(engine): State<Arc<VolumeEngine>>,
    Path(p): Path<VolumePath>,
) -> Result<Json<VolumeSnapshotInfo>, Error> {
    blocking(engine, move |e| e.snapshot_info(&p.name))
        .await
        .map(Json)
}

/// Delete a volume snapshot.
#[utoipa::path(delete, path = "/v1/volume-snapshots/{name}")]
async fn delete_snapshot(
    State(engine): State<Arc<VolumeEngine>>,
    Path(p): Path<VolumePath>,
) -> Result<Json<Deleted>, Error> {
    let name = p.name;
    blocking(engine, move |e| {
        e.delete_snapshot(&name).map(|()| Deleted { deleted: name })
    })
    .await
    .map(Json)
}

/// Import a qcow2 file on the server's host as a new volume, its internal
/// snapshots as volume snapshots.
#[utoipa::path(post, path = "/v1/volumes/import")]
async fn import_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Json(req): Json<ImportVolume>,
) -> Result<Created<ImportedVolume>, Error> {
    let path = std::path::PathBuf::from(&req.path);
    if !path.is_absolute() {
        return Err(Error::BadRequest(format!(
            "path {:?} is not absolute; give the qcow2 file's absolute path on the server's host",
            req.path
        )));
    }
    blocking(engine, move |e| {
        e.import_qcow2(&path, &req.name, &req.snapshot_prefix)
    })
    .await
    .map(Created)
}

/// Write a volume to a new qcow2 file on the server's host.
#[utoipa::path(post, path = "/v1/volumes/{name}/export")]
async fn export_volume(
    State(engine): State<Arc<VolumeEngine>>,
    Path(p): Path<VolumePath>,
    Json(req): Json<ExportVolume>,
) -> Result<Json<ExportedVolume>, Error> {
    let path = std::path::PathBuf::from(req.path);
    blocking(engine, move |e| e.export_qcow2(&p.name, &path))
        .await
        .map(Json)
}

#[cfg(test)]
mod tests {
    use axum::body::Bytes;
    use axum::extract::FromRequest;
    use axum::http::Request;
    use axum::response::IntoResponse;

    use super::*;

    fn engine() -> (tempfile::TempDir, Arc<VolumeEngine>) {
        let dir = tempfile::tempdir().unwrap();
        let engine = Arc::new(VolumeEngine::open(dir.path()).unwrap());
        (dir, engine)
    }

    /// `body` through the JSON extractor and `create_volume`: the status.
    async fn create(engine: &Arc<VolumeEngine>, body: impl Into<Bytes>) -> u16 {
        let req = Request::post("/v1/volumes")
            .body(axum::body::Body::from(body.into()))
            .unwrap();
        let res = match Json::<CreateVolume>::from_request(req, &()).await {
            Ok(json) => match create_volume(State(engine.clone()), json).await {
                Ok(created) => created.into_response(),
                Err(e) => e.into_response(),
            },
            Err(rejected) => rejected,
        };
        res.status().as_u16()
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
            assert_eq!(create(&engine, body).await, 400, "{body}");
        }
        let huge = format!(r#"{{"name":"v","size_mib":{}}}"#, u64::MAX);
        assert_eq!(create(&engine, huge).await, 400);
    }

    /// /tmp is not expected to reflink; where it does, the engine works.
    #[tokio::test]
    async fn engine_errors_become_json_with_their_status() {
        let (_dir, engine) = engine();
        let unavailable = engine.reflink() != &volume::Reflink::Supported;
        let res = get_volume(
            State(engine),
            Path(VolumePath {
                name: "nope".into(),
            }),
        )
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
        let resp = res.into_response();
        assert_eq!(resp.status().as_u16(), want);
    }
}
