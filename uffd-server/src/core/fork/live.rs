//! `POST /v1/vms/{id}/fork`: the steps of a live fork (see the module
//! doc), each a function, and the timings the answer reports.

use std::rc::Rc;
use std::time::Instant;

use proto::api::{ForkPhases, ForkResponse, MAX_FORK_COUNT};
use proto::vmm::{Reply, Request};
use shared::VmId;
use tracing::warn;

use super::children::{abort_children, create_children, fork_volumes, Ready};
use super::layer;
use crate::core::busy::{self, expect_state};
use crate::core::error::{Error, Result};
use crate::core::fd_budget::FdKind;
use crate::core::launch::create::{spawn_vmm, wait_ready};
use crate::core::launch::delete::discard_vms;
use crate::core::link::error::LinkError;
use crate::core::link::requests::{await_reply, request, send_request};
use crate::core::pool::take::launch_from_pool;
use crate::core::snapshot::arm::{arm_ahead, protect, ArmedAhead};
use crate::core::state::Core;
use crate::core::vm::RunState;

/// Children of a live fork at most that start before the parent resumes.
const EARLY_CHILDREN: usize = 4;

fn us(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Fork `parent` into `count` children.
pub(crate) async fn fork(core: &Rc<Core>, parent: VmId, count: u32) -> Result<ForkResponse> {
    busy::wait_out_reclaim(core, parent, "fork").await?;
    let template = check(core, parent, count)?;
    // The children's fds are promised to the fork until they have started.
    let _fds = core.fds.admit(FdKind::ForkChild, u64::from(count))?;
    let _busy = busy::begin(core, parent, "fork", "a fork")?;
    // Held busy: no other fork of it can begin a layer meanwhile.
    layer::wait_filled(core, parent).await;
    let mut stopped = stop_parent(core, parent, template).await?;
    let protected = protect_at_fork(core, parent, template, &mut stopped);
    let t_fork = Instant::now();
    let created = create_children(core, parent, count, Rc::clone(&stopped.state));
    let fork_us = us(t_fork);
    // Disks are reflinked while the parent is still paused.
    let t_vol = Instant::now();
    let created = created.and_then(|c| fork_volumes(core, parent, c));
    let volume_us = us(t_vol);
    let layer_held = layer::held(core, parent);
    let t_begin = Instant::now();
    let (created, layered) = begin_layer(core, parent, &protected, created, stopped.layer.take());
    let layer_begin_us = if layered { us(t_begin) } else { 0 };
    // The children of a parent on a base read its layer while it fills
    // (a page not copied yet is copied when read): they start as early as
    // any other fork's.
    let early = start_early(core, template, &protected, &created);
    let t_resume = Instant::now();
    let resumed = resume_parent(core, parent, template).await;
    let resume_us = us(t_resume);
    // From the pause, not from the arming before it: the parent runs
    // while its protection is armed.
    let pause_us = us(stopped.paused_at);
    let phases = ForkPhases {
        armed_ahead_us: stopped.armed.as_ref().map_or(0, |a| a.us),
        pause_and_capture_us: stopped.pause_and_capture_us,
        write_protect_us: stopped.write_protect_us,
        table_fork_us: fork_us,
        volumes_us: volume_us,
        resume_us,
        write_protected_pages: protected.as_ref().ok().copied(),
        layer_pages: 0,
        layer_us: 0,
        layer_begin_us,
        late_protect_us: stopped.late_protect_us,
    };
    let layer_pages = if layered { layer_held } else { 0 };
    let children = match keep_or_undo(core, protected, created, resumed, &early).await {
        Ok(c) => c,
        Err(e) => {
            layer::undo(core, parent);
            return Err(e);
        }
    };
    if layered {
        // Off the answer's path: the children start meanwhile.
        if let Some(l) = core
            .reg
            .borrow()
            .vms
            .get(&parent)
            .and_then(|v| v.fork.layering.clone())
        {
            layer::spawn_fill(core, l);
        }
    }
    let phases = ForkPhases {
        layer_pages,
        ..phases
    };
    let ids = start_children(core, children, &early).await?;
    if layered {
        layer::children_started(core, parent, &ids);
    }
    core.log_after_answer(format!(
        "{parent}: forked into {ids:?} (pause {pause_us} us, table fork {fork_us} us)"
    ));
    Ok(ForkResponse {
        parent: parent.to_string(),
        children: ids.iter().map(ToString::to_string).collect(),
        pause_us,
        fork_us,
        phases,
    })
}

/// Refuse a bad count, a VM that is neither running nor a paused template,
/// and children beyond the memory budget. Returns whether `parent` forks
/// as a template: a paused VM stays paused, and its pages need protecting
/// only once until it runs again.
fn check(core: &Core, parent: VmId, count: u32) -> Result<bool> {
    if count == 0 || count > MAX_FORK_COUNT {
        return Err(Error::BadRequest(format!(
            "count must be between 1 and {MAX_FORK_COUNT}"
        )));
    }
    let template = core
        .reg
        .borrow()
        .vms
        .get(&parent)
        .is_some_and(|v| v.state() == RunState::Paused && !v.is_deleted());
    if !template {
        expect_state(core, parent, RunState::Running, "fork")?;
    }
    let reg = core.reg.borrow();
    let size = reg.vms.get(&parent).map_or(0, |v| v.memory.size());
    crate::core::reclaim::admit(core)?;
    reg.admit(&core.settings, u64::from(count), size)?;
    Ok(template)
}

/// The parent stopped at the fork's moment, and how it got there.
struct Stopped<'a> {
    /// Its vCPU and device state, the children's start.
    state: Rc<shared::VmState>,
    /// A running parent's protection, armed before its pause.
    armed: Option<ArmedAhead<'a>>,
    /// Pages protected by the arming and the pause's re-protect.
    reprotected: Option<Result<u64>>,
    /// When the pause was sent (for a template, when its fork began).
    paused_at: Instant,
    pause_and_capture_us: u64,
    write_protect_us: u64,
    /// After the capture (a running parent): see `ForkPhases`.
    late_protect_us: u64,
    /// A parent on a base: the memfd of its layer, made before the pause.
    layer: Option<Rc<crate::memory::GuestMemory>>,
}

