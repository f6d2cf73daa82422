//! What the API asks of an existing VM directly: show it, list them,
//! pause, resume, run a guest op.

use std::rc::Rc;

use proto::api::{ExecRequest, ExecResponse, FaultCounters, VmInfo, VmKind, VmList};
use proto::vmm::{Reply, Request};
use shared::{VmId, PAGE_SIZE};

use crate::core::busy::{expect_state, refuse_while_busy, wait_out_reclaim};
use crate::core::error::{Error, Result};
use crate::core::link::error::LinkError;
use crate::core::link::requests::{await_reply, request, send_request};
use crate::core::settings::fault_around_kib;
use crate::core::state::Core;
use crate::core::vm::RunState;

/// `GET /v1/vms/{id}`.
pub(crate) fn info(core: &Core, id: VmId) -> Result<VmInfo> {
    let reg = core.reg.borrow();
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
                chunk_waits: v.stats.chunk_waits,
                fault_around_kib: fault_around_kib(v.fault_around_pages),
                wp_copies: v.stats.wp_copies,
                minor: 0,
                pages_shared: 0,
                service_us_log2: v.stats.service_us_log2.to_vec(),
                phases: v.phases.to_api(),
            },
            snapshot_saving: None,
            adopted: None,
            memory: proto::api::VmMemory {
                own_bytes: v.table.count_of(v.self_src) * PAGE_SIZE,
                shared_bytes: 0,
                base: None,
            },
            reads_from: crate::core::kept::reads_from(&reg, &v.table, v.self_src, None),
            reclaim: proto::api::VmReclaim::default(),
        });
    }
    let v = reg.vm(id)?;
    let memory = crate::core::base::memory(&reg, id);
    Ok(VmInfo {
        id: id.to_string(),
        state: v.api_state(),
        kind: VmKind::Pagefork,
        pid: v.link.pid,
        memory_mib: v.memory_mib(),
        vcpus: v.vcpus,
        hugepages: v.memory.unit_pages() > 1,
        pages: reg.pages_by_kind(&v.table),
        // Present in the VM: its own pages and those it maps from its base.
        resident_pages: (memory.own_bytes + memory.shared_bytes) / PAGE_SIZE,
        // The memfd its VMM maps: its own, or its base's.
        memfd: Some(
            v.base
                .on
                .as_ref()
                .map_or(v.memory.name(), |on| on.base.memory.name())
                .to_owned(),
        ),
        exit_reason: v.link.exit_reason.clone(),
        failure: v.failure().map(str::to_owned),
        parent: v.fork.parent.map(|p| p.to_string()),
        volume: v.volume.clone(),
        faults: FaultCounters {
            missing: v.log.stats.missing,
            write_protect: v.log.stats.write_protect,
            pages_installed: v.log.stats.pages_installed,
            removes: v.log.stats.removes,
            deferred: v.log.stats.deferred,
            frame_waits: v.log.stats.frame_waits,
            chunk_waits: v.log.stats.chunk_waits,
            fault_around_kib: fault_around_kib(v.faults.fault_around_pages),
            wp_copies: v.log.stats.wp_copies,
            minor: v.log.stats.minor,
            pages_shared: v.log.stats.pages_shared,
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
        adopted: v
            .adopted
            .as_ref()
            .map(crate::core::restart::state::AdoptedVm::to_api),
        memory,
        reads_from: crate::core::kept::reads_from(&reg, &v.table, v.self_src, v.base.on.as_ref()),
        // Its pages in the swap store: its own frames, and its parent's
        // it read since a fork.
        reclaim: v.reclaim.to_api(
            v.table
                .counts()
                .iter()
                .filter(|(s, _)| reg.arena.get(**s).is_some_and(|s| s.kind() == "swap"))
                .map(|(_, n)| n)
                .sum(),
        ),
    })
}

