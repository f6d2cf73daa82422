//! One Firecracker VM being served: its regions, table and uffd, and how a
//! fault is resolved (zero pages, EAGAIN). Which pages to install and
//! their bytes come from the resolver in [`crate::pages::resolve`], shared
//! with our own VMs; here they are installed with UFFDIO_COPY from a
//! staging buffer, or UFFDIO_ZEROPAGE.

use std::cell::RefCell;
use std::os::unix::net::UnixStream;
use std::rc::Rc;

use proto::firecracker::Region;
use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tracing::{error, warn};
use uffd_abi::Install;
use userfaultfd::Uffd;
use vm_memory::VolatileSlice;

use crate::core::ratelimit::{suppressed_note, RateLimit};
use crate::core::vm::{FaultStats, Readahead, RunState};
use crate::observe::phases::{self, Phase, PhaseHists};
use crate::pages::{
    fault_on, plan_run, read_pages, Fault, PageTable, ResolveError, SourceArena, SourceId,
    UNINITIALIZED,
};

/// Largest run installed by one UFFDIO_COPY: the staging buffer's size.
/// One 2 MiB huge page, the largest page size served, which must be
/// installed by a single call.
const STAGING_PAGES: u64 = 512;

/// A Firecracker VM being served.
#[derive(Debug)]
pub struct FcVm {
    pub id: VmId,
    pub listener: u32,
    pub conn: u64,
    pub pid: u32,
    pub regions: Vec<Region>,
    pub table: PageTable,
    pub self_src: SourceId,
    pub file_src: SourceId,
    pub uffd: Rc<AsyncFd<Uffd>>,
    pub state: RunState,
    pub stats: FaultStats,
    pub fault_around_pages: u64,
    pub readahead: Readahead,
    /// Source pages installed by faults, in order (for working-set
    /// recording).
    pub fault_order: Vec<u64>,
    pub stream: UnixStream,
    /// Signalled on hang-up: the serving task stops and drops the uffd
    /// (after the process exits its uffd never becomes readable again).
    pub closed: Rc<tokio::sync::Notify>,
    /// Why the VM failed (state `Failed`): a fault could not be served.
    pub failure: Option<String>,
    /// Limits the fault path's repeated warnings about this VM.
    pub warnings: RateLimit,
    /// Where the fault path's time goes, phase by phase.
    pub phases: PhaseHists,
    /// A readahead window is installed in pieces of this many pages
    /// (0 = in one piece; see `Settings::readahead_piece_pages`).
    pub readahead_piece_pages: u64,
}

/// Result of resolving one fault.
pub(super) enum Resolved {
    Ok,
    /// Retry after the pending events.
    Again,
    /// Retry when these fire: frames of a compressed image are being
    /// decoded off the core thread (the faulting thread stays asleep).
    Wait(Vec<tokio::sync::oneshot::Receiver<()>>),
    Gone,
}

/// How an attempt to resolve a fault ended.
enum Outcome {
    Resolved(Resolved),
    /// The pages cannot be served, for this reason.
    Unservable(String),
}

impl FcVm {
    fn region_of(&self, addr: u64) -> Option<Region> {
        self.regions
            .iter()
            .copied()
            .find(|r| addr >= r.base && addr < r.base + r.size)
    }

