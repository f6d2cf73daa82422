//! A snapshot's pause: the VM's vCPUs stop (a VM paused already stays
//! paused, and is only captured), what it wrote since its protection was
//! armed is re-protected, the pages to save are chosen and the saving
//! window opens with a new dirty log, the volume is snapshotted, and the
//! VM resumes; the capture's answer and the resume's share one wait (the
//! VMM answers in order).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::time::Instant;

use proto::api::SnapshotMode;
use proto::vmm::{Reply, Request};
use shared::VmId;
use tracing::warn;

use super::arm::ArmedAhead;
use super::plan::Plan;
use super::state::{DirtyLog, Saving};
use crate::core::error::Result;
use crate::core::link::error::LinkError;
use crate::core::link::requests::{await_reply, send_request};
use crate::core::link::state::PendingReply;
use crate::core::state::Core;
use crate::pages::UNINITIALIZED;
use crate::snapshot::pageset::PageSet;
use crate::snapshot::writer;

/// Snapshots saving at least this many pages (16 MiB) have the writer
/// copy runs of the VM's own pages out of its memory itself; smaller ones
/// have the core read them. Reading on the core and writing on the writer
/// overlap on two threads, which makes a small save quickest (at 1 % of
/// 1 GiB, A/B: 1.46 and 1.32× write + fsync against 1.64 and 1.49× with
/// the writer copying); a large one would keep the thread that serves
/// every VM's faults reading for hundreds of ms (a neighbour's faults
/// during a 512 MiB save: 1.38× their time alone with the writer copying,
/// 2.78× with the core reading, medians of five runs).
pub(crate) const COPY_MIN_PAGES: u64 = 4096;