/// `GET /v1/vms`.
pub(crate) fn list_vms(core: &Core) -> VmList {
    let ids: Vec<VmId> = {
        let reg = core.reg.borrow();
        let mut ids: Vec<VmId> = reg
            .vms
            .values()
            .filter(|v| !v.is_deleted())
            .map(|v| v.id)
            .collect();
        ids.extend(reg.fc_vms.keys().copied());
        ids.sort();
        ids
    };
    VmList {
        vms: ids
            .into_iter()
            .filter_map(|id| info(core, id).ok())
            .collect(),
    }
}

/// Send a pause or resume; if the VMM misses the deadline, the request
/// stays queued and its late answer still sets the state, so the API
/// always shows what the guest is doing.
async fn pause_or_resume(core: &Rc<Core>, id: VmId, pause: bool) -> Result<()> {
    let (request, after) = if pause {
        (Request::Pause, RunState::Paused)
    } else {
        (Request::Resume, RunState::Running)
    };
    if let Some(v) = core.reg.borrow_mut().vms.get_mut(&id) {
        v.fork.forget_template();
    }
    let rx = send_request(core, id, request)?;
    let deadline = core.settings.vmm_deadline;
    let (tx, on_time) = tokio::sync::oneshot::channel();
    let core = core.clone();
    tokio::task::spawn_local(async move {
        let r = await_reply(id, rx, core.settings.exec_timeout).await;
        if r.is_ok() {
            if let Some(v) = core.reg.borrow_mut().vms.get_mut(&id) {
                v.set_paused(pause);
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
        Ok(Err(_)) => Err(LinkError::VmmGone { vm: id }.into()),
        Err(_) => Err(LinkError::VmmTimeout {
            vm: id,
            after: deadline,
        }
        .into()),
    }
}

/// `POST /v1/vms/{id}/pause`.
pub(crate) async fn pause(core: Rc<Core>, id: VmId) -> Result<VmInfo> {
    wait_out_reclaim(&core, id, "pause").await?;
    refuse_while_busy(&core, id, "pause")?;
    expect_state(&core, id, RunState::Running, "pause")?;
    pause_or_resume(&core, id, true).await?;
    info(&core, id)
}

/// `POST /v1/vms/{id}/resume`.
pub(crate) async fn resume(core: Rc<Core>, id: VmId) -> Result<VmInfo> {
    wait_out_reclaim(&core, id, "resume").await?;
    refuse_while_busy(&core, id, "resume")?;
    expect_state(&core, id, RunState::Paused, "resume")?;
    {
        // A template whose memfd its children map moves onto it first: it
        // must not write it again.
        let _busy = crate::core::busy::begin(&core, id, "resume", "a resume")?;
        crate::core::base::move_onto_base(&core, id).await?;
    }
    pause_or_resume(&core, id, false).await?;
    info(&core, id)
}

/// `POST /v1/vms/{id}/exec`.
pub(crate) async fn exec(core: &Rc<Core>, id: VmId, req: ExecRequest) -> Result<ExecResponse> {
    let (pages, has_disk) = {
        let reg = core.reg.borrow();
        let v = reg.vm(id)?;
        (v.memory.pages(), v.volume.is_some())
    };
    let op = req
        .to_op(pages)
        .map_err(|e| Error::BadRequest(e.to_string()))?;
    if req.needs_disk() && !has_disk {
        return Err(Error::NoDisk { vm: id });
    }
    expect_state(core, id, RunState::Running, "exec")?;
    match request(core, id, Request::Exec(op), core.settings.exec_timeout).await? {
        Reply::Op(r) => Ok(ExecResponse {
            op: op.name().into(),
            result: r.value,
            elapsed_us: r.elapsed_us,
        }),
        other => Err(LinkError::UnexpectedReply {
            vm: id,
            request: "exec",
            reply: format!("{other:?}"),
        }
        .into()),
    }
}

fn request_name(pause: bool) -> &'static str {
    if pause {
        "pause"
    } else {
        "resume"
    }
}
