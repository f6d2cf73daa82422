//! The fault installer: how a MISSING fault's pages go into a client's
//! memory, written once for both kinds of client (our VMs, whose guest RAM
//! is a memfd their VMM maps, and Firecracker's anonymous memory).
//!
//! ```text
//!   serve_missing ─┬─ 4 KiB: plan (pages::resolve) ─ before_install ─ copy_pages ─▶ stream_rest
//!                  │          the faulting page's piece first:         staging buffer,
//!                  │          its UFFDIO_COPY wakes the thread         UFFDIO_COPY
//!                  └─ hugetlb: copy_block (the file's page cache, or the staging buffer) ─▶ block_ahead
//!   an install that cannot be had ─▶ unservable: fail the VM, UFFDIO_POISON the page
//!   a page present already ─▶ UFFDIO_WAKE its unit
//! ```
//!
//! Every install is a `UFFDIO_COPY` (or `UFFDIO_ZEROPAGE` for a never
//! written page of anonymous memory) through the client's uffd: the kernel
//! makes the page visible whole and wakes every thread waiting in the
//! range copied. Writing the bytes through the server's mapping of a memfd
//! would make a page present at its first byte, and a vCPU that left its
//! fault wait (a signal, such as a fork's pause) could see it half
//! written, or have its write overwritten by the rest of the install.
//! Which pages to install and their bytes come from [`crate::pages`]; how
//! they are read into the one staging buffer and copied is here, so a new
//! way of installing (say, mapping pages of a shared base) is added in one
//! place and serves both.
//!
//! What differs between the clients is behind [`Books`] (the table, the
//! counters, what marking a page present records) and [`Request`] (bounds,
//! fault-around, pieces, zero pages). What a client does about the outcome
//! ([`Served`]) is its own: a pending event (EAGAIN) makes our VMs' loop
//! wake the thread so it faults again, Firecracker's defer the fault.
//!
//! Invariants: a page is marked present only once an ioctl put it (or
//! found it) in the client's memory; a client's thread is woken only for
//! a page present, poisoned, or about to be retried.

use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;

use shared::{VmId, PAGE_SIZE};
use tokio::sync::oneshot;
use tracing::{error, warn};
use uffd_abi::{Errno, Install};
use userfaultfd::Uffd;
use vm_memory::VolatileSlice;

use crate::bases::Base;
use crate::core::ratelimit::{suppressed_note, RateLimit};
use crate::observe::access::By;
use crate::observe::phases::{self, Phase};
use crate::observe::stats::FaultStats;
use crate::pages::{
    fault_on, plan_run, read_pages, Fault, PageSource, PageTable, Readahead, ResolveError,
    SourceArena, SourceId, UNINITIALIZED,
};

/// Where pages go: a client's memory, registered with its uffd.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub uffd: &'a Uffd,
    /// The client's address of table page 0: page `p` is at
    /// `base + p * PAGE_SIZE` (wrapping: a Firecracker region's table
    /// pages start at its offset in the memory file).
    pub base: u64,
    /// Pages per kernel unit (512 on hugetlb): copies, wakes and poison
    /// cover whole units.
    pub unit: u64,
    /// UFFDIO_COPY mode (`COPY_MODE_WP` while the client's writes are
    /// tracked, so installed pages stay write-protected).
    pub mode: u64,
    /// The shared base the client's memory maps, if any.
    pub shared: Option<OnBase<'a>>,
}

/// A client on a shared base: pages whose table entry is `src` are the
/// base's, mapped from it (UFFDIO_CONTINUE), not copied.
#[derive(Debug, Clone, Copy)]
pub struct OnBase<'a> {
    pub base: &'a Base,
    pub src: SourceId,
}