/// Steps 1 and 2: a running parent's materialized pages are
/// write-protected while it runs; then it is paused and captured (sent
/// back to back: the VMM answers in order, so the pause pays one round
/// trip, not two), and what it wrote meanwhile is re-protected while the
/// capture's answer is on its way. A template forked before, and unchanged
/// since, has its state kept: no round trip at all. On failure a running
/// parent is resumed.
async fn stop_parent(core: &Rc<Core>, parent: VmId, template: bool) -> Result<Stopped<'_>> {
    let timeout = core.settings.vmm_deadline;
    // A parent on a base needs no look at its VMM's pages: its table
    // names every page it wrote (see `core::base`). Its layer's memfd is
    // made now, while it runs.
    let layer = layer::prepare(&core.reg.borrow(), parent);
    let armed = if template {
        None
    } else {
        Some(arm_ahead(core, parent, &materialized(core, parent)?)?)
    };
    let t_pause = Instant::now();
    let kept = if template {
        core.reg
            .borrow()
            .vms
            .get(&parent)
            .and_then(|v| v.fork.paused_state.clone())
    } else {
        None
    };
    let paused = if template {
        None
    } else {
        Some(send_request(core, parent, Request::Pause)?)
    };
    let captured = match &kept {
        Some(_) => None,
        None => Some(send_request(core, parent, Request::CaptureState)),
    };
    let paused = match paused {
        Some(rx) => await_reply(parent, rx, timeout).await,
        None => Ok(Reply::Done),
    };
    // The vCPUs are stopped: re-protect what the parent wrote since its
    // protection was armed, while the capture's answer is on its way.
    let t_wp = Instant::now();
    let reprotected = match (&armed, &paused) {
        (Some(a), Ok(_)) => Some(a.reprotect().map(|(n, _)| a.pages + n)),
        _ => None,
    };
    let write_protect_us = us(t_wp);
    let captured = match (captured, kept) {
        (Some(Ok(rx)), _) => await_reply(parent, rx, timeout).await.map(|r| match r {
            Reply::State(s) => Ok(Rc::new(s)),
            other => Err(other),
        }),
        (Some(Err(e)), _) => Err(e),
        (None, Some(s)) => Ok(Ok(s)),
        (None, None) => unreachable!("a capture is sent unless a state is kept"),
    };
    let pause_and_capture_us = us(t_pause);
    match (paused, captured) {
        (Ok(_), Ok(Ok(state))) => Ok(Stopped {
            state,
            armed,
            reprotected,
            paused_at: t_pause,
            pause_and_capture_us,
            write_protect_us,
            late_protect_us: 0,
            layer,
        }),
        (p, c) => {
            // The pause may still land later (a VMM that stopped
            // answering): a resume queued behind it leaves the parent
            // running, as it was before the fork.
            if !template {
                drop(armed);
                resume_in_background(core, parent);
            }
            Err(match (p, c) {
                (Err(e), _) | (_, Err(e)) => e,
                (_, Ok(Err(r))) => LinkError::UnexpectedReply {
                    vm: parent,
                    request: "capture",
                    reply: format!("{r:?}"),
                }
                .into(),
                (Ok(_), Ok(Ok(_))) => unreachable!("handled above"),
            })
        }
    }
}