    /// Install source pages `[lo, hi)` of region `r`; returns how many pages
    /// from `lo` were installed before an existing page, or the outcome.
    fn install_run(
        &mut self,
        arena: &SourceArena,
        r: Region,
        lo: u64,
        hi: u64,
    ) -> Result<u64, Outcome> {
        let src_id = self.table.get(lo);
        if src_id == UNINITIALIZED && r.page_size == PAGE_SIZE {
            let dst = r.base + (lo * PAGE_SIZE - r.offset);
            phases::lap(Phase::Resolve);
            let res = uffd_abi::zeropage(self.uffd.get_ref(), dst, (hi - lo) * PAGE_SIZE);
            phases::lap(Phase::Install);
            return self.installed(lo, hi, 0, res);
        }
        let Some(source) = arena.get(src_id).cloned() else {
            let e = ResolveError::UnknownSource(src_id);
            return Err(Outcome::Unservable(e.to_string()));
        };
        // A readahead window goes in piece by piece, the faulting page's
        // (the first: a sequential run starts at it) waking its thread, the
        // rest behind it; each piece's copy wakes whoever faulted in it
        // meanwhile (see `core/fault.rs` `stream_rest`).
        let piece = match self.readahead_piece_pages {
            0 => STAGING_PAGES,
            n if r.page_size == PAGE_SIZE => n.max(self.fault_around_pages).min(STAGING_PAGES),
            _ => STAGING_PAGES,
        };
        let mut at = lo;
        while at < hi {
            let end = hi.min(at + piece);
            let len = (end - at) * PAGE_SIZE;
            let res = STAGING.with(|buf| -> Result<Install, ResolveError> {
                let mut buf = buf.borrow_mut();
                let bytes = shared::geometry::usize_of(len);
                if buf.len() < bytes {
                    buf.resize(bytes, 0);
                }
                let dst = VolatileSlice::from(&mut buf[..bytes]);
                read_pages(&source, at, &dst, &|_| None)?;
                let to = r.base + (at * PAGE_SIZE - r.offset);
                phases::lap(Phase::Resolve);
                // SAFETY: `buf` holds `len` initialized bytes and stays
                // borrowed for the call.
                let res = unsafe { uffd_abi::copy(self.uffd.get_ref(), buf.as_ptr(), to, len, 0) };
                phases::lap(Phase::Install);
                Ok(res)
            });
            let res = match res {
                Ok(res) => res,
                Err(ResolveError::NotDecoded { image, frames }) => {
                    self.mark(lo, at - lo);
                    self.stats.frame_waits += 1;
                    let ready = crate::images::zst::FramePool::wait(&image, frames);
                    return Err(Outcome::Resolved(Resolved::Wait(ready)));
                }
                Err(e) => {
                    self.mark(lo, at - lo);
                    return Err(Outcome::Unservable(format!(
                        "pages {at}..{end} cannot be served: {}",
                        shared::error_chain(&e)
                    )));
                }
            };
            match res {
                Install::Done => at = end,
                other => return self.installed(lo, end, at - lo, other),
            }
        }
        self.mark(lo, hi - lo);
        Ok(hi - lo)
    }

    /// Account for an install of `[lo, hi)` whose first `before` pages were
    /// installed by earlier calls and whose last call ended in `res`.
    fn installed(&mut self, lo: u64, hi: u64, before: u64, res: Install) -> Result<u64, Outcome> {
        let done = |copied: u64| before + copied / PAGE_SIZE;
        let n = match res {
            Install::Done => hi - lo,
            Install::Exists { copied } => done(copied),
            Install::Again { copied } => {
                self.mark(lo, done(copied));
                return Err(Outcome::Resolved(Resolved::Again));
            }
            Install::Gone => return Err(Outcome::Resolved(Resolved::Gone)),
            Install::Failed(errno) => {
                self.mark(lo, before);
                return Err(Outcome::Unservable(format!(
                    "UFFDIO_COPY of pages {lo}..{hi} failed: {errno}"
                )));
            }
        };
        self.mark(lo, n);
        Ok(n)
    }

    fn mark(&mut self, lo: u64, n: u64) {
        let me = self.self_src;
        self.table.set_range(lo, n, me);
        self.stats.pages_installed += n;
    }

    pub(super) fn wake(&self, addr: u64, len: u64) {
        phases::lap(Phase::Resolve);
        let _ = uffd_abi::wake(self.uffd.get_ref(), addr, len);
        phases::lap(Phase::Wake);
    }

    /// Resolve a MISSING fault at `addr`; a fault that cannot be served
    /// fails the VM and poisons the faulting page (see [`Self::unservable`]).
    pub(super) fn resolve(&mut self, arena: &SourceArena, addr: u64, record: bool) -> Resolved {
        match self.try_resolve(arena, addr, record) {
            Outcome::Resolved(r) => r,
            Outcome::Unservable(reason) => self.unservable(addr, reason),
        }
    }

