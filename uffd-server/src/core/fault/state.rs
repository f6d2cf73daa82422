//! What serving one of our VMs' faults keeps per VM: the VMM's uffd and
//! where guest RAM is in its address space, how much to install around a
//! fault, and the fault path's own bookkeeping.

use std::rc::Rc;

use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;
use userfaultfd::Uffd;

use crate::core::ratelimit::RateLimit;
use crate::pages::{Readahead, SourceId};

/// One VM's fault-serving state.
#[derive(Debug)]
pub struct FaultState {
    /// The VMM's uffd, once it sent it (`None` again once the VMM is gone).
    pub uffd: Option<Rc<AsyncFd<Uffd>>>,
    /// The VMM's host virtual address of guest RAM.
    pub vmm_base: u64,
    /// Pages installed around a file-backed fault, at most.
    pub fault_around_pages: u64,
    pub readahead: Readahead,
    /// Limits the fault path's repeated warnings about this VM.
    pub warnings: RateLimit,
    /// VMs (their sources) this VM lost a pre-write copy from: every page
    /// it read from them is poisoned, and their writes skip it.
    pub lost_from: Vec<SourceId>,
    /// Fired when the VMM's uffd arrives (dropped with the VM): faults
    /// that must not write into this VM's memory before then wait on it.
    pub on_uffd: Vec<oneshot::Sender<()>>,
    /// Notified when the VMM is gone: the fault-serving task stops and
    /// drops its handle on the uffd.
    pub closed: Rc<tokio::sync::Notify>,
}

impl FaultState {
    /// No uffd yet; `fault_around_pages` and readahead windows up to
    /// `readahead_pages`.
    pub fn new(fault_around_pages: u64, readahead_pages: u64) -> Self {
        FaultState {
            uffd: None,
            vmm_base: 0,
            fault_around_pages,
            readahead: Readahead::new(readahead_pages),
            warnings: RateLimit::default(),
            lost_from: Vec::new(),
            on_uffd: Vec::new(),
            closed: Rc::new(tokio::sync::Notify::new()),
        }
    }
}
