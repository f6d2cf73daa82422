//! `POST /v1/vms/{id}/rollback`: the steps of a rollback in place (see
//! the module doc), each a function.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Instant;

use proto::api::{RollbackVm, VmRolledBack};
use proto::snapshot::StateFile;
use proto::vmm::Request;
use shared::{VmId, PAGE_SIZE};
use tracing::{info, warn};

use super::discard::{discard, spawn_scrub};
use super::fit;
use crate::core::busy::{self, expect_state};
use crate::core::error::{Error, Result};
use crate::core::fault::dependents::preserve_for_dependents;
use crate::core::link::process::stop_vmm;
use crate::core::link::requests::request;
use crate::core::restart::journal;
use crate::core::snapshot::state::DirtyLog;
use crate::core::state::Core;
use crate::core::vm::RunState;
use crate::images::{Pin, Stamp};
use crate::pages::{FileSource, ImageSource, PageSource, PageTable, UNINITIALIZED};
use crate::snapshot::pageset::PageSet;
use crate::snapshot::{image, SnapshotError};

fn us(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// The time of each step, as the answer reports it.
struct Phases {
    t: Instant,
    us: BTreeMap<String, u64>,
}

impl Phases {
    fn start() -> Self {
        Phases {
            t: Instant::now(),
            us: BTreeMap::new(),
        }
    }

    /// The step `name` ends now.
    fn lap(&mut self, name: &str) {
        self.us.insert(name.to_owned(), us(self.t));
        self.t = Instant::now();
    }
}

/// The snapshot a VM goes back to, checked and opened before the pause.
struct Target {
    name: String,
    state: StateFile,
    /// The VM's volume (the snapshot has one exactly when the VM does).
    volume: Option<String>,
    image: TargetImage,
}

/// The snapshot's image, which the VM's table will read.
struct TargetImage {
    file: File,
    path: PathBuf,
    len: u64,
    /// The runs of its pages that hold data.
    data: Vec<(u64, u64)>,
    pin: Pin,
}

/// What the pause of a rollback decided before the memory is dropped.
struct Prepared {
    /// Page runs to reset to the snapshot.
    reset: Vec<(u64, u64)>,
    /// The dirty log since the snapshot, when it is the VM's last one.
    since_target: Option<PageSet>,
    /// Pages handed to dependents.
    handed: u64,
    /// Host ranges for the VMM to discard, where it may.
    discard: Option<Vec<(u64, u64)>>,
}

/// Roll `vm` back to snapshot `req.snapshot`.
pub(crate) async fn rollback(core: &Rc<Core>, vm: VmId, req: RollbackVm) -> Result<VmRolledBack> {
    busy::wait_out_reclaim(core, vm, "roll back").await?;
    expect_state(core, vm, RunState::Running, "roll back")?;
    let _busy = busy::begin(core, vm, "roll back", "a rollback")?;
    let target = open_target(core, vm, req.snapshot)?;
    let t_pause = Instant::now();
    let mut phases = Phases::start();
    request(core, vm, Request::Pause, core.settings.vmm_deadline).await?;
    let _under_way = UnderWay::begin(core, vm, &target.name);
    phases.lap("pause");
    let prepared = match hand_over(core, vm, &target.name) {
        Ok(p) => p,
        Err(e) => {
            stop_vmm(core, vm).await;
            return Err(e);
        }
    };
    phases.lap("handover");
    let discarded = drop_pages(core, vm, &target.name, &prepared).await?;
    phases.lap("drop");
    let Target {
        name,
        state,
        volume,
        image,
    } = target;
    if let Err(e) = point_at_snapshot(core, vm, &name, image, &prepared, discarded) {
        stop_vmm(core, vm).await;
        return Err(e);
    }
    phases.lap("memory");
    restore_state(core, vm, &name, &state, volume.as_deref(), &mut phases).await?;
    request(core, vm, Request::Resume, core.settings.vmm_deadline).await?;
    phases.lap("resume");
    let based = core.reg.borrow().is_based(vm);
    if discarded && !based {
        spawn_scrub(core, vm);
    }
    let pause_us = us(t_pause);
    let handed = prepared.handed;
    info!("{vm}: rolled back to {name} in {pause_us} us ({handed} pages handed to dependents)");
    Ok(VmRolledBack {
        vm: vm.to_string(),
        snapshot: name,
        pages_handed_over: handed,
        pages_discarded: if discarded {
            prepared.reset.iter().map(|(_, n)| n).sum()
        } else {
            0
        },
        pause_us,
        phases_us: phases.us,
    })
}

/// A rollback under way, as the journal records it: from the pause on, a
/// server that takes the VM back after a crash finishes it
/// ([`finish_cut_short`]). Dropped (done, or the VM failed), it is over;
/// the sync before the answer records that.
struct UnderWay {
    core: Rc<Core>,
    vm: VmId,
}

impl UnderWay {
    fn begin(core: &Rc<Core>, vm: VmId, snapshot: &str) -> Self {
        if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
            v.rollback.begin(snapshot);
        }
        journal::sync(core, false);
        UnderWay {
            core: core.clone(),
            vm,
        }
    }
}