    /// As for our own VMs (`Registry::unservable`): waking would make the
    /// vCPU fault again for ever, so the VM fails with the reason in the
    /// API and the page is poisoned; Firecracker's access gets SIGBUS.
    /// Faults after the first are counted under a rate-limited warning.
    fn unservable(&mut self, addr: u64, reason: String) -> Resolved {
        if self.failure.is_none() {
            error!("{}: failed: {reason}; the page is poisoned", self.id);
            self.failure = Some(reason);
            self.state = RunState::Failed;
        } else if let Some(n) = self.warnings.allow() {
            warn!("{}: {reason}{}", self.id, suppressed_note(n));
        }
        let size = self.region_of(addr).map_or(PAGE_SIZE, |r| r.page_size);
        let start = addr & !(size - 1);
        match uffd_abi::poison(self.uffd.get_ref(), start, size) {
            Install::Done => Resolved::Ok,
            Install::Gone => Resolved::Gone,
            Install::Again { .. } => Resolved::Again,
            Install::Exists { .. } => {
                self.wake(start, size);
                Resolved::Ok
            }
            Install::Failed(errno) => {
                if let Some(n) = self.warnings.allow() {
                    warn!(
                        "{}: cannot poison {start:#x}: {errno}{}",
                        self.id,
                        suppressed_note(n)
                    );
                }
                self.wake(start, size);
                Resolved::Ok
            }
        }
    }

    fn try_resolve(&mut self, arena: &SourceArena, addr: u64, record: bool) -> Outcome {
        let Some(r) = self.region_of(addr) else {
            if let Some(n) = self.warnings.allow() {
                warn!(
                    "{}: fault at {addr:#x} outside every region{}",
                    self.id,
                    suppressed_note(n)
                );
            }
            return Outcome::Resolved(Resolved::Ok);
        };
        let unit = r.page_size / PAGE_SIZE;
        let page = (r.offset + (addr - r.base)) / PAGE_SIZE;
        let first = page - page % unit;
        if self.table.get(first) == self.self_src {
            self.wake(addr & !(r.page_size - 1), r.page_size);
            return Outcome::Resolved(Resolved::Ok);
        }
        let (lo, hi) = if unit > 1 || self.table.get(page) != self.file_src {
            (first, first + unit)
        } else {
            // Fault-around within the region, readahead for a sequential
            // reader (see `pages::plan_run`).
            let r_lo = r.offset / PAGE_SIZE;
            let fault = Fault {
                page,
                bounds: r_lo..r_lo + r.size / PAGE_SIZE,
                block: self.fault_around_pages,
                track: record,
            };
            let fault = match arena.get(self.file_src) {
                Some(source) => fault_on(source, fault, &self.readahead),
                None => fault,
            };
            let run = plan_run(&self.table, self.file_src, &fault, &self.readahead);
            self.readahead.window = run.window;
            (run.lo, run.hi)
        };
        match self.install_run(arena, r, lo, hi) {
            Ok(n) if lo + n > page => {
                if record {
                    self.readahead.next = lo + n;
                    // The working set is every page this VM was given, in
                    // order, including those installed around the fault.
                    self.fault_order.extend(lo..lo + n);
                }
                Outcome::Resolved(Resolved::Ok)
            }
            Ok(_) => {
                // Something below `page` already existed: install just it.
                match self.install_run(arena, r, first, first + unit) {
                    Ok(n) => {
                        if record {
                            self.fault_order.extend(first..first + n);
                        }
                        self.wake(addr & !(r.page_size - 1), r.page_size);
                        Outcome::Resolved(Resolved::Ok)
                    }
                    Err(e) => e,
                }
            }
            Err(e) => e,
        }
    }

    pub(super) fn remove(&mut self, start: u64, end: u64) {
        self.stats.removes += 1;
        for r in self.regions.clone() {
            let s = start.max(r.base);
            let e = end.min(r.base + r.size);
            if s >= e {
                continue;
            }
            let lo = (r.offset + (s - r.base)) / PAGE_SIZE;
            let hi = (r.offset + (e - r.base)).div_ceil(PAGE_SIZE);
            self.table.set_range(lo, hi - lo, UNINITIALIZED);
        }
    }
}

thread_local! {
    /// Where pages are read before UFFDIO_COPY; grows to [`STAGING_PAGES`].
    static STAGING: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}
