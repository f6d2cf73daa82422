//! The warm VMM pool (`--vmm-pool N`): `vmm` processes started ahead of
//! need, each connected, authenticated and holding its KVM VM and first
//! vCPU (see the VMM's `Prewarmed`), waiting for guest RAM.
//!
//! ```text
//!  refill ──launch──▶ pooled vmm (pool id) ──hello──▶ idle, writer kept
//!  create / fork / restore / clone: spawn_vmm(id)
//!        └─ an idle VMM? bind it to id, send its Welcome now
//!           (else launch one as before); refill later, off the critical path
//! ```
//!
//! With `--vmm-pool-memory-mib` (default 256), each pooled VMM is launched
//! with guest RAM of that size that the server made for it: an empty
//! memfd, which the VMM maps and sets KVM's slot over while it waits. A VM
//! of that size (4 KiB pages) gets such a memfd as its guest RAM when it is
//! created, and the VMM that mapped it is set aside for the VM's launch
//! ([`SetAside`]): the Welcome then brings RAM the VMM has mapped already.
//! (Mapping other RAM over a KVM slot costs KVM a walk of the whole slot:
//! 0.13–0.18 ms for 256 MiB on this kind of host.)
//!
//! A pooled VMM is launched under a pool id (at or above [`POOL_BASE`],
//! never a VM's id) with its own log, `logs/pool-N.log`. Taking it binds
//! its connection to the VM (see [`crate::conn::Binding`]) and renames the
//! log to the VM's. Only VMMs whose hello the core has handled are taken;
//! one still starting stays in the pool. A pooled VMM that exits before it
//! is used leaves the pool; after [`MAX_FAILURES`] in a row the pool stops
//! refilling (and says so) until a VM launch asks for a VMM again, so a
//! broken `vmm` binary cannot make the server spawn processes in a loop.

pub mod state;

use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shared::VmId;
use tracing::{info, warn};

use super::Core;
use crate::conn::{Binding, VmmWriter};
use crate::memory::{GuestMemory, MemoryError, PageSize};
use state::{Pooled, SetAside};

/// Pool ids start here; VM ids stay far below.
pub const POOL_BASE: u32 = 0x8000_0000;

/// Pooled VMMs that may exit unused in a row before the pool stops
/// refilling.
pub const MAX_FAILURES: u32 = 3;

/// How long a refill waits after a take, so the launch that took a VMM
/// (and others right behind it, as in a fan-out) do not share the core
/// thread with process spawning.
const REFILL_DELAY: Duration = Duration::from_millis(20);

/// A refill launches a VMM only when no API request is in flight and none
/// came for this long: starting a process costs a few ms of CPU, and on a
/// small host a burst of them right after a fan-out slowed the fan-out's
/// own requests about six-fold.
const QUIET: Duration = Duration::from_millis(5);

/// Under load that never pauses, a refill still launches one VMM this
/// often, so the pool does not stay empty for good.
const UNDER_LOAD: Duration = Duration::from_millis(50);

/// Whether `id` is a pool id rather than a VM's.
pub fn is_pool_id(id: VmId) -> bool {
    id.0 >= POOL_BASE
}

/// Counts an API request as in flight while it lives (see [`QUIET`]).
#[derive(Debug)]
pub struct Activity(Rc<Core>);

impl Drop for Activity {
    fn drop(&mut self) {
        let mut pool = self.0.pool.borrow_mut();
        pool.inflight = pool.inflight.saturating_sub(1);
        pool.last_activity = Some(Instant::now());
    }
}

impl Core {
    /// Mark an API request in flight until the guard drops.
    pub(super) fn pool_activity(self: &Rc<Self>) -> Activity {
        let mut pool = self.pool.borrow_mut();
        pool.inflight += 1;
        pool.last_activity = Some(Instant::now());
        drop(pool);
        Activity(self.clone())
    }

