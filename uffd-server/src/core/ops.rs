//! API operations on existing VMs: show, list, pause, resume, exec.

use std::collections::BTreeMap;
use std::rc::Rc;

use proto::api::{ExecRequest, ExecResponse, FaultCounters, VmInfo};
use proto::vmm::{Reply, Request};
use serde_json::Value;
use shared::{VmId, PAGE_SIZE};

use super::vm::RunState;
use super::{not_found, ApiError, ApiResult, Core};

impl Core {
    /// `GET /v1/vms/{id}` as a typed value.
    pub fn info(&self, id: VmId) -> ApiResult<VmInfo> {
        let reg = self.reg.borrow();
        if let Some(v) = reg.fc_vms.get(&id) {
            let mut pages = BTreeMap::new();
            for (src, n) in v.table.counts() {
                let kind = reg.arena.get(*src).map(|s| s.kind()).unwrap_or("unknown");
                *pages.entry(kind.to_owned()).or_insert(0) += n;
            }
            return Ok(VmInfo {
                id: id.to_string(),
                state: v.state.name().into(),
                kind: "firecracker".into(),
                pid: Some(v.pid),
                memory_mib: v.regions.iter().map(|r| r.size).sum::<u64>() >> 20,
                vcpus: 0,
                pages,
                resident_pages: v.table.count_of(v.self_src),
                exit_reason: None,
                parent: None,
                volume: None,
                faults: FaultCounters {
                    missing: v.stats.missing,
                    write_protect: 0,
                    pages_installed: v.stats.pages_installed,
                    removes: v.stats.removes,
                    deferred: v.stats.deferred,
                    fault_around_kib: super::fault_around_kib(v.fault_around_pages),
                },
            });
        }
        let v = reg.vms.get(&id).ok_or_else(|| not_found(id))?;
        let mut pages = BTreeMap::new();
        for (src, n) in v.table.counts() {
            let kind = reg.arena.get(*src).map(|s| s.kind()).unwrap_or("unknown");
            *pages.entry(kind.to_owned()).or_insert(0) += n;
        }
        Ok(VmInfo {
            id: id.to_string(),
            state: if v.deleted {
                "deleted".into()
            } else {
                v.state.name().into()
            },
            kind: "pagefork".into(),
            pid: v.pid,
            memory_mib: v.memory_mib(),
            vcpus: v.vcpus,
            pages,
            resident_pages: v.memory.allocated_bytes() / PAGE_SIZE,
            exit_reason: v.exit_reason.clone(),
            parent: v.parent.map(|p| p.to_string()),
            volume: v.volume.clone(),
            faults: FaultCounters {
                missing: v.stats.missing,
                write_protect: v.stats.write_protect,
                pages_installed: v.stats.pages_installed,
                removes: v.stats.removes,
                deferred: v.stats.deferred,
                fault_around_kib: super::fault_around_kib(v.fault_around_pages),
            },
        })
    }

    /// `GET /v1/vms/{id}`.
    pub fn vm_info(&self, id: VmId) -> ApiResult<Value> {
        to_json(&self.info(id)?)
    }

    /// `GET /v1/vms`.
    pub fn list_vms(&self) -> Value {
        let ids: Vec<VmId> = {
            let reg = self.reg.borrow();
            let mut ids: Vec<VmId> = reg
                .vms
                .values()
                .filter(|v| !v.deleted)
                .map(|v| v.id)
                .collect();
            ids.extend(reg.fc_vms.keys().copied());
            ids.sort();
            ids
        };
        let infos: Vec<VmInfo> = ids
            .into_iter()
            .filter_map(|id| self.info(id).ok())
            .collect();
        serde_json::json!({ "vms": infos })
    }

    /// `POST /v1/vms/{id}/pause`.
    pub(super) async fn pause(self: Rc<Self>, id: VmId) -> ApiResult<Value> {
        self.expect_state(id, RunState::Running, "pause")?;
        self.request(id, Request::Pause, self.settings.exec_timeout)
            .await?;
        if let Some(v) = self.reg.borrow_mut().vms.get_mut(&id) {
            v.state = RunState::Paused;
        }
        self.vm_info(id)
    }

    /// `POST /v1/vms/{id}/resume`.
    pub(super) async fn resume(self: Rc<Self>, id: VmId) -> ApiResult<Value> {
        self.expect_state(id, RunState::Paused, "resume")?;
        self.request(id, Request::Resume, self.settings.exec_timeout)
            .await?;
        if let Some(v) = self.reg.borrow_mut().vms.get_mut(&id) {
            v.state = RunState::Running;
        }
        self.vm_info(id)
    }

    /// `POST /v1/vms/{id}/exec`.
    pub(super) async fn exec(self: Rc<Self>, id: VmId, req: ExecRequest) -> ApiResult<Value> {
        let (pages, state) = {
            let reg = self.reg.borrow();
            let v = reg.vms.get(&id).ok_or_else(|| not_found(id))?;
            (v.memory.pages(), v.state)
        };
        let op = req.to_op(pages).map_err(ApiError::bad_request)?;
        if state == RunState::Paused {
            return Err(ApiError::conflict(format!(
                "{id} is paused; resume it before exec"
            )));
        }
        match self
            .request(id, Request::Exec(op), self.settings.exec_timeout)
            .await?
        {
            Reply::Op(r) => to_json(&ExecResponse {
                op: op.name().into(),
                result: r.value,
                elapsed_us: r.elapsed_us,
            }),
            other => Err(ApiError::vmm(format!(
                "{id}: unexpected reply to exec: {other:?}"
            ))),
        }
    }

    fn expect_state(&self, id: VmId, want: RunState, what: &str) -> ApiResult<()> {
        let reg = self.reg.borrow();
        let v = reg.vms.get(&id).ok_or_else(|| not_found(id))?;
        if v.state != want {
            return Err(ApiError::conflict(format!(
                "cannot {what} {id}: it is {}, not {}",
                v.state.name(),
                want.name()
            )));
        }
        Ok(())
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> ApiResult<Value> {
    serde_json::to_value(v).map_err(|e| ApiError::internal(e.to_string()))
}
