//! VMs: create, inspect, delete, pause and resume; guest agent ops;
//! fork.

use std::time::{Duration, Instant};

use proto::api::{
    CreateVm, ExecRequest, ExecResponse, ForkRequest, ForkResponse, RunState, VmDeleted, VmInfo,
    VmKind, VmList,
};

use super::{body, from_snapshot, op, Answer, Api};

impl Api {
    /// `POST /v1/vms` (201).
    pub fn try_create_vm(&self, req: &CreateVm) -> Answer<VmInfo> {
        let vm: VmInfo = self.call("POST", "/v1/vms", Some(body(req)), 201)?;
        if let Some(pid) = vm.pid {
            self.vmm_pids
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(pid);
        }
        Ok(vm)
    }

    /// Create a VM; panics unless the answer is 201. Returns its id.
    pub fn create_vm(&self, req: &CreateVm) -> String {
        self.try_create_vm(req)
            .unwrap_or_else(|r| panic!("POST /v1/vms {} failed: {r}", body(req)))
            .id
    }

    /// Create a VM from snapshot `name`; returns its id.
    pub fn restore(&self, name: &str) -> String {
        self.create_vm(&from_snapshot(name))
    }

    /// `GET /v1/vms/{id}` (200).
    pub fn try_vm(&self, id: &str) -> Answer<VmInfo> {
        self.call("GET", &format!("/v1/vms/{id}"), None, 200)
    }

    /// `GET /v1/vms/{id}`; panics unless 200.
    pub fn vm(&self, id: &str) -> VmInfo {
        self.try_vm(id)
            .unwrap_or_else(|r| panic!("GET {id} failed: {r}"))
    }

    /// `GET /v1/vms`.
    pub fn vms(&self) -> Vec<VmInfo> {
        let list: VmList = self
            .call("GET", "/v1/vms", None, 200)
            .unwrap_or_else(|r| panic!("GET /v1/vms failed: {r}"));
        list.vms
    }

    /// `GET /v1/bases`: the shared bases and their users.
    pub fn bases(&self) -> proto::api::BaseList {
        self.call("GET", "/v1/bases", None, 200)
            .unwrap_or_else(|r| panic!("GET /v1/bases failed: {r}"))
    }

    /// Ids listed by `GET /v1/vms`.
    pub fn vm_ids(&self) -> Vec<String> {
        self.vms().into_iter().map(|vm| vm.id).collect()
    }

    /// `DELETE /v1/vms/{id}` (200).
    pub fn try_delete_vm(&self, id: &str) -> Answer<VmDeleted> {
        self.call("DELETE", &format!("/v1/vms/{id}"), None, 200)
    }

    /// Delete a VM; panics unless 200 and `deleted`.
    pub fn delete_vm(&self, id: &str) -> VmDeleted {
        let d = self
            .try_delete_vm(id)
            .unwrap_or_else(|r| panic!("DELETE {id} failed: {r}"));
        assert!(d.deleted, "DELETE {id}: {d:?}");
        d
    }

    /// `POST /v1/vms/{id}/reclaim` (200): give back every page of the VM
    /// that can be given back now.
    pub fn try_reclaim(&self, id: &str) -> Answer<proto::api::VmReclaimed> {
        self.call("POST", &format!("/v1/vms/{id}/reclaim"), None, 200)
    }

    /// [`Self::try_reclaim`]; panics unless 200.
    pub fn reclaim(&self, id: &str) -> proto::api::VmReclaimed {
        self.try_reclaim(id)
            .unwrap_or_else(|r| panic!("reclaim {id} failed: {r}"))
    }

    /// `GET /v1/memory`; panics unless 200.
    pub fn memory(&self) -> proto::api::MemoryStatus {
        self.call("GET", "/v1/memory", None, 200)
            .unwrap_or_else(|r| panic!("GET /v1/memory failed: {r}"))
    }

    /// `POST /v1/vms/{id}/pause` (200).
    pub fn try_pause(&self, id: &str) -> Answer<VmInfo> {
        self.call("POST", &format!("/v1/vms/{id}/pause"), None, 200)
    }

    /// Pause a VM's vCPUs; panics unless 200.
    pub fn pause(&self, id: &str) -> VmInfo {
        self.try_pause(id)
            .unwrap_or_else(|r| panic!("pause of {id} failed: {r}"))
    }

    /// `POST /v1/vms/{id}/resume` (200).
    pub fn try_resume(&self, id: &str) -> Answer<VmInfo> {
        self.call("POST", &format!("/v1/vms/{id}/resume"), None, 200)
    }

    /// Resume a VM's vCPUs; panics unless 200.
    pub fn resume(&self, id: &str) -> VmInfo {
        self.try_resume(id)
            .unwrap_or_else(|r| panic!("resume of {id} failed: {r}"))
    }

