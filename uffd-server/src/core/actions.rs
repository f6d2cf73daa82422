//! What the API (and `main.rs`) can ask of the core: one method of
//! [`Core`] per action, each handing it to the feature module that does
//! it. The API layer calls these with a request's typed body and gets its
//! typed answer; nothing here holds logic of its own.

use std::rc::Rc;

use proto::api::{
    AccessMap, AccessQuery, CloneVm, ClonedVms, CreateListener, CreateSnapshot, CreateVm,
    ExecRequest, ExecResponse, ForkResponse, Invariant, ListenerDeleted, ListenerInfo,
    ListenerList, MapQuery, PageInfo, PageMap, PullSnapshot, RemoteGc, RemoteSnapshotDeleted,
    RemoteSnapshotInfo, RemoteSnapshotList, RemoteStatus, RollbackVm, SnapshotCreated,
    SnapshotDeleted, SnapshotInfo, SnapshotList, SnapshotPulled, Sources, Tree, VmDeleted, VmInfo,
    VmList, VmRolledBack,
};
use shared::VmId;

use super::error::Result;
use super::state::Core;
use super::{clone, firecracker, fork, inspect, launch, ops, pool, remote, rollback, snapshot};
use crate::observe::metrics::Sample;
use crate::observe::trace::Subscription;

impl Core {
    /// `POST /v1/vms`: a new VM, or one restored from a snapshot.
    pub async fn create_vm(self: Rc<Self>, req: CreateVm) -> Result<VmInfo> {
        launch::create::create_vm(self, req).await
    }

    /// `GET /v1/vms`.
    pub fn list_vms(&self) -> VmList {
        ops::list_vms(self)
    }

    /// `GET /v1/bases`.
    pub fn list_bases(&self) -> proto::api::BaseList {
        crate::core::base::list(&self.reg.borrow())
    }

    /// `GET /v1/vms/{id}`.
    pub fn info(&self, id: VmId) -> Result<VmInfo> {
        ops::info(self, id)
    }

    /// `DELETE /v1/vms/{id}`.
    pub async fn delete_vm(self: Rc<Self>, id: VmId) -> Result<VmDeleted> {
        launch::delete::delete_vm(self, id).await
    }

    /// `POST /v1/vms/{id}/pause`.
    pub async fn pause(self: Rc<Self>, id: VmId) -> Result<VmInfo> {
        ops::pause(self, id).await
    }

    /// `POST /v1/vms/{id}/resume`.
    pub async fn resume(self: Rc<Self>, id: VmId) -> Result<VmInfo> {
        ops::resume(self, id).await
    }

    /// `POST /v1/vms/{id}/exec`.
    pub async fn exec(self: &Rc<Self>, id: VmId, req: ExecRequest) -> Result<ExecResponse> {
        ops::exec(self, id, req).await
    }

    /// `POST /v1/vms/{id}/fork`.
    pub async fn fork(self: &Rc<Self>, parent: VmId, count: u32) -> Result<ForkResponse> {
        fork::live::fork(self, parent, count).await
    }

    /// `GET /v1/vms/{id}/sources`.
    pub fn sources(&self, id: VmId) -> Result<Sources> {
        inspect::sources(self, id)
    }

    /// `GET /v1/vms/{id}/pages/{page}[?explain=true]`.
    pub fn page(&self, id: VmId, page: u64, explain: bool) -> Result<PageInfo> {
        inspect::page(self, id, page, explain)
    }

    /// `GET /v1/vms/{id}/faults`: listen to its faults from now on.
    pub fn subscribe_faults(&self, id: VmId) -> Result<Subscription> {
        super::fault::trace::subscribe(self, id)
    }

    /// `GET /v1/vms/{id}/access`.
    pub fn access(&self, id: VmId, q: &AccessQuery) -> Result<AccessMap> {
        inspect::access(self, id, q)
    }

    /// `GET /v1/vms/{id}/map`.
    pub fn page_map(&self, id: VmId, q: &MapQuery) -> Result<PageMap> {
        inspect::page_map(self, id, q)
    }

    /// `GET /v1/vms/{id}/access.png`.
    pub fn access_png(&self, id: VmId, q: &MapQuery) -> Result<Vec<u8>> {
        inspect::access_png(self, id, q)
    }

    /// `GET /v1/tree`.
    pub fn tree(&self) -> Tree {
        inspect::tree(self)
    }

    /// `GET /v1/debug/invariant`.
    pub fn check_invariant(&self) -> Invariant {
        inspect::check_invariant(self)
    }

