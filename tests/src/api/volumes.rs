//! Disk volumes and their snapshots; qcow2 import and export.

use proto::api::{
    CreateVolume, CreateVolumeSnapshot, Deleted, ExportVolume, ExportedVolume, ImportVolume,
    ImportedVolume, RollbackVolume, VolumeInfo, VolumeRollback, VolumeSnapshotInfo,
};

use super::{body, Answer, Api};

impl Api {
    /// `POST /v1/volumes` (201).
    pub fn try_create_volume(&self, req: &CreateVolume) -> Answer<VolumeInfo> {
        self.call("POST", "/v1/volumes", Some(body(req)), 201)
    }

    /// Create an empty volume of `size_mib`; panics unless 201.
    pub fn create_volume(&self, name: &str, size_mib: u64) -> VolumeInfo {
        self.try_create_volume(&CreateVolume {
            name: name.to_owned(),
            size_mib: Some(size_mib),
            from_snapshot: None,
        })
        .unwrap_or_else(|r| panic!("volume {name} failed: {r}"))
    }

    /// `GET /v1/volumes`; panics unless 200.
    pub fn volumes(&self) -> Vec<VolumeInfo> {
        self.call("GET", "/v1/volumes", None, 200)
            .unwrap_or_else(|r| panic!("GET /v1/volumes failed: {r}"))
    }

    /// `GET /v1/volumes/{name}` (200).
    pub fn try_volume(&self, name: &str) -> Answer<VolumeInfo> {
        self.call("GET", &format!("/v1/volumes/{name}"), None, 200)
    }

    /// `DELETE /v1/volumes/{name}` (200).
    pub fn try_delete_volume(&self, name: &str) -> Answer<Deleted> {
        self.call("DELETE", &format!("/v1/volumes/{name}"), None, 200)
    }

    /// `POST /v1/volumes/{volume}/snapshots` (201).
    pub fn try_snapshot_volume(&self, volume: &str, name: &str) -> Answer<VolumeSnapshotInfo> {
        let req = CreateVolumeSnapshot {
            name: name.to_owned(),
        };
        self.call(
            "POST",
            &format!("/v1/volumes/{volume}/snapshots"),
            Some(body(&req)),
            201,
        )
    }

    /// Snapshot `volume` as `name`; panics unless 201.
    pub fn snapshot_volume(&self, volume: &str, name: &str) -> VolumeSnapshotInfo {
        self.try_snapshot_volume(volume, name)
            .unwrap_or_else(|r| panic!("snapshot {name} of volume {volume} failed: {r}"))
    }

    /// `GET /v1/volume-snapshots/{name}` (200).
    pub fn try_volume_snapshot(&self, name: &str) -> Answer<VolumeSnapshotInfo> {
        self.call("GET", &format!("/v1/volume-snapshots/{name}"), None, 200)
    }

    /// `POST /v1/volumes/{volume}/rollback` (200).
    pub fn try_rollback_volume(
        &self,
        volume: &str,
        req: &RollbackVolume,
    ) -> Answer<VolumeRollback> {
        self.call(
            "POST",
            &format!("/v1/volumes/{volume}/rollback"),
            Some(body(req)),
            200,
        )
    }

    /// `POST /v1/volumes/import` (201).
    pub fn try_import_volume(&self, req: &ImportVolume) -> Answer<ImportedVolume> {
        self.call("POST", "/v1/volumes/import", Some(body(req)), 201)
    }

    /// `POST /v1/volumes/{volume}/export` (200).
    pub fn try_export_volume(&self, volume: &str, req: &ExportVolume) -> Answer<ExportedVolume> {
        self.call(
            "POST",
            &format!("/v1/volumes/{volume}/export"),
            Some(body(req)),
            200,
        )
    }
}
