//! The fault engine: resolves a VM's userfaultfd events from its page-source
//! table.
//!
//! Pages are installed by writing the bytes through the server's own mapping
//! of the VM's memfd and then `UFFDIO_WAKE` (DESIGN §2): this never races
//! with EEXIST (a plain UFFDIO_COPY that finds the page present does not
//! wake the faulting thread) and it keeps write protection where a plain
//! UFFDIO_COPY would drop it. Which pages to install and their bytes come
//! from the resolver in [`crate::pages::resolve`], shared with Firecracker
//! VMs.

use std::cell::RefCell;
use std::rc::Rc;

use proto::api::FaultKind as ApiKind;
use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tracing::{debug, error, warn};
use uffd_abi::{Errno, Install};
use userfaultfd::{Event, FaultKind, ReadWrite, Uffd};
use vm_memory::VolatileSlice;

use super::ratelimit::suppressed_note;
use super::vm::RunState;
use super::Registry;
use crate::memory::{GuestMemory, MemoryError};
use crate::observe::access::By;
use crate::observe::phases::{self, Phase};
use crate::pages::{
    fault_on, plan_run, read_pages, Fault, PageSource, ResolveError, SourceId, UNINITIALIZED,
};

/// Outcome of handling one event.
#[derive(Debug)]
pub enum Handled {
    Ok,
    /// The VMM's address space is gone (ESRCH): treat the VMM as exited.
    VmmGone,
    /// The VM failed just now: a fault could not be served, for this
    /// reason. The page is poisoned (see [`Registry::unservable`]).
    Failed(String),
    /// The fault on `page` waits for frames of a compressed image being
    /// decoded off the core thread; retry it when every receiver fired.
    /// The faulting thread stays asleep until then.
    Wait {
        page: u64,
        ready: Vec<tokio::sync::oneshot::Receiver<()>>,
        /// The fault is a write-protect fault (else a missing one).
        write_protect: bool,
    },
}

impl Registry {
    /// Handle one uffd event of `vm`.
    pub fn handle_event(&mut self, vm: VmId, event: Event) -> Handled {
        match event {
            Event::Pagefault { kind, rw, addr, .. } => {
                self.handle_fault(vm, kind, rw == ReadWrite::Write, addr as u64)
            }
            Event::Remove { start, end } => self.handle_remove(vm, start as u64, end as u64),
            other => {
                debug!("{vm}: ignoring uffd event {other:?}");
                Handled::Ok
            }
        }
    }

    fn handle_fault(&mut self, vm: VmId, kind: FaultKind, write: bool, addr: u64) -> Handled {
        let Some(v) = self.vms.get_mut(&vm) else {
            return Handled::Ok;
        };
        let Some(page) = v.page_of(addr) else {
            if let Some(v) = self.vms.get_mut(&vm) {
                if let Some(n) = v.warnings.allow() {
                    warn!(
                        "{vm}: fault at {addr:#x} outside guest RAM; ignoring{}",
                        suppressed_note(n)
                    );
                }
            }
            return Handled::Ok;
        };
        v.log.fault(
            page,
            match kind {
                FaultKind::WriteProtected => ApiKind::Wp,
                FaultKind::Missing | FaultKind::Minor => ApiKind::Missing,
            },
        );
        if write || kind == FaultKind::WriteProtected {
            // A write is coming: the dirty log and a snapshot still saving
            // this page see it first (see `snapshot.rs`).
            self.before_write(vm, page);
        }
        match kind {
            FaultKind::Missing => self.resolve_missing(vm, page),
            FaultKind::WriteProtected => self.resolve_write_protect(vm, page),
            FaultKind::Minor => self.resolve_minor(vm, page),
        }
    }

    /// A page in the memfd that the VMM does not map: registered MINOR
    /// only after a rollback discarded pages. A stale page (the table
    /// points elsewhere) is punched and installed from the table like a
    /// missing one; any other page is the VM's own and is mapped as it is
    /// (UFFDIO_CONTINUE).
    fn resolve_minor(&mut self, vm: VmId, page: u64) -> Handled {
        let Some(v) = self.vms.get_mut(&vm) else {
            return Handled::Ok;
        };
        v.stats.minor += 1;
        if v.table.get(page) != v.self_src || v.stale.contains(page) {
            // Whatever the memfd holds there is not the VM's page: drop it
            // (stale or not), then install the table's.
            v.stale.remove(page);
            if let Err(e) = v.memory.punch_hole(page, 1) {
                let e = ResolveError::Memory(e);
                return self.unservable(vm, page, &e);
            }
            return self.resolve_missing(vm, page);
        }
        let Some(uffd) = v.uffd.clone() else {
            return Handled::Ok;
        };
        let addr = v.addr_of(page);
        match uffd
            .get_ref()
            .r#continue(addr.cast(), shared::geometry::usize_of(PAGE_SIZE), true)
        {
            Ok(_) => Handled::Ok,
            // Mapped meanwhile, or the VMM is on its way out: a wake lets
            // the thread retry (or find out).
            Err(e) => {
                debug!("{vm}: UFFDIO_CONTINUE of page {page}: {e}");
                wake(v, page, 1)
            }
        }
    }