impl Drop for UnderWay {
    fn drop(&mut self) {
        if let Some(v) = self.core.reg.borrow_mut().vms.get_mut(&self.vm) {
            v.rollback.end();
        }
    }
}

/// Finish the rollback of `vm` that a crash of the server cut short (its
/// VMM just rejoined, paused since then): the whole rollback again, from
/// the pause (all of memory goes back: the dirty log did not survive). A
/// failure fails the VM visibly: its memory may be the snapshot's in
/// part.
pub(crate) async fn finish_cut_short(core: Rc<Core>, vm: VmId, snapshot: String) {
    info!("{vm}: finishing the rollback to {snapshot} a restart of the server cut short");
    if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
        // Held since adoption, so nothing else paused it meanwhile.
        v.busy.release();
    }
    let req = RollbackVm {
        snapshot: snapshot.clone(),
    };
    match rollback(&core, vm, req).await {
        Ok(done) => info!(
            "{vm}: the rollback to {snapshot} is finished ({} us)",
            done.pause_us
        ),
        Err(e) => {
            let reason = format!(
                "the rollback to {snapshot} a restart cut short cannot be finished: {}",
                e.message()
            );
            warn!("{vm}: {reason}");
            let failed = core.reg.borrow_mut().vms.get_mut(&vm).is_some_and(|v| {
                let failed = v.fail(reason);
                if failed {
                    v.rollback.end();
                }
                failed
            });
            if failed {
                stop_vmm(&core, vm).await;
            }
        }
    }
    journal::sync(&core, false);
}

/// Step 0, before the pause: the snapshot must fit the VM (`fit::check`:
/// whatever would fail once the VM is paused is refused here); its image
/// is opened and its data runs read.
fn open_target(core: &Core, vm: VmId, name: String) -> Result<Target> {
    let (state, path) = {
        let cat = core.snapshots.borrow();
        (cat.get(&name)?.clone(), cat.image_of(&name))
    };
    let volume = {
        let reg = core.reg.borrow();
        let v = reg.vm(vm)?;
        fit::check(core.volumes.as_deref(), v, &name, &state)?;
        v.volume.clone()
    };
    let file = image::open_read(&path)?;
    let len = file
        .metadata()
        .map_err(SnapshotError::io("stat", &path))?
        .len();
    let data = image::data_pages(&file, len).map_err(SnapshotError::io("read", &path))?;
    let pin = Pin::Stamp(Stamp::of(&file).map_err(SnapshotError::io("stat", &path))?);
    Ok(Target {
        name,
        state,
        volume,
        image: TargetImage {
            file,
            path,
            len,
            data,
            pin,
        },
    })
}

