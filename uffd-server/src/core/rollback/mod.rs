//! `impl Core` for rolling a VM back to a snapshot in place, and for
//! cloning a VM n times (DESIGN §6).
//!
//! Rollback of VM X to snapshot S (X keeps its id, memfd, VMM and
//! dependents):
//! 1. Pause X.
//! 2. Hand every page another VM still reads from X to that VM (the
//!    copy-on-write step of a WP fault, done for all of them at once).
//! 3. Drop every page of X's memfd (no stale page may survive) and point
//!    X's table at S's image (holes `Uninitialized`): the next accesses
//!    fault S's bytes in. When S is X's last snapshot and X's dirty log
//!    runs since S, only the pages written since S differ from it: only
//!    those are dropped and pointed at S (cost follows the dirty pages,
//!    not memory), and tracking goes on from S.
//!
//!    On 4 KiB memory the paused VMM discards them (`Request::Discard`):
//!    it registers guest RAM MINOR too and unmaps them from itself and
//!    from KVM, and their bytes stay in the memfd, stale (`Vm::stale`).
//!    A stale page cannot be read: unmapped, its next access is a MINOR
//!    fault, where the server punches it and installs S's bytes; every
//!    install punches the stale pages of its run first; and a scrub task
//!    punches the rest after the resume. The pause thus pays the unmap,
//!    not the freeing of the pages (two thirds of a punch). Where the VMM
//!    cannot (hugetlb memory, no MINOR on shmem), the pause punches.
//! 4. FICLONE S's volume snapshot into X's volume file (same inode: the
//!    VMM's open disk sees it).
//! 5. Load S's vCPU/device state into the paused VMM (`Request::Restore`)
//!    and resume. A failure after step 3 fails X visibly.
//!
//! clone(n, c): one snapshot (`dirty` where the VM has a base, else
//! `full`), then n VMs from it, at most c being created at once. All or
//! nothing: if one fails, every clone made is deleted, and the snapshot
//! with them.

pub mod state;

use std::rc::Rc;
use std::time::Instant;

use proto::api::{
    CloneVm, ClonedVms, CreateSnapshot, CreateVm, RollbackVm, SnapshotMode, VmRolledBack,
    MAX_CLONE_COUNT,
};
use proto::vmm::Request;
use shared::{VmId, PAGE_SIZE};
use tracing::{info, warn};

use super::snapshot::state::DirtyLog;
use super::vm::RunState;
use super::{Core, Error, Result};
use crate::pages::{FileSource, ImageSource, PageSource, PageTable, UNINITIALIZED};
use crate::snapshot::{image, PageSet, SnapshotError};

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