    /// Poll `GET /v1/vms/{id}` until its state is `state`; panics after
    /// `within`. Returns the last answer.
    pub fn wait_state(&self, id: &str, state: RunState, within: Duration) -> VmInfo {
        let deadline = Instant::now() + within;
        loop {
            let v = self.vm(id);
            if v.state == state {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{id} did not become {state} within {within:?}: {v:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The pid of VM `id`'s VMM; panics if it has none.
    pub fn vmm_pid(&self, id: &str) -> u32 {
        let vm = self.vm(id);
        vm.pid.unwrap_or_else(|| panic!("no pid in {vm:?}"))
    }

    /// 4 KiB pages per unit the server installs, protects and tracks for
    /// VM `id`: 512 on hugepage guest RAM, else 1.
    pub fn unit_pages(&self, id: &str) -> u64 {
        if self.vm(id).hugepages {
            512
        } else {
            1
        }
    }

    /// Firecracker VMs listed by `GET /v1/vms`.
    pub fn firecracker_vms(&self) -> Vec<VmInfo> {
        self.vms()
            .into_iter()
            .filter(|vm| vm.kind == VmKind::Firecracker)
            .collect()
    }

    /// The Firecracker VM of client process `pid`, if listed.
    pub fn firecracker_vm(&self, pid: u32) -> Option<VmInfo> {
        self.firecracker_vms()
            .into_iter()
            .find(|vm| vm.pid == Some(pid))
    }

    /// Wait until client process `pid` shows up as a Firecracker VM;
    /// panics after `within`. Returns the VM.
    pub fn wait_firecracker_vm(&self, pid: u32, within: Duration) -> VmInfo {
        crate::host::wait_until(
            &format!("fc_client pid {pid} in GET /v1/vms"),
            within,
            || self.firecracker_vm(pid),
        )
    }

    /// Wait until no Firecracker VM of client process `pid` is listed;
    /// panics after `within`.
    pub fn wait_firecracker_vm_gone(&self, pid: u32, within: Duration) {
        crate::host::wait_until(
            &format!("fc_client pid {pid} to leave GET /v1/vms"),
            within,
            || self.firecracker_vm(pid).is_none().then_some(()),
        );
    }

    // ------------------------------------------------------- guest ops --

    /// `POST /v1/vms/{id}/exec` (200).
    pub fn try_exec(&self, id: &str, req: &ExecRequest) -> Answer<ExecResponse> {
        self.call("POST", &format!("/v1/vms/{id}/exec"), Some(body(req)), 200)
    }

    /// Run a guest op; panics unless the answer is 200. Returns its result.
    pub fn exec(&self, id: &str, req: &ExecRequest) -> u64 {
        self.try_exec(id, req)
            .unwrap_or_else(|r| panic!("exec {} on {id} failed: {r}", body(req)))
            .result
    }

    /// `fill` pages `[start, start+pages)` of `id` with `seed`'s pattern.
    pub fn fill(&self, id: &str, start: u64, pages: u64, seed: u64) {
        let r = self.exec(id, &op::fill(start, pages, seed));
        assert_eq!(r, 0, "fill on {id} returned {r}");
    }

    /// `touch` (read, or rewrite unchanged) pages `[start, start+pages)`.
    pub fn touch(&self, id: &str, start: u64, pages: u64, write: bool) {
        self.exec(id, &op::touch(start, pages, write));
    }

    /// Pages of `[start, start+pages)` whose fill words differ from `seed`'s.
    pub fn verify(&self, id: &str, start: u64, pages: u64, seed: u64) -> u64 {
        self.exec(id, &op::verify(start, pages, seed))
    }

    /// The guest's checksum of `[start, start+pages)`.
    pub fn checksum(&self, id: &str, start: u64, pages: u64) -> u64 {
        self.exec(id, &op::checksum(start, pages))
    }

    /// The VMM's digest of `[start, start+pages)`.
    pub fn digest(&self, id: &str, start: u64, pages: u64) -> u64 {
        self.exec(id, &op::digest(start, pages))
    }

    /// The VM's id as its guest reads it.
    pub fn identity(&self, id: &str) -> u64 {
        self.exec(id, &op::identity())
    }

    // ------------------------------------------------------------ fork --

    /// `POST /v1/vms/{id}/fork` (201).
    pub fn try_fork(&self, id: &str, req: &ForkRequest) -> Answer<ForkResponse> {
        self.call("POST", &format!("/v1/vms/{id}/fork"), Some(body(req)), 201)
    }

    /// Fork `id` into `count` children; panics unless 201 with `count`
    /// children. Returns the whole answer.
    pub fn fork(&self, id: &str, count: u32) -> ForkResponse {
        let f = self
            .try_fork(id, &ForkRequest { count })
            .unwrap_or_else(|r| panic!("fork of {id} (count {count}) failed: {r}"));
        assert_eq!(
            f.children.len(),
            usize::try_from(count).expect("fits"),
            "fork answer: {f:?}"
        );
        f
    }

    /// Fork `id` into one child; returns the child's id.
    pub fn fork_one(&self, id: &str) -> String {
        self.fork(id, 1).children.remove(0)
    }
}
