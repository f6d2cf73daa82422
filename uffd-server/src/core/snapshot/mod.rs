//! `impl Core` for VM snapshots (DESIGN §5, §6): take one (`full`,
//! `incremental`, `dirty`) with a short pause and a copy-on-write window;
//! list, show and delete them; start a VM from one. The files themselves
//! are the [`crate::snapshot`] module's; this file decides what to write
//! and when.
//!
//! Taking a snapshot of VM X:
//! 1. Before the pause: reserve the name, create `memory.img` (a FICLONE of
//!    the parent's image for `incremental` / `dirty`).
//!    Write-protect the pages X wrote since its last snapshot (all of its
//!    RAM for a first one) while X still runs (`arm.rs`).
//! 2. Pause X, with the capture of its vCPU/device state queued behind
//!    the pause.
//! 3. Once the vCPUs are stopped: re-protect the pages X wrote since step
//!    1 (now all of X's RAM is protected: dirty tracking is re-armed and
//!    the copy-on-write window open), the pages to save (all data pages,
//!    the pages not read from the base image, or the dirty log), start a
//!    new dirty log, snapshot the volume.
//! 4. Resume X: the resume goes out behind the capture (the VMM answers
//!    in order), so the capture's answer and the resume's share one wait.
//!    Save the pages in order, a run at a time, yielding between
//!    runs. A write by X to a page not yet saved raises a WP fault (or a
//!    MISSING one) first, and the fault handler saves that page's pre-write
//!    bytes before lifting the protection ([`Registry::before_write`]).
//!    Both run on the core thread, so a page leaves the pending set
//!    exactly once, with the bytes it had at the pause.
//!    In a save of [`COPY_MIN_PAGES`] or more, runs of X's own pages
//!    (4 KiB memory) are not read here: the writer thread copies them out
//!    of X's memfd itself, later. Until it reports
//!    a run copied, its pages are in flight: a write to one first saves
//!    the page's bytes again (still those of the pause, as the page is
//!    still protected), queued behind the run, so the image ends with
//!    them whatever the copy took. The saving window closes only once
//!    every copy is done.
//! 5. fsync the image, checksum it (chunks written whole were digested as
//!    they were written; only the others are read back), write
//!    `state.json`, rename: committed.
//!
//! Dirty tracking is the same write protection the fork machinery uses:
//! every WP fault (and every MISSING fault on a write) marks its page in
//! the VM's [`DirtyLog`], whoever armed the protection.

pub mod state;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use proto::api::{
    CreateSnapshot, CreateVm, SnapshotCreated, SnapshotDeleted, SnapshotInfo, SnapshotList,
    SnapshotMode, SnapshotPages,
};
use proto::vmm::{Reply, Request};
use shared::{VmId, PAGE_SIZE};
use tokio::sync::{oneshot, OwnedSemaphorePermit};
use tracing::{debug, info, warn};
use vm_memory::VolatileSlice;

use super::arm::ArmedAhead;
use super::vm::{RunState, Vm, VmParts};
use super::{Core, Error, Registry, Result};
use crate::pages::UNINITIALIZED;
use crate::pages::{
    read_pages, FileSource, ImageSource, PageSource, PageTable, ResolveError, SourceId, ZstdSource,
};
use crate::snapshot::image::{self, ImageWriter};
use crate::snapshot::writer::{self, WriteReport, WriterHandle};
use crate::snapshot::{catalog, checksum, PageSet, SnapshotError, StateFile};
use state::{DirtyLog, Saving};

/// Pages saved per step of the writer before it lets faults and other
/// requests run.
const SAVE_RUN_PAGES: u64 = 256;

/// Snapshots saving at least this many pages (16 MiB) have the writer
/// copy runs of the VM's own pages out of its memory itself; smaller ones
/// have the core read them. Reading on the core and writing on the writer
/// overlap on two threads, which makes a small save quickest (at 1 % of
/// 1 GiB, A/B: 1.46 and 1.32× write + fsync against 1.64 and 1.49× with
/// the writer copying); a large one would keep the thread that serves
/// every VM's faults reading for hundreds of ms (a neighbour's faults
/// during a 512 MiB save: 1.38× their time alone with the writer copying,
/// 2.78× with the core reading, medians of five runs).
const COPY_MIN_PAGES: u64 = 4096;
// Full runs are exactly the writer's reusable buffers, and checksum chunks.
const _: () = assert!(SAVE_RUN_PAGES * PAGE_SIZE == crate::snapshot::writer::BUFFER_BYTES as u64);
const CHUNK_PAGES: u64 = checksum::CHUNK_BYTES / PAGE_SIZE;
const _: () = assert!(SAVE_RUN_PAGES == CHUNK_PAGES);