impl Target<'_> {
    /// The client's address of page `page`.
    pub fn addr(&self, page: u64) -> u64 {
        self.base.wrapping_add(page * PAGE_SIZE)
    }

    /// `[lo, hi)` widened to whole units.
    pub fn units(&self, lo: u64, hi: u64) -> (u64, u64) {
        let u = self.unit.max(1);
        (lo / u * u, hi.div_ceil(u) * u)
    }

    /// UFFDIO_COPY `len` bytes at `from` to page `page` (waking the
    /// threads waiting in the range).
    ///
    /// # Safety
    /// `from..from + len` must be readable memory of this process for the
    /// whole call.
    pub unsafe fn copy(&self, from: *const u8, page: u64, len: u64) -> Install {
        // SAFETY: the caller's guarantee.
        unsafe { uffd_abi::copy(self.uffd, from, self.addr(page), len, self.mode) }
    }

    /// UFFDIO_CONTINUE `[page, page + n)`: map the base's pages there,
    /// write-protected. A base page mapped unprotected takes the guest's
    /// first write as a copy on write the kernel makes without a
    /// userfaultfd event, and the table would go on naming the base for a
    /// page the VM holds; protected, that write faults and the table learns
    /// it (`fault::resolve`), so a VM's table is exact without asking the
    /// kernel (a plain CONTINUE would also drop the protection of a page
    /// never mapped, which tracked memory carries).
    pub fn map_from_base(&self, page: u64, n: u64) -> Install {
        uffd_abi::continue_range(
            self.uffd,
            self.addr(page),
            n * PAGE_SIZE,
            uffd_abi::CONTINUE_MODE_WP,
        )
    }

    /// UFFDIO_COPY `[page, page + n)` out of the server's mapping of the
    /// base `base` (filled there): a write's pages, the client's own from
    /// now on, as the kernel would have copied them on the write.
    pub fn copy_from_base(&self, base: &Base, page: u64, n: u64) -> Result<Install, ResolveError> {
        base.memory.slice(page, n).map_err(ResolveError::Memory)?;
        let from = base.memory.page_ptr(page).map_err(ResolveError::Memory)?;
        // SAFETY: `[page, page + n)` is inside the server's mapping of the
        // base (checked above), which lives as long as `base`.
        Ok(unsafe { self.copy(from, page, n * PAGE_SIZE) })
    }

    /// Wake the threads faulting on the units of `[page, page + n)`.
    pub fn wake(&self, page: u64, n: u64) -> Result<(), Errno> {
        let (lo, hi) = self.units(page, page + n);
        phases::lap(Phase::Resolve);
        let woken = uffd_abi::wake(self.uffd, self.addr(lo), (hi - lo) * PAGE_SIZE);
        phases::lap(Phase::Wake);
        woken
    }

    /// Poison the units of `[page, page + n)`: every access to them fails
    /// from now on.
    ///
    /// UFFDIO_POISON refuses any pte that is not empty, the write-protect
    /// marker of a never-touched page included (which every missing page
    /// of a VM whose writes are tracked carries): it answers EEXIST there,
    /// and the fault would be retried for ever. So on EEXIST the range's
    /// protection is lifted (which clears those markers; the VM is failing,
    /// its writes need no tracking) and the poison tried once more. A
    /// page really present still answers EEXIST.
    pub fn poison(&self, page: u64, n: u64) -> Install {
        let (lo, hi) = self.units(page, page + n);
        let len = (hi - lo) * PAGE_SIZE;
        match uffd_abi::poison(self.uffd, self.addr(lo), len) {
            Install::Exists { .. } => {
                if let Err(e) = uffd_abi::write_protect(self.uffd, self.addr(lo), len, false) {
                    return Install::Failed(e);
                }
                uffd_abi::poison(self.uffd, self.addr(lo), len)
            }
            other => other,
        }
    }

    /// Write-protect (`protect`) or unprotect and wake the units of
    /// `[page, page + n)`.
    pub fn write_protect(&self, page: u64, n: u64, protect: bool) -> Result<(), Errno> {
        let (lo, hi) = self.units(page, page + n);
        uffd_abi::write_protect(self.uffd, self.addr(lo), (hi - lo) * PAGE_SIZE, protect)
    }
}

/// How a run of pages got in, for the client's page log.
#[derive(Debug, Clone, Copy)]
pub struct How {
    /// The faulting page (the rest of the run is fault-around).
    pub fault: u64,
    pub by: By,
    pub from: SourceId,
}

/// A client's side of an install: its table and its books.
pub trait Books {
    /// The VM, for log lines.
    fn id(&self) -> VmId;
    /// Its page-source table.
    fn table(&self) -> &PageTable;
    /// The id of `Vm(itself)`: a page is present when its entry says so.
    fn self_src(&self) -> SourceId;
    fn readahead(&self) -> &Readahead;
    fn readahead_mut(&mut self) -> &mut Readahead;
    fn stats(&mut self) -> &mut FaultStats;
    /// Its fault path's rate-limited warnings.
    fn warnings(&mut self) -> &mut RateLimit;
    /// Pages `[lo, lo + n)` are in the client's memory now (`how`).
    fn mark(&mut self, lo: u64, n: u64, how: How);
    /// Pages `[lo, lo + n)` are mapped from the client's shared base now:
    /// they stay the base's in its table (recorded in its page log only).
    fn mapped_shared(&mut self, _lo: u64, _n: u64, _how: How) {}
    /// `[lo, hi)` is about to be installed: our VMs punch the stale pages
    /// a rollback left there (UFFDIO_COPY would stop at them).
    fn before_install(&mut self, lo: u64, hi: u64) -> Result<(), ResolveError>;
    /// The VM cannot go on: record `reason` and mark it failed; `true` if
    /// it had not failed before.
    fn fail(&mut self, reason: &str) -> bool;
}