fn us(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// What the pause produced.
pub(crate) struct Paused {
    /// The VM's captured vCPU and device state.
    pub state: shared::VmState,
    /// Its volume's snapshot, if it has a volume.
    pub volume_snapshot: Option<String>,
    /// The pause's phases (capture, write_protect, arm, volume, resume).
    pub phases_us: BTreeMap<String, u64>,
    /// From the pause to the resume's answer.
    pub pause_us: u64,
}

/// Stop `vm` (unless it is `paused` already), capture it, re-protect what
/// it wrote since `ahead`, open the saving window for snapshot `name`
/// (`writer` writes it), snapshot its volume, and let it run again (unless
/// it was paused). On failure the VM runs as it did before.
pub(crate) async fn pause(
    core: &Rc<Core>,
    vm: VmId,
    name: &str,
    plan: &Plan,
    writer: writer::WriterHandle,
    ahead: &ArmedAhead<'_>,
    paused: bool,
) -> Result<Paused> {
    let t_pause = Instant::now();
    let (captured, write_protect_us) = stop(core, vm, ahead, paused).await?;
    let capture_us = us(t_pause);
    let t_arm = Instant::now();
    let armed = open_window(core, vm, name, plan, writer, ahead);
    let arm_us = us(t_arm);
    let t_volume = Instant::now();
    let volume_snapshot = match &armed {
        Ok(_) => snapshot_volume(core, vm, name),
        Err(_) => Ok(None),
    };
    let volume_us = us(t_volume);
    let t_resume = Instant::now();
    let (state, resumed) = resume(core, vm, captured, paused).await;
    let resume_us = us(t_resume);
    let pause_us = us(t_pause);
    armed?;
    let state = match state? {
        Reply::State(s) => s,
        r => {
            return Err(LinkError::UnexpectedReply {
                vm,
                request: "capture",
                reply: format!("{r:?}"),
            }
            .into())
        }
    };
    let phases_us = [
        ("capture", capture_us),
        ("write_protect", write_protect_us),
        ("arm", arm_us),
        ("volume", volume_us),
        ("resume", resume_us),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let volume_snapshot = volume_snapshot?;
    resumed?;
    Ok(Paused {
        state,
        volume_snapshot,
        phases_us,
        pause_us,
    })
}

/// Pause `vm` (unless it is `paused` already) and ask for its state; once
/// its vCPUs are stopped, re-protect what it wrote since `ahead` armed its
/// protection (while the capture's answer is on its way). Returns the
/// capture's pending answer and the re-protect's time in µs. On failure
/// the VM is resumed.
async fn stop(
    core: &Rc<Core>,
    vm: VmId,
    ahead: &ArmedAhead<'_>,
    paused: bool,
) -> Result<(Result<PendingReply>, u64)> {
    let timeout = core.settings.vmm_deadline;
    let pausing = if paused {
        None
    } else {
        Some(send_request(core, vm, Request::Pause)?)
    };
    let captured = send_request(core, vm, Request::CaptureState);
    let stopped = match pausing {
        Some(rx) => await_reply(vm, rx, timeout).await.map(drop),
        None => Ok(()),
    };
    let protected = stopped.and_then(|()| ahead.reprotect().map(|(_, took)| took));
    match protected {
        Ok(took) => Ok((captured, took)),
        Err(e) => {
            // The pause may still land later (a VMM that stopped
            // answering): a resume queued behind it leaves the VM
            // running.
            if !paused {
                resume_in_background(core, vm);
            }
            Err(e)
        }
    }
}

/// Queue a resume for `vm` after a failed capture, and log its failure.
fn resume_in_background(core: &Rc<Core>, vm: VmId) {
    if let Ok(rx) = send_request(core, vm, Request::Resume) {
        let core = core.clone();
        tokio::task::spawn_local(async move {
            let late = core.settings.exec_timeout;
            if let Err(e) = await_reply(vm, rx, late).await {
                warn!("{vm}: resume after a failed capture: {}", e.message());
            }
        });
    }
}

/// Nothing left needs the guest stopped: the resume goes out now (unless
/// the VM was `paused` before the snapshot: it stays so), behind the
/// capture in the VMM's queue. Returns the capture's answer and the
/// resume's.
async fn resume(
    core: &Core,
    vm: VmId,
    captured: Result<PendingReply>,
    paused: bool,
) -> (Result<Reply>, Result<()>) {
    let timeout = core.settings.vmm_deadline;
    let resume = (!paused).then(|| send_request(core, vm, Request::Resume));
    let state = match captured {
        Ok(rx) => await_reply(vm, rx, timeout).await,
        Err(e) => Err(e),
    };
    let resumed = match resume {
        Some(Ok(rx)) => await_reply(vm, rx, timeout).await.map(drop),
        Some(Err(e)) => Err(e),
        None => Ok(()),
    };
    (state, resumed)
}

/// While `vm` is paused: choose the pages to save, finish the protection
/// armed ahead (all of its RAM is protected then), restart its dirty log
/// and open the saving window.
fn open_window(
    core: &Core,
    vm: VmId,
    name: &str,
    plan: &Plan,
    writer: writer::WriterHandle,
    ahead: &ArmedAhead<'_>,
) -> Result<()> {
    let mut reg = core.reg.borrow_mut();
    // The pages a VM on a shared base wrote over it raised no fault: its
    // table learns them now, while its vCPUs are stopped.
    crate::core::base::sync_private(&mut reg, vm)?;
    let v = reg.vm_mut(vm)?;
    let pages = v.memory.pages();
    let pending = match plan.mode {
        SnapshotMode::Full => {
            let mut set = PageSet::new(pages);
            for e in v.table.extents() {
                if e.source != UNINITIALIZED {
                    set.insert_range(e.start, e.pages);
                }
            }
            set
        }
        SnapshotMode::Incremental => {
            let (base_src, data) = plan.base.clone().unwrap_or_default();
            let mut set = PageSet::new(pages);
            for e in v.table.extents() {
                if e.source != UNINITIALIZED && e.source != base_src {
                    set.insert_range(e.start, e.pages);
                }
            }
            // Pages discarded since the start read as zero now, where
            // the base image may hold data.
            for (first, n) in data {
                for p in first..(first + n).min(pages) {
                    if v.table.get(p) == UNINITIALIZED {
                        set.insert(p);
                    }
                }
            }
            set
        }
        SnapshotMode::Dirty => v
            .snapshot
            .dirty
            .as_ref()
            .map_or_else(|| PageSet::new(pages), |d| d.pages.clone()),
    };
    // Faults handled since the re-protect (one that waited) may have
    // lifted a protection: put it back, with the new log and the
    // saving window opened in the same step.
    drop(reg);
    ahead.finish()?;
    let mut reg = core.reg.borrow_mut();
    let v = reg.vm_mut(vm)?;
    v.snapshot.dirty = Some(DirtyLog {
        since: name.to_owned(),
        pages: PageSet::new(pages),
    });
    let copy_runs = writer.copies() && pending.len() >= COPY_MIN_PAGES;
    v.snapshot.saving = Some(Rc::new(RefCell::new(Saving {
        name: name.to_owned(),
        touched: pending.clone(),
        pending,
        writer: Some(writer),
        error: None,
        pages_written: 0,
        saved_before_write: 0,
        in_flight: PageSet::new(pages),
        copying: Default::default(),
        copy_runs,
    })));
    Ok(())
}

/// The name of the volume snapshot taken with snapshot `name` of `vm`,
/// if `vm` has a volume.
pub(crate) fn volume_snapshot_name(core: &Core, vm: VmId, name: &str) -> Option<String> {
    let reg = core.reg.borrow();
    reg.vms
        .get(&vm)
        .and_then(|v| v.volume.as_ref())
        .map(|_| format!("{name}.disk"))
}

/// Snapshot `vm`'s volume (while paused) as `<name>.disk`.
fn snapshot_volume(core: &Core, vm: VmId, name: &str) -> Result<Option<String>> {
    let vol = core
        .reg
        .borrow()
        .vms
        .get(&vm)
        .and_then(|v| v.volume.clone());
    let (Some(vol), Some(engine)) = (vol, core.volumes.as_ref()) else {
        return Ok(None);
    };
    let snap = format!("{name}.disk");
    engine.snapshot(&vol, &snap)?;
    Ok(Some(snap))
}