/// Step 2: which pages go back (only those written since snapshot `name`
/// when it is the VM's last one and its dirty log is intact, else all of
/// memory); those other VMs still read from this one go to them first.
fn hand_over(core: &Core, vm: VmId, name: &str) -> Result<Prepared> {
    let mut reg = core.reg.borrow_mut();
    // A VM on a shared base: the pages its guest wrote over the base are
    // its own too (learnt while it is paused), for the dependents' sake.
    crate::core::base::sync_private(&mut reg, vm)?;
    let (self_src, pages, since_target) = {
        let v = reg.vm(vm)?;
        let since = v
            .snapshot
            .dirty
            .as_ref()
            .filter(|d| d.since == name)
            .map(|d| d.pages.clone());
        (v.self_src, v.memory.pages(), since)
    };
    let reset = match &since_target {
        Some(written) => written.runs(),
        None => vec![(0, pages)],
    };
    // Pages other VMs read from this one go to them first (none to look at
    // when no other table names this VM).
    let mut handed = 0;
    let read_by_others = reg
        .vms
        .values()
        .any(|o| o.id != vm && o.table.count_of(self_src) > 0);
    for (first, n) in reset.iter().filter(|_| read_by_others) {
        for p in *first..first + n {
            let present = reg.vms.get(&vm).is_some_and(|v| v.table.get(p) == self_src);
            if present {
                handed += preserve_for_dependents(&mut reg, vm, p);
            }
        }
    }
    let v = reg.vm(vm)?;
    // 4 KiB memory whose VMM can: discard rather than punch. A VM on a
    // shared base keeps its own pages in its VMM: only the VMM can drop
    // them (and nothing stays stale: the base is left as it is).
    let based = v.base.is_based();
    let discard = (based || !v.rollback.no_discard && v.memory.unit_pages() == 1).then(|| {
        reset
            .iter()
            .map(|(first, n)| (v.addr_of(*first) as u64, n * PAGE_SIZE))
            .collect::<Vec<_>>()
    });
    Ok(Prepared {
        reset,
        since_target,
        handed,
        discard,
    })
}

/// Step 3, the pages' side. Fast way: the paused VMM unmaps the reset pages
/// (from itself and KVM) and leaves them in the memfd; they become stale
/// (see `RollbackState::stale`) and are punched after the resume, or at
/// their first access, whichever comes first. Freeing the pages is most of
/// a punch's cost (about two thirds measured on 4 KiB shmem), so the pause
/// no longer waits for it. Otherwise no stale page may survive: the reset
/// pages leave the memfd (which also unmaps them from the paused VMM and
/// from KVM), and the next access faults in the snapshot's bytes. Returns
/// whether the VMM discarded them; a VM whose memory cannot be emptied
/// fails (its VMM stopped).
async fn drop_pages(core: &Rc<Core>, vm: VmId, name: &str, prepared: &Prepared) -> Result<bool> {
    let discarded = match &prepared.discard {
        Some(ranges) => discard(core, vm, ranges.clone()).await,
        None => false,
    };
    if discarded {
        return Ok(true);
    }
    let punched: Result<()> = (|| {
        let mut reg = core.reg.borrow_mut();
        let v = reg.vm_mut(vm)?;
        if v.base.is_based() {
            let reason = format!("rollback to {name}: its VMM cannot drop the pages it wrote");
            v.fail(reason.clone());
            return Err(Error::RollbackFailed { vm, reason });
        }
        let punched = prepared
            .reset
            .iter()
            .try_for_each(|(first, n)| v.memory.punch_hole(*first, *n));
        if let Err(e) = punched {
            let reason = format!("rollback to {name}: cannot empty its memory: {e}");
            v.fail(reason.clone());
            return Err(Error::RollbackFailed { vm, reason });
        }
        Ok(())
    })();
    if let Err(e) = punched {
        stop_vmm(core, vm).await;
        return Err(e);
    }
    Ok(false)
}