/// What the fault asks for, beyond the page.
#[derive(Debug, Clone)]
pub struct Request {
    /// The faulting page, as the table indexes it.
    pub page: u64,
    /// Pages a run may cover: the VM's memory, or the Firecracker region
    /// the fault is in.
    pub bounds: Range<u64>,
    /// Fault-around block in pages (1 = off).
    pub fault_around: u64,
    /// Whether the fault feeds readahead (a bulk prefetch does not).
    pub track: bool,
    /// A run longer than this goes in piece by piece, the faulting page's
    /// first (0 = in one piece).
    pub piece: u64,
    /// Never-written pages go in with UFFDIO_ZEROPAGE (4 KiB private
    /// memory only: shared shmem and hugetlb have no zero page to map),
    /// unless the client's writes are tracked.
    pub zero_pages: bool,
    /// On hugetlb, a sequential reader's next blocks go in behind the
    /// faulting one (`block_ahead`).
    pub blocks_ahead: bool,
    /// The fault is a write: over a shared base, the faulting page is the
    /// client's own from now on.
    pub write: bool,
}

/// How a fault was served.
#[derive(Debug)]
pub enum Served {
    /// The page is in (or poisoned) and its thread woken.
    Done,
    /// A non-cooperative event (REMOVE) is pending on the uffd: the copy
    /// stopped before the faulting page, whose thread still sleeps.
    Again,
    /// Frames of a compressed image are being decoded, or chunks of a
    /// snapshot in the object store fetched, off the core thread: retry
    /// when every receiver fired (the thread sleeps).
    Wait(Vec<oneshot::Receiver<()>>),
    /// The client's process is gone (ESRCH).
    Gone,
    /// The page cannot be served: the VM failed just now, for this
    /// reason, and the page is poisoned (see [`unservable`]).
    Failed(String),
}

/// Where the faulting page stands after an install.
enum Page {
    /// Installed by a copy that woke its thread.
    Woken,
    /// In the client's memory already: its thread needs a wake.
    Present,
    /// A pending event stopped the copy before it.
    Again,
    /// The process is gone.
    Gone,
}

/// The most hugetlb blocks a sequential fault installs ahead of the
/// reader (8 MiB): enough that the reader waits on one fault per five
/// blocks, few enough that another VM's fault waits at most a few block
/// copies behind it on the core thread.
const BLOCKS_AHEAD_MAX: u64 = 4;

