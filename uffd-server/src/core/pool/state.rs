//! The warm VMM pool's state: the pooled VMMs waiting for a VM, and the
//! one set aside for a VM that took its memfd (see `mod.rs`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use shared::VmId;

use crate::conn::{Binding, VmmWriter};
use crate::memory::GuestMemory;

/// Pool ids start here; VM ids stay far below.
pub const POOL_BASE: u32 = 0x8000_0000;

/// Pooled VMMs that may exit unused in a row before the pool stops
/// refilling.
pub const MAX_FAILURES: u32 = 3;

/// Whether `id` is a pool id rather than a VM's.
pub fn is_pool_id(id: VmId) -> bool {
    id.0 >= POOL_BASE
}

/// One pooled VMM.
#[derive(Debug)]
pub struct Pooled {
    /// Its pool id.
    pub id: VmId,
    pub pid: u32,
    pub binding: Binding,
    /// Set once its hello was handled: only then can it be taken.
    pub writer: Option<Arc<VmmWriter>>,
    /// The guest RAM made for it, which it has mapped; a VM of its size
    /// takes it (with the VMM).
    pub memory: Option<GuestMemory>,
}

/// A pooled VMM set aside for the VM that took its memfd as guest RAM: the
/// VM's launch takes it (`launch_from_pool`). A VM that goes before
/// its launch drops it, which stops the VMM: it maps memory that is no
/// longer anyone's to use.
#[derive(Debug)]
pub struct SetAside(pub(super) Option<Pooled>);

impl Drop for SetAside {
    fn drop(&mut self) {
        if let Some(w) = self.0.take().and_then(|p| p.writer) {
            w.shutdown();
        }
    }
}

/// The pool's state.
#[derive(Debug, Default)]
pub struct VmmPool {
    /// VMMs to keep ready.
    pub target: usize,
    pub(super) idle: VecDeque<Pooled>,
    pub(super) next: u32,
    /// Pooled VMMs that exited unused, in a row.
    pub(super) failures: u32,
    /// Refilling gave up after `MAX_FAILURES`; the next VM launch that
    /// finds the pool empty tries again.
    pub(super) stopped: bool,
    pub(super) refilling: bool,
    /// Launches served from the pool, and those that found it empty.
    pub taken: u64,
    pub missed: u64,
    /// API requests in flight, and when the last one began or ended.
    pub(super) inflight: usize,
    pub(super) last_activity: Option<Instant>,
}

impl VmmPool {
    /// A pool that keeps `target` VMMs ready.
    pub fn new(target: usize) -> Self {
        VmmPool {
            target,
            ..VmmPool::default()
        }
    }

    /// VMMs in the pool (ready or still starting).
    pub fn held(&self) -> usize {
        self.idle.len()
    }

    /// The pids of the VMMs it holds.
    pub fn pids(&self) -> Vec<u32> {
        self.idle.iter().map(|p| p.pid).collect()
    }

    /// VMMs ready to be taken.
    pub fn ready(&self) -> usize {
        self.idle.iter().filter(|p| p.writer.is_some()).count()
    }

    /// Its figures for `/metrics`.
    pub fn sample(&self) -> crate::observe::metrics::PoolSample {
        let ready = self.ready() as u64;
        crate::observe::metrics::PoolSample {
            target: self.target as u64,
            ready,
            starting: self.held() as u64 - ready,
            taken: self.taken,
            missed: self.missed,
        }
    }

    /// Take a ready VMM, if any.
    pub(super) fn take(&mut self) -> Option<Pooled> {
        let at = self.idle.iter().position(|p| p.writer.is_some());
        match at.and_then(|i| self.idle.remove(i)) {
            Some(p) => {
                self.taken += 1;
                Some(p)
            }
            None => {
                if self.target > 0 {
                    self.missed += 1;
                }
                None
            }
        }
    }

    /// Take a ready VMM whose memory is `size` bytes, and its memory. The
    /// memory must still be empty: nothing but the VM may have written it.
    pub(super) fn take_with_memory(&mut self, size: u64) -> Option<(GuestMemory, Pooled)> {
        let at = self.idle.iter().position(|p| {
            p.writer.is_some()
                && p.memory.as_ref().is_some_and(|m| {
                    m.size() == size && m.present_ranges().is_some_and(|r| r.is_empty())
                })
        })?;
        let mut p = self.idle.remove(at)?;
        self.taken += 1;
        Some((p.memory.take()?, p))
    }

    /// The pooled VMM `id` said hello: it is ready.
    pub(super) fn hello(&mut self, id: VmId, writer: Arc<VmmWriter>, pid: u32) -> bool {
        match self.idle.iter_mut().find(|p| p.id == id && p.pid == pid) {
            Some(p) => {
                p.writer = Some(writer);
                self.failures = 0;
                true
            }
            None => false,
        }
    }

    /// The pooled VMM `id` is gone before it was used.
    pub(super) fn gone(&mut self, id: VmId) -> Option<Pooled> {
        let at = self.idle.iter().position(|p| p.id == id)?;
        self.failures += 1;
        self.idle.remove(at)
    }
}
