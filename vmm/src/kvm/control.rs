//! State shared between the control thread and the vCPU threads: the pause
//! flag, each vCPU's parked state, and the agent's command queue.
//!
//! Invariants: `paused[i]` is `Some` only while vCPU `i` is parked at a
//! consistent point (no half-done I/O, state captured); the queue is only
//! consumed by vCPU 0 in its command wait, never while a pause is pending.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use shared::VcpuState;

/// Callback that receives an agent op's raw result.
pub type JobReply = Box<dyn FnOnce(Result<u64, proto::vmm::RequestError>) + Send>;

/// One command for the guest agent.
pub struct Job {
    /// Op code returned from the command IN.
    pub opcode: u32,
    /// Mailbox arguments.
    pub args: [u64; 4],
    /// Called with the result when the agent reports done.
    pub reply: JobReply,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("opcode", &self.opcode)
            .field("args", &self.args)
            .finish()
    }
}

/// The mutable part, under one mutex.
#[derive(Debug)]
pub struct Shared {
    /// A pause is requested (or in effect).
    pub pause: bool,
    /// The vCPUs must exit their threads.
    pub stop: bool,
    /// Per vCPU: its captured state while parked.
    pub paused: Vec<Option<VcpuState>>,
    /// Per vCPU: a state to load before it runs again (a rollback).
    pub load: Vec<Option<VcpuState>>,
    /// Agent commands not yet taken by vCPU 0.
    pub queue: VecDeque<Job>,
}

/// Mutex + condvar around [`Shared`].
#[derive(Debug)]
pub struct Control {
    shared: Mutex<Shared>,
    cond: Condvar,
}

impl Control {
    /// Control block for `vcpus` vCPUs.
    pub fn new(vcpus: usize) -> Self {
        Control {
            shared: Mutex::new(Shared {
                pause: false,
                stop: false,
                paused: vec![None; vcpus],
                load: vec![None; vcpus],
                queue: VecDeque::new(),
            }),
            cond: Condvar::new(),
        }
    }

    /// Lock the shared state. A poisoned lock (a panicked thread) still
    /// holds consistent data: every update is a single assignment.
    pub fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wait for a change.
    pub fn wait<'a>(&self, g: MutexGuard<'a, Shared>) -> MutexGuard<'a, Shared> {
        self.cond.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    /// Wait for a change, at most `d`.
    pub fn wait_timeout<'a>(
        &self,
        g: MutexGuard<'a, Shared>,
        d: Duration,
    ) -> MutexGuard<'a, Shared> {
        match self.cond.wait_timeout(g, d) {
            Ok((g, _)) => g,
            Err(e) => e.into_inner().0,
        }
    }

    /// Wake every waiter.
    pub fn notify(&self) {
        self.cond.notify_all();
    }

    /// Change the shared state and wake every waiter.
    pub fn update(&self, f: impl FnOnce(&mut Shared)) {
        f(&mut self.lock());
        self.notify();
    }
}