    /// Make `page` (and the run planned around it) present in `vm`'s
    /// memory from its source, and wake the faulting thread.
    ///
    /// With the VMM running, the bytes are read into a staging buffer and
    /// installed with UFFDIO_COPY, which makes each page visible whole and
    /// wakes the waiters. Writing them through the server's mapping of the
    /// memfd instead would make a page present at its first byte: a vCPU
    /// that left its fault wait (a signal, such as the pause of a fork)
    /// and touched the page again would find it half written and its
    /// write could be overwritten by the rest of the install.
    pub(super) fn resolve_missing(&mut self, vm: VmId, page: u64) -> Handled {
        let huge = self.vms.get(&vm).is_some_and(|v| v.memory.unit_pages() > 1);
        let result = match self.vms.get(&vm).and_then(|v| v.uffd.clone()) {
            Some(uffd) if huge => self.install_block(vm, page, &uffd),
            Some(uffd) => self.install_missing(vm, page, &uffd),
            None => self
                .materialize(vm, page, By::Missing)
                .map(|(first, count)| (first, count, true)),
        };
        let (first, count, woken) = match result {
            Ok(r) => r,
            Err(ResolveError::NotDecoded { image, frames }) => {
                let ready = crate::images::zst::FramePool::wait(&image, frames);
                if let Some(v) = self.vms.get_mut(&vm) {
                    v.stats.frame_waits += 1;
                }
                return Handled::Wait {
                    page,
                    ready,
                    write_protect: false,
                };
            }
            Err(e) => return self.unservable(vm, page, &e),
        };
        let Some(v) = self.vms.get_mut(&vm) else {
            return Handled::Ok;
        };
        v.stats.missing += 1;
        if woken {
            // UFFDIO_COPY woke the run; only a page installed earlier
            // (a concurrent fault) or a memcpy install needs a wake.
            return Handled::Ok;
        }
        wake(v, first, count)
    }

