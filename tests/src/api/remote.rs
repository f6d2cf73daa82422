//! Snapshots in the object store: push (and its progress), the store's
//! listing, one snapshot, delete, gc, pull, clone, the store's counters.

use std::time::{Duration, Instant};

use proto::api::{
    CloneVm, ClonedVms, PullSnapshot, PushState, PushStatus, RemoteGc, RemoteSnapshotDeleted,
    RemoteSnapshotInfo, RemoteSnapshotList, RemoteStatus, SnapshotInfo, SnapshotPulled,
};

use super::{body, Answer, Api};

impl Api {
    /// `POST /v1/snapshots/{name}/push` (202).
    pub fn try_push_snapshot(&self, name: &str) -> Answer<SnapshotInfo> {
        self.call("POST", &format!("/v1/snapshots/{name}/push"), None, 202)
    }

    /// Start pushing snapshot `name`; panics unless 202.
    pub fn push_snapshot(&self, name: &str) -> SnapshotInfo {
        self.try_push_snapshot(name)
            .unwrap_or_else(|r| panic!("push of {name} failed: {r}"))
    }

    /// The status of snapshot `name`'s last push (panics if it has none).
    pub fn push_status(&self, name: &str) -> PushStatus {
        self.snapshot_info(name)
            .push
            .unwrap_or_else(|| panic!("snapshot {name} has no push"))
    }

    /// Wait until snapshot `name`'s push ends; its last status.
    pub fn wait_push(&self, name: &str, within: Duration) -> PushStatus {
        let deadline = Instant::now() + within;
        loop {
            let s = self.push_status(name);
            if s.state != PushState::Running {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "push of {name} still runs after {within:?}: {s:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Push snapshot `name` and wait until it is in the store; panics
    /// unless it succeeds. Its last status.
    pub fn push_and_wait(&self, name: &str) -> PushStatus {
        self.push_snapshot(name);
        let s = self.wait_push(name, Duration::from_secs(300));
        assert_eq!(s.state, PushState::Done, "push of {name}: {s:?}");
        s
    }

    /// `GET /v1/remote`; panics unless 200.
    pub fn remote_status(&self) -> RemoteStatus {
        self.call("GET", "/v1/remote", None, 200)
            .unwrap_or_else(|r| panic!("GET /v1/remote failed: {r}"))
    }

    /// `GET /v1/remote/snapshots` (200).
    pub fn try_remote_snapshots(&self) -> Answer<RemoteSnapshotList> {
        self.call("GET", "/v1/remote/snapshots", None, 200)
    }

    /// Names of the snapshots in the store; panics unless 200.
    pub fn remote_snapshot_names(&self) -> Vec<String> {
        self.try_remote_snapshots()
            .unwrap_or_else(|r| panic!("GET /v1/remote/snapshots failed: {r}"))
            .snapshots
            .into_iter()
            .map(|s| s.name)
            .collect()
    }

    /// `GET /v1/remote/snapshots/{name}` (200).
    pub fn try_remote_snapshot(&self, name: &str) -> Answer<RemoteSnapshotInfo> {
        self.call("GET", &format!("/v1/remote/snapshots/{name}"), None, 200)
    }

    /// Remote snapshot `name`; panics unless 200.
    pub fn remote_snapshot(&self, name: &str) -> RemoteSnapshotInfo {
        self.try_remote_snapshot(name)
            .unwrap_or_else(|r| panic!("GET remote snapshot {name} failed: {r}"))
    }

    /// `DELETE /v1/remote/snapshots/{name}` (200).
    pub fn try_delete_remote_snapshot(&self, name: &str) -> Answer<RemoteSnapshotDeleted> {
        self.call("DELETE", &format!("/v1/remote/snapshots/{name}"), None, 200)
    }

    /// `POST /v1/remote/gc` (200).
    pub fn try_remote_gc(&self) -> Answer<RemoteGc> {
        self.call("POST", "/v1/remote/gc", None, 200)
    }

    /// `POST /v1/remote/snapshots/{name}/pull` (201).
    pub fn try_pull_snapshot(&self, name: &str, local: Option<&str>) -> Answer<SnapshotPulled> {
        let req = PullSnapshot {
            name: local.map(str::to_owned),
        };
        self.call(
            "POST",
            &format!("/v1/remote/snapshots/{name}/pull"),
            Some(body(&req)),
            201,
        )
    }

    /// Pull remote snapshot `name` (as `local`); panics unless 201.
    pub fn pull_snapshot(&self, name: &str, local: Option<&str>) -> SnapshotPulled {
        self.try_pull_snapshot(name, local)
            .unwrap_or_else(|r| panic!("pull of {name} failed: {r}"))
    }

    /// `POST /v1/remote/snapshots/{name}/clone` (201).
    pub fn try_clone_remote(&self, name: &str, count: u32, concurrency: u32) -> Answer<ClonedVms> {
        self.call(
            "POST",
            &format!("/v1/remote/snapshots/{name}/clone"),
            Some(body(&CloneVm { count, concurrency })),
            201,
        )
    }

    /// Clone remote snapshot `name` `count` times; panics unless 201.
    pub fn clone_remote(&self, name: &str, count: u32, concurrency: u32) -> ClonedVms {
        self.try_clone_remote(name, count, concurrency)
            .unwrap_or_else(|r| panic!("clone of remote snapshot {name} failed: {r}"))
    }
}
