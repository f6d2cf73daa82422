//! One VM as the core sees it.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use proto::vmm::Reply;
use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;
use userfaultfd::Uffd;

use crate::conn::VmmWriter;
use crate::memory::GuestMemory;
use crate::pages::{PageTable, SourceId};

pub use proto::api::RunState;

/// Sequential-fault detection for image-backed pages.
pub use crate::pages::Readahead;

/// A pending answer from the VMM.
pub type ReplySender = oneshot::Sender<super::Result<Reply>>;

/// Fulfilled when the VMM reports `Running`, or fails first.
pub type ReadySender = oneshot::Sender<super::Result<()>>;

/// One VM.
#[derive(Debug)]
pub struct Vm {
    pub id: VmId,
    pub state: RunState,
    pub memory: Rc<GuestMemory>,
    pub table: PageTable,
    /// Arena id of `Vm(self)`.
    pub self_src: SourceId,
    pub vcpus: u8,
    pub pid: Option<u32>,
    pub writer: Option<Arc<VmmWriter>>,
    /// The pooled VMM whose memfd is this VM's guest RAM, until the VM's
    /// launch takes it (see `pool::SetAside`).
    pub pooled: Option<super::pool::SetAside>,
    pub uffd: Option<Rc<AsyncFd<Uffd>>>,
    /// VMM's host virtual address of guest RAM.
    pub vmm_base: u64,
    pub pending: HashMap<u64, ReplySender>,
    pub next_seq: u64,
    /// Fulfilled when the VMM reports `Running` (or fails first).
    pub ready: Option<ReadySender>,
    pub exit_reason: Option<String>,
    /// Why the VM failed (state `Failed`).
    pub failure: Option<String>,
    /// VMs (their sources) this VM lost a pre-write copy from: every page
    /// it read from them is poisoned, and their writes skip it.
    pub lost_from: Vec<SourceId>,
    /// Pages installed around a file-backed fault, at most.
    pub fault_around_pages: u64,
    pub readahead: Readahead,
    pub stats: crate::observe::stats::FaultStats,
    pub parent: Option<VmId>,
    pub volume: Option<String>,
    /// vCPU state a fork child starts from.
    pub start_state: Option<Rc<shared::VmState>>,
    /// Deleted by the user but kept as a frozen source while other tables
    /// still read pages from it.
    pub deleted: bool,
    /// Every page this VM holds is write-protected and it has neither run
    /// nor changed since: set by a fork of the paused VM, cleared by a
    /// resume and by any other operation on it. A further fork skips the
    /// write-protect pass (a template forked again and again).
    pub protected_paused: bool,
    /// The state a fork of this paused VM captured, reused by later forks
    /// until it runs or changes (cleared with `protected_paused`).
    pub paused_state: Option<Rc<shared::VmState>>,
    /// An operation that pauses, captures and resumes the VM itself (a
    /// fork, a snapshot, a rollback) is under way: pause, resume and
    /// another such operation wait their turn.
    pub busy: Option<&'static str>,
    /// Pages written since the VM's last snapshot, while tracked.
    pub dirty: Option<super::snapshot::DirtyLog>,
    /// A snapshot still saving pages after the guest resumed: a write to
    /// one of them first hands its pre-image to it.
    pub saving: Option<Rc<std::cell::RefCell<super::snapshot::Saving>>>,
    /// Pages that lost their write protection since a fork or snapshot
    /// armed it ahead of its pause (see `arm.rs`); the pause re-protects
    /// them.
    pub arming: Option<crate::snapshot::PageSet>,
    /// Stale pages: a rollback unmapped them from the VMM and pointed the
    /// table away from them, but their old bytes are still in the memfd
    /// (see `rollback.rs`). Each is punched before anything is installed
    /// over it, at its first access (a MINOR fault) or by the scrub that
    /// runs after the rollback, whichever comes first. Empty (bound 0)
    /// until a rollback discards pages.
    pub stale: crate::snapshot::PageSet,
    /// A discard the server asked the VMM for is under way: the REMOVE
    /// events it raises are the server's own, not the guest's.
    pub discarding: bool,
    /// The VMM cannot discard (no MINOR on this kernel or memory):
    /// rollbacks punch instead.
    pub no_discard: bool,
    /// The snapshot the VM started from (restore or rollback), and the
    /// arena id of its image.
    pub base: Option<(String, SourceId)>,
    /// Its volume was made for it (from a snapshot) and goes with it.
    pub owns_volume: bool,
    /// Notified when the VMM is gone: the fault-serving task stops and
    /// drops its handle on the uffd.
    pub closed: Rc<tokio::sync::Notify>,
    /// Limits the fault path's repeated warnings about this VM.
    pub warnings: super::ratelimit::RateLimit,
    /// How each page got here and what the VM touched (explain, access).
    pub log: crate::observe::access::PageLog,
    /// The live fault trace's listeners.
    pub tap: Rc<crate::observe::trace::Tap>,
    /// Fired when the VMM's uffd arrives (dropped with the VM): faults
    /// that must not write into this VM's memory before then wait on it.
    pub on_uffd: Vec<oneshot::Sender<()>>,
    /// Where the fault path's time goes, phase by phase.
    pub phases: crate::observe::phases::PhaseHists,
}