    /// Install the run around `page` through `uffd` (see
    /// [`Self::resolve_missing`]). Returns the run and whether the copy
    /// woke it; when it did not (the page was there already, or an event
    /// is pending), the caller wakes the faulting page so its thread
    /// retries.
    fn install_missing(
        &mut self,
        vm: VmId,
        page: u64,
        uffd: &AsyncFd<Uffd>,
    ) -> Result<(u64, u64, bool), ResolveError> {
        let Some((src_id, source, lo, hi, window)) = self.plan(vm, page)? else {
            return Ok((page, 1, false)); // Already present: a concurrent fault.
        };
        let v = self.vms.get_mut(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
        // Stale bytes a rollback left in the run go first (UFFDIO_COPY
        // would stop at them).
        v.scrub(lo, hi).map_err(ResolveError::Memory)?;
        let v = self.vms.get(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
        // While writes are tracked, the installed pages stay
        // write-protected like the rest of memory, so a later write is
        // seen.
        let mode = v.copy_mode();
        // A run longer than one piece (a readahead window) goes in piece by
        // piece: the piece holding the faulting page first, whose copy
        // wakes the faulting thread, then the rest behind it while it runs
        // (see `stream_rest`).
        let piece = self.readahead_piece_pages.max(v.fault_around_pages);
        let first_end = if self.readahead_piece_pages == 0 || hi - lo <= piece {
            hi
        } else {
            (page + 1).max(lo + piece).min(hi)
        };
        let how = Installed {
            fault: page,
            by: By::Missing,
            from: src_id,
        };
        let copy = CopyRun {
            vm,
            source: &source,
            mode,
            how,
            uffd,
        };
        let res = self.copy_pages(&copy, lo, first_end)?;
        let installed = match res {
            Install::Done => first_end - lo,
            Install::Exists { copied } | Install::Again { copied } => copied / PAGE_SIZE,
            Install::Gone => 0,
            Install::Failed(errno) => return Err(ResolveError::Install { first: lo, errno }),
        };
        self.mark_present(vm, lo, installed, how);
        if let Install::Exists { .. } = res {
            if lo + installed == page {
                // The faulting page itself is in the memfd already (put
                // there by another path): it is present; say so, so the
                // next fault does not try to install it again.
                self.mark_present(vm, page, 1, how);
            } else if page > lo + installed && first_end - lo > 1 {
                // A page before it was there: install just the faulting
                // page.
                return self.install_missing_one(vm, page, uffd);
            }
        }
        let mut end = lo + installed;
        if matches!(res, Install::Done) && first_end < hi {
            end = self.stream_rest(&copy, first_end, hi, piece);
        }
        if let (Some(window), Some(v)) = (window, self.vms.get_mut(&vm)) {
            v.readahead.next = end;
            v.readahead.window = window;
        }
        Ok((page, 1, matches!(res, Install::Done)))
    }

    /// Install the hugetlb block holding `page` through `uffd`: its 512
    /// pages are read from their sources (a block may mix them: a fork
    /// parent's pages beside zero pages, an image's data beside its holes)
    /// and go in with one UFFDIO_COPY of 2 MiB, which the kernel installs
    /// whole. Returns the block and whether the copy woke its waiters.
    fn install_block(
        &mut self,
        vm: VmId,
        page: u64,
        uffd: &AsyncFd<Uffd>,
    ) -> Result<(u64, u64, bool), ResolveError> {
        let v = self.vms.get(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
        let (lo, hi) = v.memory.unit_range(page, page + 1);
        let src_id = v.table.get(page);
        if src_id == v.self_src {
            return Ok((lo, hi - lo, false)); // Already present.
        }
        let mode = v.copy_mode();
        let to = v.addr_of(lo) as u64;
        let res = self.copy_block(vm, lo, hi, uffd, to, mode)?;
        phases::lap(Phase::Install);
        let how = Installed {
            fault: page,
            by: By::Missing,
            from: src_id,
        };
        match res {
            Install::Done => {
                self.mark_present(vm, lo, hi - lo, how);
                self.block_ahead(vm, lo, hi, uffd, mode);
                Ok((lo, hi - lo, true))
            }
            // No page to put there: the kernel says EEXIST (see
            // `hugepages_exhausted`).
            Install::Exists { .. } if crate::memory::hugepages_exhausted() => {
                Err(ResolveError::HugePagesExhausted { first: lo })
            }
            // Present already (the kernel installs hugetlb blocks whole).
            Install::Exists { .. } => {
                self.mark_present(vm, lo, hi - lo, how);
                Ok((lo, hi - lo, false))
            }
            // A pending event or a gone VMM: the wake makes the thread, if
            // any, fault again.
            Install::Again { .. } | Install::Gone => Ok((lo, hi - lo, false)),
            Install::Failed(errno) => Err(ResolveError::Install { first: lo, errno }),
        }
    }

    /// Readahead for hugetlb memory: when the block `[lo, hi)` just
    /// installed (its faulting thread already woken) follows the block
    /// faulted before it, install the blocks after it too, while the vCPU
    /// works through this one. The run ahead doubles with each sequential
    /// fault, from one block up to [`BLOCKS_AHEAD_MAX`], so a sequential
    /// reader soon faults once per five blocks; any other fault starts
    /// again from none. Only blocks that start with image data; off with
    /// readahead (`readahead_kib` 0). A failure here is left to the fault
    /// that will come for that block.
    fn block_ahead(&mut self, vm: VmId, lo: u64, hi: u64, uffd: &AsyncFd<Uffd>, mode: u64) {
        let Some(v) = self.vms.get_mut(&vm) else {
            return;
        };
        let sequential = v.readahead.max_pages > 0 && v.readahead.next == lo;
        v.readahead.next = hi;
        // For hugetlb memory the window counts blocks, not pages.
        v.readahead.window = if sequential {
            (v.readahead.window * 2).clamp(1, BLOCKS_AHEAD_MAX)
        } else {
            0
        };
        let block = hi - lo;
        for _ in 0..v.readahead.window {
            let Some(v) = self.vms.get(&vm) else {
                return;
            };
            let (at, end) = (v.readahead.next, v.readahead.next + block);
            if end > v.memory.pages() {
                return;
            }
            let src_id = v.table.get(at);
            // Image data only, as for 4 KiB pages: reading ahead from a
            // fork parent or of zero pages would only copy memory early.
            if src_id == v.self_src || !self.arena.get(src_id).is_some_and(|s| s.fault_around()) {
                return;
            }
            let to = v.addr_of(at) as u64;
            let res = self.copy_block(vm, at, end, uffd, to, mode);
            match res {
                Ok(Install::Done) => {}
                Ok(Install::Exists { .. }) if !crate::memory::hugepages_exhausted() => {}
                _ => return,
            }
            let how = Installed {
                fault: lo,
                by: By::FaultAround,
                from: src_id,
            };
            self.mark_present(vm, at, block, how);
            if let Some(v) = self.vms.get_mut(&vm) {
                v.readahead.next = end;
            }
        }
    }

    /// UFFDIO_COPY the hugetlb block `[lo, hi)` of `vm` to `to`. A block
    /// that is all data of one image file goes straight from the file's
    /// page cache ([`crate::pages::FileSource::mapped`]): the `pread`
    /// into the staging buffer was half the copying of a block. Any
    /// other block, or one whose copy from the mapping faults (the file
    /// changed under it), is read into the staging buffer as before,
    /// which also names what went wrong.
    fn copy_block(
        &self,
        vm: VmId,
        lo: u64,
        hi: u64,
        uffd: &AsyncFd<Uffd>,
        to: u64,
        mode: u64,
    ) -> Result<Install, ResolveError> {
        if let Some(from) = self.mapped_block(vm, lo, hi)? {
            phases::lap(Phase::Resolve);
            let len = (hi - lo) * PAGE_SIZE;
            // SAFETY: `from` is `len` bytes inside a mapping that the
            // source (held by the arena, which this borrows) keeps alive
            // for the call; only the kernel reads it. Mapping the block's
            // page cache first (best effort) spares the copy its slow
            // path, which starts again after a fault on its source.
            let res = unsafe {
                libc::madvise(
                    from.cast_mut().cast(),
                    shared::geometry::usize_of(len),
                    libc::MADV_POPULATE_READ,
                );
                uffd_abi::copy(uffd.get_ref(), from, to, len, mode)
            };
            // The copy mapped the block's page cache into this process:
            // unmap it again, so the server's own memory does not grow by
            // every image block it serves (the page cache stays).
            // SAFETY: as above; MADV_DONTNEED on a shared file mapping
            // only drops page-table entries.
            unsafe {
                libc::madvise(
                    from.cast_mut().cast(),
                    shared::geometry::usize_of(len),
                    libc::MADV_DONTNEED,
                );
            }
            if !matches!(res, Install::Failed(uffd_abi::Errno::EFAULT)) {
                return Ok(res);
            }
        }
        self.with_block(vm, lo, hi, |bytes| {
            // SAFETY: `bytes` is the whole block, borrowed for the call.
            unsafe { uffd_abi::copy(uffd.get_ref(), bytes.as_ptr(), to, bytes.len() as u64, mode) }
        })
    }

    /// Where block `[lo, hi)` of `vm` lies in its image's mapping, if the
    /// whole block is data of one `File` or `Image` source inside the
    /// file's length and the file can be mapped.
    fn mapped_block(&self, vm: VmId, lo: u64, hi: u64) -> Result<Option<*const u8>, ResolveError> {
        let v = self.vms.get(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
        let src = v.table.get(lo);
        if (lo + 1..hi).any(|p| v.table.get(p) != src) {
            return Ok(None);
        }
        let Some(f) = self.arena.get(src).and_then(|s| s.file()) else {
            return Ok(None);
        };
        if hi * PAGE_SIZE > f.len {
            return Ok(None);
        }
        crate::pages::resolve::check_unchanged(f)?;
        let Some(map) = f.mapped() else {
            return Ok(None);
        };
        let off = shared::geometry::usize_of(lo * PAGE_SIZE);
        // SAFETY: `off + (hi - lo) * PAGE_SIZE` is within the file's
        // length when opened, which is the mapping's size.
        Ok(Some(unsafe { map.as_ptr().add(off).cast_const() }))
    }

    /// Read pages `[lo, hi)` of `vm` as its table describes them (run by
    /// run of one source) into the staging buffer, and call `f` with the
    /// bytes.
    fn with_block<R>(
        &self,
        vm: VmId,
        lo: u64,
        hi: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, ResolveError> {
        let v = self.vms.get(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
        STAGING.with(|buf| {
            let mut buf = buf.borrow_mut();
            let bytes = shared::geometry::usize_of((hi - lo) * PAGE_SIZE);
            if buf.len() < bytes {
                buf.resize(bytes, 0);
            }
            let vms = &self.vms;
            let lookup = |id| vms.get(&id).map(|o| Rc::clone(&o.memory));
            let mut p = lo;
            while p < hi {
                let src = v.table.get(p);
                let mut q = p + 1;
                while q < hi && v.table.get(q) == src {
                    q += 1;
                }
                let source = self
                    .arena
                    .get(src)
                    .ok_or(ResolveError::UnknownSource(src))?;
                let at = shared::geometry::usize_of((p - lo) * PAGE_SIZE);
                let end = shared::geometry::usize_of((q - lo) * PAGE_SIZE);
                let dst = VolatileSlice::from(&mut buf[at..end]);
                read_pages(source, p, &dst, &lookup)?;
                p = q;
            }
            phases::lap(Phase::Resolve);
            Ok(f(&buf[..bytes]))
        })
    }

    /// Install pages `[at, hi)` of a run whose faulting page is in already
    /// (and its thread woken), `piece` pages at a time. A thread that
    /// faults on one of them meanwhile is woken by the UFFDIO_COPY of its
    /// piece (which wakes every waiter in its range, its event unread
    /// included), never later than if the run had gone in whole. Stops at
    /// a piece that cannot be installed (a fault on it reports why).
    /// Returns the end of what was installed.
    fn stream_rest(&mut self, copy: &CopyRun<'_>, mut at: u64, hi: u64, piece: u64) -> u64 {
        while at < hi {
            let end = (at + piece).min(hi);
            let n = match self.copy_pages(copy, at, end) {
                Ok(Install::Done) => end - at,
                Ok(Install::Exists { copied } | Install::Again { copied }) => {
                    self.mark_present(copy.vm, at, copied / PAGE_SIZE, copy.how);
                    return at + copied / PAGE_SIZE;
                }
                Ok(Install::Gone | Install::Failed(_)) | Err(_) => return at,
            };
            self.mark_present(copy.vm, at, n, copy.how);
            at = end;
        }
        at
    }

    /// Read pages `[lo, hi)` of `copy.source` into the staging buffer and
    /// UFFDIO_COPY them into `copy.vm`.
    fn copy_pages(&self, copy: &CopyRun<'_>, lo: u64, hi: u64) -> Result<Install, ResolveError> {
        let CopyRun {
            vm,
            source,
            mode,
            uffd,
            ..
        } = *copy;
        let v = self.vms.get(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
        let len = (hi - lo) * PAGE_SIZE;
        let to = v.addr_of(lo) as u64;
        STAGING.with(|buf| -> Result<Install, ResolveError> {
            let mut buf = buf.borrow_mut();
            let bytes = shared::geometry::usize_of(len);
            if buf.len() < bytes {
                buf.resize(bytes, 0);
            }
            let dst = VolatileSlice::from(&mut buf[..bytes]);
            let vms = &self.vms;
            read_pages(source, lo, &dst, &|id| {
                vms.get(&id).map(|o| Rc::clone(&o.memory))
            })?;
            phases::lap(Phase::Resolve);
            // SAFETY: `buf` holds `len` initialized bytes and stays
            // borrowed for the call.
            let res = unsafe { uffd_abi::copy(uffd.get_ref(), buf.as_ptr(), to, len, mode) };
            phases::lap(Phase::Install);
            Ok(res)
        })
    }

    /// A fault on `page` cannot be served (its image is unreadable or
    /// changed, its source is gone): waking the vCPU would only make it
    /// fault again, for ever. The VM fails instead, with the reason in the
    /// API, and the page is poisoned (UFFDIO_POISON), so the access cannot
    /// be retried into: KVM turns it into SIGBUS for the vCPU thread, a
    /// direct access by the VMM gets SIGBUS too, and the VMM ends. Every
    /// fault after the first is only counted, with a rate-limited warning.
    fn unservable(&mut self, vm: VmId, page: u64, e: &ResolveError) -> Handled {
        let Some(v) = self.vms.get_mut(&vm) else {
            return Handled::Ok;
        };
        v.stats.missing += 1;
        let reason = format!("page {page} cannot be served: {}", shared::error_chain(e));
        let first = v.failure.is_none();
        if first {
            error!("{vm}: failed: {reason}; the page is poisoned");
            v.failure = Some(reason.clone());
            v.state = RunState::Failed;
        } else if let Some(n) = v.warnings.allow() {
            warn!("{vm}: {reason}{}", suppressed_note(n));
        }
        match poison(v, page) {
            Handled::Ok if first => Handled::Failed(reason),
            other => other,
        }
    }

    /// Copy-on-write step for a WP fault: give the pre-write page to every
    /// VM that still reads it from `vm`, then lift the protection.
    /// On hugetlb the unit is the whole block: its pre-write copy goes to
    /// the dependents and its protection is lifted whole.
    ///
    /// A dependent whose VMM has connected but whose uffd has not arrived
    /// can take the copy neither way (its guest may run already, see
    /// [`super::vm::Vm::uffd_pending`]): the write waits, protected, until
    /// the uffd is there.
    pub(super) fn resolve_write_protect(&mut self, vm: VmId, page: u64) -> Handled {
        if let Some(ready) = self.wait_for_dependents(vm, page) {
            return Handled::Wait {
                page,
                ready,
                write_protect: true,
            };
        }
        self.preserve_for_dependents(vm, page);
        let Some(v) = self.vms.get_mut(&vm) else {
            return Handled::Ok;
        };
        v.stats.write_protect += 1;
        let Some(uffd) = v.uffd.clone() else {
            return Handled::Ok;
        };
        let (lo, hi) = v.memory.unit_range(page, page + 1);
        phases::lap(Phase::Resolve);
        let lifted = uffd_abi::write_protect(
            uffd.get_ref(),
            v.addr_of(lo) as u64,
            (hi - lo) * PAGE_SIZE,
            false,
        );
        phases::lap(Phase::Install);
        match lifted {
            Ok(()) => Handled::Ok,
            Err(e) => errno_outcome(vm, "remove write protection", e),
        }
    }

    /// Receivers that fire when every VM that reads `page`'s unit from
    /// `vm` and whose uffd is pending has its uffd; `None` if none waits.
    fn wait_for_dependents(
        &mut self,
        vm: VmId,
        page: u64,
    ) -> Option<Vec<tokio::sync::oneshot::Receiver<()>>> {
        let src = self.arena.vm_id(vm)?;
        let (lo, hi) = self.vms.get(&vm)?.memory.unit_range(page, page + 1);
        let mut ready = Vec::new();
        for (id, d) in self.vms.iter_mut() {
            if *id != vm && d.uffd_pending() && (lo..hi).any(|p| d.table.get(p) == src) {
                let (tx, rx) = tokio::sync::oneshot::channel();
                d.on_uffd.push(tx);
                ready.push(rx);
            }
        }
        (!ready.is_empty()).then_some(ready)
    }

    /// Install only `page` through `uffd` (after a run met a present page).
    fn install_missing_one(
        &mut self,
        vm: VmId,
        page: u64,
        uffd: &AsyncFd<Uffd>,
    ) -> Result<(u64, u64, bool), ResolveError> {
        let v = self.vms.get_mut(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
        // A one-page run: no fault-around, no readahead.
        let saved = std::mem::replace(&mut v.fault_around_pages, 1);
        let max = std::mem::replace(&mut v.readahead.max_pages, 0);
        let r = self.install_missing(vm, page, uffd);
        if let Some(v) = self.vms.get_mut(&vm) {
            v.fault_around_pages = saved;
            v.readahead.max_pages = max;
        }
        r
    }

    /// Install `page` (and, for image sources, the surrounding fault-around
    /// block or readahead window) into `vm`'s memfd. Returns the page range
    /// installed.
    ///
    /// The bytes are written through the server's mapping of the memfd:
    /// only for a VM whose VMM is not running (prefetch before start).
    pub fn materialize(&mut self, vm: VmId, page: u64, by: By) -> Result<(u64, u64), ResolveError> {
        if self.vms.get(&vm).is_some_and(|v| v.memory.unit_pages() > 1) {
            return self.materialize_block(vm, page, by);
        }
        let Some((src_id, source, lo, hi, window)) = self.plan(vm, page)? else {
            return Ok((page, 1)); // Already present: a concurrent fault.
        };
        {
            let v = self.vms.get(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
            let dst = v.memory.slice(lo, hi - lo)?;
            let vms = &self.vms;
            read_pages(&source, lo, &dst, &|id| {
                vms.get(&id).map(|o| Rc::clone(&o.memory))
            })?;
        }
        let how = Installed {
            fault: page,
            by,
            from: src_id,
        };
        self.mark_present(vm, lo, hi - lo, how);
        if let (Some(window), Some(v)) = (window, self.vms.get_mut(&vm)) {
            v.readahead.next = hi;
            v.readahead.window = window;
        }
        Ok((lo, hi - lo))
    }

    /// [`Self::materialize`] on hugetlb: the whole block, allocated first
    /// (see [`GuestMemory::write_block`]).
    fn materialize_block(
        &mut self,
        vm: VmId,
        page: u64,
        by: By,
    ) -> Result<(u64, u64), ResolveError> {
        let v = self.vms.get(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
        let (lo, hi) = v.memory.unit_range(page, page + 1);
        let src_id = v.table.get(page);
        if src_id == v.self_src {
            return Ok((lo, hi - lo));
        }
        let memory = Rc::clone(&v.memory);
        self.with_block(vm, lo, hi, |bytes| memory.write_block(lo, bytes))??;
        let how = Installed {
            fault: page,
            by,
            from: src_id,
        };
        self.mark_present(vm, lo, hi - lo, how);
        Ok((lo, hi - lo))
    }

    /// What to install for a MISSING fault on `page`: its source (id and
    /// value) and the run `[lo, hi)` (with the readahead window it used,
    /// for an image), or `None` when the page is present already.
    #[allow(clippy::type_complexity)]
    fn plan(
        &self,
        vm: VmId,
        page: u64,
    ) -> Result<Option<(SourceId, Rc<PageSource>, u64, u64, Option<u64>)>, ResolveError> {
        let v = self.vms.get(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
        let src_id = v.table.get(page);
        if src_id == v.self_src {
            return Ok(None);
        }
        let source = self
            .arena
            .get(src_id)
            .cloned()
            .ok_or(ResolveError::UnknownSource(src_id))?;
        let run = source.fault_around().then(|| {
            let fault = Fault {
                page,
                bounds: 0..v.memory.pages(),
                block: v.fault_around_pages,
                track: true,
            };
            let fault = fault_on(&source, fault, &v.readahead);
            plan_run(&v.table, src_id, &fault, &v.readahead)
        });
        let (lo, hi) = run.map_or((page, page + 1), |r| (r.lo, r.hi));
        Ok(Some((src_id, source, lo, hi, run.map(|r| r.window))))
    }

    fn mark_present(&mut self, vm: VmId, page: u64, pages: u64, how: Installed) {
        if let Some(v) = self.vms.get_mut(&vm) {
            let me = v.self_src;
            v.table.set_range(page, pages, me);
            v.stats.pages_installed += pages;
            v.log
                .installed_run(page, pages, how.fault, how.by, how.from);
            if how.by == By::Prefetch {
                for p in page..page + pages {
                    v.log.fault(p, ApiKind::Prefetch);
                }
            }
            self.installed += pages;
        }
    }

    /// Before `vm` overwrites `page`, copy its current bytes to every VM
    /// whose table still reads that page from `vm`.
    /// Returns how many VMs got a copy.
    pub(super) fn preserve_for_dependents(&mut self, vm: VmId, page: u64) -> u64 {
        let Some(src) = self.arena.vm_id(vm) else {
            return 0;
        };
        let Some(mem) = self.vms.get(&vm).map(|v| Rc::clone(&v.memory)) else {
            return 0;
        };
        if mem.unit_pages() > 1 {
            return self.preserve_block(vm, src, page);
        }
        let mut given = 0;
        let mut lost = Vec::new();
        for (id, dep) in self.vms.iter_mut() {
            // A VM that lost a copy from `vm` has everything it read from
            // `vm` poisoned (see `fail_dependent`).
            if *id == vm || dep.lost_from.contains(&src) || dep.table.get(page) != src {
                continue;
            }
            if let Err(e) = install_copy(dep, &mem, page) {
                lost.push((
                    *id,
                    format!(
                        "its page {page} could not be kept when {vm} wrote it: {}",
                        shared::error_chain(&e)
                    ),
                ));
                continue;
            }
            let me = dep.self_src;
            dep.table.set(page, me);
            dep.stats.pages_installed += 1;
            dep.log.installed_run(page, 1, page, By::WpCopy, src);
            given += 1;
        }
        for (id, reason) in lost {
            self.fail_dependent(id, src, reason);
        }
        self.installed += given;
        if let Some(v) = self.vms.get_mut(&vm) {
            v.stats.wp_copies += given;
        }
        given
    }

    /// A page's pre-write copy had nowhere to go in `id`: it can no longer
    /// be given its memory as it was. Fail it, saying why, rather than let
    /// it read what the VM it shared the page with writes next: every page
    /// it still reads from that VM (`src`) is poisoned, so an access to one
    /// ends its VMM instead of fetching the new bytes (as for a page that
    /// cannot be served), and later writes of that VM skip it.
    fn fail_dependent(&mut self, id: VmId, src: SourceId, reason: String) {
        let Some(dep) = self.vms.get_mut(&id) else {
            return;
        };
        if dep.lost_from.contains(&src) {
            return;
        }
        dep.lost_from.push(src);
        if dep.failure.is_none() {
            error!("{id}: failed: {reason}");
            dep.failure = Some(reason);
            dep.state = RunState::Failed;
        } else {
            warn!("{id}: {reason}");
        }
        let Some(uffd) = dep.uffd.clone() else {
            return;
        };
        for (first, n) in dep.table.ranges_of(src) {
            let (lo, hi) = dep.memory.unit_range(first, first + n);
            let len = (hi - lo) * PAGE_SIZE;
            match uffd_abi::poison(uffd.get_ref(), dep.addr_of(lo) as u64, len) {
                Install::Done | Install::Gone => {}
                other => warn!("{id}: cannot poison pages {lo}..{hi}: {other:?}"),
            }
        }
    }

    /// [`Self::preserve_for_dependents`] on hugetlb: every VM that reads a
    /// page of `page`'s block from `vm` gets its whole block (its other
    /// pages from their own sources), installed whole. Returns the pages
    /// given, like the 4 KiB path (one per VM and page).
    fn preserve_block(&mut self, vm: VmId, src: SourceId, page: u64) -> u64 {
        let Some((lo, hi)) = self
            .vms
            .get(&vm)
            .map(|v| v.memory.unit_range(page, page + 1))
        else {
            return 0;
        };
        let deps: Vec<VmId> = self
            .vms
            .iter()
            .filter(|(id, d)| {
                **id != vm && !d.lost_from.contains(&src) && (lo..hi).any(|p| d.table.get(p) == src)
            })
            .map(|(id, _)| *id)
            .collect();
        let mut given = 0;
        for id in deps {
            let done = self
                .with_block(id, lo, hi, |bytes| {
                    self.vms
                        .get(&id)
                        .map_or(Ok(()), |dep| install_block_copy(dep, lo, bytes))
                })
                .map_err(PreserveError::from)
                .and_then(|r| r);
            if let Err(e) = done {
                let why = if crate::memory::hugepages_exhausted() {
                    ResolveError::HugePagesExhausted { first: lo }.to_string()
                } else {
                    shared::error_chain(&e)
                };
                self.fail_dependent(
                    id,
                    src,
                    format!("its block at page {lo} could not be kept when {vm} wrote it: {why}"),
                );
                continue;
            }
            if let Some(dep) = self.vms.get_mut(&id) {
                let me = dep.self_src;
                dep.table.set_range(lo, hi - lo, me);
                dep.stats.pages_installed += hi - lo;
                dep.log.installed_run(lo, hi - lo, page, By::WpCopy, src);
            }
            self.installed += hi - lo;
            given += hi - lo;
        }
        if let Some(v) = self.vms.get_mut(&vm) {
            v.stats.wp_copies += given;
        }
        given
    }

    fn handle_remove(&mut self, vm: VmId, start: u64, end: u64) -> Handled {
        let Some(v) = self.vms.get_mut(&vm) else {
            return Handled::Ok;
        };
        if v.discarding {
            // The server's own discard (a rollback), already accounted for.
            return Handled::Ok;
        }
        let (Some(first), Some(last)) = (v.page_of(start), v.page_of(end.saturating_sub(1))) else {
            return Handled::Ok;
        };
        let pages = last - first + 1;
        v.stats.removes += 1;
        for p in first..first + pages {
            v.log.fault(p, ApiKind::Remove);
        }
        v.log.dropped(first, pages);
        let me = v.self_src;
        let tracked = v.dirty.is_some();
        let unit = v.memory.unit_pages();
        for p in (first..first + pages).step_by(shared::geometry::usize_of(unit)) {
            self.before_write(vm, p);
        }
        let Some(v) = self.vms.get_mut(&vm) else {
            return Handled::Ok;
        };
        let unit = v.memory.unit_pages();
        let present: Vec<u64> = (first..first + pages)
            .step_by(shared::geometry::usize_of(unit))
            .filter(|p| v.table.get(*p) == me)
            .collect();
        // Dependents that still read these pages from this VM get their
        // copy before the bytes are dropped.
        for p in present {
            self.preserve_for_dependents(vm, p);
        }
        let Some(v) = self.vms.get_mut(&vm) else {
            return Handled::Ok;
        };
        // The discarded pages read as zero from now on.
        v.table.set_range(first, pages, UNINITIALIZED);
        if let Err(e) = v.memory.punch_hole(first, pages) {
            warn!(
                "{vm}: cannot drop removed pages {first}..{}: {e}",
                first + pages
            );
        }
        if tracked {
            // Keep tracking writes to the discarded range.
            if let Some(uffd) = v.uffd.clone() {
                let addr = v.addr_of(first) as u64;
                if let Err(e) =
                    uffd_abi::write_protect(uffd.get_ref(), addr, pages * PAGE_SIZE, true)
                {
                    return errno_outcome(vm, "write-protect removed pages", e);
                }
            }
        }
        Handled::Ok
    }
}

/// What every piece of one install shares: where to, from what, how.
struct CopyRun<'a> {
    vm: VmId,
    source: &'a PageSource,
    /// UFFDIO_COPY mode (`COPY_MODE_WP` while writes are tracked).
    mode: u64,
    how: Installed,
    uffd: &'a AsyncFd<Uffd>,
}

/// How a run of pages was installed, for the VM's page log.
#[derive(Debug, Clone, Copy)]
struct Installed {
    /// The faulting page (the rest of the run is fault-around).
    fault: u64,
    by: By,
    from: SourceId,
}

/// The most hugetlb blocks a sequential fault installs ahead of the
/// reader (8 MiB): enough that the reader waits on one fault per five
/// blocks, few enough that another VM's fault waits at most a few block
/// copies behind it on the core thread.
const BLOCKS_AHEAD_MAX: u64 = 4;

thread_local! {
    /// Where a fault's pages are read before UFFDIO_COPY; grows to the
    /// largest run installed (the readahead limit).
    static STAGING: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Why the pre-write copy of a page could not be given to a dependent.
#[derive(Debug, thiserror::Error)]
enum PreserveError {
    #[error("the page is already present although the table says it is not")]
    AlreadyPresent,
    #[error("UFFDIO_COPY failed")]
    Copy(#[source] Errno),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Resolve(#[from] ResolveError),
}

/// Put `bytes` (a whole hugetlb block) at page `lo` of `dep`: through its
/// uffd while its VMM runs (see [`install_copy`]), else allocated and
/// written through the server's mapping.
fn install_block_copy(dep: &super::vm::Vm, lo: u64, bytes: &[u8]) -> Result<(), PreserveError> {
    if let Some(uffd) = dep.uffd.clone() {
        let mode = dep.copy_mode();
        let to = dep.addr_of(lo) as u64;
        // SAFETY: `bytes` is borrowed for the call.
        match unsafe {
            uffd_abi::copy(uffd.get_ref(), bytes.as_ptr(), to, bytes.len() as u64, mode)
        } {
            Install::Done => return Ok(()),
            Install::Exists { .. } => return Err(PreserveError::AlreadyPresent),
            Install::Gone | Install::Again { .. } => {}
            Install::Failed(errno) => return Err(PreserveError::Copy(errno)),
        }
    }
    Ok(dep.memory.write_block(lo, bytes)?)
}

/// Put a copy of `src`'s `page` into `dep`.
///
/// A dependent whose VMM runs may be touching that very page: UFFDIO_COPY
/// through its uffd installs the page whole (and wakes any thread faulting
/// on it), where a memcpy through the server's mapping would make the page
/// present at its first byte and let the guest see or lose a torn page.
/// Without a running VMM (not yet connected, exited, frozen) the memcpy is
/// safe.
fn install_copy(dep: &super::vm::Vm, src: &GuestMemory, page: u64) -> Result<(), PreserveError> {
    if let Some(uffd) = dep.uffd.clone() {
        let from = src.page_ptr(page)?;
        let to = dep.addr_of(page) as u64;
        // A dependent whose writes are tracked keeps the page protected.
        let mode = dep.copy_mode();
        // SAFETY: `from` is one page inside the source VM's live mapping,
        // which `src` keeps alive for the call.
        match unsafe { uffd_abi::copy(uffd.get_ref(), from, to, PAGE_SIZE, mode) } {
            Install::Done => return Ok(()),
            Install::Exists { .. } => return Err(PreserveError::AlreadyPresent),
            // Gone: the VMM died, nobody touches the memfd any more.
            // Again: a non-cooperative event (REMOVE) is pending on the
            // dependent's uffd, which the VMM only raises while it discards
            // memory; the event is read on this same thread, so waiting here
            // cannot help. Both fall back to the memcpy.
            Install::Gone | Install::Again { .. } => {}
            Install::Failed(errno) => return Err(PreserveError::Copy(errno)),
        }
    }
    Ok(dep.memory.copy_page_from(src, page)?)
}

/// Poison `page` in `v`'s VMM: every access to it fails from now on.
fn poison(v: &mut super::vm::Vm, page: u64) -> Handled {
    let Some(uffd) = v.uffd.clone() else {
        return Handled::Ok;
    };
    let (lo, hi) = v.memory.unit_range(page, page + 1);
    match uffd_abi::poison(uffd.get_ref(), v.addr_of(lo) as u64, (hi - lo) * PAGE_SIZE) {
        Install::Done => Handled::Ok,
        // Installed meanwhile, or an event is pending: let the access retry.
        Install::Exists { .. } | Install::Again { .. } => wake(v, page, 1),
        Install::Gone => Handled::VmmGone,
        Install::Failed(errno) => {
            if let Some(n) = v.warnings.allow() {
                warn!(
                    "{}: cannot poison page {page}: {errno}{}",
                    v.id,
                    suppressed_note(n)
                );
            }
            wake(v, page, 1)
        }
    }
}

fn wake(v: &super::vm::Vm, first: u64, count: u64) -> Handled {
    let Some(uffd) = v.uffd.clone() else {
        return Handled::Ok;
    };
    // Hugetlb waiters wait on their block: wake it whole.
    let (first, end) = v.memory.unit_range(first, first + count);
    let addr = v.addr_of(first) as u64;
    phases::lap(Phase::Resolve);
    let woken = uffd_abi::wake(uffd.get_ref(), addr, (end - first) * PAGE_SIZE);
    phases::lap(Phase::Wake);
    match woken {
        Ok(()) => Handled::Ok,
        Err(e) => errno_outcome(v.id, "wake", e),
    }
}

fn errno_outcome(vm: VmId, what: &str, e: Errno) -> Handled {
    if e == Errno::ESRCH {
        return Handled::VmmGone;
    }
    warn!("{vm}: uffd {what} failed: {e}");
    Handled::Ok
}
