//! What an install works on: the client's memory and uffd ([`Target`]),
//! its books ([`Books`]), the fault asked for ([`Request`]) and what came
//! of it ([`Served`]), and the staging buffer pages are read into.

use std::cell::RefCell;
use std::ops::Range;

use shared::{VmId, PAGE_SIZE};
use tokio::sync::oneshot;
use uffd_abi::{Errno, Install};
use userfaultfd::Uffd;

use crate::bases::Base;
use crate::core::ratelimit::RateLimit;
use crate::observe::access::By;
use crate::observe::phases::{self, Phase};
use crate::observe::stats::FaultStats;
use crate::pages::{PageTable, Readahead, ResolveError, SourceId};

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
pub(super) enum Page {
    /// Installed by a copy that woke its thread.
    Woken,
    /// In the client's memory already: its thread needs a wake.
    Present,
    /// A pending event stopped the copy before it.
    Again,
    /// The process is gone.
    Gone,
}

thread_local! {
    /// Where a fault's pages are read before UFFDIO_COPY; grows to the
    /// largest run installed (a readahead piece, a hugetlb block).
    pub(super) static STAGING: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}