fn us(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What a snapshot will write, decided before the pause.
struct Plan {
    mode: SnapshotMode,
    parent: Option<String>,
    fallback_reason: Option<String>,
    image: Rc<ImageWriter>,
    /// For `incremental`: the base image's source and its data pages.
    base: Option<(SourceId, Vec<(u64, u64)>)>,
    /// `state.json`, created empty ([`catalog::create_state`]).
    state_file: std::fs::File,
}

impl Registry {
    /// Before `page` of `vm` changes (a write fault, a discard): record it
    /// in the dirty log and the arming set (`arm.rs`), and hand its
    /// current bytes to a snapshot that has not saved it yet.
    ///
    /// On hugetlb the write changes the whole block as far as tracking can
    /// tell (its protection is lifted whole): all of it is dirty, and its
    /// pending pages are saved first.
    pub(super) fn before_write(&mut self, vm: VmId, page: u64) {
        let Some(v) = self.vms.get_mut(&vm) else {
            return;
        };
        let (lo, hi) = v.memory.unit_range(page, page + 1);
        if let Some(d) = v.snapshot.dirty.as_mut() {
            d.pages.insert_range(lo, hi - lo);
        }
        if let Some(a) = v.snapshot.arming.as_mut() {
            a.insert_range(lo, hi - lo);
        }
        let Some(saving) = v.snapshot.saving.clone() else {
            return;
        };
        let runs: Vec<(u64, u64)> = {
            let s = saving.borrow();
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for p in (lo..hi).filter(|p| s.pending.contains(*p)) {
                match runs.last_mut() {
                    Some((a, n)) if *a + *n == p => *n += 1,
                    _ => runs.push((p, 1)),
                }
            }
            runs
        };
        for (a, n) in runs {
            self.save_run(vm, &saving, a, n, None);
            saving.borrow_mut().saved_before_write += n;
        }
        // A page the writer may still be copying out of the memory: its
        // bytes now (still protected) go again, behind the copy, whose
        // bytes may come from after this write.
        let again: Vec<u64> = {
            let mut s = saving.borrow_mut();
            if s.copying.is_empty() || !s.in_flight.any_in(lo, hi) {
                return;
            }
            s.prune_copies();
            (lo..hi).filter(|p| s.in_flight.contains(*p)).collect()
        };
        for p in again {
            self.save_again(vm, &saving, p);
        }
    }

    /// Save page `p` of `vm` once more, from the VM's memory now, behind
    /// the copy run that holds it; the page leaves the in-flight set (the
    /// bytes saved now are its bytes at the pause).
    fn save_again(&self, vm: VmId, saving: &RefCell<Saving>, p: u64) {
        let Some(v) = self.vms.get(&vm) else {
            return;
        };
        let mut s = saving.borrow_mut();
        s.in_flight.remove(p);
        let Some(w) = &s.writer else {
            return;
        };
        let mut buf = w.buffer(shared::geometry::usize_of(PAGE_SIZE));
        match v.memory.read_pages_at(p, &mut buf) {
            Ok(()) => {
                w.pages(p, buf);
                s.saved_before_write += 1;
            }
            Err(e) => {
                s.error
                    .get_or_insert(format!("page {p}: {}", shared::error_chain(&e)));
            }
        }
    }

    /// Save pages `[lo, lo + n)` of `vm` (all pending): read them through
    /// the live table, hand the bytes to `saving`'s writer thread (a bulk
    /// run with its `permit`) and mark them saved. A failure is recorded
    /// in `saving` (the snapshot fails with it).
    fn save_run(
        &self,
        vm: VmId,
        saving: &RefCell<Saving>,
        lo: u64,
        n: u64,
        mut permit: Option<OwnedSemaphorePermit>,
    ) {
        let Some(v) = self.vms.get(&vm) else {
            return;
        };
        let mut s = saving.borrow_mut();
        // A bulk run of the VM's own pages: the writer copies them out of
        // the memory itself (one copy, off this thread).
        let bulk = permit.is_some();
        let end = lo + n;
        let mut p = lo;
        while p < end {
            let src = v.table.get(p);
            let mut q = p + 1;
            while q < end && v.table.get(q) == src {
                q += 1;
            }
            let cnt = q - p;
            let copy = bulk && s.copy_runs && src == v.self_src;
            if copy {
                if let Some(seq) = s.writer.as_ref().map(|w| w.copy(p, cnt, permit.take())) {
                    s.copying.push_back((seq, p, q));
                    s.in_flight.insert_range(p, cnt);
                }
            } else if let Some(w) = &s.writer {
                if src == UNINITIALIZED {
                    w.punch(p, cnt);
                } else {
                    let buf = w.buffer(shared::geometry::usize_of(cnt * PAGE_SIZE));
                    match self.read_run(src, p, buf) {
                        Ok(bytes) => match permit.take() {
                            Some(permit) => w.bulk(p, bytes, Some(permit)),
                            None => w.pages(p, bytes),
                        },
                        Err(e) => {
                            s.error.get_or_insert(format!(
                                "pages {p}..{q}: {}",
                                shared::error_chain(&e)
                            ));
                        }
                    }
                }
            }
            for x in p..q {
                s.pending.remove(x);
            }
            s.pages_written += cnt;
            p = q;
        }
    }

    /// The bytes of pages from `first` of source `src`, as many as `buf`
    /// holds, read into all of `buf`.
    fn read_run(
        &self,
        src: SourceId,
        first: u64,
        mut buf: Vec<u8>,
    ) -> std::result::Result<Vec<u8>, ResolveError> {
        let source = self
            .arena
            .get(src)
            .cloned()
            .ok_or(ResolveError::UnknownSource(src))?;
        if let PageSource::Vm(owner) = &*source {
            // pread, not the server's mapping (see `read_pages_at`).
            let mem = self.vms.get(owner).map(|o| Rc::clone(&o.memory)).ok_or(
                ResolveError::SourceGone {
                    owner: *owner,
                    page: first,
                },
            )?;
            mem.read_pages_at(first, &mut buf)?;
            return Ok(buf);
        }
        let dst = VolatileSlice::from(&mut buf[..]);
        let vms = &self.vms;
        let read = || {
            read_pages(&source, first, &dst, &|id| {
                vms.get(&id).map(|o| Rc::clone(&o.memory))
            })
        };
        match read() {
            Err(ResolveError::NotDecoded { image, frames }) => {
                // `save_pending` waits for a run's frames before it saves
                // the run; only a guest write racing the writer to a page
                // never read since the restore gets here: decode its frame
                // now rather than lose the page.
                for f in frames {
                    image.decode_now(f).map_err(|reason| ResolveError::Frame {
                        path: image.path.clone(),
                        reason,
                    })?;
                }
                read()?;
            }
            other => other?,
        }
        Ok(buf)
    }

    /// Receivers that fire when the compressed frames pages `pages` of
    /// `vm` read from are decoded (none if nothing needs decoding).
    fn frames_to_decode(
        &self,
        vm: VmId,
        pages: std::ops::Range<u64>,
    ) -> Vec<tokio::sync::oneshot::Receiver<()>> {
        let Some(v) = self.vms.get(&vm) else {
            return Vec::new();
        };
        let mut waits = Vec::new();
        let mut p = pages.start;
        while p < pages.end {
            let src = v.table.get(p);
            let mut q = p + 1;
            while q < pages.end && v.table.get(q) == src {
                q += 1;
            }
            if let Some(z) = self.arena.get(src).and_then(|s| s.zstd()) {
                waits.extend(crate::images::zst::FramePool::wait(z, z.frames_of(p..q)));
            }
            p = q;
        }
        waits
    }

    /// VMs whose tables read pages from snapshot `name`'s image.
    fn readers_of(&self, name: &str) -> Vec<String> {
        let sources: Vec<SourceId> = self
            .arena
            .image_ids()
            .filter(|id| {
                self.arena
                    .get(*id)
                    .and_then(|s| s.snapshot())
                    .is_some_and(|s| s == name)
            })
            .collect();
        self.vms
            .values()
            .filter(|v| sources.iter().any(|s| v.table.count_of(*s) > 0))
            .map(|v| v.id.to_string())
            .collect()
    }
}

impl Core {
    /// `POST /v1/vms/{id}/snapshots`.
    pub(super) async fn snapshot(
        self: &Rc<Self>,
        vm: VmId,
        req: CreateSnapshot,
    ) -> Result<SnapshotCreated> {
        let t0 = Instant::now();
        self.expect_state(vm, RunState::Running, "snapshot")?;
        let _busy = self.begin_busy(vm, "snapshot", "a snapshot")?;
        let disk = self.volume_snapshot_name(vm, &req.name);
        if let (Some(disk), Some(engine)) = (&disk, &self.volumes) {
            // Taken with the memory, under the snapshot's name: refuse a
            // name whose volume snapshot exists before pausing anything.
            if engine.snapshot_info(disk).is_ok() {
                return Err(SnapshotError::Exists(disk.clone()).into());
            }
        }
        let tmp = self.snapshots.borrow_mut().reserve(&req.name)?;
        let taken = self.take_snapshot(vm, &req, &tmp, t0).await;
        if taken.is_err() {
            self.snapshots.borrow_mut().abandon(&req.name);
            if let (Some(disk), Some(engine)) = (&disk, &self.volumes) {
                if engine.snapshot_info(disk).is_ok() {
                    if let Err(e) = engine.delete_snapshot(disk) {
                        warn!("cannot delete volume snapshot {disk}: {}", e.chain());
                    }
                }
            }
            if let Some(v) = self.reg.borrow_mut().vms.get_mut(&vm) {
                v.snapshot.saving = None;
                // The log restarted at the pause for a snapshot that never
                // came to be: the next `dirty` needs a new base.
                v.snapshot.dirty = None;
            }
        }
        taken
    }

    async fn take_snapshot(
        self: &Rc<Self>,
        vm: VmId,
        req: &CreateSnapshot,
        tmp: &Path,
        t0: Instant,
    ) -> Result<SnapshotCreated> {
        let plan = self.plan_snapshot(vm, req.mode, tmp)?;
        let plan_us = us(t0);
        // The writer copies runs of the VM's own pages out of its memory
        // itself (4 KiB pages; hugetlb memory is read by the core).
        let memory = self.reg.borrow().vms.get(&vm).and_then(|v| {
            (v.memory.unit_pages() == 1).then(|| writer::Memory {
                memfd: v.memory.shared_memfd(),
                len: v.memory.size(),
                hold: self.settings.snapshot_copy_hold,
            })
        });
        // The writer thread starts before the pause: spawning it is no
        // part of the guest's stop.
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
        // The pages written since the last snapshot (all of memory for a
        // first one) are protected now, while the guest runs; the pause
        // re-protects only what it writes meanwhile (see `arm.rs`).
        let writer_us = us(t0).saturating_sub(plan_us);
        let ahead = self.arm_ahead(vm, &self.unprotected_runs(vm)?)?;
        let t_pause = Instant::now();
        let (captured, write_protect_us) = self.pause_for_snapshot(vm, &ahead).await?;
        let capture_us = us(t_pause);
        let t_arm = Instant::now();
        let armed = self.arm_snapshot(vm, &req.name, &plan, writer, &ahead);
        let arm_us = us(t_arm);
        let t_volume = Instant::now();
        let volume_snapshot = match &armed {
            Ok(_) => self.snapshot_volume(vm, &req.name),
            Err(_) => Ok(None),
        };
        let volume_us = us(t_volume);
        // Nothing left needs the guest stopped: the resume goes out now,
        // behind the capture in the VMM's queue, so the capture's answer
        // and the resume's share one wait.
        let t_resume = Instant::now();
        let timeout = self.settings.vmm_deadline;
        let resume = self.send_request(vm, Request::Resume);
        let state = match captured {
            Ok(rx) => self.await_reply(vm, rx, timeout).await,
            Err(e) => Err(e),
        };
        let resumed = match resume {
            Ok(rx) => self.await_reply(vm, rx, timeout).await,
            Err(e) => Err(e),
        };
        let resume_us = us(t_resume);
        let pause_us = us(t_pause);
        armed?;
        let state = match state? {
            Reply::State(s) => s,
            r => {
                return Err(Error::UnexpectedReply {
                    vm,
                    request: "capture",
                    reply: format!("{r:?}"),
                })
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
        let t_save = Instant::now();
        if plan.parent.is_some() {
            self.prefetch_kept_pages(vm);
        }
        let (saving, report) = self.save_pending(vm).await?;
        let (bytes_written, streamed, synced) =
            (report.bytes_written, report.chunk_digests, report.synced);
        let save_us = us(t_save);
        let t_handoff = Instant::now();
        let (pages_written, early, saving_touched) = {
            let mut s = saving.borrow_mut();
            let touched = std::mem::take(&mut s.touched);
            (s.pages_written, s.saved_before_write, touched)
        };
        let (memory_bytes, hugepages) = self
            .reg
            .borrow()
            .vms
            .get(&vm)
            .map_or((0, false), |v| (v.memory.size(), v.memory.unit_pages() > 1));
        let mut state = StateFile {
            format_version: crate::snapshot::FORMAT_VERSION,
            name: req.name.clone(),
            vm: vm.to_string(),
            mode: plan.mode,
            parent: plan.parent.clone(),
            created: now_secs(),
            memory_bytes,
            page_size: PAGE_SIZE,
            hugepages,
            vm_state: state,
            volume_snapshot,
            files: Default::default(),
        };
        let file = plan
            .image
            .file
            .try_clone()
            .map_err(SnapshotError::io("reopen", &plan.image.path))?;
        let fallback_reason = plan.fallback_reason.clone();
        let state_file = plan.state_file;
        drop(plan.image);
        drop(saving);
        let root = self.snapshots.borrow().root().to_owned();
        let tmp = tmp.to_owned();
        // Only the parent image's chunk digests, not the whole entry.
        let parent_chunks = state.parent.as_deref().and_then(|p| {
            let cat = self.snapshots.borrow();
            cat.get(p)
                .ok()?
                .files
                .get(crate::snapshot::MEMORY_FILE)
                // A parent checksummed with another hash has no digests
                // to lend.
                .filter(|f| f.algorithm == checksum::WRITE_ALGORITHM)
                .map(|f| f.chunks.clone())
        });
        let touched = saving_touched;
        let compress = req.compress.then(|| zst::CompressOptions {
            threads: self.settings.compress_threads,
            ..zst::CompressOptions::default()
        });
        let (state, extents, finished) = tokio::task::spawn_blocking(move || {
            // The digests of the chunks written whole are waited for on
            // the checksum's side, while the image's fsync already runs.
            let streamed = std::cell::Cell::new(Some(streamed));
            let digests = std::cell::OnceCell::new();
            let reuse = |c: u64| {
                let digests = digests.get_or_init(|| {
                    streamed
                        .take()
                        .map(writer::Digests::wait)
                        .unwrap_or_default()
                });
                if let Some(d) = digests.get(&c) {
                    return Some(d.clone());
                }
                let pages = checksum::CHUNK_BYTES / PAGE_SIZE;
                let untouched = !touched.any_in(c * pages, (c + 1) * pages);
                parent_chunks
                    .as_ref()
                    .filter(|_| untouched)
                    .and_then(|ch| ch.get(shared::geometry::usize_of(c)).cloned())
            };
            // From the last write to here: the commit's inputs gathered and
            // this thread woken.
            let mut phases = BTreeMap::from([("handoff".to_owned(), us(t_handoff))]);
            finish_files(
                &root,
                &tmp,
                Written {
                    image: file,
                    synced,
                    state_file,
                },
                &mut state,
                &reuse,
                compress,
                &mut phases,
            )
            .map(|n| (state, n, phases))
        })
        .await
        .map_err(|_| Error::ShuttingDown)??;
        let (state, extents, mut after_pause_us) = (state, extents, finished);
        after_pause_us.insert("save".to_owned(), save_us);
        let compressed_bytes = state.files.get(crate::snapshot::ZSTD_FILE).map(|f| f.bytes);
        let mode_used = state.mode;
        self.snapshots.borrow_mut().insert(state);
        if self.settings.rewrite_extents > 0 && extents > self.settings.rewrite_extents {
            self.rewrite_in_background(&req.name, extents);
        }
        let duration_us = us(t0);
        info!(
            "{vm}: snapshot {} ({mode_used}): {pages_written} pages, pause {pause_us} us, \
             {early} saved ahead of guest writes, {duration_us} us in all",
            req.name
        );
        Ok(SnapshotCreated {
            name: req.name.clone(),
            vm: vm.to_string(),
            mode_requested: req.mode,
            mode_used,
            fallback_reason,
            pages_written,
            bytes_written,
            pause_us,
            before_pause_us: [
                ("plan".to_owned(), plan_us),
                ("armed_ahead".to_owned(), ahead.us),
                ("writer".to_owned(), writer_us),
            ]
            .into_iter()
            .collect(),
            phases_us,
            after_pause_us,
            duration_us,
            image_extents: extents,
            pages_saved_ahead: early,
            compressed_bytes,
        })
    }

    /// Decide the mode and create the image (a reflink of the parent's
    /// for `incremental` and `dirty`), before the pause.
    fn plan_snapshot(&self, vm: VmId, asked: SnapshotMode, tmp: &Path) -> Result<Plan> {
        let reg = self.reg.borrow();
        let v = reg.vms.get(&vm).ok_or(Error::NoSuchVm(vm))?;
        let cat = self.snapshots.borrow();
        let size = v.memory.size();
        let fits = |name: &str| cat.get(name).is_ok_and(|s| s.memory_bytes == size);
        let mut reasons: Vec<String> = Vec::new();
        let mut choice: Option<(SnapshotMode, String)> = None;
        if asked == SnapshotMode::Dirty {
            match &v.snapshot.dirty {
                Some(d) if fits(&d.since) => {
                    choice = Some((SnapshotMode::Dirty, d.since.clone()));
                }
                Some(d) => reasons.push(format!("{vm}'s last snapshot {} is gone", d.since)),
                None => reasons.push(format!(
                    "{vm} has no snapshot since it started (or its last one failed)"
                )),
            }
        }
        if choice.is_none() && asked != SnapshotMode::Full {
            match &v.snapshot.base {
                Some((b, _)) if fits(b) => choice = Some((SnapshotMode::Incremental, b.clone())),
                Some((b, _)) => reasons.push(format!("{vm}'s base snapshot {b} is gone")),
                None => reasons.push(format!("{vm} did not start from a snapshot")),
            }
        }
        let path = tmp.join(crate::snapshot::MEMORY_FILE);
        let mut mode = SnapshotMode::Full;
        let mut parent = None;
        let mut reflinked = None;
        let mut base = None;
        if let Some((m, p)) = choice {
            match ImageWriter::reflink(&path, &cat.image_of(&p), size) {
                Ok(img) => {
                    if m == SnapshotMode::Incremental {
                        let (_, src) = v.snapshot.base.clone().unwrap_or_default();
                        let base_source = reg.arena.get(src);
                        let data = match base_source.and_then(|s| s.zstd()) {
                            Some(z) => z.data_pages(),
                            None => base_source
                                .and_then(|s| s.file())
                                .map(|f| image::data_pages(&f.file, f.len))
                                .transpose()
                                .map_err(SnapshotError::io("read the base image of", &path))?
                                .unwrap_or_default(),
                        };
                        base = Some((src, data));
                    }
                    mode = m;
                    parent = Some(p);
                    reflinked = Some(img);
                }
                Err(e) => reasons.push(format!(
                    "cannot reflink {} on this filesystem ({e}); use XFS with reflink=1 or btrfs",
                    cat.image_of(&p).display()
                )),
            }
        }
        let image = match reflinked {
            Some(img) => img,
            None => ImageWriter::create(&path, size)?,
        };
        Ok(Plan {
            mode,
            parent,
            fallback_reason: (mode != asked).then(|| reasons.join("; ")),
            image: Rc::new(image),
            base,
            state_file: catalog::create_state(tmp)?,
        })
    }

    /// Pause `vm` and ask for its state; once its vCPUs are stopped,
    /// re-protect what it wrote since `ahead` armed its protection (while
    /// the capture's answer is on its way). Returns the capture's pending
    /// answer and the re-protect's time in µs. On failure the VM is
    /// resumed.
    async fn pause_for_snapshot(
        self: &Rc<Self>,
        vm: VmId,
        ahead: &ArmedAhead<'_>,
    ) -> Result<(Result<super::PendingReply>, u64)> {
        let timeout = self.settings.vmm_deadline;
        let paused = self.send_request(vm, Request::Pause)?;
        let captured = self.send_request(vm, Request::CaptureState);
        let protected = match self.await_reply(vm, paused, timeout).await {
            Ok(_) => ahead.reprotect().map(|(_, took)| took),
            Err(e) => Err(e),
        };
        match protected {
            Ok(took) => Ok((captured, took)),
            Err(e) => {
                // The pause may still land later (a VMM that stopped
                // answering): a resume queued behind it leaves the VM
                // running.
                if let Ok(rx) = self.send_request(vm, Request::Resume) {
                    let core = self.clone();
                    tokio::task::spawn_local(async move {
                        let late = core.settings.exec_timeout;
                        if let Err(e) = core.await_reply(vm, rx, late).await {
                            warn!("{vm}: resume after a failed capture: {}", e.message());
                        }
                    });
                }
                Err(e)
            }
        }
    }

    /// While `vm` is paused: choose the pages to save, finish the
    /// protection armed ahead (all of its RAM is protected then), restart
    /// its dirty log and open the saving window.
    fn arm_snapshot(
        &self,
        vm: VmId,
        name: &str,
        plan: &Plan,
        writer: writer::WriterHandle,
        ahead: &ArmedAhead<'_>,
    ) -> Result<()> {
        let mut reg = self.reg.borrow_mut();
        let v = reg.vms.get_mut(&vm).ok_or(Error::NoSuchVm(vm))?;
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
        let mut reg = self.reg.borrow_mut();
        let v = reg.vms.get_mut(&vm).ok_or(Error::NoSuchVm(vm))?;
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

    /// The pages of `vm` that are not write-protected: while tracking
    /// runs only those written since the last snapshot (the WP handler
    /// marks each one dirty before lifting its protection), else all of
    /// RAM (never touched pages get markers, WP_UNPOPULATED).
    fn unprotected_runs(&self, vm: VmId) -> Result<Vec<(u64, u64)>> {
        let reg = self.reg.borrow();
        let v = reg.vms.get(&vm).ok_or(Error::NoSuchVm(vm))?;
        Ok(match &v.snapshot.dirty {
            Some(d) => d.pages.runs(),
            None => vec![(0, v.memory.pages())],
        })
    }

    /// The name of the volume snapshot taken with snapshot `name` of `vm`,
    /// if `vm` has a volume.
    fn volume_snapshot_name(&self, vm: VmId, name: &str) -> Option<String> {
        let reg = self.reg.borrow();
        reg.vms
            .get(&vm)
            .and_then(|v| v.volume.as_ref())
            .map(|_| format!("{name}.disk"))
    }

    /// Snapshot `vm`'s volume (while paused) as `<name>.disk`.
    fn snapshot_volume(&self, vm: VmId, name: &str) -> Result<Option<String>> {
        let vol = self
            .reg
            .borrow()
            .vms
            .get(&vm)
            .and_then(|v| v.volume.clone());
        let (Some(vol), Some(engine)) = (vol, self.volumes.as_ref()) else {
            return Ok(None);
        };
        let snap = format!("{name}.disk");
        engine.snapshot(&vol, &snap)?;
        Ok(Some(snap))
    }

    /// Have the writer of `vm`'s snapshot (a reflinked image) read ahead
    /// what the image keeps of its parent in the chunks it writes in part.
    fn prefetch_kept_pages(&self, vm: VmId) {
        let reg = self.reg.borrow();
        let Some(saving) = reg.vms.get(&vm).and_then(|v| v.snapshot.saving.as_ref()) else {
            return;
        };
        let s = saving.borrow();
        if let Some(w) = &s.writer {
            // What the checksum at the commit reads back
            // (`checksum::sum_file_reusing`).
            let kept = s.touched.gaps_in_chunks(CHUNK_PAGES, PREFETCH_RUNS);
            w.prefetch(kept.unwrap_or_default());
        }
    }

    /// Save every page still pending, a run at a time, in page order.
    /// Returns the writer's report: the bytes written, the digests of the
    /// checksum chunks written whole and the image's fsync (both still
    /// under way).
    async fn save_pending(self: &Rc<Self>, vm: VmId) -> Result<(Rc<RefCell<Saving>>, WriteReport)> {
        let saving = self
            .reg
            .borrow()
            .vms
            .get(&vm)
            .and_then(|v| v.snapshot.saving.clone())
            .ok_or(Error::NoSuchVm(vm))?;
        let gate = saving
            .borrow()
            .writer
            .as_ref()
            .map(WriterHandle::gate)
            .ok_or(Error::NoSuchVm(vm))?;
        let mut cursor = 0;
        loop {
            // Room in the writer's queue first; then read and queue a run
            // in one step (no fault can come between).
            let permit = gate.clone().acquire_owned().await.ok();
            let next = saving.borrow().pending.next_from(cursor);
            let Some(lo) = next else { break };
            let mut hi = lo + 1;
            {
                // A run stays inside one checksum chunk, so that the
                // chunks a snapshot writes whole are digested as written.
                let chunk_end = (lo / CHUNK_PAGES + 1) * CHUNK_PAGES;
                let s = saving.borrow();
                while hi - lo < SAVE_RUN_PAGES && hi < chunk_end && s.pending.contains(hi) {
                    hi += 1;
                }
            }
            // Frames of a compressed image the run reads are decoded by
            // the frame pool first, not on this thread.
            let waits = self.reg.borrow().frames_to_decode(vm, lo..hi);
            for w in waits {
                let _ = w.await;
            }
            {
                let reg = self.reg.borrow();
                match reg.vms.get(&vm) {
                    Some(v) if !v.deleted => {}
                    _ => {
                        return Err(Error::SaveSnapshot {
                            vm,
                            reason: "the VM was deleted while its snapshot was written".into(),
                        })
                    }
                }
                reg.save_run(vm, &saving, lo, hi - lo, permit);
            }
            if let Some(e) = saving.borrow().error.clone() {
                return Err(Error::SaveSnapshot { vm, reason: e });
            }
            cursor = hi;
            // Faults and other requests run between runs.
            tokio::task::yield_now().await;
        }
        // The window stays open until the writer has copied every run it
        // copies itself: until then a write to one of its pages must save
        // that page again.
        let copies = saving
            .borrow()
            .writer
            .as_ref()
            .map(|w| w.copies_done_waiter());
        if let Some(done) = copies {
            done.await;
        }
        if let Some(v) = self.reg.borrow_mut().vms.get_mut(&vm) {
            v.snapshot.saving = None;
        }
        if let Some(e) = saving.borrow().error.clone() {
            return Err(Error::SaveSnapshot { vm, reason: e });
        }
        let writer = saving.borrow_mut().writer.take();
        let mut report = match writer {
            Some(w) => w.finish().await,
            None => WriteReport::default(),
        };
        if let Some(e) = report.error.take() {
            return Err(e.into());
        }
        Ok((saving, report))
    }

    /// `GET /v1/snapshots`.
    pub(super) fn list_snapshots(&self) -> SnapshotList {
        let names: Vec<String> = self
            .snapshots
            .borrow()
            .iter()
            .map(|s| s.name.clone())
            .collect();
        SnapshotList {
            snapshots: names
                .iter()
                .filter_map(|n| self.snapshot_info(n).ok())
                .collect(),
            quarantined: self.snapshots.borrow().quarantined().to_vec(),
        }
    }

    /// `GET /v1/snapshots/{name}`.
    pub(super) fn snapshot_info(&self, name: &str) -> Result<SnapshotInfo> {
        let cat = self.snapshots.borrow();
        let s = cat.get(name)?;
        let path = cat.image_of(name);
        let file = image::open_read(&path)?;
        let data: u64 = image::data_pages(&file, s.memory_bytes)
            .map_err(SnapshotError::io("read", &path))?
            .iter()
            .map(|(_, n)| n)
            .sum();
        let total = s.memory_bytes / PAGE_SIZE;
        let on_disk = |p: PathBuf| {
            std::fs::metadata(p).map_or(0, |m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
        };
        Ok(SnapshotInfo {
            name: s.name.clone(),
            vm: s.vm.clone(),
            mode: s.mode,
            parent: s.parent.clone(),
            memory_mib: s.memory_bytes >> 20,
            vcpus: s.vcpus(),
            page_size: s.page_size,
            pages: SnapshotPages {
                data,
                zero_hole: total.saturating_sub(data),
            },
            bytes_on_disk: on_disk(path.clone())
                + on_disk(cat.dir_of(name).join(crate::snapshot::STATE_FILE))
                + on_disk(cat.dir_of(name).join(crate::snapshot::ZSTD_FILE)),
            exclusive_bytes: image::exclusive_bytes(&file),
            image_extents: image::extent_count(&file),
            volume_snapshot: s.volume_snapshot.clone(),
            created: s.created,
            readers: self.reg.borrow().readers_of(name),
            compressed_bytes: s.files.get(crate::snapshot::ZSTD_FILE).map(|f| f.bytes),
        })
    }

    /// `DELETE /v1/snapshots/{name}`: refused while a VM reads from it.
    pub(super) fn delete_snapshot(&self, name: &str) -> Result<SnapshotDeleted> {
        self.snapshots.borrow().get(name)?;
        let readers = {
            let mut reg = self.reg.borrow_mut();
            reg.collect_garbage();
            reg.readers_of(name)
        };
        if !readers.is_empty() {
            return Err(SnapshotError::InUse {
                name: name.to_owned(),
                vms: readers,
            }
            .into());
        }
        let state = self.snapshots.borrow_mut().remove(name)?;
        if let (Some(vs), Some(engine)) = (&state.volume_snapshot, self.volumes.as_ref()) {
            if let Err(e) = engine.delete_snapshot(vs) {
                warn!(
                    "snapshot {name}: cannot delete its volume snapshot {vs}: {}",
                    e.chain()
                );
            }
        }
        info!("snapshot {name} deleted");
        Ok(SnapshotDeleted {
            name: name.to_owned(),
            deleted: true,
        })
    }

    /// Register a VM that starts from snapshot `name` (`POST /v1/vms`
    /// with `from_snapshot`): its table reads the snapshot's image (holes
    /// are `Uninitialized` up front), its VMM starts from the saved state.
    pub(super) fn prepare_restore(
        &self,
        req: &CreateVm,
        name: &str,
    ) -> Result<(VmId, oneshot::Receiver<Result<()>>)> {
        // What a restore needs of the snapshot, not all of it (the
        // checksums of every chunk stay in the catalog).
        let (size, hugepages, compressed, volume_snapshot, vm_state, path) = {
            let cat = self.snapshots.borrow();
            let st = cat.get(name)?;
            (
                st.memory_bytes,
                st.hugepages,
                st.files.contains_key(crate::snapshot::ZSTD_FILE),
                st.volume_snapshot.clone(),
                st.vm_state.clone(),
                cat.image_of(name),
            )
        };
        if req.memory_mib != 0 && req.memory_mib << 20 != size {
            return Err(Error::BadRequest(format!(
                "snapshot {name} has {} MiB of memory; leave memory_mib out",
                size >> 20
            )));
        }
        if req.memory_source.is_some() || req.volume.is_some() || req.prefetch {
            return Err(Error::BadRequest(
                "from_snapshot takes memory and volume from the snapshot; \
                 leave memory_source, volume and prefetch out"
                    .into(),
            ));
        }
        let fault_around = req
            .fault_around_kib
            .map(crate::pages::FaultAround::from_kib)
            .transpose()
            .map_err(|e| Error::BadRequest(format!("fault_around_kib {e}")))?;
        // Backed like the VM the snapshot was taken of, unless asked.
        let page_size = self.page_size_for(
            &CreateVm {
                hugepages: req.hugepages.or(Some(hugepages)),
                ..req.clone()
            },
            size,
        )?;
        let (source, data) = self.open_snapshot_memory(name, compressed, &path)?;
        let mut reg = self.reg.borrow_mut();
        reg.admit(&self.settings, 1, size)?;
        let id = reg.alloc_id(&self.settings.state_dir);
        let volume = match (&volume_snapshot, self.volumes.as_ref()) {
            (Some(vs), Some(engine)) => {
                let vol = format!("{name}-{id}");
                engine.clone_snapshot(vs, &vol)?;
                Some(vol)
            }
            (Some(_), None) => return Err(Error::NoVolumes),
            (None, _) => None,
        };
        let (memory, pooled) = match self.new_guest_memory(id, size, page_size) {
            Ok(m) => m,
            Err(e) => {
                if let (Some(vol), Some(engine)) = (&volume, self.volumes.as_ref()) {
                    let _ = engine.delete(vol);
                }
                return Err(Error::CreateMemory(e));
            }
        };
        let memory = Rc::new(memory);
        let self_src = reg.arena.vm_with_memory(id, Rc::clone(&memory));
        let src = reg.arena.insert(source);
        let pages = size / PAGE_SIZE;
        let mut table = PageTable::new(pages, UNINITIALIZED);
        for (first, n) in data {
            table.set_range(first, n, src);
        }
        let (ready_tx, ready_rx) = oneshot::channel();
        let mut vm = Vm::new(VmParts {
            id,
            memory,
            table,
            self_src,
            vcpus: u8::try_from(vm_state.vcpus.len()).unwrap_or(u8::MAX),
            fault_around_pages: fault_around
                .map_or(self.settings.fault_around_pages, |f| f.pages()),
            readahead_pages: req
                .readahead_kib
                .map_or(self.settings.readahead_pages, |k| k / 4),
            ready: ready_tx,
        });
        vm.start_state = Some(Rc::new(vm_state));
        vm.snapshot.base = Some((name.to_owned(), src));
        vm.owns_volume = volume.is_some();
        vm.volume = volume;
        vm.pooled = pooled;
        reg.vms.insert(id, vm);
        // Logged with the start (`create_vm`): one line per VM started.
        debug!("{id}: restoring from snapshot {name}");
        Ok((id, ready_rx))
    }
}

impl Core {
    /// Rewrite snapshot `name`'s fragmented image sequentially on a
    /// blocking thread (see [`image::rewrite_sequential`]); the snapshot
    /// stays usable throughout.
    fn rewrite_in_background(&self, name: &str, extents: u64) {
        let path = self.snapshots.borrow().image_of(name);
        let name = name.to_owned();
        info!("snapshot {name}: image has {extents} extents; rewriting it sequentially");
        tokio::task::spawn_blocking(move || match image::rewrite_sequential(&path) {
            Ok((before, after)) => {
                info!("snapshot {name}: image rewritten, {before} -> {after} extents");
            }
            // A snapshot deleted meanwhile is not an error.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => warn!("snapshot {name}: cannot rewrite its image: {e}"),
        });
    }

    /// The source a VM restored from snapshot `name` reads (its
    /// `memory.zst` if it is `compressed`, else `memory.img` at `path`)
    /// and the runs of pages that hold data in it (the rest reads as
    /// zero).
    pub(super) fn open_snapshot_memory(
        &self,
        name: &str,
        compressed: bool,
        path: &Path,
    ) -> Result<(PageSource, Vec<(u64, u64)>)> {
        if compressed {
            let zpath = self
                .snapshots
                .borrow()
                .dir_of(name)
                .join(crate::snapshot::ZSTD_FILE);
            let image = self.open_zstd(&zpath.display().to_string(), Some(name))?;
            let data = image.data_pages();
            return Ok((PageSource::Zstd(ZstdSource { image }), data));
        }
        let file = image::open_read(path)?;
        let len = file
            .metadata()
            .map_err(SnapshotError::io("stat", path))?
            .len();
        let data = image::data_pages(&file, len).map_err(SnapshotError::io("read", path))?;
        let pin = crate::images::Pin::Stamp(
            crate::images::Stamp::of(&file).map_err(SnapshotError::io("stat", path))?,
        );
        let source = PageSource::Image(ImageSource {
            snapshot: name.to_owned(),
            file: FileSource::new(path.to_owned(), file, len, pin),
        });
        Ok((source, data))
    }
}

/// Prefetch no more runs than this per snapshot: a scattered set of
/// pages leaves the checksum to read its chunks back as it finds them.
const PREFETCH_RUNS: usize = 1024;

/// What the save hands to the commit.
struct Written {
    /// The image.
    image: std::fs::File,
    /// Its fsync, which the writer started.
    synced: writer::Synced,
    /// `state.json`, still empty.
    state_file: std::fs::File,
}

/// After the last page is saved: wait for the image's fsync (the
/// writer's), record its checksums in `state` (`reuse` gives those of
/// chunks the parent's image already has), and commit the snapshot
/// directory. Returns the image's extent count. Blocking file I/O: runs
/// off the core thread.
fn finish_files(
    root: &Path,
    tmp: &Path,
    written: Written,
    state: &mut StateFile,
    reuse: &dyn Fn(u64) -> Option<String>,
    compress: Option<zst::CompressOptions>,
    phases: &mut BTreeMap<String, u64>,
) -> Result<u64> {
    let Written {
        image,
        synced,
        state_file,
    } = written;
    let image = &image;
    let path = tmp.join(crate::snapshot::MEMORY_FILE);
    let mut t = Instant::now();
    let mut lap = |phases: &mut BTreeMap<String, u64>, name: &str| {
        phases.insert(name.to_owned(), us(t));
        t = Instant::now();
    };
    // The writer fsyncs the image since its last write returned; the
    // checksum reads the image from the page cache meanwhile. Without a
    // compressed copy to make, `state.json` (which holds that checksum) is
    // written and fsynced while the image's fsync may still run: the
    // rename that commits the snapshot waits for both, and at 1 % dirty
    // the fsyncs are most of a snapshot's fixed cost.
    let written = checksum::sum_file_reusing(image, checksum::WRITE_ALGORITHM, reuse)
        .map_err(SnapshotError::io("checksum", &path))
        .and_then(|sum| {
            state
                .files
                .insert(crate::snapshot::MEMORY_FILE.to_owned(), sum);
            match compress {
                None => catalog::write_state(tmp, state_file, state).map(|()| None),
                Some(_) => Ok(Some(state_file)),
            }
        });
    let synced = synced.wait(image);
    synced.map_err(SnapshotError::io("sync", &path))?;
    let state_unwritten = written?;
    lap(phases, "sync_and_checksum");
    if let Some(opts) = compress {
        let zpath = tmp.join(crate::snapshot::ZSTD_FILE);
        zst::compress(image, &zpath, &opts, &mut |_, _| {}).map_err(|e| {
            SnapshotError::io("compress into", &zpath)(std::io::Error::other(shared::error_chain(
                &e,
            )))
        })?;
        let zfile = image::open_read(&zpath)?;
        let zsum = checksum::sum_file(&zfile, checksum::WRITE_ALGORITHM)
            .map_err(SnapshotError::io("checksum", &zpath))?;
        state
            .files
            .insert(crate::snapshot::ZSTD_FILE.to_owned(), zsum);
        lap(phases, "compress");
    }
    let extents = image::extent_count(image);
    if let Some(file) = state_unwritten {
        catalog::write_state(tmp, file, state)?;
    }
    catalog::publish(root, tmp, &state.name)?;
    lap(phases, "commit");
    Ok(extents)
}
