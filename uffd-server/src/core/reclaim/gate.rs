//! The fault gate: how many more pages the fault path may install before
//! the reclaim loop has looked at memory again.
//!
//! The loop reads usage every tick (5 ms near the watermark); the fault
//! path can install far faster than that (a readahead window, fault-around
//! runs, many VMs at once), and what it installs between two readings is
//! what the kernel's OOM killer would see first. So each reading turns the
//! room left under the watermark into a page budget, and a missing fault
//! that finds the budget spent waits ([`FaultGate::hold`]) until the loop,
//! woken at once, has read usage again and given pages back: faults
//! proceed at the pace reclaim frees memory, the way the kernel's direct
//! reclaim throttles an allocating task.
//!
//! The fault path's cost is one compare. A gate whose server has no limit
//! (or reclaim off) never closes; one that reclaim cannot get under the
//! watermark is opened wide (the kernel decides, and new VMs are refused).
//! Write-protect faults are never held (they allocate nothing, or a
//! pre-write copy a dependent needs), nor is a fault retried after it
//! waited.

use std::rc::Rc;

use tokio::sync::{oneshot, Notify};

/// The page budget of the fault path.
#[derive(Debug)]
pub struct FaultGate {
    /// Faults may install pages while the server's count of installed
    /// pages is below this.
    until: u64,
    waiters: Vec<oneshot::Sender<()>>,
    kick: Rc<Notify>,
}

impl Default for FaultGate {
    fn default() -> Self {
        FaultGate {
            until: u64::MAX,
            waiters: Vec::new(),
            kick: Rc::new(Notify::new()),
        }
    }
}

impl FaultGate {
    /// A fault would install pages now, `installed` being the server's
    /// count so far: None if it may, else what it waits for.
    #[inline]
    pub fn hold(&mut self, installed: u64) -> Option<oneshot::Receiver<()>> {
        if installed < self.until {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        self.waiters.push(tx);
        self.kick.notify_one();
        Some(rx)
    }

    /// Let faults install `pages` more pages from `installed` on, and
    /// wake those that wait.
    pub fn open_for(&mut self, installed: u64, pages: u64) {
        self.until = installed.saturating_add(pages);
        self.release();
    }

    /// Never hold a fault (no limit, or nothing left to give back).
    pub fn open_wide(&mut self) {
        self.open_for(0, u64::MAX);
    }

    /// Wake the faults that wait (they are retried, and installed), the
    /// budget as it is: before a VM is paused, none of its threads may be
    /// one of them.
    pub fn release(&mut self) {
        for w in self.waiters.drain(..) {
            let _ = w.send(());
        }
    }

    /// Faults wait now.
    pub fn holding(&self) -> usize {
        self.waiters.len()
    }

    /// What wakes the reclaim loop when a fault finds the budget spent.
    pub fn kick(&self) -> Rc<Notify> {
        Rc::clone(&self.kick)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spent_budget_holds_faults_until_it_opens_again() {
        let mut g = FaultGate::default();
        assert!(g.hold(u64::MAX - 1).is_none(), "a new gate is open");
        g.open_for(100, 10);
        assert!(g.hold(109).is_none());
        let mut rx = g.hold(110).expect("spent at 110");
        assert_eq!(g.holding(), 1);
        assert!(rx.try_recv().is_err(), "not woken yet");
        g.open_for(110, 5);
        assert_eq!(g.holding(), 0);
        assert!(rx.try_recv().is_ok(), "woken when it opened");
        let mut rx = g.hold(200).expect("spent");
        g.release();
        assert!(rx.try_recv().is_ok(), "released");
        assert!(g.hold(200).is_some(), "release keeps the budget");
        g.open_wide();
        assert!(g.hold(u64::MAX - 1).is_none());
    }
}