/// Step 2's end, with no await before the children are made: protect
/// what a late fault lifted since the re-protect (a running parent), or
/// the template's materialized pages the first time it forks. Returns how
/// many pages are protected.
fn protect_at_fork(
    core: &Core,
    parent: VmId,
    template: bool,
    stopped: &mut Stopped<'_>,
) -> Result<u64> {
    let t_wp = Instant::now();
    let frozen = template && freezes(core, parent);
    let protected = if let (Some(a), Some(p)) = (&stopped.armed, stopped.reprotected.take()) {
        let p = p.and_then(|n| a.finish().map(|(late, _)| n + late));
        stopped.late_protect_us = us(t_wp);
        p
    } else if protected_paused(core, parent) || frozen {
        // A paused parent on its own memfd never writes it again: it moves
        // onto it, as its children's base, before it runs.
        Ok(0)
    } else {
        let p = write_protect_materialized(core, parent);
        stopped.write_protect_us = us(t_wp);
        p
    };
    if template && protected.is_ok() {
        if let Some(v) = core.reg.borrow_mut().vms.get_mut(&parent) {
            v.fork.protected_paused = true;
            v.fork.paused_state = Some(Rc::clone(&stopped.state));
        }
    }
    protected
}

/// In the pause, once the children's tables are made: a parent on a base
/// freezes the pages it holds into a layer for them (see
/// [`layer::begin`]). On failure the children are forgotten.
fn begin_layer(
    core: &Core,
    parent: VmId,
    protected: &Result<u64>,
    created: Result<Vec<(VmId, Ready)>>,
    made: Option<Rc<crate::memory::GuestMemory>>,
) -> (Result<Vec<(VmId, Ready)>>, bool) {
    let (Ok(_), Ok(children)) = (protected, created.as_ref()) else {
        return (created, false);
    };
    let begun = layer::begin(&mut core.reg.borrow_mut(), parent, made);
    match begun {
        Ok(begun) => (created, begun),
        Err(e) => {
            let ids: Vec<VmId> = children.iter().map(|(id, _)| *id).collect();
            discard_vms(core, &ids);
            (Err(e), false)
        }
    }
}

/// The children of a small live fork that find a ready VMM in the pool
/// start now, while the parent's resume is on its way: a bind and a
/// Welcome add microseconds to the pause and take the resume round trip
/// off the children's start. The others (and the children of a template,
/// which has no resume) start after it.
fn start_early(
    core: &Rc<Core>,
    template: bool,
    protected: &Result<u64>,
    created: &Result<Vec<(VmId, Ready)>>,
) -> Vec<VmId> {
    let mut early = Vec::new();
    if let (false, Ok(_), Ok(c)) = (template, protected, created) {
        if c.len() <= EARLY_CHILDREN {
            for (id, _) in c {
                if launch_from_pool(core, *id) {
                    early.push(*id);
                }
            }
        }
    }
    early
}

