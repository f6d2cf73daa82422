//! A snapshot's saving window, after the resume: every page still
//! pending is saved in page order, a run at a time, yielding between runs;
//! a write by the guest to a page not saved yet hands its bytes of the
//! pause to the writer first (`track::before_write`). The window closes
//! once every run the writer copies itself is copied.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use shared::{VmId, PAGE_SIZE};

use super::state::Saving;
use super::track::{frames_to_decode, save_run};
use crate::core::error::{Error, Result};
use crate::core::state::Core;
use crate::snapshot::checksum;
use crate::snapshot::writer::{WriteReport, WriterHandle};

/// Pages saved per step of the writer before it lets faults and other
/// requests run.
const SAVE_RUN_PAGES: u64 = 256;
// Full runs are exactly the writer's reusable buffers, and checksum chunks.
const _: () = assert!(SAVE_RUN_PAGES * PAGE_SIZE == crate::snapshot::writer::BUFFER_BYTES as u64);
const CHUNK_PAGES: u64 = checksum::CHUNK_BYTES / PAGE_SIZE;
const _: () = assert!(SAVE_RUN_PAGES == CHUNK_PAGES);

/// Prefetch no more runs than this per snapshot: a scattered set of
/// pages leaves the checksum to read its chunks back as it finds them.
const PREFETCH_RUNS: usize = 1024;

/// What the window saved.
pub(crate) struct Saved {
    pub saving: Rc<RefCell<Saving>>,
    /// The writer's report: the bytes written, the digests of the
    /// checksum chunks written whole and the image's fsync (both still
    /// under way).
    pub report: WriteReport,
    /// The window's time, µs.
    pub save_us: u64,
}

/// Save every page of `vm`'s snapshot still pending (see the module doc);
/// a `reflinked` image first has its writer read ahead what it keeps of
/// its parent.
pub(crate) async fn save(core: &Rc<Core>, vm: VmId, reflinked: bool) -> Result<Saved> {
    let t_save = Instant::now();
    if reflinked {
        prefetch_kept_pages(core, vm);
    }
    let (saving, report) = save_pending(core, vm).await?;
    Ok(Saved {
        saving,
        report,
        save_us: u64::try_from(t_save.elapsed().as_micros()).unwrap_or(u64::MAX),
    })
}

/// Have the writer of `vm`'s snapshot (a reflinked image) read ahead
/// what the image keeps of its parent in the chunks it writes in part.
fn prefetch_kept_pages(core: &Core, vm: VmId) {
    let reg = core.reg.borrow();
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
async fn save_pending(core: &Rc<Core>, vm: VmId) -> Result<(Rc<RefCell<Saving>>, WriteReport)> {
    let saving = core
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
        let waits = frames_to_decode(&core.reg.borrow(), vm, lo..hi);
        for w in waits {
            let _ = w.await;
        }
        {
            let reg = core.reg.borrow();
            match reg.vms.get(&vm) {
                Some(v) if !v.is_deleted() => {}
                _ => {
                    return Err(Error::SaveSnapshot {
                        vm,
                        reason: "the VM was deleted while its snapshot was written".into(),
                    })
                }
            }
            save_run(&reg, vm, &saving, lo, hi - lo, permit);
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
    if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
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
