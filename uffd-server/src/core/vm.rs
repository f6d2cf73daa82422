//! One VM as the core sees it.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use proto::vmm::Reply;
use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;
use userfaultfd::Uffd;

use crate::memory::GuestMemory;
use crate::pages::{PageTable, SourceId};
use crate::vmm_conn::VmmWriter;

/// Life-cycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    /// Launched; waiting for the VMM to connect and start its guest.
    Starting,
    Running,
    Paused,
    /// The VMM is gone; memory may still serve dependents.
    Exited,
}

impl RunState {
    /// Name as the API shows it.
    pub fn name(self) -> &'static str {
        match self {
            RunState::Starting => "starting",
            RunState::Running => "running",
            RunState::Paused => "paused",
            RunState::Exited => "exited",
        }
    }
}

/// Counters of the fault engine for one VM.
#[derive(Debug, Clone, Copy, Default)]
pub struct FaultStats {
    /// MISSING faults resolved.
    pub missing: u64,
    /// WP faults resolved.
    pub write_protect: u64,
    /// Pages installed into the memfd by the server.
    pub pages_installed: u64,
    /// REMOVE events handled.
    pub removes: u64,
    /// Installs deferred by EAGAIN (a pending non-cooperative event).
    pub deferred: u64,
}

/// Sequential-fault detection for image-backed pages.
pub use crate::pages::Readahead;

/// A pending answer from the VMM.
pub type ReplySender = oneshot::Sender<Result<Reply, String>>;

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
    pub uffd: Option<Rc<AsyncFd<Uffd>>>,
    /// VMM's host virtual address of guest RAM.
    pub vmm_base: u64,
    pub pending: HashMap<u64, ReplySender>,
    pub next_seq: u64,
    /// Fulfilled when the VMM reports `Running` (or fails first).
    pub ready: Option<oneshot::Sender<Result<(), String>>>,
    pub exit_reason: Option<String>,
    /// Pages installed around a file-backed fault, at most.
    pub fault_around_pages: u64,
    pub readahead: Readahead,
    pub stats: FaultStats,
    pub parent: Option<VmId>,
    pub volume: Option<String>,
    /// vCPU state a fork child starts from.
    pub start_state: Option<Rc<shared::VmState>>,
    /// Deleted by the user but kept as a frozen source while other tables
    /// still read pages from it.
    pub deleted: bool,
}

/// What a new VM is made of; everything else starts empty.
#[derive(Debug)]
pub struct VmParts {
    pub id: VmId,
    pub memory: GuestMemory,
    pub table: PageTable,
    pub self_src: SourceId,
    pub vcpus: u8,
    pub fault_around_pages: u64,
    pub readahead_pages: u64,
    pub ready: oneshot::Sender<Result<(), String>>,
}

impl Vm {
    /// A VM in `Starting` state, waiting for its VMM.
    pub fn new(p: VmParts) -> Self {
        Vm {
            id: p.id,
            state: RunState::Starting,
            memory: Rc::new(p.memory),
            table: p.table,
            self_src: p.self_src,
            vcpus: p.vcpus,
            pid: None,
            writer: None,
            uffd: None,
            vmm_base: 0,
            pending: HashMap::new(),
            next_seq: 0,
            ready: Some(p.ready),
            exit_reason: None,
            fault_around_pages: p.fault_around_pages,
            readahead: Readahead {
                next: u64::MAX,
                window: 0,
                max_pages: p.readahead_pages,
            },
            stats: FaultStats::default(),
            parent: None,
            volume: None,
            start_state: None,
            deleted: false,
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

    /// Fail every request still waiting for the VMM.
    pub fn fail_pending(&mut self, why: &str) {
        for (_, tx) in self.pending.drain() {
            let _ = tx.send(Err(why.to_owned()));
        }
        if let Some(tx) = self.ready.take() {
            let _ = tx.send(Err(why.to_owned()));
        }
    }
}