fn us(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

impl Core {
    /// `POST /v1/vms/{id}/rollback`.
    pub(super) async fn rollback(
        self: &Rc<Self>,
        vm: VmId,
        req: RollbackVm,
    ) -> Result<VmRolledBack> {
        self.expect_state(vm, RunState::Running, "roll back")?;
        let _busy = self.begin_busy(vm, "roll back", "a rollback")?;
        let name = req.snapshot;
        let (state, path) = {
            let cat = self.snapshots.borrow();
            (cat.get(&name)?.clone(), cat.image_of(&name))
        };
        let (size, volume) = {
            let reg = self.reg.borrow();
            let v = reg.vms.get(&vm).ok_or(Error::NoSuchVm(vm))?;
            (v.memory.size(), v.volume.clone())
        };
        if state.memory_bytes != size {
            return Err(Error::BadRequest(format!(
                "snapshot {name} has {} MiB of memory, {vm} has {} MiB",
                state.memory_bytes >> 20,
                size >> 20
            )));
        }
        if state.volume_snapshot.is_some() != volume.is_some() {
            return Err(Error::BadRequest(format!(
                "snapshot {name} {} a volume and {vm} {}; roll back to a snapshot of this VM",
                if state.volume_snapshot.is_some() {
                    "has"
                } else {
                    "has no"
                },
                if volume.is_some() {
                    "has one"
                } else {
                    "has none"
                },
            )));
        }
        let file = image::open_read(&path)?;
        let len = file
            .metadata()
            .map_err(SnapshotError::io("stat", &path))?
            .len();
        let data = image::data_pages(&file, len).map_err(SnapshotError::io("read", &path))?;
        let pin = crate::images::Pin::Stamp(
            crate::images::Stamp::of(&file).map_err(SnapshotError::io("stat", &path))?,
        );

        let t_pause = Instant::now();
        let mut phases = std::collections::BTreeMap::new();
        let mut t = Instant::now();
        let mut phase = |name: &str, phases: &mut std::collections::BTreeMap<String, u64>| {
            phases.insert(name.to_owned(), us(t));
            t = Instant::now();
        };
        self.request(vm, Request::Pause, self.settings.vmm_deadline)
            .await?;
        phase("pause", &mut phases);
        // Step 2: pages others read from this VM go to them first.
        let prepared: Result<Prepared> = (|| {
            let mut reg = self.reg.borrow_mut();
            let (self_src, pages, since_target) = {
                let v = reg.vms.get(&vm).ok_or(Error::NoSuchVm(vm))?;
                let since = v
                    .snapshot
                    .dirty
                    .as_ref()
                    .filter(|d| d.since == name)
                    .map(|d| d.pages.clone());
                (v.self_src, v.memory.pages(), since)
            };
            // Back to the VM's last snapshot with its dirty log intact: only
            // the pages written since differ from the snapshot; reset those.
            // Otherwise reset all of memory.
            let reset = match &since_target {
                Some(written) => written.runs(),
                None => vec![(0, pages)],
            };
            // Pages other VMs read from this one go to them first (none
            // to look at when no other table names this VM).
            let mut handed = 0;
            let read_by_others = reg
                .vms
                .values()
                .any(|o| o.id != vm && o.table.count_of(self_src) > 0);
            for (first, n) in reset.iter().filter(|_| read_by_others) {
                for p in *first..first + n {
                    let present = reg.vms.get(&vm).is_some_and(|v| v.table.get(p) == self_src);
                    if present {
                        handed +=
                            super::fault::dependents::preserve_for_dependents(&mut reg, vm, p);
                    }
                }
            }
            let v = reg.vms.get(&vm).ok_or(Error::NoSuchVm(vm))?;
            // 4 KiB memory whose VMM can: discard rather than punch.
            let discard = (!v.rollback.no_discard && v.memory.unit_pages() == 1).then(|| {
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
        })();
        let Prepared {
            reset,
            since_target,
            handed,
            discard,
        } = match prepared {
            Ok(p) => p,
            Err(e) => {
                self.stop_vmm(vm).await;
                return Err(e);
            }
        };
        phase("handover", &mut phases);
        // Step 3, fast way: the paused VMM unmaps the reset pages (from
        // itself and KVM) and leaves them in the memfd; they become stale
        // (see `Vm::stale`) and are punched after the resume, or at their
        // first access, whichever comes first. Freeing the pages is most
        // of a punch's cost (about two thirds measured on 4 KiB shmem), so
        // the pause no longer waits for it.
        let discarded = match discard {
            Some(ranges) => self.discard(vm, ranges).await,
            None => false,
        };
        if !discarded {
            // No stale page may survive: the reset pages leave the memfd
            // (which also unmaps them from the paused VMM and from KVM),
            // and the next access faults in the snapshot's bytes.
            let punched: Result<()> = (|| {
                let mut reg = self.reg.borrow_mut();
                let v = reg.vms.get_mut(&vm).ok_or(Error::NoSuchVm(vm))?;
                let punched = reset
                    .iter()
                    .try_for_each(|(first, n)| v.memory.punch_hole(*first, *n));
                if let Err(e) = punched {
                    let reason = format!("rollback to {name}: cannot empty its memory: {e}");
                    v.failure = Some(reason.clone());
                    v.state = RunState::Failed;
                    return Err(Error::RollbackFailed { vm, reason });
                }
                Ok(())
            })();
            if let Err(e) = punched {
                self.stop_vmm(vm).await;
                return Err(e);
            }
        }
        phase("drop", &mut phases);
        let swapped: Result<()> = (|| {
            let mut reg = self.reg.borrow_mut();
            let src = reg.arena.insert(PageSource::Image(ImageSource {
                snapshot: name.clone(),
                file: FileSource::new(path.clone(), file, len, pin),
            }));
            let v = reg.vms.get_mut(&vm).ok_or(Error::NoSuchVm(vm))?;
            let pages = v.memory.pages();
            if discarded {
                if v.rollback.stale.pages() != pages {
                    v.rollback.stale = PageSet::new(pages);
                }
                for (first, n) in &reset {
                    v.rollback.stale.insert_range(*first, *n);
                }
            }
            // The page log starts again with the VM's new memory.
            for (first, n) in &reset {
                v.log.pages.dropped(*first, *n);
            }
            v.log.reset_access();
            match since_target {
                Some(_) => {
                    let mut has_data = PageSet::new(pages);
                    for (first, n) in &data {
                        has_data.insert_range(*first, *n);
                    }
                    for (first, n) in &reset {
                        for p in *first..first + n {
                            let to = if has_data.contains(p) {
                                src
                            } else {
                                UNINITIALIZED
                            };
                            v.table.set(p, to);
                        }
                    }
                    // Tracking stays exact: the reset pages lost their
                    // protection with their bytes; give it back.
                    let rearmed = v.faults.uffd.clone().is_some_and(|uffd| {
                        v.write_protect_pages(uffd.get_ref(), &reset, true).is_ok()
                    });
                    v.snapshot.dirty = rearmed.then(|| DirtyLog {
                        since: name.clone(),
                        pages: PageSet::new(pages),
                    });
                }
                None => {
                    let mut table = PageTable::new(pages, UNINITIALIZED);
                    for (first, n) in data {
                        table.set_range(first, n, src);
                    }
                    v.table = table;
                    v.snapshot.base = Some((name.clone(), src));
                    v.snapshot.dirty = None;
                }
            }
            v.faults.readahead.next = u64::MAX;
            reg.release_unused_sources();
            Ok(())
        })();
        if let Err(e) = swapped {
            self.stop_vmm(vm).await;
            return Err(e);
        }
        phase("memory", &mut phases);
        let restored = match (&state.volume_snapshot, &volume) {
            (Some(vs), Some(vol)) => self.roll_volume_back(vol, vs),
            _ => Ok(()),
        };
        phase("volume", &mut phases);
        let restored = match restored {
            Ok(()) => self
                .request(
                    vm,
                    Request::Restore(state.vm_state.clone()),
                    self.settings.vmm_deadline,
                )
                .await
                .map(drop),
            Err(e) => Err(e),
        };
        if let Err(e) = restored {
            // Memory is the snapshot's, the vCPUs are not: the VM cannot
            // go on. It fails visibly.
            let reason = format!("rollback to {name} failed half-way: {}", e.message());
            if let Some(v) = self.reg.borrow_mut().vms.get_mut(&vm) {
                v.failure = Some(reason.clone());
                v.state = RunState::Failed;
            }
            self.stop_vmm(vm).await;
            return Err(Error::RollbackFailed { vm, reason });
        }
        phase("restore", &mut phases);
        self.request(vm, Request::Resume, self.settings.vmm_deadline)
            .await?;
        phase("resume", &mut phases);
        if discarded {
            self.spawn_scrub(vm);
        }
        let pause_us = us(t_pause);
        info!("{vm}: rolled back to {name} in {pause_us} us ({handed} pages handed to dependents)");
        Ok(VmRolledBack {
            vm: vm.to_string(),
            snapshot: name,
            pages_handed_over: handed,
            pages_discarded: if discarded {
                reset.iter().map(|(_, n)| n).sum()
            } else {
                0
            },
            pause_us,
            phases_us: phases,
        })
    }

    /// Ask `vm`'s paused VMM to unmap `ranges` (host address, bytes) and
    /// leave their pages in the memfd (`Request::Discard`). Returns whether
    /// it did; a VMM that cannot (no MINOR on this kernel) is not asked
    /// again, and the rollback punches instead.
    async fn discard(self: &Rc<Self>, vm: VmId, ranges: Vec<(u64, u64)>) -> bool {
        if let Some(v) = self.reg.borrow_mut().vms.get_mut(&vm) {
            v.rollback.discarding = true;
        }
        let r = self
            .request(vm, Request::Discard(ranges), self.settings.vmm_deadline)
            .await;
        let mut reg = self.reg.borrow_mut();
        let Some(v) = reg.vms.get_mut(&vm) else {
            return false;
        };
        v.rollback.discarding = false;
        match r {
            Ok(_) => true,
            Err(e) => {
                info!(
                    "{vm}: the VMM cannot discard pages ({}); rollbacks punch them",
                    e.message()
                );
                v.rollback.no_discard = true;
                false
            }
        }
    }

    /// Punch `vm`'s stale pages out of its memfd a few at a time, letting
    /// faults and requests run in between, until none is left (or the VM
    /// is gone), after `--rollback-scrub-delay-ms`. A fault on a stale
    /// page meanwhile punches that page itself.
    fn spawn_scrub(self: &Rc<Self>, vm: VmId) {
        /// Pages punched per step: ~0.1-0.2 ms of the core thread.
        const STEP: u64 = 256;
        let core = Rc::clone(self);
        let delay = self.settings.rollback_scrub_delay;
        tokio::task::spawn_local(async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            loop {
                let left = {
                    let mut reg = core.reg.borrow_mut();
                    let Some(v) = reg.vms.get_mut(&vm) else {
                        return;
                    };
                    match v.rollback.scrub_some(&v.memory, STEP) {
                        Ok(left) => left,
                        Err(e) => {
                            warn!("{vm}: cannot punch stale pages: {e}");
                            return;
                        }
                    }
                };
                if left == 0 {
                    return;
                }
                tokio::task::yield_now().await;
            }
        });
    }

    /// Put volume snapshot `vs`'s content into volume `vol` in place (the
    /// VMM keeps its open file and sees the new content).
    fn roll_volume_back(&self, vol: &str, vs: &str) -> Result<()> {
        let engine = self.volumes.as_ref().ok_or(Error::NoVolumes)?;
        engine.restore_in_place(vol, vs)?;
        Ok(())
    }

    /// `POST /v1/vms/{id}/clone`.
    pub(super) async fn clone_vm(self: &Rc<Self>, vm: VmId, req: CloneVm) -> Result<ClonedVms> {
        if req.count == 0 || req.count > MAX_CLONE_COUNT {
            return Err(Error::BadRequest(format!(
                "count must be between 1 and {MAX_CLONE_COUNT}"
            )));
        }
        if req.concurrency == 0 {
            return Err(Error::BadRequest("concurrency must be at least 1".into()));
        }
        let t0 = Instant::now();
        // Clones are backed like their original.
        let hugepages = self
            .reg
            .borrow()
            .vms
            .get(&vm)
            .map(|v| v.memory.unit_pages() > 1);
        let name = self.clone_snapshot_name(vm);
        let snap = self
            .snapshot(
                vm,
                CreateSnapshot {
                    name: name.clone(),
                    mode: SnapshotMode::Dirty,
                    compress: false,
                },
            )
            .await?;
        let snapshot_us = us(t0);
        let t_create = Instant::now();
        let gate = Rc::new(tokio::sync::Semaphore::new(
            usize::try_from(req.concurrency).unwrap_or(usize::MAX),
        ));
        let mut tasks = Vec::new();
        for _ in 0..req.count {
            let core = self.clone();
            let gate = gate.clone();
            let from = name.clone();
            tasks.push(tokio::task::spawn_local(async move {
                let _permit = gate.acquire().await.map_err(|_| Error::ShuttingDown)?;
                core.create_vm(CreateVm {
                    memory_mib: 0,
                    from_snapshot: Some(from),
                    vcpus: 1,
                    memory_source: None,
                    volume: None,
                    fault_around_kib: None,
                    readahead_kib: None,
                    prefetch: false,
                    hugepages,
                })
                .await
            }));
        }
        let mut made = Vec::new();
        let mut failed = None;
        for (i, t) in tasks.into_iter().enumerate() {
            match t.await {
                Ok(Ok(info)) => made.push(info.id),
                Ok(Err(e)) => {
                    failed.get_or_insert((i, e));
                }
                Err(_) => {
                    failed.get_or_insert((i, Error::ShuttingDown));
                }
            }
        }
        if let Some((index, source)) = failed {
            warn!(
                "{vm}: clone {} of {} failed; deleting the {} made and snapshot {name}",
                index + 1,
                req.count,
                made.len()
            );
            for id in &made {
                if let Ok(id) = id.parse::<VmId>() {
                    if let Err(e) = self.clone().delete_vm(id).await {
                        warn!("{id}: cannot delete a clone: {}", e.message());
                    }
                }
            }
            if let Err(e) = self.delete_snapshot(&name) {
                warn!("cannot delete snapshot {name}: {}", e.message());
            }
            return Err(Error::CloneFailed {
                vm,
                index: u32::try_from(index + 1).unwrap_or(u32::MAX),
                count: req.count,
                source: Box::new(source),
            });
        }
        let create_us = us(t_create);
        info!(
            "{vm}: {} clones from {name} ({}) in {} us",
            made.len(),
            snap.mode_used,
            us(t0)
        );
        Ok(ClonedVms {
            snapshot: name,
            clones: made,
            duration_us: us(t0),
            phases_us: [
                ("snapshot".to_owned(), snapshot_us),
                ("pause".to_owned(), snap.pause_us),
                ("create".to_owned(), create_us),
            ]
            .into_iter()
            .collect(),
        })
    }

    /// A snapshot name for a clone request of `vm` no snapshot has.
    fn clone_snapshot_name(&self, vm: VmId) -> String {
        let cat = self.snapshots.borrow();
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let mut n = 0u32;
        loop {
            let name = format!("clone-{vm}-{ms}-{n}");
            if cat.get(&name).is_err() && !cat.tmp_dir(&name).exists() {
                return name;
            }
            n += 1;
        }
    }
}
