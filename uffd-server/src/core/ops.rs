//! API operations on existing VMs: show, list, pause, resume, exec.

use std::collections::BTreeMap;
use std::rc::Rc;

use proto::api::{ExecRequest, ExecResponse, FaultCounters, VmInfo, VmKind, VmList};
use proto::vmm::{Reply, Request};
use shared::{VmId, PAGE_SIZE};

use super::vm::RunState;
use super::{Core, Error, Registry, Result};
use crate::pages::PageTable;

impl Registry {
    /// Pages per source kind of `table`.
    pub(super) fn pages_by_kind(&self, table: &PageTable) -> BTreeMap<String, u64> {
        let mut pages = BTreeMap::new();
        for (src, n) in table.counts() {
            let kind = self.arena.get(*src).map_or("unknown", |s| s.kind());
            *pages.entry(kind.to_owned()).or_insert(0) += n;
        }
        pages
    }
}

impl Core {
    /// `GET /v1/vms/{id}`.
    pub fn info(&self, id: VmId) -> Result<VmInfo> {
        let reg = self.reg.borrow();
        if let Some(v) = reg.fc_vms.get(&id) {
            return Ok(VmInfo {
                id: id.to_string(),
                state: v.state,
                kind: VmKind::Firecracker,
                pid: Some(v.pid),
                memory_mib: v.regions.iter().map(|r| r.size).sum::<u64>() >> 20,
                vcpus: 0,
                hugepages: v.regions.iter().any(|r| r.page_size > PAGE_SIZE),
                pages: reg.pages_by_kind(&v.table),
                resident_pages: v.table.count_of(v.self_src),
                memfd: None,
                exit_reason: None,
                failure: v.failure.clone(),
                parent: None,
                volume: None,
                faults: FaultCounters {
                    missing: v.stats.missing,
                    write_protect: 0,
                    pages_installed: v.stats.pages_installed,
                    removes: v.stats.removes,
                    deferred: v.stats.deferred,
                    frame_waits: v.stats.frame_waits,
                    fault_around_kib: super::fault_around_kib(v.fault_around_pages),
                    wp_copies: v.stats.wp_copies,
                    minor: 0,
                    service_us_log2: v.stats.service_us_log2.to_vec(),
                    phases: v.phases.to_api(),
                },
                snapshot_saving: None,
            });
        }
        let v = reg.vms.get(&id).ok_or(Error::NoSuchVm(id))?;
        Ok(VmInfo {
            id: id.to_string(),
            state: if v.deleted {
                RunState::Deleted
            } else {
                v.state
            },
            kind: VmKind::Pagefork,
            pid: v.link.pid,
            memory_mib: v.memory_mib(),
            vcpus: v.vcpus,
            hugepages: v.memory.unit_pages() > 1,
            pages: reg.pages_by_kind(&v.table),
            resident_pages: v.memory.allocated_bytes() / PAGE_SIZE,
            memfd: Some(v.memory.name().to_owned()),
            exit_reason: v.link.exit_reason.clone(),
            failure: v.failure.clone(),
            parent: v.fork.parent.map(|p| p.to_string()),
            volume: v.volume.clone(),
            faults: FaultCounters {
                missing: v.log.stats.missing,
                write_protect: v.log.stats.write_protect,
                pages_installed: v.log.stats.pages_installed,
                removes: v.log.stats.removes,
                deferred: v.log.stats.deferred,
                frame_waits: v.log.stats.frame_waits,
                fault_around_kib: super::fault_around_kib(v.faults.fault_around_pages),
                wp_copies: v.log.stats.wp_copies,
                minor: v.log.stats.minor,
                service_us_log2: v.log.stats.service_us_log2.to_vec(),
                phases: v.log.phases.to_api(),
            },
            snapshot_saving: v.snapshot.saving.as_ref().map(|s| {
                let s = s.borrow();
                proto::api::SnapshotSaving {
                    name: s.name.clone(),
                    pages_total: s.touched.len(),
                    pages_saved: s.pages_written,
                }
            }),
        })
    }

    /// `GET /v1/vms`.
    pub fn list_vms(&self) -> VmList {
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
        VmList {
            vms: ids
                .into_iter()
                .filter_map(|id| self.info(id).ok())
                .collect(),
        }
    }

    /// Mark `vm` as running `running` (a fork, a snapshot, a rollback:
    /// operations that pause and resume the VM themselves) until the guard
    /// drops; refuse if one is under way already. (Guest ops may run
    /// meanwhile: a pause stops the vCPUs at an instruction boundary.)
    pub(super) fn begin_busy(
        self: &Rc<Self>,
        vm: VmId,
        action: &'static str,
        running: &'static str,
    ) -> Result<BusyGuard> {
        self.refuse_while_busy(vm, action)?;
        if let Some(v) = self.reg.borrow_mut().vms.get_mut(&vm) {
            v.busy = Some(running);
            if action != "fork" {
                v.fork.protected_paused = false;
                v.fork.paused_state = None;
            }
        }
        Ok(BusyGuard {
            core: self.clone(),
            vm,
        })
    }