/// What a new VM is made of; everything else starts empty.
#[derive(Debug)]
pub struct VmParts {
    pub id: VmId,
    /// Its memory, which the arena holds too (`SourceArena::vm_with_memory`).
    pub memory: Rc<GuestMemory>,
    pub table: PageTable,
    pub self_src: SourceId,
    pub vcpus: u8,
    pub fault_around_pages: u64,
    pub readahead_pages: u64,
    pub ready: ReadySender,
}

impl Vm {
    /// Punch the stale pages of `[lo, hi)` out of the memfd (see
    /// [`Vm::stale`]), so that what is installed there next is whole and
    /// current. Nothing to do (and no scan) while no page is stale.
    pub fn scrub(&mut self, lo: u64, hi: u64) -> Result<(), crate::memory::MemoryError> {
        if self.stale.is_empty() || !self.stale.any_in(lo, hi) {
            return Ok(());
        }
        let mut p = lo;
        while let Some(first) = self.stale.next_from(p).filter(|&f| f < hi) {
            let mut end = first + 1;
            while end < hi && self.stale.contains(end) {
                end += 1;
            }
            self.memory.punch_hole(first, end - first)?;
            for x in first..end {
                self.stale.remove(x);
            }
            p = end;
        }
        Ok(())
    }

    /// Scrub the first stale pages, at most `max`; returns how many are
    /// left (the scrub after a rollback calls this until none are).
    pub fn scrub_some(&mut self, max: u64) -> Result<u64, crate::memory::MemoryError> {
        if let Some(first) = self.stale.next_from(0) {
            self.scrub(first, first.saturating_add(max))?;
        }
        Ok(self.stale.len())
    }

    /// The VMM is connected but its uffd has not arrived: its guest may
    /// already run (the VMM starts it right after sending the uffd), so
    /// nothing may be written into its memory through the server's
    /// mapping, and nothing can go in through the uffd yet.
    pub fn uffd_pending(&self) -> bool {
        self.writer.is_some() && self.uffd.is_none()
    }

    /// A VM in `Starting` state, waiting for its VMM.
    pub fn new(p: VmParts) -> Self {
        let log = crate::observe::access::PageLog::new(p.memory.pages());
        Vm {
            id: p.id,
            state: RunState::Starting,
            memory: p.memory,
            table: p.table,
            self_src: p.self_src,
            vcpus: p.vcpus,
            pid: None,
            writer: None,
            pooled: None,
            uffd: None,
            vmm_base: 0,
            pending: HashMap::new(),
            next_seq: 0,
            ready: Some(p.ready),
            exit_reason: None,
            failure: None,
            lost_from: Vec::new(),
            fault_around_pages: p.fault_around_pages,
            readahead: Readahead {
                next: u64::MAX,
                window: 0,
                max_pages: p.readahead_pages,
            },
            stats: crate::observe::stats::FaultStats::default(),
            parent: None,
            volume: None,
            start_state: None,
            deleted: false,
            protected_paused: false,
            paused_state: None,
            busy: None,
            dirty: None,
            saving: None,
            arming: None,
            stale: crate::snapshot::PageSet::new(0),
            discarding: false,
            no_discard: false,
            base: None,
            owns_volume: false,
            closed: Rc::new(tokio::sync::Notify::new()),
            warnings: super::ratelimit::RateLimit::default(),
            log,
            tap: Rc::default(),
            on_uffd: Vec::new(),
            phases: crate::observe::phases::PhaseHists::default(),
        }
    }

    /// Guest RAM size in MiB.
    pub fn memory_mib(&self) -> u64 {
        self.memory.size() >> 20
    }

    /// Guest page that VMM address `addr` falls in, if inside guest RAM.
    pub fn page_of(&self, addr: u64) -> Option<u64> {
        let off = addr.checked_sub(self.vmm_base)?;
        (off < self.memory.size()).then_some(off / PAGE_SIZE)
    }

    /// VMM address of `page`.
    pub fn addr_of(&self, page: u64) -> *mut libc::c_void {
        (self.vmm_base + page * PAGE_SIZE) as *mut libc::c_void
    }

    /// Write-protect (`protect`) or unprotect the page runs `(first, n)`
    /// of this VM's memory in its VMM through `uffd`, from several threads
    /// when there is much to do ([`uffd_abi::write_protect_runs`]). On
    /// failure, the index in `runs` of a run that failed and the error.
    pub fn write_protect_pages(
        &self,
        uffd: &Uffd,
        runs: &[(u64, u64)],
        protect: bool,
    ) -> Result<(), (usize, uffd_abi::Errno)> {
        let bytes: Vec<(u64, u64)> = runs
            .iter()
            .map(|&(first, n)| (self.vmm_base + first * PAGE_SIZE, n * PAGE_SIZE))
            .collect();
        uffd_abi::write_protect_runs(uffd, &bytes, self.memory.page_size().bytes(), protect)
    }

    /// Fail every request still waiting for the VMM: it exited for
    /// `reason`.
    pub fn fail_pending(&mut self, reason: &str) {
        let vm = self.id;
        let exited = || super::Error::VmmExited {
            vm,
            reason: reason.to_owned(),
        };
        for (_, tx) in self.pending.drain() {
            let _ = tx.send(Err(exited()));
        }
        if let Some(tx) = self.ready.take() {
            let _ = tx.send(Err(exited()));
        }
    }
}
