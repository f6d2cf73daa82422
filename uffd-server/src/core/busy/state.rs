//! A VM's busy state: the operation under way that pauses and resumes
//! it itself, and who waits for a reclaim pass over it.

/// Which operation a VM runs that pauses and resumes it itself, and how
/// many operations wait for a reclaim pass over it to end. Changed only
/// in `core::busy` (`begin` and its guard, the waiting count) and by the two that
/// hold a VM busy across a restart ([`Busy::hold`], [`Busy::release`]).
#[derive(Debug, Default)]
pub struct Busy {
    pub(super) running: Option<&'static str>,
    pub(super) waiters: u32,
}

impl Busy {
    /// The operation under way, if one is.
    pub fn running(&self) -> Option<&'static str> {
        self.running
    }

    /// An operation is under way.
    pub fn is_busy(&self) -> bool {
        self.running.is_some()
    }

    /// Hold the VM busy with `what` until [`Busy::release`], without a
    /// guard: a rollback a restart cut short, held from adoption until
    /// it is finished.
    pub fn hold(&mut self, what: &'static str) {
        self.running = Some(what);
    }

    /// End what [`Busy::hold`] began.
    pub fn release(&mut self) {
        self.running = None;
    }
}
