//! Dirty tracking and the saving window, on the fault path: before a page
//! of a VM is written (a write fault, a REMOVE), its dirty log and arming
//! set record it, and a snapshot still saving the page gets its bytes of
//! the pause first. And the reads the save makes through the VM's live
//! table.

use std::cell::RefCell;

use shared::{VmId, PAGE_SIZE};
use tokio::sync::OwnedSemaphorePermit;
use vm_memory::VolatileSlice;

use super::state::Saving;
use crate::core::registry::Registry;
use crate::pages::{read_pages, PageSource, ResolveError, SourceId, VmPages, UNINITIALIZED};

/// Before `page` of `vm` changes (a write fault, a discard): record it
/// in the dirty log and the arming set (`snapshot/arm.rs`), and hand its
/// current bytes to a snapshot that has not saved it yet.
///
/// On hugetlb the write changes the whole block as far as tracking can
/// tell (its protection is lifted whole): all of it is dirty, and its
/// pending pages are saved first.
pub(crate) fn before_write(reg: &mut Registry, vm: VmId, page: u64) {
    let Some(v) = reg.vms.get_mut(&vm) else {
        return;
    };
    let (lo, hi) = v.memory.unit_range(page, page + 1);
    v.snapshot.record_write(lo, hi);
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
        save_run(reg, vm, &saving, a, n, None);
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
        save_again(reg, vm, &saving, p);
    }
}

/// Save page `p` of `vm` once more, from the VM's memory now, behind
/// the copy run that holds it; the page leaves the in-flight set (the
/// bytes saved now are its bytes at the pause).
fn save_again(reg: &Registry, vm: VmId, saving: &RefCell<Saving>, p: u64) {
    let Some(v) = reg.vms.get(&vm) else {
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
pub(crate) fn save_run(
    reg: &Registry,
    vm: VmId,
    saving: &RefCell<Saving>,
    lo: u64,
    n: u64,
    mut permit: Option<OwnedSemaphorePermit>,
) {
    let Some(v) = reg.vms.get(&vm) else {
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
                match read_run(reg, src, p, buf) {
                    Ok(bytes) => match permit.take() {
                        Some(permit) => w.bulk(p, bytes, Some(permit)),
                        None => w.pages(p, bytes),
                    },
                    Err(e) => {
                        s.error
                            .get_or_insert(format!("pages {p}..{q}: {}", shared::error_chain(&e)));
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
    reg: &Registry,
    src: SourceId,
    first: u64,
    mut buf: Vec<u8>,
) -> std::result::Result<Vec<u8>, ResolveError> {
    let source = reg
        .arena
        .get(src)
        .cloned()
        .ok_or(ResolveError::UnknownSource(src))?;
    if let PageSource::Vm(owner) = &*source {
        if let Some(VmPages::Memfd(mem)) = reg.arena.memory_of(*owner) {
            // pread, not the server's mapping (see `read_pages_at`).
            mem.read_pages_at(first, &mut buf)?;
            return Ok(buf);
        }
    }
    let dst = VolatileSlice::from(&mut buf[..]);
    let arena = &reg.arena;
    let read = || read_pages(&source, first, &dst, &|id| arena.memory_of(id));
    match read() {
        Err(ResolveError::NotDecoded { image, frames }) => {
            // `save_pending` waits for a run's frames before it saves
            // the run; only a guest write racing the writer to a page
            // never read since the restore gets here: decode its frame
            // now rather than lose the page.
            for f in frames {
                image.decode_now(f).map_err(|source| ResolveError::Frame {
                    path: image.path.clone(),
                    source,
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
pub(crate) fn frames_to_decode(
    reg: &Registry,
    vm: VmId,
    pages: std::ops::Range<u64>,
) -> Vec<tokio::sync::oneshot::Receiver<()>> {
    let Some(v) = reg.vms.get(&vm) else {
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
        if let Some(z) = reg.arena.get(src).and_then(|s| s.zstd()) {
            waits.extend(crate::images::zst::FramePool::wait(z, z.frames_of(p..q)));
        }
        if let Some(r) = reg.arena.get(src).and_then(|s| s.remote()) {
            waits.extend(r.wait(r.chunks_of(p..q)));
        }
        p = q;
    }
    waits
}