    /// `GET /metrics`: the counters, read now.
    pub fn metrics_sample(&self) -> Sample {
        inspect::metrics_sample(self)
    }

    /// `POST /v1/vms/{id}/snapshots`.
    pub async fn snapshot(
        self: &Rc<Self>,
        vm: VmId,
        req: CreateSnapshot,
    ) -> Result<SnapshotCreated> {
        snapshot::save::snapshot(self, vm, req).await
    }

    /// `GET /v1/snapshots`.
    pub fn list_snapshots(&self) -> SnapshotList {
        snapshot::catalog::list_snapshots(self)
    }

    /// `GET /v1/snapshots/{name}`.
    pub fn snapshot_info(&self, name: &str) -> Result<SnapshotInfo> {
        snapshot::catalog::snapshot_info(self, name)
    }

    /// `DELETE /v1/snapshots/{name}`.
    pub fn delete_snapshot(&self, name: &str) -> Result<SnapshotDeleted> {
        snapshot::catalog::delete_snapshot(self, name)
    }

    /// `POST /v1/vms/{id}/rollback`.
    pub async fn rollback(self: &Rc<Self>, vm: VmId, req: RollbackVm) -> Result<VmRolledBack> {
        rollback::reset::rollback(self, vm, req).await
    }

    /// `POST /v1/vms/{id}/clone`.
    pub async fn clone_vm(self: &Rc<Self>, vm: VmId, req: CloneVm) -> Result<ClonedVms> {
        clone::clone_vm(self, vm, req).await
    }

    /// `POST /v1/snapshots/{name}/push`: start pushing it to the store.
    pub fn push_snapshot(self: &Rc<Self>, name: &str) -> Result<SnapshotInfo> {
        remote::push::push(self, name)
    }

    /// `GET /v1/remote`.
    pub fn remote_status(&self) -> Result<RemoteStatus> {
        remote::store::status(self)
    }

    /// `GET /v1/remote/snapshots`.
    pub async fn remote_snapshots(self: Rc<Self>) -> Result<RemoteSnapshotList> {
        remote::store::list(&self).await
    }

    /// `GET /v1/remote/snapshots/{name}`.
    pub async fn remote_snapshot(self: Rc<Self>, name: &str) -> Result<RemoteSnapshotInfo> {
        remote::store::info(&self, name).await
    }

    /// `DELETE /v1/remote/snapshots/{name}`.
    pub async fn delete_remote_snapshot(
        self: Rc<Self>,
        name: &str,
    ) -> Result<RemoteSnapshotDeleted> {
        remote::store::delete(&self, name).await
    }

    /// `POST /v1/remote/gc`.
    pub async fn remote_gc(self: Rc<Self>) -> Result<RemoteGc> {
        remote::store::gc(&self).await
    }

    /// `POST /v1/remote/snapshots/{name}/pull`.
    pub async fn pull_snapshot(
        self: Rc<Self>,
        name: &str,
        req: PullSnapshot,
    ) -> Result<SnapshotPulled> {
        remote::pull::pull(&self, name, req).await
    }

    /// `POST /v1/remote/snapshots/{name}/clone`.
    pub async fn clone_remote(self: Rc<Self>, name: &str, req: CloneVm) -> Result<ClonedVms> {
        remote::clone::clone_remote(&self, name, req).await
    }

    /// `POST /v1/firecracker/listeners` (and `--fc-listen` at start-up).
    pub fn add_fc_listener(self: &Rc<Self>, req: CreateListener) -> Result<ListenerInfo> {
        firecracker::listener::add_fc_listener(self, req)
    }

    /// `GET /v1/firecracker/listeners/{id}`.
    pub fn fc_listener_info(&self, id: u32) -> Result<ListenerInfo> {
        firecracker::listener::fc_listener_info(self, id)
    }

    /// `GET /v1/firecracker/listeners`.
    pub fn fc_listeners(&self) -> ListenerList {
        firecracker::listener::fc_listeners(self)
    }

    /// `DELETE /v1/firecracker/listeners/{id}`.
    pub fn delete_fc_listener(&self, id: u32) -> Result<ListenerDeleted> {
        firecracker::listener::delete_fc_listener(self, id)
    }

    /// Fill the warm VMM pool (at start-up).
    pub fn start_pool(self: &Rc<Self>) {
        pool::refill::start(self);
    }

    /// Mark an API request in flight until the guard drops (the pool
    /// refills only while the API is quiet).
    pub fn pool_activity(self: &Rc<Self>) -> pool::refill::Activity {
        pool::refill::activity(self)
    }
}
