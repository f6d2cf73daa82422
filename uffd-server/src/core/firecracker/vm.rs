//! One Firecracker VM being served: its regions, table and uffd, and what
//! an install into its memory records. Faults go through the installer our
//! own VMs use ([`crate::core::fault::install`]): UFFDIO_COPY from the
//! staging buffer (or the image's page cache for a hugetlb block), and
//! UFFDIO_ZEROPAGE for never-written pages, since Firecracker's memory is
//! anonymous. A pending event (EAGAIN) defers the fault until the events
//! are read (`serve.rs`).

use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::rc::Rc;

use proto::firecracker::Region;
use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tracing::warn;
use userfaultfd::Uffd;

use crate::core::fault::install::{self, Books, How, Request, Served, Target};
use crate::core::ratelimit::{suppressed_note, RateLimit};
use crate::core::vm::RunState;
use crate::observe::phases::PhaseHists;
use crate::observe::stats::FaultStats;
use crate::pages::{PageTable, Readahead, ResolveError, SourceArena, SourceId, UNINITIALIZED};

/// Largest piece of a run one UFFDIO_COPY installs into Firecracker's
/// memory (2 MiB): a readahead window goes in in pieces of at most this.
const PIECE_MAX_PAGES: u64 = 512;

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

/// What an install into a Firecracker VM records: its table, counters and
/// working set.
struct FcBooks<'a> {
    v: &'a mut FcVm,
    /// Record installed pages in the working set.
    record: bool,
}

impl Books for FcBooks<'_> {
    fn id(&self) -> VmId {
        self.v.id
    }
    fn table(&self) -> &PageTable {
        &self.v.table
    }
    fn self_src(&self) -> SourceId {
        self.v.self_src
    }
    fn readahead(&self) -> &Readahead {
        &self.v.readahead
    }
    fn readahead_mut(&mut self) -> &mut Readahead {
        &mut self.v.readahead
    }
    fn stats(&mut self) -> &mut FaultStats {
        &mut self.v.stats
    }
    fn warnings(&mut self) -> &mut RateLimit {
        &mut self.v.warnings
    }
    fn mark(&mut self, lo: u64, n: u64, _how: How) {
        let me = self.v.self_src;
        self.v.table.set_range(lo, n, me);
        self.v.stats.pages_installed += n;
        if self.record {
            // The working set is every page this VM was given, in order,
            // including those installed around the fault.
            self.v.fault_order.extend(lo..lo + n);
        }
    }
    fn before_install(&mut self, _lo: u64, _hi: u64) -> Result<(), ResolveError> {
        Ok(())
    }
    fn fail(&mut self, reason: &str) -> bool {
        if self.v.failure.is_some() {
            return false;
        }
        self.v.failure = Some(reason.to_owned());
        self.v.state = RunState::Failed;
        true
    }
}

impl FcVm {
    fn region_of(&self, addr: u64) -> Option<Region> {
        self.regions
            .iter()
            .copied()
            .find(|r| addr >= r.base && addr < r.base + r.size)
    }

    /// Wake the threads faulting on the page at `addr` (a fault that is
    /// not a MISSING one: nothing to install).
    pub(super) fn wake(&self, addr: u64) {
        let (t, page) = match self.region_of(addr) {
            Some(r) => (
                region_target(self.uffd.get_ref(), r),
                (r.offset + (addr - r.base)) / PAGE_SIZE,
            ),
            None => (
                Target {
                    uffd: self.uffd.get_ref(),
                    base: 0,
                    unit: 1,
                    mode: 0,
                    shared: None,
                },
                addr / PAGE_SIZE,
            ),
        };
        let _ = t.wake(page, 1);
    }

    /// Resolve a MISSING fault at `addr` (see [`install::serve_missing`]):
    /// fault-around and readahead on the image's pages of 4 KiB regions,
    /// zero pages for the rest; a fault that cannot be served fails the VM
    /// and poisons the page. `record`: the fault feeds readahead and the
    /// working set (a bulk prefetch does not).
    pub(super) fn resolve(&mut self, arena: &SourceArena, addr: u64, record: bool) -> Resolved {
        let Some(r) = self.region_of(addr) else {
            if let Some(n) = self.warnings.allow() {
                warn!(
                    "{}: fault at {addr:#x} outside every region{}",
                    self.id,
                    suppressed_note(n)
                );
            }
            return Resolved::Ok;
        };
        let uffd = Rc::clone(&self.uffd);
        let t = region_target(uffd.get_ref(), r);
        let piece = match self.readahead_piece_pages {
            0 => PIECE_MAX_PAGES,
            n if r.page_size == PAGE_SIZE => n.max(self.fault_around_pages).min(PIECE_MAX_PAGES),
            _ => PIECE_MAX_PAGES,
        };
        let r_lo = r.offset / PAGE_SIZE;
        let req = Request {
            page: (r.offset + (addr - r.base)) / PAGE_SIZE,
            bounds: r_lo..r_lo + r.size / PAGE_SIZE,
            fault_around: self.fault_around_pages,
            track: record,
            piece,
            zero_pages: r.page_size == PAGE_SIZE,
            blocks_ahead: false,
            write: false,
        };
        let mut books = FcBooks { v: self, record };
        match install::serve_missing(&mut books, arena, &t, &req) {
            Served::Done | Served::Failed(_) => Resolved::Ok,
            Served::Again => Resolved::Again,
            Served::Wait(ready) => Resolved::Wait(ready),
            Served::Gone => Resolved::Gone,
        }
    }

    /// REMOVE (balloon, `MADV_DONTNEED`): the range reads as zero again.
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

/// The installer's view of region `r` through `uffd`: its pages are
/// indexed by their offset in the memory file, as the table is.
fn region_target(uffd: &Uffd, r: Region) -> Target<'_> {
    Target {
        uffd,
        base: r.base.wrapping_sub(r.offset),
        unit: (r.page_size / PAGE_SIZE).max(1),
        mode: 0,
        shared: None,
    }
}

/// Firecracker VMs by id.
pub type FcVms = BTreeMap<VmId, FcVm>;
