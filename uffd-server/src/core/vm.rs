//! One VM as the core sees it: what the VM is (its memory, page-source
//! table, vCPUs, disk, state) and one field per feature, each a type its
//! feature's module owns with the functions that change it.
//!
//! | field | feature | type |
//! |---|---|---|
//! | `link` | the VMM process and its connection | `link::state::VmmLink` |
//! | `faults` | serving its uffd | `fault::state::FaultState` |
//! | `fork` | live fork, paused templates | `fork::state::ForkState` |
//! | `snapshot` | base snapshot, dirty log, saving, arming | `snapshot::state::SnapshotState` |
//! | `rollback` | stale pages, discard | `rollback::state::RollbackState` |
//! | `pooled` | a warm-pool VMM set aside for it | `pool::state::SetAside` |
//! | `base` | the shared base its guest RAM maps | `base::state::BaseState` |
//! | `log` | page log, fault trace, phases, counters | `observe::vm::VmLog` |
//! | `adopted` | taken back after a restart of the server | `restart::state::AdoptedVm` |
//! | `reclaim` | memory given back under pressure | `reclaim::state::VmReclaim` |

use std::rc::Rc;

use shared::{VmId, PAGE_SIZE};
use userfaultfd::Uffd;

use super::base::state::BaseState;
use super::busy::state::Busy;
use super::fault::state::FaultState;
use super::fork::state::ForkState;
use super::link::state::{ReadySender, VmmLink};
use super::pool::state::SetAside;
use super::reclaim::state::VmReclaim;
use super::restart::state::AdoptedVm;
use super::rollback::state::RollbackState;
use super::snapshot::state::SnapshotState;
use crate::memory::{GuestMemory, MemoryError};
use crate::observe::vm::VmLog;
use crate::pages::{PageTable, SourceId};

pub use proto::api::RunState;

/// One VM.
#[derive(Debug)]
pub struct Vm {
    pub id: VmId,
    /// Changed only by the transitions below ([`Vm::fail`] and the rest),
    /// which keep `Failed` and `Exited` final.
    state: RunState,
    pub memory: Rc<GuestMemory>,
    pub table: PageTable,
    /// Arena id of `Vm(self)`.
    pub self_src: SourceId,
    pub vcpus: u8,
    /// vCPU state the VM starts from (a fork child, a restore).
    pub start_state: Option<Rc<shared::VmState>>,
    /// Its disk, a volume of the volume engine.
    pub volume: Option<String>,
    /// Its volume was made for it (from a snapshot) and goes with it.
    pub owns_volume: bool,
    /// Why the VM failed (state `Failed`): the first reason.
    failure: Option<String>,
    /// Deleted by the user but kept as a frozen source while other tables
    /// still read pages from it: set once ([`Vm::mark_deleted`]).
    deleted: bool,
    /// Which operation that pauses, captures and resumes the VM itself
    /// (a fork, a snapshot, a rollback) is under way: pause, resume and
    /// another such operation wait their turn (see `core::busy`).
    pub busy: Busy,
    pub link: VmmLink,
    pub faults: FaultState,
    pub fork: ForkState,
    pub snapshot: SnapshotState,
    pub rollback: RollbackState,
    /// The pooled VMM whose memfd is this VM's guest RAM, until the VM's
    /// launch takes it.
    pub pooled: Option<SetAside>,
    pub base: BaseState,
    pub log: VmLog,
    pub adopted: Option<AdoptedVm>,
    pub reclaim: VmReclaim,
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
    /// A VM in `Starting` state, waiting for its VMM.
    pub fn new(p: VmParts) -> Self {
        let log = VmLog::new(p.memory.pages());
        let reclaim = VmReclaim::new(None, p.memory.pages(), None);
        Vm {
            id: p.id,
            state: RunState::Starting,
            memory: p.memory,
            table: p.table,
            self_src: p.self_src,
            vcpus: p.vcpus,
            start_state: None,
            volume: None,
            owns_volume: false,
            failure: None,
            deleted: false,
            busy: Busy::default(),
            link: VmmLink::new(p.ready),
            faults: FaultState::new(p.fault_around_pages, p.readahead_pages),
            fork: ForkState::default(),
            snapshot: SnapshotState::default(),
            rollback: RollbackState::default(),
            pooled: None,
            base: BaseState::default(),
            log,
            adopted: None,
            reclaim,
        }
    }

    /// The state as the API shows it: a deleted VM kept frozen is
    /// `deleted`.
    pub fn api_state(&self) -> RunState {
        if self.deleted {
            RunState::Deleted
        } else {
            self.state
        }
    }

    /// Its run state (a deleted VM kept frozen has the state it had).
    pub fn state(&self) -> RunState {
        self.state
    }