    /// Wait until the API is quiet (see [`QUIET`]) or [`UNDER_LOAD`] has
    /// passed.
    async fn quiet(&self) {
        let start = Instant::now();
        loop {
            let wait = {
                let pool = self.pool.borrow();
                let since = pool.last_activity.map_or(QUIET, |t| t.elapsed());
                if pool.inflight == 0 && since >= QUIET {
                    return;
                }
                if start.elapsed() >= UNDER_LOAD {
                    return;
                }
                QUIET.saturating_sub(since).max(Duration::from_millis(1))
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// Guest RAM for a new VM `id`: the memfd of a ready pooled VMM when
    /// one has RAM of this size and kind (the VMM is set aside for the
    /// VM's launch), else a new memfd.
    pub(super) fn new_guest_memory(
        &self,
        id: VmId,
        size: u64,
        page_size: PageSize,
    ) -> Result<(GuestMemory, Option<SetAside>), MemoryError> {
        if page_size == PageSize::Small {
            if let Some((memory, p)) = self.pool.borrow_mut().take_with_memory(size) {
                return Ok((memory, Some(SetAside(Some(p)))));
            }
        }
        let memory = GuestMemory::create_with(&format!("pagefork-{id}"), size, page_size)?;
        Ok((memory, None))
    }

    /// Launch a VMM for `id` from the pool: the one set aside for it, else
    /// a ready one if there is any; bind it to `id` and send its Welcome.
    /// Returns whether it did.
    pub(super) fn launch_from_pool(self: &Rc<Self>, id: VmId) -> bool {
        let set_aside = self
            .reg
            .borrow_mut()
            .vms
            .get_mut(&id)
            .and_then(|v| v.pooled.take())
            .and_then(|mut s| s.0.take());
        let taken = match set_aside {
            Some(p) => Some(p),
            None => self.pool.borrow_mut().take(),
        };
        let Some(p) = taken else {
            // A launch asks for a VMM: worth trying again after a give-up.
            self.pool.borrow_mut().stopped = false;
            self.schedule_refill();
            return false;
        };
        let Some(writer) = p.writer else {
            return false;
        };
        p.binding.bind(id);
        self.on_hello(id, writer, p.pid);
        // After the Welcome, which the start waits for: the log follows the
        // VMM (its open fd keeps writing to the file), and this core thread
        // handles whatever the VMM says only after this returns.
        let log = self.log_path(id);
        if let Err(e) = std::fs::rename(self.pool_log_path(p.id), &log) {
            warn!("{id}: cannot rename the pooled vmm's log: {e}");
        }
        info!("{id}: took pooled vmm pid {}", p.pid);
        self.schedule_refill();
        true
    }

    /// A VMM's hello for pool id `id`: keep its writer; false if `id` is
    /// not (or no longer) in the pool.
    pub(super) fn pool_hello(&self, id: VmId, writer: Arc<VmmWriter>, pid: u32) -> bool {
        self.pool.borrow_mut().hello(id, writer, pid)
    }

    /// The pooled VMM `id` exited or hung up before it was used.
    pub(super) fn pool_gone(self: &Rc<Self>, id: VmId, reason: &str) {
        // One set aside for a VM: that VM's launch starts a VMM of its own.
        let set_aside = self.reg.borrow_mut().vms.values_mut().find_map(|v| {
            v.pooled
                .as_ref()
                .is_some_and(|s| s.0.as_ref().is_some_and(|p| p.id == id))
                .then(|| v.pooled.take())
                .flatten()
        });
        if let Some(s) = set_aside {
            warn!(
                "pooled vmm {} went away before the VM it was set aside for started: {reason}",
                id.0 - POOL_BASE
            );
            drop(s);
            return;
        }
        let gone = self.pool.borrow_mut().gone(id);
        if let Some(p) = gone {
            if let Some(w) = p.writer {
                w.shutdown();
            }
            warn!(
                "pooled vmm {} (pid {}) went away unused: {reason}",
                p.id.0 - POOL_BASE,
                p.pid
            );
            self.schedule_refill();
        }
    }

    /// Where pooled VMM `id` logs until it is taken.
    fn pool_log_path(&self, id: VmId) -> std::path::PathBuf {
        self.settings
            .state_dir
            .join("logs")
            .join(format!("pool-{}.log", id.0.saturating_sub(POOL_BASE)))
    }

    /// Fill the pool now (at start-up): remove logs of a previous run's
    /// pool, then launch up to the target.
    pub fn start_pool(self: &Rc<Self>) {
        if let Ok(entries) = std::fs::read_dir(self.settings.state_dir.join("logs")) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with("pool-") {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let core = self.clone();
        tokio::task::spawn_local(async move { core.refill(Duration::ZERO).await });
    }

    /// Refill the pool soon, unless a refill is on its way.
    fn schedule_refill(self: &Rc<Self>) {
        {
            let mut pool = self.pool.borrow_mut();
            if pool.target == 0 || pool.refilling || pool.stopped {
                return;
            }
            pool.refilling = true;
        }
        let core = self.clone();
        tokio::task::spawn_local(async move { core.refill(REFILL_DELAY).await });
    }

    /// Launch pooled VMMs until the pool holds its target, one per turn of
    /// the core's loop, after `delay`.
    async fn refill(self: Rc<Self>, delay: Duration) {
        self.pool.borrow_mut().refilling = true;
        tokio::time::sleep(delay).await;
        loop {
            self.quiet().await;
            let id = {
                let mut pool = self.pool.borrow_mut();
                if pool.idle.len() >= pool.target {
                    break;
                }
                if pool.failures >= MAX_FAILURES {
                    warn!(
                        "the vmm pool stops refilling: {MAX_FAILURES} pooled vmms in a row went \
                         away unused (see logs/pool-*.log); VMs still start without it"
                    );
                    pool.failures = 0;
                    pool.stopped = true;
                    pool.refilling = false;
                    return;
                }
                pool.next += 1;
                VmId(POOL_BASE + pool.next)
            };
            let binding = Binding::new(id);
            let hint = self.settings.vmm_pool_memory_mib;
            let log = self.pool_log_path(id);
            let name = format!("pagefork-pool-{}", id.0 - POOL_BASE);
            let memory = match (hint > 0)
                .then(|| GuestMemory::create(&name, hint << 20))
                .transpose()
            {
                Ok(m) => m,
                Err(e) => {
                    warn!(
                        "the vmm pool cannot make guest RAM for a vmm: {}",
                        shared::error_chain(&e)
                    );
                    None
                }
            };
            let ram = memory.as_ref().map(GuestMemory::memfd);
            match self.launch_process(id, binding.clone(), &log, Some((hint, ram))) {
                Ok(pid) => self.pool.borrow_mut().idle.push_back(Pooled {
                    id,
                    pid,
                    binding,
                    writer: None,
                    memory,
                }),
                Err(e) => {
                    warn!("the vmm pool cannot launch a vmm: {}", e.message());
                    break;
                }
            }
            tokio::task::yield_now().await;
        }
        self.pool.borrow_mut().refilling = false;
    }
}