/// Step 3, the table's side: the reset pages read the snapshot's image
/// (its holes `Uninitialized`). Back to the VM's last snapshot, only they
/// change and tracking goes on from it (their protection is given back);
/// otherwise the whole table is the snapshot's and the snapshot becomes
/// the VM's base.
fn point_at_snapshot(
    core: &Core,
    vm: VmId,
    name: &str,
    image: TargetImage,
    prepared: &Prepared,
    discarded: bool,
) -> Result<()> {
    let TargetImage {
        file,
        path,
        len,
        data,
        pin,
    } = image;
    let reset = &prepared.reset;
    let mut reg = core.reg.borrow_mut();
    let src = reg.arena.insert(PageSource::Image(ImageSource {
        snapshot: name.to_owned(),
        file: FileSource::new(path, file, len, pin),
    }));
    let v = reg.vm_mut(vm)?;
    let pages = v.memory.pages();
    // Over a base, the discard dropped the VM's own pages outright.
    if discarded && !v.base.is_based() {
        if v.rollback.stale.pages() != pages {
            v.rollback.stale = PageSet::new(pages);
        }
        for (first, n) in reset {
            v.rollback.stale.insert_range(*first, *n);
        }
    }
    // The page log starts again with the VM's new memory.
    for (first, n) in reset {
        v.log.pages.dropped(*first, *n);
    }
    v.log.pages.reset_access();
    match prepared.since_target {
        Some(_) => {
            let mut has_data = PageSet::new(pages);
            for (first, n) in &data {
                has_data.insert_range(*first, *n);
            }
            for (first, n) in reset {
                for p in *first..first + n {
                    let to = if has_data.contains(p) {
                        src
                    } else {
                        UNINITIALIZED
                    };
                    v.table.set(p, to);
                }
            }
            // Tracking stays exact: the reset pages lost their protection
            // with their bytes; give it back.
            let rearmed = v
                .faults
                .uffd
                .clone()
                .is_some_and(|uffd| v.write_protect_pages(uffd.get_ref(), reset, true).is_ok());
            v.snapshot.dirty = rearmed.then(|| DirtyLog {
                since: name.to_owned(),
                pages: PageSet::new(pages),
            });
        }
        None => {
            let mut table = PageTable::new(pages, UNINITIALIZED);
            for (first, n) in data {
                table.set_range(first, n, src);
            }
            v.table.replace(table);
            v.snapshot.base = Some((name.to_owned(), src));
            v.snapshot.dirty = None;
        }
    }
    v.faults.readahead.next = u64::MAX;
    reg.release_unused_sources();
    Ok(())
}

/// Steps 4 and 5's first half: the snapshot's volume into the VM's
/// volume, in place (the VMM keeps its open file and sees the new
/// content), and the snapshot's vCPU and device state into the paused
/// VMM. Memory is the snapshot's already: a failure here fails the VM
/// visibly, and its VMM is stopped.
async fn restore_state(
    core: &Rc<Core>,
    vm: VmId,
    name: &str,
    state: &StateFile,
    volume: Option<&str>,
    phases: &mut Phases,
) -> Result<()> {
    let restored = match (&state.volume_snapshot, volume) {
        (Some(vs), Some(vol)) => roll_volume_back(core, vol, vs),
        _ => Ok(()),
    };
    phases.lap("volume");
    let restored = match restored {
        Ok(()) => request(
            core,
            vm,
            Request::Restore(state.vm_state.clone()),
            core.settings.vmm_deadline,
        )
        .await
        .map(drop),
        Err(e) => Err(e),
    };
    if let Err(e) = restored {
        let reason = format!("rollback to {name} failed half-way: {}", e.message());
        if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
            v.fail(reason.clone());
        }
        stop_vmm(core, vm).await;
        return Err(Error::RollbackFailed { vm, reason });
    }
    phases.lap("restore");
    Ok(())
}

/// Put volume snapshot `vs`'s content into volume `vol` in place (the VMM
/// keeps its open file and sees the new content).
fn roll_volume_back(core: &Core, vol: &str, vs: &str) -> Result<()> {
    let engine = core.volumes.as_ref().ok_or(Error::NoVolumes)?;
    engine.restore_in_place(vol, vs)?;
    Ok(())
}
