//! What the server records of one of its VMs: how every page got there
//! and what the VM touched ([`PageLog`]), the live fault trace's listeners
//! ([`Tap`]), where the fault path's time goes ([`PhaseHists`]) and the
//! fault counters ([`FaultStats`]).

use std::rc::Rc;

use super::access::PageLog;
use super::phases::PhaseHists;
use super::stats::FaultStats;
use super::trace::Tap;

/// One VM's record.
#[derive(Debug)]
pub struct VmLog {
    /// How each page got here and what the VM touched (explain, access).
    pub pages: PageLog,
    /// The live fault trace's listeners.
    pub tap: Rc<Tap>,
    /// Where the fault path's time goes, phase by phase.
    pub phases: PhaseHists,
    pub stats: FaultStats,
}

impl VmLog {
    /// The record of a new VM of `pages` pages.
    pub fn new(pages: u64) -> Self {
        VmLog {
            pages: PageLog::new(pages),
            tap: Rc::default(),
            phases: PhaseHists::default(),
            stats: FaultStats::default(),
        }
    }

    /// Start the access record again (`POST /v1/vms/{id}/access/reset`).
    pub fn reset_access(&mut self) {
        self.pages.reset_access();
    }
}