/// Step 5's first half: a running parent resumes.
async fn resume_parent(core: &Core, parent: VmId, template: bool) -> Result<Reply> {
    if template {
        return Ok(Reply::Done);
    }
    request(core, parent, Request::Resume, core.settings.vmm_deadline).await
}

/// The children, if every step went well; else the first error, with the
/// children made so far forgotten (stopped first if some started early).
async fn keep_or_undo(
    core: &Rc<Core>,
    protected: Result<u64>,
    created: Result<Vec<(VmId, Ready)>>,
    resumed: Result<Reply>,
    early: &[VmId],
) -> Result<Vec<(VmId, Ready)>> {
    match (protected, created, resumed) {
        (Ok(_), Ok(c), Ok(_)) => Ok(c),
        (Err(e), c, _) => {
            if let Ok(c) = c {
                discard_vms(core, &c.iter().map(|(id, _)| *id).collect::<Vec<_>>());
            }
            Err(e)
        }
        (_, Err(e), _) => Err(e),
        (_, Ok(c), Err(e)) => {
            let ids: Vec<VmId> = c.iter().map(|(id, _)| *id).collect();
            if early.is_empty() {
                discard_vms(core, &ids);
            } else {
                abort_children(core, &ids).await;
            }
            Err(e)
        }
    }
}

/// Step 5's second half: start every child's VMM (but those started
/// early), then wait for all of them. Returns their ids.
async fn start_children(
    core: &Rc<Core>,
    children: Vec<(VmId, Ready)>,
    early: &[VmId],
) -> Result<Vec<VmId>> {
    let ids: Vec<VmId> = children.iter().map(|(id, _)| *id).collect();
    let mut waits = Vec::new();
    for (id, ready) in children {
        if !early.contains(&id) {
            if let Err(e) = spawn_vmm(core, id).await {
                abort_children(core, &ids).await;
                return Err(e);
            }
        }
        waits.push((id, ready));
    }
    for (id, ready) in waits {
        if let Err(e) = wait_ready(core, id, ready).await {
            abort_children(core, &ids).await;
            return Err(e);
        }
    }
    Ok(ids)
}

/// Whether a template fork of `vm` freezes its memfd as its children's
/// base (a paused VM on its own memfd, with shared bases on).
fn freezes(core: &Core, vm: VmId) -> bool {
    core.settings.shared_bases
        && core
            .reg
            .borrow()
            .vms
            .get(&vm)
            .is_some_and(|v| !v.base.is_based())
}

/// Whether `vm` is a paused template whose pages are all protected.
fn protected_paused(core: &Core, vm: VmId) -> bool {
    core.reg
        .borrow()
        .vms
        .get(&vm)
        .is_some_and(|v| v.fork.protected_paused)
}

/// Queue a resume for `vm` and log its outcome, without waiting.
fn resume_in_background(core: &Rc<Core>, vm: VmId) {
    let Ok(rx) = send_request(core, vm, Request::Resume) else {
        return;
    };
    let core = core.clone();
    tokio::task::spawn_local(async move {
        let late = core.settings.exec_timeout;
        match await_reply(vm, rx, late).await {
            // The guest runs again, whatever a late pause said before.
            Ok(_) => {
                if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
                    v.set_paused(false);
                }
            }
            Err(e) => warn!("{vm}: resume after a failed fork: {}", e.message()),
        }
    });
}

/// The runs of pages `vm` holds itself (its `Vm(vm)` extents).
fn materialized(core: &Core, vm: VmId) -> Result<Vec<(u64, u64)>> {
    let reg = core.reg.borrow();
    let v = reg.vm(vm)?;
    Ok(v.table.ranges_of(v.self_src))
}

/// Write-protect `vm`'s materialized pages. Returns how many pages.
fn write_protect_materialized(core: &Core, vm: VmId) -> Result<u64> {
    let ranges = materialized(core, vm)?;
    let reg = core.reg.borrow();
    protect(reg.vm(vm)?, &ranges)?;
    Ok(ranges.iter().map(|&(_, n)| n).sum())
}