    /// Refuse `action` while `vm` runs an operation that pauses and
    /// resumes it itself.
    pub(super) fn refuse_while_busy(&self, vm: VmId, action: &'static str) -> Result<()> {
        let reg = self.reg.borrow();
        match reg.vms.get(&vm) {
            Some(v) => match v.busy {
                Some(running) => Err(Error::Busy {
                    vm,
                    action,
                    running,
                }),
                None => Ok(()),
            },
            None => Err(Error::NoSuchVm(vm)),
        }
    }

    /// Send a pause or resume; if the VMM misses the deadline, the request
    /// stays queued and its late answer still sets the state, so the API
    /// always shows what the guest is doing.
    async fn pause_or_resume(self: &Rc<Self>, id: VmId, pause: bool) -> Result<()> {
        let (request, after) = if pause {
            (Request::Pause, RunState::Paused)
        } else {
            (Request::Resume, RunState::Running)
        };
        if let Some(v) = self.reg.borrow_mut().vms.get_mut(&id) {
            v.fork.protected_paused = false;
            v.fork.paused_state = None;
        }
        let rx = self.send_request(id, request)?;
        let deadline = self.settings.vmm_deadline;
        let (tx, on_time) = tokio::sync::oneshot::channel();
        let core = self.clone();
        tokio::task::spawn_local(async move {
            let r = core.await_reply(id, rx, core.settings.exec_timeout).await;
            if r.is_ok() {
                if let Some(v) = core.reg.borrow_mut().vms.get_mut(&id) {
                    if matches!(v.state, RunState::Running | RunState::Paused) {
                        v.state = after;
                    }
                }
            }
            if let Err(Ok(())) = tx.send(r.map(drop)) {
                tracing::info!(
                    "{id}: a late {} took effect: it is {after}",
                    request_name(pause)
                );
            }
        });
        match tokio::time::timeout(deadline, on_time).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Error::VmmGone { vm: id }),
            Err(_) => Err(Error::VmmTimeout {
                vm: id,
                after: deadline,
            }),
        }
    }

    /// `POST /v1/vms/{id}/pause`.
    pub(super) async fn pause(self: Rc<Self>, id: VmId) -> Result<VmInfo> {
        self.refuse_while_busy(id, "pause")?;
        self.expect_state(id, RunState::Running, "pause")?;
        self.pause_or_resume(id, true).await?;
        self.info(id)
    }

    /// `POST /v1/vms/{id}/resume`.
    pub(super) async fn resume(self: Rc<Self>, id: VmId) -> Result<VmInfo> {
        self.refuse_while_busy(id, "resume")?;
        self.expect_state(id, RunState::Paused, "resume")?;
        self.pause_or_resume(id, false).await?;
        self.info(id)
    }

    /// `POST /v1/vms/{id}/exec`.
    pub(super) async fn exec(self: &Rc<Self>, id: VmId, req: ExecRequest) -> Result<ExecResponse> {
        let (pages, has_disk) = {
            let reg = self.reg.borrow();
            let v = reg.vms.get(&id).ok_or(Error::NoSuchVm(id))?;
            (v.memory.pages(), v.volume.is_some())
        };
        let op = req
            .to_op(pages)
            .map_err(|e| Error::BadRequest(e.to_string()))?;
        if req.needs_disk() && !has_disk {
            return Err(Error::NoDisk { vm: id });
        }
        self.expect_state(id, RunState::Running, "exec")?;
        match self
            .request(id, Request::Exec(op), self.settings.exec_timeout)
            .await?
        {
            Reply::Op(r) => Ok(ExecResponse {
                op: op.name().into(),
                result: r.value,
                elapsed_us: r.elapsed_us,
            }),
            other => Err(Error::UnexpectedReply {
                vm: id,
                request: "exec",
                reply: format!("{other:?}"),
            }),
        }
    }

    pub(super) fn expect_state(
        &self,
        id: VmId,
        want: RunState,
        action: &'static str,
    ) -> Result<()> {
        let reg = self.reg.borrow();
        let v = reg.vms.get(&id).ok_or(Error::NoSuchVm(id))?;
        let state = if v.deleted {
            RunState::Deleted
        } else {
            v.state
        };
        if state != want {
            return Err(Error::WrongState {
                vm: id,
                state,
                action,
            });
        }
        Ok(())
    }
}

fn request_name(pause: bool) -> &'static str {
    if pause {
        "pause"
    } else {
        "resume"
    }
}

/// Marks a VM as busy (see [`Core::begin_busy`]) while alive.
#[derive(Debug)]
pub(super) struct BusyGuard {
    core: Rc<Core>,
    vm: VmId,
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        if let Some(v) = self.core.reg.borrow_mut().vms.get_mut(&self.vm) {
            v.busy = None;
        }
    }
}
