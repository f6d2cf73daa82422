//! `impl Core` for rolling a VM back to a snapshot in place, and for
//! cloning a VM n times (DESIGN §6).
//!
//! Rollback of VM X to snapshot S (X keeps its id, memfd and dependents):
//! 1. Stop X's VMM: its vCPUs never run again on the old memory.
//! 2. Hand every page another VM still reads from X to that VM (the
//!    copy-on-write step of a WP fault, done for all of them at once).
//! 3. Drop every page of X's memfd (no stale page may survive) and point
//!    X's table at S's image (holes `Uninitialized`).
//! 4. Put S's volume snapshot in place of X's volume.
//! 5. Start a new VMM for X from S's vCPU/device state (the restore path):
//!    it maps the now empty memfd and faults S's pages in lazily.
//!
//! clone(n, c): one snapshot (`dirty` where the VM has a base, else
//! `full`), then n VMs from it, at most c being created at once. All or
//! nothing: if one fails, every clone made is deleted, and the snapshot
//! with them.

use std::rc::Rc;
use std::time::Instant;

use proto::api::{
    CloneVm, ClonedVms, CreateSnapshot, CreateVm, RollbackVm, SnapshotMode, VmRolledBack,
    MAX_CLONE_COUNT,
};
use shared::VmId;
use tokio::sync::oneshot;
use tracing::{info, warn};

use super::vm::RunState;
use super::{Core, Error, Result};
use crate::pages::{FileSource, ImageSource, PageSource, PageTable, UNINITIALIZED};
use crate::snapshot::{image, SnapshotError};
use crate::volume::VolumeError;

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
        let (size, volume, owns_volume) = {
            let reg = self.reg.borrow();
            let v = reg.vms.get(&vm).ok_or(Error::NoSuchVm(vm))?;
            (v.memory.size(), v.volume.clone(), v.owns_volume)
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
        self.stop_vmm(vm).await;
        let (handed, ready) = {
            let mut reg = self.reg.borrow_mut();
            let present = {
                let v = reg.vms.get(&vm).ok_or(Error::NoSuchVm(vm))?;
                v.table.ranges_of(v.self_src)
            };
            // Pages other VMs read from this one go to them first.
            let mut handed = 0;
            for (first, n) in present {
                for p in first..first + n {
                    handed += reg.preserve_for_dependents(vm, p);
                }
            }
            let src = reg.arena.insert(PageSource::Image(ImageSource {
                snapshot: name.clone(),
                file: FileSource {
                    path: path.clone(),
                    file,
                    len,
                    pin,
                },
            }));
            let v = reg.vms.get_mut(&vm).ok_or(Error::NoSuchVm(vm))?;
            let pages = v.memory.pages();
            v.memory.punch_hole(0, pages).map_err(Error::CreateMemory)?;
            let mut table = PageTable::new(pages, UNINITIALIZED);
            for (first, n) in data {
                table.set_range(first, n, src);
            }
            v.table = table;
            v.start_state = Some(Rc::new(state.vm_state.clone()));
            v.base = Some((name.clone(), src));
            v.dirty = None;
            // A fresh life for the VMM side of the VM.
            let (tx, rx) = oneshot::channel();
            v.state = RunState::Starting;
            v.ready = Some(tx);
            v.exit_reason = None;
            v.failure = None;
            v.pid = None;
            v.uffd = None;
            v.writer = None;
            v.vmm_base = 0;
            v.readahead.next = u64::MAX;
            v.closed = Rc::new(tokio::sync::Notify::new());
            reg.release_unused_sources();
            (handed, rx)
        };
        if let (Some(vs), Some(vol)) = (&state.volume_snapshot, &volume) {
            self.roll_volume_back(vol, vs, owns_volume)?;
        }
        self.spawn_vmm(vm).await?;
        self.wait_ready(vm, ready).await?;
        let pause_us = us(t_pause);
        info!("{vm}: rolled back to {name} in {pause_us} us ({handed} pages handed to dependents)");
        Ok(VmRolledBack {
            vm: vm.to_string(),
            snapshot: name,
            pages_handed_over: handed,
            pause_us,
        })
    }

    /// Put volume snapshot `vs` in place of volume `vol` (detached now).
    fn roll_volume_back(&self, vol: &str, vs: &str, owned: bool) -> Result<()> {
        let engine = self.volumes.as_ref().ok_or(Error::NoVolumes)?;
        match engine.rollback(vol, vs, false) {
            Ok(_) => Ok(()),
            // A volume made for this VM from the snapshot's volume: make
            // it again.
            Err(VolumeError::NotSnapshotOf { .. }) if owned => {
                engine.delete(vol)?;
                engine.clone_snapshot(vs, vol)?;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
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
        let name = self.clone_snapshot_name(vm);
        let snap = self
            .snapshot(
                vm,
                CreateSnapshot {
                    name: name.clone(),
                    mode: SnapshotMode::Dirty,
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