    /// Why it failed, if it did.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// Fail the VM for `reason`: it is `Failed` from now on, whatever it
    /// was. False, and the first reason kept, if it had failed already.
    pub fn fail(&mut self, reason: impl Into<String>) -> bool {
        if self.failure.is_some() || self.state == RunState::Failed {
            return false;
        }
        self.failure = Some(reason.into());
        self.state = RunState::Failed;
        true
    }

    /// Its VMM said its guest runs: a VM starting (or one adopted while
    /// starting) is `Running`. A VM that failed or exited stays so.
    pub fn started(&mut self) {
        if !self.is_over() {
            self.state = RunState::Running;
        }
    }

    /// A pause (`paused`) or resume of its guest took effect: a running
    /// or paused VM is `Paused` or `Running`; any other stays as it is.
    pub fn set_paused(&mut self, paused: bool) {
        if matches!(self.state, RunState::Running | RunState::Paused) {
            self.state = if paused {
                RunState::Paused
            } else {
                RunState::Running
            };
        }
    }

    /// Its VMM is gone: `Exited`, unless it had failed (or exited)
    /// already. True if this is the change.
    pub fn exited(&mut self) -> bool {
        if self.is_over() {
            return false;
        }
        self.state = RunState::Exited;
        true
    }

    /// It has failed or exited: no state change brings it back.
    pub fn is_over(&self) -> bool {
        matches!(self.state, RunState::Exited | RunState::Failed)
    }

    /// A VM adopted after a restart takes back the state, failure and
    /// deletion its journal record kept (`Vm::new` made it `Starting`).
    pub fn adopt_state(&mut self, state: RunState, failure: Option<String>, deleted: bool) {
        self.state = state;
        self.failure = failure;
        self.deleted = deleted;
    }

    /// Deleted by the user but kept, frozen, while other tables still
    /// read pages from it.
    pub fn is_deleted(&self) -> bool {
        self.deleted
    }

    /// The user deleted it; it stays as a frozen source while others read
    /// from it (the registry drops it when none does).
    pub fn mark_deleted(&mut self) {
        self.deleted = true;
    }

    /// Guest RAM size in MiB.
    pub fn memory_mib(&self) -> u64 {
        self.memory.size() >> 20
    }

    /// Guest page that VMM address `addr` falls in, if inside guest RAM.
    pub fn page_of(&self, addr: u64) -> Option<u64> {
        let off = addr.checked_sub(self.faults.vmm_base)?;
        (off < self.memory.size()).then_some(off / PAGE_SIZE)
    }

    /// VMM address of `page`.
    pub fn addr_of(&self, page: u64) -> *mut libc::c_void {
        (self.faults.vmm_base + page * PAGE_SIZE) as *mut libc::c_void
    }

    /// The VMM is connected but its uffd has not arrived: its guest may
    /// already run (the VMM starts it right after sending the uffd), so
    /// nothing may be written into its memory through the server's
    /// mapping, and nothing can go in through the uffd yet.
    pub fn uffd_pending(&self) -> bool {
        self.link.writer.is_some() && self.faults.uffd.is_none()
    }

    /// The UFFDIO_COPY mode for pages installed into this VM now: they
    /// keep write protection while its writes are tracked.
    pub fn copy_mode(&self) -> u64 {
        if self.snapshot.tracks_writes() {
            uffd_abi::COPY_MODE_WP
        } else {
            0
        }
    }

    /// A VM on a base is about to write `page`, which it maps from the
    /// base (or maps as the zero page): the write copies it into its VMM's
    /// memory, so its kernel page (the whole block on hugetlb) is the VM's
    /// own from now on.
    pub fn own_written(&mut self, page: u64) {
        let (lo, hi) = self.memory.unit_range(page, page + 1);
        let me = self.self_src;
        if (lo..hi).any(|p| self.table.get(p) != me) {
            self.table.set_range(lo, hi - lo, me);
        }
    }

    /// Punch the stale pages of `[lo, hi)` a rollback left in the memfd
    /// (see [`RollbackState::scrub`]).
    pub fn scrub(&mut self, lo: u64, hi: u64) -> Result<(), MemoryError> {
        self.rollback.scrub(&self.memory, lo, hi)
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
            .map(|&(first, n)| (self.faults.vmm_base + first * PAGE_SIZE, n * PAGE_SIZE))
            .collect();
        uffd_abi::write_protect_runs(uffd, &bytes, self.memory.page_size().bytes(), protect)
    }

    /// Fail every request still waiting for the VMM: it exited for
    /// `reason`.
    pub fn fail_pending(&mut self, reason: &str) {
        self.link.fail_pending(self.id, reason);
    }
}
