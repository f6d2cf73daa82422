//! VM snapshots: take, list, show, delete; rollback in place; clone.

use proto::api::{
    CloneVm, ClonedVms, CreateSnapshot, RollbackVm, SnapshotCreated, SnapshotDeleted, SnapshotInfo,
    SnapshotList, SnapshotMode, VmRolledBack,
};

use super::{body, Answer, Api};

impl Api {
    /// `POST /v1/vms/{vm}/snapshots` (201).
    pub fn try_snapshot(&self, vm: &str, req: &CreateSnapshot) -> Answer<SnapshotCreated> {
        self.call(
            "POST",
            &format!("/v1/vms/{vm}/snapshots"),
            Some(body(req)),
            201,
        )
    }

    /// Snapshot `vm` as `name` in `mode`; panics unless 201.
    pub fn snapshot(&self, vm: &str, name: &str, mode: SnapshotMode) -> SnapshotCreated {
        self.try_snapshot(
            vm,
            &CreateSnapshot {
                name: name.to_owned(),
                mode,
                compress: false,
            },
        )
        .unwrap_or_else(|r| panic!("snapshot {name} of {vm}: {r}"))
    }

    /// `GET /v1/snapshots`; panics unless 200.
    pub fn snapshots(&self) -> SnapshotList {
        self.call("GET", "/v1/snapshots", None, 200)
            .unwrap_or_else(|r| panic!("GET /v1/snapshots failed: {r}"))
    }

    /// `GET /v1/snapshots/{name}` (200).
    pub fn try_snapshot_info(&self, name: &str) -> Answer<SnapshotInfo> {
        self.call("GET", &format!("/v1/snapshots/{name}"), None, 200)
    }

    /// Snapshot `name`; panics unless 200.
    pub fn snapshot_info(&self, name: &str) -> SnapshotInfo {
        self.try_snapshot_info(name)
            .unwrap_or_else(|r| panic!("GET snapshot {name} failed: {r}"))
    }

    /// `DELETE /v1/snapshots/{name}` (200).
    pub fn try_delete_snapshot(&self, name: &str) -> Answer<SnapshotDeleted> {
        self.call("DELETE", &format!("/v1/snapshots/{name}"), None, 200)
    }

    /// Delete snapshot `name`; panics unless 200.
    pub fn delete_snapshot(&self, name: &str) -> SnapshotDeleted {
        self.try_delete_snapshot(name)
            .unwrap_or_else(|r| panic!("DELETE snapshot {name} failed: {r}"))
    }

    /// `POST /v1/vms/{vm}/rollback` (200).
    pub fn try_rollback(&self, vm: &str, snapshot: &str) -> Answer<VmRolledBack> {
        let req = RollbackVm {
            snapshot: snapshot.to_owned(),
        };
        self.call(
            "POST",
            &format!("/v1/vms/{vm}/rollback"),
            Some(body(&req)),
            200,
        )
    }

    /// Roll `vm` back to `snapshot`; panics unless 200.
    pub fn rollback(&self, vm: &str, snapshot: &str) -> VmRolledBack {
        self.try_rollback(vm, snapshot)
            .unwrap_or_else(|r| panic!("rollback of {vm} to {snapshot} failed: {r}"))
    }

    /// `POST /v1/vms/{vm}/clone` (201).
    pub fn try_clone_vm(&self, vm: &str, req: &CloneVm) -> Answer<ClonedVms> {
        self.call("POST", &format!("/v1/vms/{vm}/clone"), Some(body(req)), 201)
    }

    /// Clone `vm` `count` times; panics unless 201.
    pub fn clone_vm(&self, vm: &str, count: u32, concurrency: u32) -> ClonedVms {
        self.try_clone_vm(vm, &CloneVm { count, concurrency })
            .unwrap_or_else(|r| panic!("clone of {vm} (count {count}) failed: {r}"))
    }
}
