//! Keeping the warm VMM pool full: pooled VMMs are launched one at a time,
//! a little after a take and only while the API is quiet, so a burst of
//! process starts never shares the core thread with the requests that
//! emptied the pool.

use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use shared::VmId;
use tracing::warn;

use super::state::{Pooled, MAX_FAILURES, POOL_BASE};
use crate::conn::Binding;
use crate::core::fd_budget::FdKind;
use crate::core::link::process::launch_process;
use crate::core::settings::Settings;
use crate::core::state::Core;
use crate::memory::GuestMemory;

/// How long a refill waits after a take, so the launch that took a VMM
/// (and others right behind it, as in a fan-out) do not share the core
/// thread with process spawning.
const REFILL_DELAY: Duration = Duration::from_millis(20);

/// A refill launches a VMM only when no API request is in flight and none
/// came for this long: starting a process costs a few ms of CPU, and on a
/// small host a burst of them right after a fan-out slowed the fan-out's
/// own requests about six-fold.
pub(crate) const QUIET: Duration = Duration::from_millis(5);

/// Under load that never pauses, a refill still launches one VMM this
/// often, so the pool does not stay empty for good.
const UNDER_LOAD: Duration = Duration::from_millis(50);

#[derive(Debug)]
pub struct Activity(Rc<Core>);

impl Drop for Activity {
    fn drop(&mut self) {
        let mut pool = self.0.pool.borrow_mut();
        pool.inflight = pool.inflight.saturating_sub(1);
        pool.last_activity = Some(Instant::now());
    }
}

/// Mark an API request in flight until the guard drops.
pub(crate) fn activity(core: &Rc<Core>) -> Activity {
    let mut pool = core.pool.borrow_mut();
    pool.inflight += 1;
    pool.last_activity = Some(Instant::now());
    drop(pool);
    Activity(core.clone())
}

/// Wait until the API is quiet (see [`QUIET`]) or [`UNDER_LOAD`] has
/// passed.
async fn quiet(core: &Core) {
    let start = Instant::now();
    loop {
        let wait = {
            let pool = core.pool.borrow();
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

/// Where pooled VMM `id` logs until it is taken.
pub(crate) fn pool_log_path(settings: &Settings, id: VmId) -> PathBuf {
    settings
        .state_dir
        .join("logs")
        .join(format!("pool-{}.log", id.0.saturating_sub(POOL_BASE)))
}

/// Fill the pool now (at start-up): remove logs of a previous run's
/// pool, then launch up to the target.
pub(crate) fn start(core: &Rc<Core>) {
    if let Ok(entries) = std::fs::read_dir(core.settings.state_dir.join("logs")) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with("pool-") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let core = core.clone();
    tokio::task::spawn_local(async move { refill(core, Duration::ZERO).await });
}

/// Refill the pool soon, unless a refill is on its way.
pub(crate) fn schedule_refill(core: &Rc<Core>) {
    {
        let mut pool = core.pool.borrow_mut();
        if pool.target == 0 || pool.refilling || pool.stopped {
            return;
        }
        pool.refilling = true;
    }
    let core = core.clone();
    tokio::task::spawn_local(async move { refill(core, REFILL_DELAY).await });
}

/// Launch pooled VMMs until the pool holds its target, one per turn of
/// the core's loop, after `delay`.
async fn refill(core: Rc<Core>, delay: Duration) {
    core.pool.borrow_mut().refilling = true;
    tokio::time::sleep(delay).await;
    loop {
        quiet(&core).await;
        let id = {
            let mut pool = core.pool.borrow_mut();
            // Pooled VMMs hold fds too: none is started into the fds
            // kept for running VMs and the API; the next launch asks again.
            if pool.idle.len() >= pool.target || !core.fds.has_room(FdKind::Pooled, 1) {
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
        let hint = core.settings.vmm_pool_memory_mib;
        let log = pool_log_path(&core.settings, id);
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
        match launch_process(&core, id, binding.clone(), &log, Some((hint, ram))) {
            Ok(pid) => core.pool.borrow_mut().idle.push_back(Pooled {
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
    core.pool.borrow_mut().refilling = false;
}
