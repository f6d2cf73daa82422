//! `POST /v1/vms/{id}/snapshots`: take a snapshot of a running or paused
//! VM, step by step (see the module doc): plan it, start its writer, arm
//! write protection ahead, pause, save in the window, commit.

use std::path::Path;
use std::rc::Rc;
use std::time::Instant;

use proto::api::{CreateSnapshot, SnapshotCreated};
use shared::VmId;
use tracing::warn;

use super::arm::arm_ahead;
use super::commit::{commit, Before, Taken};
use super::pause::{pause, volume_snapshot_name};
use super::plan::{plan, unprotected_runs, Plan};
use crate::core::busy;
use crate::core::error::{Error, Result};
use crate::core::state::Core;
use crate::core::vm::RunState;
use crate::snapshot::{checksum, writer, SnapshotError};

fn us(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Take snapshot `req.name` of `vm`. A paused VM is captured as it is and
/// stays paused; a running one is paused for the capture only. On failure
/// nothing is left behind: no snapshot listed, no `.tmp-` directory, no
/// volume snapshot, and the VM runs (or stays paused) as before.
pub(crate) async fn snapshot(
    core: &Rc<Core>,
    vm: VmId,
    req: CreateSnapshot,
) -> Result<SnapshotCreated> {
    let t0 = Instant::now();
    busy::wait_out_reclaim(core, vm, "snapshot").await?;
    let paused = check(core, vm)?;
    let _busy = busy::begin(core, vm, "snapshot", "a snapshot")?;
    let disk = volume_snapshot_name(core, vm, &req.name);
    if let (Some(disk), Some(engine)) = (&disk, &core.volumes) {
        // Taken with the memory, under the snapshot's name: refuse a name
        // whose volume snapshot exists before pausing anything.
        if engine.snapshot_info(disk).is_ok() {
            return Err(SnapshotError::Exists(disk.clone()).into());
        }
    }
    let tmp = core.snapshots.borrow_mut().reserve(&req.name)?;
    let taken = take(core, vm, &req, &tmp, paused, t0).await;
    if taken.is_err() {
        abandon(core, vm, &req.name, disk.as_deref());
    }
    taken
}

/// A snapshot is of a running or a paused VM; returns whether it is
/// paused. A paused VM is what one snapshots to keep a template, and
/// what Firecracker requires: it is captured as it is and stays paused.
fn check(core: &Core, vm: VmId) -> Result<bool> {
    let reg = core.reg.borrow();
    let v = reg.vm(vm)?;
    match v.api_state() {
        RunState::Running => Ok(false),
        RunState::Paused => Ok(true),
        state => Err(Error::WrongState {
            vm,
            state,
            action: "snapshot",
        }),
    }
}

/// The steps, once the name is reserved.
async fn take(
    core: &Rc<Core>,
    vm: VmId,
    req: &CreateSnapshot,
    tmp: &Path,
    paused: bool,
    t0: Instant,
) -> Result<SnapshotCreated> {
    let plan = plan(core, vm, req.mode, tmp)?;
    let plan_us = us(t0);
    let writer = start_writer(core, vm, &plan)?;
    let writer_us = us(t0).saturating_sub(plan_us);
    // The pages written since the last snapshot (all of memory for a first
    // one) are protected now, while the guest runs; the pause re-protects
    // only what it writes meanwhile (see `snapshot/arm.rs`).
    let ahead = arm_ahead(core, vm, &unprotected_runs(core, vm)?)?;
    let stopped = pause(core, vm, &req.name, &plan, writer, &ahead, paused).await?;
    let before = Before {
        t0,
        plan_us,
        armed_ahead_us: ahead.us,
        writer_us,
    };
    drop(ahead);
    let saved = super::window::save(core, vm, plan.parent.is_some()).await?;
    let taken = Taken {
        plan,
        paused: stopped,
        saved,
        before,
    };
    commit(core, vm, req, tmp, taken).await
}

/// Start the thread that writes the image, before the pause: spawning it
/// is no part of the guest's stop. It copies runs of the VM's own pages
/// out of its memory itself (4 KiB pages; hugetlb memory is read by the
/// core).
fn start_writer(core: &Core, vm: VmId, plan: &Plan) -> Result<writer::WriterHandle> {
    // A VM on a shared base keeps its own pages in its VMM, not in a
    // memfd: they are read through its table, on this thread.
    let memory = core.reg.borrow().vms.get(&vm).and_then(|v| {
        (v.memory.unit_pages() == 1 && !v.base.is_based()).then(|| writer::Memory {
            memfd: v.memory.shared_memfd(),
            len: v.memory.size(),
            hold: core.settings.snapshot_copy_hold,
        })
    });
    let writer = plan
        .image
        .file
        .try_clone()
        .and_then(|f| {
            writer::spawn(
                f,
                plan.image.path.clone(),
                plan.parent.is_none(),
                checksum::WRITE_ALGORITHM,
                memory,
            )
        })
        .map_err(SnapshotError::io("start writing", &plan.image.path))?;
    Ok(writer)
}

/// Undo a snapshot that failed: its name and files go, its volume
/// snapshot too, and the VM's saving window closes. The dirty log
/// restarted at the pause for a snapshot that never came to be: the next
/// `dirty` needs a new base.
fn abandon(core: &Core, vm: VmId, name: &str, disk: Option<&str>) {
    core.snapshots.borrow_mut().abandon(name);
    if let (Some(disk), Some(engine)) = (disk, &core.volumes) {
        if engine.snapshot_info(disk).is_ok() {
            if let Err(e) = engine.delete_snapshot(disk) {
                warn!("cannot delete volume snapshot {disk}: {}", e.chain());
            }
        }
    }
    if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
        v.snapshot.saving = None;
        v.snapshot.dirty = None;
    }
}