thread_local! {
    /// Where a fault's pages are read before UFFDIO_COPY; grows to the
    /// largest run installed (a readahead piece, a hugetlb block).
    static STAGING: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Serve a MISSING fault on `req.page`: install it (and the run planned
/// around it) from the client's table, or wake it if it is there already;
/// a page that cannot be served fails the VM and is poisoned.
pub fn serve_missing(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    req: &Request,
) -> Served {
    let installed = if t.unit > 1 {
        install_block(b, arena, t, req)
    } else {
        install_run(b, arena, t, req)
    };
    match installed {
        Ok(Page::Woken) => Served::Done,
        Ok(Page::Present) => wake(b, t, req.page),
        Ok(Page::Again) => Served::Again,
        Ok(Page::Gone) => Served::Gone,
        Err(ResolveError::NotDecoded { image, frames }) => {
            b.stats().frame_waits += 1;
            Served::Wait(crate::images::zst::FramePool::wait(&image, frames))
        }
        Err(ResolveError::NotFetched { image, chunks }) => {
            b.stats().chunk_waits += 1;
            Served::Wait(image.wait(chunks))
        }
        Err(e) => unservable(b, Some(t), req.page, &e),
    }
}

/// Wake the thread faulting on `page` (a page present already, or one to
/// retry).
pub fn wake(b: &mut impl Books, t: &Target<'_>, page: u64) -> Served {
    match t.wake(page, 1) {
        Ok(()) => Served::Done,
        Err(e) => errno_outcome(b.id(), "wake", e),
    }
}

/// ESRCH means the client's process is gone; any other failure of an
/// ioctl that only wakes or lifts protection is logged, and the thread
/// will fault again if it must.
pub fn errno_outcome(vm: VmId, what: &str, e: Errno) -> Served {
    if e == Errno::ESRCH {
        return Served::Gone;
    }
    warn!("{vm}: uffd {what} failed: {e}");
    Served::Done
}

/// A fault on `page` cannot be served (its image is unreadable or
/// changed, its source is gone): waking the thread would only make it
/// fault again, for ever. The VM fails instead, with the reason in the
/// API, and the page is poisoned (UFFDIO_POISON), so the access cannot be
/// retried into: KVM turns it into SIGBUS for the vCPU thread, a direct
/// access by the VMM (or Firecracker) gets SIGBUS too, and the process
/// ends. Every fault after the first is only counted, with a rate-limited
/// warning. Without a target (a VM whose VMM is gone) there is nothing to
/// poison.
pub fn unservable(
    b: &mut impl Books,
    t: Option<&Target<'_>>,
    page: u64,
    e: &ResolveError,
) -> Served {
    let vm = b.id();
    let reason = format!("page {page} cannot be served: {}", shared::error_chain(e));
    let first = b.fail(&reason);
    if first {
        error!("{vm}: failed: {reason}; the page is poisoned");
    } else if let Some(n) = b.warnings().allow() {
        warn!("{vm}: {reason}{}", suppressed_note(n));
    }
    let Some(t) = t else {
        return if first {
            Served::Failed(reason)
        } else {
            Served::Done
        };
    };
    match t.poison(page, 1) {
        Install::Done if first => Served::Failed(reason),
        Install::Done => Served::Done,
        Install::Gone => Served::Gone,
        // An event is pending: the client retries as for any install.
        Install::Again { .. } => Served::Again,
        // Installed meanwhile: let the access retry.
        Install::Exists { .. } => wake(b, t, page),
        Install::Failed(errno) => {
            if let Some(n) = b.warnings().allow() {
                warn!(
                    "{vm}: cannot poison page {page}: {errno}{}",
                    suppressed_note(n)
                );
            }
            wake(b, t, page)
        }
    }
}

/// What to install for a MISSING fault on a page that is not present:
/// its source, and the run `[lo, hi)` of pages around it that read from
/// that source (with the readahead window it used, for an image).
#[derive(Debug)]
pub struct Plan {
    pub src: SourceId,
    pub source: Rc<PageSource>,
    pub lo: u64,
    pub hi: u64,
    pub window: Option<u64>,
}

/// Plan the install of `req.page`: `None` when it is present already.
/// `shared` is the client's base, if any: frames and chunks of pages it
/// holds are not decoded or fetched ahead.
pub fn plan(
    table: &PageTable,
    self_src: SourceId,
    arena: &SourceArena,
    ra: &Readahead,
    req: &Request,
    shared: Option<OnBase<'_>>,
) -> Result<Option<Plan>, ResolveError> {
    let page = req.page;
    let src = table.get(page);
    if src == self_src {
        return Ok(None);
    }
    let source = arena
        .get(src)
        .cloned()
        .ok_or(ResolveError::UnknownSource(src))?;
    let run = source.fault_around().then(|| {
        let fault = Fault {
            page,
            bounds: req.bounds.clone(),
            block: req.fault_around,
            track: req.track,
        };
        // What the client's base holds is not decoded or fetched ahead.
        let held = |lo, hi| shared.is_some_and(|on| on.src == src && on.base.holds(lo, hi));
        let fault = fault_on(&source, fault, ra, &held);
        plan_run(table, src, &fault, ra)
    });
    let (lo, hi) = run.map_or((page, page + 1), |r| (r.lo, r.hi));
    Ok(Some(Plan {
        src,
        source,
        lo,
        hi,
        window: run.map(|r| r.window),
    }))
}

/// Install the run planned around `req.page` (4 KiB pages): the piece
/// holding the faulting page first, whose copy wakes its thread, then the
/// rest behind it ([`stream_rest`]).
fn install_run(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    req: &Request,
) -> Result<Page, ResolveError> {
    let page = req.page;
    let Some(plan) = plan(b.table(), b.self_src(), arena, b.readahead(), req, t.shared)? else {
        return Ok(Page::Present); // A concurrent fault installed it.
    };
    if let Some(on) = t.shared.filter(|on| on.src == plan.src) {
        return map_run(b, t, req, &plan, on);
    }
    if t.shared.is_some() && req.write && plan.src == UNINITIALIZED {
        // A write to a never-written page over a base: that page alone,
        // copied (zero), is the VM's own. Its neighbours stay unmapped: the
        // zero page would have to go in protected, for faults they may
        // never take.
        let how = How {
            fault: page,
            by: By::Missing,
            from: plan.src,
        };
        b.before_install(page, page + 1)?;
        let one = Request {
            zero_pages: false,
            ..req.clone()
        };
        return install_one(b, arena, t, &one, how);
    }
    let Plan {
        src,
        lo,
        hi,
        window,
        ..
    } = plan;
    b.before_install(lo, hi)?;
    let first_end = if req.piece == 0 || hi - lo <= req.piece {
        hi
    } else {
        (page + 1).max(lo + req.piece).min(hi)
    };
    let how = How {
        fault: page,
        by: By::Missing,
        from: src,
    };
    let (res, zero_page) = copy_or_zero(arena, t, &plan.source, src, lo, first_end, req)?;
    let installed = match res {
        Install::Done => first_end - lo,
        Install::Exists { copied } | Install::Again { copied } => copied / PAGE_SIZE,
        Install::Gone => 0,
        Install::Failed(errno) => return Err(ResolveError::Install { first: lo, errno }),
    };
    if t.shared.is_some() && zero_page {
        // The zero page is no page of the VM's own: it stays zero in the
        // table until the guest writes it (a write-protect fault, see
        // `fault::resolve`).
        b.mapped_shared(lo, installed, how);
    } else {
        b.mark(lo, installed, how);
    }
    let mut end = lo + installed;
    let at = match res {
        Install::Done => {
            if first_end < hi {
                end = stream_rest(b, arena, t, &plan.source, first_end, hi, req.piece, how);
            }
            Page::Woken
        }
        // The faulting page itself is in the client's memory already (put
        // there by another path): it is present; say so, so the next fault
        // does not try to install it again.
        Install::Exists { .. } if end == page => {
            b.mark(page, 1, how);
            Page::Present
        }
        // A page before it was there: install just the faulting page.
        Install::Exists { .. } if page > end && first_end - lo > 1 => {
            return install_one(b, arena, t, req, how)
        }
        Install::Exists { .. } => Page::Present,
        Install::Again { .. } => Page::Again,
        Install::Gone | Install::Failed(_) => Page::Gone,
    };
    if let Some(window) = window {
        let ra = b.readahead_mut();
        ra.window = window;
        // Only a fault that feeds readahead moves it on (a bulk prefetch
        // of a working set does not).
        if req.track {
            ra.next = end;
        }
    }
    Ok(at)
}

/// Install only `req.page` (after its run met a present page before it).
fn install_one(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    req: &Request,
    how: How,
) -> Result<Page, ResolveError> {
    let page = req.page;
    let src = b.table().get(page);
    if src == b.self_src() {
        return Ok(Page::Present);
    }
    let source = arena
        .get(src)
        .cloned()
        .ok_or(ResolveError::UnknownSource(src))?;
    match copy_or_zero(arena, t, &source, src, page, page + 1, req)?.0 {
        Install::Done => {
            b.mark(page, 1, how);
            Ok(Page::Woken)
        }
        Install::Exists { .. } => {
            b.mark(page, 1, how);
            Ok(Page::Present)
        }
        Install::Again { .. } => Ok(Page::Again),
        Install::Gone => Ok(Page::Gone),
        Install::Failed(errno) => Err(ResolveError::Install { first: page, errno }),
    }
}

/// Map the run planned around `req.page` from the client's shared base
/// (4 KiB pages): the base is filled first where it lacks pages of it
/// (the faulting page's piece first), then the faulting page's piece is
/// mapped from the faulting page on (UFFDIO_CONTINUE wakes its thread),
/// then the rest of the run behind it. A page of the run mapped already
/// (the VM mapped it, or wrote it, since) ends that piece: the table does
/// not record which pages a VM maps from its base.
fn map_run(
    b: &mut impl Books,
    t: &Target<'_>,
    req: &Request,
    plan: &Plan,
    on: OnBase<'_>,
) -> Result<Page, ResolveError> {
    let page = req.page;
    let (lo, hi) = (plan.lo, plan.hi);
    let first_end = if req.piece == 0 || hi - lo <= req.piece {
        hi
    } else {
        (page + 1).max(lo + req.piece).min(hi)
    };
    let how = How {
        fault: page,
        by: By::Missing,
        from: plan.src,
    };
    on.base.fill(&plan.source, lo, first_end)?;
    drop_decoded(on.base, &plan.source, lo, first_end);
    phases::lap(Phase::Resolve);
    // A write's page goes in alone, copied, as the VM's own (the table
    // never names as its own a page it maps shared), and the rest of its
    // piece behind it, mapped.
    let head = if req.write { page + 1 } else { first_end };
    let res = if req.write {
        t.copy_from_base(on.base, page, 1)?
    } else {
        t.map_from_base(page, first_end - page)
    };
    phases::lap(Phase::Install);
    let at = match res {
        Install::Done => Page::Woken,
        Install::Exists { copied } if copied > 0 => Page::Woken,
        Install::Exists { .. } => Page::Present,
        Install::Again { .. } => return Ok(Page::Again),
        Install::Gone => return Ok(Page::Gone),
        Install::Failed(errno) => return Err(ResolveError::Install { first: page, errno }),
    };
    let mut mapped = match res {
        Install::Done => head - page,
        Install::Exists { copied } => copied / PAGE_SIZE,
        _ => 0,
    };
    if req.write {
        if mapped > 0 {
            b.mark(page, 1, how);
        }
        if matches!(res, Install::Done) && head < first_end {
            let rest = match t.map_from_base(head, first_end - head) {
                Install::Done => first_end - head,
                Install::Exists { copied } | Install::Again { copied } => copied / PAGE_SIZE,
                Install::Gone | Install::Failed(_) => 0,
            };
            b.mapped_shared(head, rest, how);
            mapped += rest;
        }
    } else {
        b.mapped_shared(page, mapped, how);
    }
    // The pages before the faulting one, and the rest of a readahead
    // window, behind the woken thread.
    if lo < page && matches!(t.map_from_base(lo, page - lo), Install::Done) {
        b.mapped_shared(lo, page - lo, how);
    }
    let mut end = page + mapped;
    if matches!(res, Install::Done) && end == first_end && first_end < hi {
        let piece = req.piece.max(1);
        let mut at = first_end;
        while at < hi {
            let e = (at + piece).min(hi);
            if on.base.fill(&plan.source, at, e).is_err() {
                break;
            }
            drop_decoded(on.base, &plan.source, at, e);
            match t.map_from_base(at, e - at) {
                Install::Done => {
                    b.mapped_shared(at, e - at, how);
                    at = e;
                }
                Install::Exists { copied } | Install::Again { copied } => {
                    b.mapped_shared(at, copied / PAGE_SIZE, how);
                    at += copied / PAGE_SIZE;
                    break;
                }
                Install::Gone | Install::Failed(_) => break,
            }
        }
        end = at;
    }
    if let Some(window) = plan.window {
        let ra = b.readahead_mut();
        ra.window = window;
        if req.track {
            ra.next = end;
        }
    }
    Ok(at)
}

/// Install pages `[at, hi)` of a run whose faulting page is in already
/// (and its thread woken), `piece` pages at a time. A thread that faults
/// on one of them meanwhile is woken by the UFFDIO_COPY of its piece
/// (which wakes every waiter in its range, its event unread included),
/// never later than if the run had gone in whole. Stops at a piece that
/// cannot be installed (a fault on it reports why). Returns the end of
/// what was installed.
#[allow(clippy::too_many_arguments)]
fn stream_rest(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    source: &PageSource,
    mut at: u64,
    hi: u64,
    piece: u64,
    how: How,
) -> u64 {
    while at < hi {
        let end = (at + piece).min(hi);
        let n = match copy_pages(arena, t, source, at, end) {
            Ok(Install::Done) => end - at,
            Ok(Install::Exists { copied } | Install::Again { copied }) => {
                b.mark(at, copied / PAGE_SIZE, how);
                return at + copied / PAGE_SIZE;
            }
            Ok(Install::Gone | Install::Failed(_)) | Err(_) => return at,
        };
        b.mark(at, n, how);
        at = end;
    }
    at
}

/// UFFDIO_ZEROPAGE `[lo, hi)` when the client takes zero pages and `src`
/// is never-written memory, else [`copy_pages`]. Returns the outcome and
/// whether the pages went in as the shared zero page (not the client's
/// own: a write to them faults).
fn copy_or_zero(
    arena: &SourceArena,
    t: &Target<'_>,
    source: &PageSource,
    src: SourceId,
    lo: u64,
    hi: u64,
    req: &Request,
) -> Result<(Install, bool), ResolveError> {
    // UFFDIO_ZEROPAGE has no write-protect mode: while the client's
    // writes are tracked, a zero page would take a write unseen. Nor can
    // it go over an empty entry that keeps a protection (a discarded
    // page's): EEXIST. Zeroes are copied then.
    let tracked = t.mode & uffd_abi::COPY_MODE_WP != 0;
    if req.zero_pages && !tracked && src == UNINITIALIZED {
        phases::lap(Phase::Resolve);
        let (at, len) = (t.addr(lo), (hi - lo) * PAGE_SIZE);
        // Over a base the zero page goes in protected (see
        // `Target::map_from_base`): the guest's first write faults.
        let (res, protected) = if t.shared.is_some() {
            uffd_abi::zeropage_protected(t.uffd, at, len)
        } else {
            (uffd_abi::zeropage(t.uffd, at, len), true)
        };
        phases::lap(Phase::Install);
        if !matches!(res, Install::Exists { copied: 0 }) {
            // Zero pages that could not be protected take a write unseen:
            // they are counted the client's own (as copies would be).
            return Ok((res, protected));
        }
    }
    Ok((copy_pages(arena, t, source, lo, hi)?, false))
}

/// Read pages `[lo, hi)` of `source` into the staging buffer and
/// UFFDIO_COPY them to the client.
pub fn copy_pages(
    arena: &SourceArena,
    t: &Target<'_>,
    source: &PageSource,
    lo: u64,
    hi: u64,
) -> Result<Install, ResolveError> {
    let len = (hi - lo) * PAGE_SIZE;
    STAGING.with(|buf| {
        let mut buf = buf.borrow_mut();
        let bytes = shared::geometry::usize_of(len);
        if buf.len() < bytes {
            buf.resize(bytes, 0);
        }
        let dst = VolatileSlice::from(&mut buf[..bytes]);
        read_pages(source, lo, &dst, &|id| arena.memory_of(id))?;
        phases::lap(Phase::Resolve);
        // SAFETY: `buf` holds `len` initialized bytes and stays borrowed
        // for the call.
        let res = unsafe { t.copy(buf.as_ptr(), lo, len) };
        phases::lap(Phase::Install);
        Ok(res)
    })
}

/// Install the hugetlb block holding `req.page`: its pages are read from
/// their sources (a block may mix them: a fork parent's pages beside zero
/// pages, an image's data beside its holes) and go in with one UFFDIO_COPY
/// of the block, which the kernel installs whole.
fn install_block(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    req: &Request,
) -> Result<Page, ResolveError> {
    let page = req.page;
    let (lo, hi) = t.units(page, page + 1);
    let src = b.table().get(page);
    if src == b.self_src() {
        return Ok(Page::Present);
    }
    if let Some(on) = t
        .shared
        .filter(|on| (lo..hi).all(|p| b.table().get(p) == on.src))
    {
        return map_block(b, arena, t, on, (page, req.write), lo, hi);
    }
    b.before_install(lo, hi)?;
    let res = copy_block(arena, b.table(), t, lo, hi)?;
    phases::lap(Phase::Install);
    let how = How {
        fault: page,
        by: By::Missing,
        from: src,
    };
    match res {
        Install::Done => {
            b.mark(lo, hi - lo, how);
            if req.blocks_ahead {
                block_ahead(b, arena, t, req, lo, hi);
            }
            Ok(Page::Woken)
        }
        // No page to put there: the kernel says EEXIST (see
        // `hugepages_exhausted`).
        Install::Exists { .. } if crate::memory::hugepages_exhausted() => {
            Err(ResolveError::HugePagesExhausted { first: lo })
        }
        // Present already (the kernel installs hugetlb blocks whole).
        Install::Exists { .. } => {
            b.mark(lo, hi - lo, how);
            Ok(Page::Present)
        }
        Install::Again { .. } => Ok(Page::Again),
        Install::Gone => Ok(Page::Gone),
        Install::Failed(errno) => Err(ResolveError::Install { first: lo, errno }),
    }
}

/// The frames of a compressed `source` whose pages `[lo, hi)` just went
/// into `base`, dropped from the frame cache once the base holds them
/// whole: the base is the one decoded copy the host keeps.
fn drop_decoded(base: &Base, source: &PageSource, lo: u64, hi: u64) {
    let Some(z) = source.zstd() else {
        return;
    };
    let h = z.header();
    let frames = z.frames_of(lo..hi);
    for f in frames {
        let r = h.frame_range(f);
        if base.holds(r.start, r.end.min(base.memory.pages())) {
            z.drop_decoded(f..f + 1);
        }
    }
}

/// Map the hugetlb block `[lo, hi)`, all of it pages of the client's
/// shared base, from the base (filled first if it lacks it), for a fault
/// on `page`; a `write`'s block is copied, the client's own from now on.
fn map_block(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    on: OnBase<'_>,
    (page, write): (u64, bool),
    lo: u64,
    hi: u64,
) -> Result<Page, ResolveError> {
    let source = arena
        .get(on.src)
        .cloned()
        .ok_or(ResolveError::UnknownSource(on.src))?;
    if let Err(e) = on.base.fill(&source, lo, hi) {
        // Filling a hugetlb base takes a huge page from the pool: a pool
        // used up makes the fill fail (EFAULT in the read), and that, not
        // the read, is what the VM's failure must say.
        if crate::memory::hugepages_exhausted() {
            return Err(ResolveError::HugePagesExhausted { first: lo });
        }
        return Err(e);
    }
    drop_decoded(on.base, &source, lo, hi);
    phases::lap(Phase::Resolve);
    let res = if write {
        t.copy_from_base(on.base, lo, hi - lo)?
    } else {
        t.map_from_base(lo, hi - lo)
    };
    phases::lap(Phase::Install);
    let how = How {
        fault: page,
        by: By::Missing,
        from: on.src,
    };
    match res {
        Install::Done if write => {
            b.mark(lo, hi - lo, how);
            Ok(Page::Woken)
        }
        Install::Done => {
            b.mapped_shared(lo, hi - lo, how);
            Ok(Page::Woken)
        }
        // No page to copy it into (see `hugepages_exhausted`).
        Install::Exists { .. } if write && crate::memory::hugepages_exhausted() => {
            Err(ResolveError::HugePagesExhausted { first: lo })
        }
        Install::Exists { .. } => Ok(Page::Present),
        Install::Again { .. } => Ok(Page::Again),
        Install::Gone => Ok(Page::Gone),
        Install::Failed(errno) => Err(ResolveError::Install { first: lo, errno }),
    }
}

/// Readahead for hugetlb memory: when the block `[lo, hi)` just installed
/// (its faulting thread already woken) follows the block faulted before
/// it, install the blocks after it too, while the vCPU works through this
/// one. The run ahead doubles with each sequential fault, from one block
/// up to [`BLOCKS_AHEAD_MAX`], so a sequential reader soon faults once per
/// five blocks; any other fault starts again from none. Only blocks that
/// start with image data; off with readahead (`readahead_kib` 0). A
/// failure here is left to the fault that will come for that block.
fn block_ahead(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    req: &Request,
    lo: u64,
    hi: u64,
) {
    let ra = b.readahead_mut();
    let sequential = ra.max_pages > 0 && ra.next == lo;
    ra.next = hi;
    // For hugetlb memory the window counts blocks, not pages.
    ra.window = if sequential {
        (ra.window * 2).clamp(1, BLOCKS_AHEAD_MAX)
    } else {
        0
    };
    let block = hi - lo;
    for _ in 0..b.readahead().window {
        let at = b.readahead().next;
        let end = at + block;
        if end > req.bounds.end {
            return;
        }
        let src = b.table().get(at);
        // Image data only, as for 4 KiB pages: reading ahead from a fork
        // parent or of zero pages would only copy memory early.
        if src == b.self_src() || !arena.get(src).is_some_and(|s| s.fault_around()) {
            return;
        }
        // A block of the client's shared base is mapped from it, as its
        // fault would be; one there already (mapped shared, or written)
        // ends the run: it is not the client's own copy to record.
        if let Some(on) = t
            .shared
            .filter(|on| (at..end).all(|p| b.table().get(p) == on.src))
        {
            match map_block(b, arena, t, on, (lo, false), at, end) {
                Ok(Page::Woken) => {
                    b.readahead_mut().next = end;
                    continue;
                }
                _ => return,
            }
        }
        match copy_block(arena, b.table(), t, at, end) {
            Ok(Install::Done) => {}
            // Present already in a memfd of its own: the kernel installs
            // hugetlb blocks whole, so the block is the client's. Over a
            // base it may be mapped shared: not the client's own.
            Ok(Install::Exists { .. })
                if t.shared.is_none() && !crate::memory::hugepages_exhausted() => {}
            _ => return,
        }
        let how = How {
            fault: lo,
            by: By::FaultAround,
            from: src,
        };
        b.mark(at, block, how);
        b.readahead_mut().next = end;
    }
}

/// UFFDIO_COPY the hugetlb block `[lo, hi)` to the client. A block that
/// is all data of one image file goes straight from the file's page cache
/// ([`crate::pages::FileSource::mapped`]): the `pread` into the staging
/// buffer was half the copying of a block. Any other block, or one whose
/// copy from the mapping faults (the file changed under it), is read into
/// the staging buffer, which also names what went wrong.
fn copy_block(
    arena: &SourceArena,
    table: &PageTable,
    t: &Target<'_>,
    lo: u64,
    hi: u64,
) -> Result<Install, ResolveError> {
    if let Some(from) = mapped_block(arena, table, lo, hi)? {
        phases::lap(Phase::Resolve);
        let len = (hi - lo) * PAGE_SIZE;
        // SAFETY: `from` is `len` bytes inside a mapping that the source
        // (held by the arena, which this borrows) keeps alive for the
        // call; only the kernel reads it. Mapping the block's page cache
        // first (best effort) spares the copy its slow path, which starts
        // again after a fault on its source.
        let res = unsafe {
            libc::madvise(
                from.cast_mut().cast(),
                shared::geometry::usize_of(len),
                libc::MADV_POPULATE_READ,
            );
            t.copy(from, lo, len)
        };
        // The copy mapped the block's page cache into this process: unmap
        // it again, so the server's own memory does not grow by every
        // image block it serves (the page cache stays).
        // SAFETY: as above; MADV_DONTNEED on a shared file mapping only
        // drops page-table entries.
        unsafe {
            libc::madvise(
                from.cast_mut().cast(),
                shared::geometry::usize_of(len),
                libc::MADV_DONTNEED,
            );
        }
        if !matches!(res, Install::Failed(Errno::EFAULT)) {
            return Ok(res);
        }
    }
    read_block(arena, table, lo, hi, |bytes| {
        // SAFETY: `bytes` is the whole block, borrowed for the call.
        unsafe { t.copy(bytes.as_ptr(), lo, bytes.len() as u64) }
    })
}

/// Where block `[lo, hi)` lies in its image's mapping, if the whole block
/// is data of one `File` or `Image` source inside the file's length and the
/// file can be mapped.
fn mapped_block(
    arena: &SourceArena,
    table: &PageTable,
    lo: u64,
    hi: u64,
) -> Result<Option<*const u8>, ResolveError> {
    let src = table.get(lo);
    if (lo + 1..hi).any(|p| table.get(p) != src) {
        return Ok(None);
    }
    let Some(f) = arena.get(src).and_then(|s| s.file()) else {
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
    // SAFETY: `off + (hi - lo) * PAGE_SIZE` is within the file's length
    // when opened, which is the mapping's size.
    Ok(Some(unsafe { map.as_ptr().add(off).cast_const() }))
}

/// Read pages `[lo, hi)` as `table` describes them (run by run of one
/// source) into the staging buffer, and call `f` with the bytes.
pub fn read_block<R>(
    arena: &SourceArena,
    table: &PageTable,
    lo: u64,
    hi: u64,
    f: impl FnOnce(&[u8]) -> R,
) -> Result<R, ResolveError> {
    STAGING.with(|buf| {
        let mut buf = buf.borrow_mut();
        let bytes = shared::geometry::usize_of((hi - lo) * PAGE_SIZE);
        if buf.len() < bytes {
            buf.resize(bytes, 0);
        }
        let lookup = |id| arena.memory_of(id);
        let mut p = lo;
        while p < hi {
            let src = table.get(p);
            let mut q = p + 1;
            while q < hi && table.get(q) == src {
                q += 1;
            }
            let source = arena.get(src).ok_or(ResolveError::UnknownSource(src))?;
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
