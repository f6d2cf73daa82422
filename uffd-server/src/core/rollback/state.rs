//! What a rollback leaves per VM: the stale pages it unmapped from the VMM
//! but left in the memfd, whether the VMM can discard at all, and the
//! rollback under way (which a restart of the server finishes).

use crate::memory::{GuestMemory, MemoryError};
use crate::snapshot::pageset::PageSet;

/// One VM's rollback state.
#[derive(Debug)]
pub struct RollbackState {
    /// Stale pages: a rollback unmapped them from the VMM and pointed the
    /// table away from them, but their old bytes are still in the memfd.
    /// Each is punched before anything is installed over it, at its first
    /// access (a MINOR fault) or by the scrub that runs after the
    /// rollback, whichever comes first. Empty (bound 0) until a rollback
    /// discards pages.
    pub stale: PageSet,
    /// A discard the server asked the VMM for is under way: the REMOVE
    /// events it raises are the server's own, not the guest's.
    pub discarding: bool,
    /// The VMM cannot discard (no MINOR on this kernel or memory):
    /// rollbacks punch instead.
    pub no_discard: bool,
    /// The snapshot a rollback under way goes back to, from the VM's pause
    /// until its answer. The journal keeps it: a server that takes the VM
    /// back after a crash in between finishes that rollback (its memory
    /// may be the snapshot's already, its vCPUs still the old ones).
    under_way: Option<String>,
}

impl Default for RollbackState {
    fn default() -> Self {
        RollbackState {
            stale: PageSet::new(0),
            discarding: false,
            no_discard: false,
            under_way: None,
        }
    }
}

impl RollbackState {
    /// A rollback to `snapshot` begins changing the VM (it is paused).
    pub fn begin(&mut self, snapshot: &str) {
        self.under_way = Some(snapshot.to_owned());
    }

    /// The rollback under way ended (done, or the VM failed).
    pub fn end(&mut self) {
        self.under_way = None;
    }

    /// The snapshot of a rollback under way.
    pub fn under_way(&self) -> Option<&str> {
        self.under_way.as_deref()
    }

    /// Punch the stale pages of `[lo, hi)` out of `memory`, so that what
    /// is installed there next is whole and current. Nothing to do (and no
    /// scan) while no page is stale.
    pub fn scrub(&mut self, memory: &GuestMemory, lo: u64, hi: u64) -> Result<(), MemoryError> {
        if self.stale.is_empty() || !self.stale.any_in(lo, hi) {
            return Ok(());
        }
        let mut p = lo;
        while let Some(first) = self.stale.next_from(p).filter(|&f| f < hi) {
            let mut end = first + 1;
            while end < hi && self.stale.contains(end) {
                end += 1;
            }
            memory.punch_hole(first, end - first)?;
            for x in first..end {
                self.stale.remove(x);
            }
            p = end;
        }
        Ok(())
    }

    /// Scrub the first stale pages, at most `max`; returns how many are
    /// left (the scrub after a rollback calls this until none are).
    pub fn scrub_some(&mut self, memory: &GuestMemory, max: u64) -> Result<u64, MemoryError> {
        if let Some(first) = self.stale.next_from(0) {
            self.scrub(memory, first, first.saturating_add(max))?;
        }
        Ok(self.stale.len())
    }
}
