//! The serving loop of one VM's uffd, and the poll window both kinds of VM
//! use.
//!
//! A fault costs the faulting thread one round trip: the kernel queues the
//! event and wakes the core thread, which reads it, installs the page and
//! wakes the faulting thread. When the core thread was asleep in the event
//! loop, its own wake-up (an idle CPU leaving its idle state, the runtime
//! returning from `epoll_wait`) is most of that trip on a virtualized host.
//! A thread that faults once usually faults again a few microseconds after
//! it is woken (a guest touching its memory, a restore), so after serving
//! events the loop keeps reading the uffd without waiting for a bounded
//! window (`Settings::fault_poll`) before it returns to
//! the event loop:
//!
//! ```text
//!   readable ─▶ read ─▶ serve ─▶ poll: yield, read ─┬─ events ─▶ serve ─▶ poll ...
//!                                                   └─ none for the window ─▶ readable
//! ```
//!
//! The window's bounds: each poll yields to the runtime first, so every
//! other task (other VMs' faults, API requests, frame-pool waiters, VMM
//! messages) runs between two polls; the window restarts only when an event
//! was found, so an idle VM costs the core at most one window after its
//! last fault; and a window of zero turns polling off.

use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::rc::Rc;
use std::time::{Duration, Instant};

use shared::VmId;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;
use tracing::{info, warn};
use userfaultfd::{Event, EventBuffer, Uffd};

use super::books::Handled;
use super::resolve as fault;
use crate::core::link::exit::{log_failure, mark_exited, protocol_error};
use crate::core::snapshot::track::before_write;
use crate::core::state::Core;
use crate::observe::phases::{self, Laps, Phase};

/// Why a serving loop stops reading a uffd.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReadError {
    #[error("the uffd was closed")]
    Eof,
    #[error("cannot read the uffd")]
    Read(#[source] userfaultfd::Error),
}

/// Read the events pending on `uffd` into `out` without waiting (the uffd
/// is non-blocking); an event that cannot be decoded is skipped with a
/// warning.
pub(crate) fn read_pending(
    vm: VmId,
    uffd: &Uffd,
    buf: &mut EventBuffer,
    out: &mut Vec<Event>,
) -> Result<(), ReadError> {
    match uffd.read_events(buf) {
        Ok(it) => {
            for ev in it {
                match ev {
                    Ok(e) => out.push(e),
                    Err(e) => warn!("{vm}: bad uffd event: {e}"),
                }
            }
            Ok(())
        }
        Err(userfaultfd::Error::ReadEof) => Err(ReadError::Eof),
        Err(e) => Err(ReadError::Read(e)),
    }
}

/// Poll `uffd` for more events for up to `window`, yielding to the runtime
/// before every read. Returns whether events were read into `out` (the
/// phase clock is started for them); the time spent finding nothing is
/// added to `idle_ns`.
pub(crate) async fn poll_window(
    vm: VmId,
    uffd: &Uffd,
    buf: &mut EventBuffer,
    out: &mut Vec<Event>,
    window: Duration,
    idle_ns: &mut u64,
) -> Result<bool, ReadError> {
    let t0 = Instant::now();
    loop {
        // The thread this core just woke may be queued on this very CPU:
        // let it run (and fault again) before polling for its fault.
        std::thread::yield_now();
        tokio::task::yield_now().await;
        phases::start();
        read_pending(vm, uffd, buf, out)?;
        let waited = t0.elapsed();
        if !out.is_empty() || waited >= window {
            *idle_ns += u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
            return Ok(!out.is_empty());
        }
    }
}

/// Read and resolve `vm`'s uffd events until the uffd closes or the VM
/// is gone (`closed`): a dead VMM's uffd never becomes readable again, so
/// waiting on it alone would keep the fd open for ever.
async fn serve_faults(
    core: Rc<Core>,
    vm: VmId,
    uffd: Rc<AsyncFd<Uffd>>,
    closed: Rc<tokio::sync::Notify>,
    tap: Rc<crate::observe::trace::Tap>,
) {
    let mut buf = EventBuffer::new(64);
    let mut batch = Batch::default();
    let window = core.settings.fault_poll;
    // Faults parked on frames being decoded, or on a dependent's uffd
    // (see `fault::resolve::resolve_write_protect`), come back here when ready.
    let (retry_tx, mut retry_rx) = mpsc::unbounded_channel::<(u64, bool)>();
    loop {
        let ready = tokio::select! {
            r = uffd.readable() => r,
            Some((page, write_protect)) = retry_rx.recv() => {
                let mut reg = core.reg.borrow_mut();
                let outcome = if write_protect {
                    // Recorded when it first came, but a snapshot or a
                    // pause's re-protect may have come between: the write
                    // is still to happen, so it is recorded again (the
                    // sets are idempotent) before the protection lifts.
                    before_write(&mut reg, vm, page);
                    fault::resolve_write_protect(&mut reg, vm, page)
                } else {
                    fault::resolve_missing(&mut reg, vm, page, false)
                };
                drop(reg);
                if !after_fault(&core, vm, outcome, &retry_tx) {
                    return;
                }
                continue;
            }
            () = closed.notified() => return,
        };
        let mut guard = match ready {
            Ok(g) => g,
            Err(e) => {
                warn!("{vm}: uffd poll failed: {e}");
                return;
            }
        };
        phases::start();
        match read_pending(vm, guard.get_inner(), &mut buf, &mut batch.events) {
            Ok(()) => {}
            Err(ReadError::Eof) => return,
            Err(e) => {
                warn!("{vm}: {}", shared::error_chain(&e));
                return;
            }
        }
        if batch.events.is_empty() {
            guard.clear_ready();
            phases::stop();
            // The VM may have exited and dropped its uffd: stop then.
            let gone = core
                .reg
                .borrow()
                .vms
                .get(&vm)
                .is_none_or(|v| v.faults.uffd.is_none());
            if gone {
                return;
            }
            continue;
        }
        drop(guard);
        let mut woken = true;
        loop {
            if !serve_batch(&core, vm, &mut batch, &tap, &retry_tx, woken) {
                return;
            }
            if window.is_zero() {
                break;
            }
            let mut idle = 0;
            let found = poll_window(
                vm,
                uffd.get_ref(),
                &mut buf,
                &mut batch.events,
                window,
                &mut idle,
            )
            .await;
            if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
                v.log.phases.poll_idle_ns += idle;
            }
            match found {
                Ok(true) => woken = false,
                Ok(false) => break,
                Err(ReadError::Eof) => return,
                Err(e) => {
                    warn!("{vm}: {}", shared::error_chain(&e));
                    return;
                }
            }
        }
        phases::stop();
    }
}

/// Buffers of the serving loop, kept from one wake-up to the next.
#[derive(Debug, Default)]
struct Batch {
    events: Vec<Event>,
    outcomes: Vec<Handled>,
    /// The phases of each event of the batch, then the loop's own.
    laps: Vec<Laps>,
}

/// `vm`'s VMM sent its uffd (`UffdReady`): serve it from now on.
pub(crate) fn on_uffd_ready(core: &Rc<Core>, vm: VmId, bases: Vec<u64>, mut fds: Vec<OwnedFd>) {
    if fds.len() != 1 || bases.len() != 1 {
        return protocol_error(
            core,
            vm,
            &format!(
                "uffd-ready needs exactly one fd and one base, got {} fds and {} bases",
                fds.len(),
                bases.len()
            ),
        );
    }
    let fd = fds.remove(0);
    if let Err(e) = serve_uffd(core, vm, fd, bases[0], false) {
        protocol_error(core, vm, &shared::error_chain(&e));
    }
}

/// Why a VM's uffd cannot be served.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ServeUffdError {
    #[error("cannot make the uffd non-blocking")]
    NonBlocking(#[source] nix::Error),
    #[error("cannot poll the uffd")]
    Poll(#[source] std::io::Error),
    #[error("uffd-ready sent twice")]
    SentTwice,
}

/// Serve `vm`'s uffd `fd` (its VMM maps guest RAM at `vmm_base`) from
/// now on: when its VMM sends it, or, `adopted`, when a server before
/// this one served it; then every range is woken once, so that a fault
/// the server before read and never answered is raised again.
pub(crate) fn serve_uffd(
    core: &Rc<Core>,
    vm: VmId,
    fd: OwnedFd,
    vmm_base: u64,
    adopted: bool,
) -> Result<(), ServeUffdError> {
    nix::fcntl::fcntl(
        fd.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    )
    .map_err(ServeUffdError::NonBlocking)?;
    // SAFETY: `fd` is owned here; ownership moves into the Uffd, which
    // closes it on drop.
    let uffd = unsafe { Uffd::from_raw_fd(fd.into_raw_fd()) };
    // SAFETY: the Uffd owns its fd, which stays open and unchanged
    // until the Uffd (moved into the AsyncFd) is dropped.
    let afd = match unsafe { AsyncFd::register_with_interest(uffd, tokio::io::Interest::READABLE) }
    {
        Ok(a) => Rc::new(a),
        Err(e) => return Err(ServeUffdError::Poll(e.into_parts().1)),
    };
    {
        let mut reg = core.reg.borrow_mut();
        let Some(v) = reg.vms.get_mut(&vm) else {
            return Ok(());
        };
        if v.faults.uffd.is_some() {
            return Err(ServeUffdError::SentTwice);
        }
        v.faults.vmm_base = vmm_base;
        v.faults.uffd = Some(afd.clone());
        for w in v.faults.on_uffd.drain(..) {
            let _ = w.send(());
        }
        if adopted {
            let len = usize::try_from(v.memory.size()).unwrap_or(0);
            if let Err(e) = afd.get_ref().wake(vmm_base as *mut libc::c_void, len) {
                warn!("{vm}: cannot wake its guest RAM: {e}");
            }
        }
        tokio::task::spawn_local(serve_faults(
            core.clone(),
            vm,
            afd,
            v.faults.closed.clone(),
            v.log.tap.clone(),
        ));
        crate::core::base::on_uffd_ready(&mut reg, vm);
        if adopted {
            // Before any of its faults is served (they are, on the task
            // spawned above, once this returns).
            match crate::core::base::sync_after_restart(&mut reg, vm) {
                Ok(0) => {}
                Ok(n) => info!("{vm}: {n} page(s) its VMM holds recorded as its own"),
                Err(e) => warn!("{vm}: cannot check its pages: {}", e.message()),
            }
        }
    }
    // Its record (with this uffd) is journaled by the sync before the
    // answer of the request that made it: a VM still starting is not
    // taken back after a crash (its VMM is refused when it rejoins).
    Ok(())
}

/// Resolve the events in `batch` (read after a wake-up of the event
/// loop if `woken`, else by polling) and act on their outcomes.
/// Returns whether to keep serving the uffd.
fn serve_batch(
    core: &Core,
    vm: VmId,
    batch: &mut Batch,
    tap: &crate::observe::trace::Tap,
    retry: &mpsc::UnboundedSender<(u64, bool)>,
    woken: bool,
) -> bool {
    phases::lap(Phase::Read);
    let count = batch.events.len() as u64;
    let mut service = [0u64; crate::observe::stats::SERVICE_BUCKETS];
    batch.laps.clear();
    {
        let mut reg = core.reg.borrow_mut();
        for ev in batch.events.drain(..) {
            let t0 = Instant::now();
            // The trace's one cost while nobody listens: `active()`.
            let begun = if tap.active() {
                super::trace::begin(&reg, vm, &ev, tap)
            } else {
                None
            };
            batch.outcomes.push(fault::handle_event(&mut reg, vm, ev));
            let took = t0.elapsed();
            phases::lap(Phase::Resolve);
            batch.laps.push(phases::take());
            core.fault_seconds.observe(took.as_secs_f64());
            service[crate::observe::stats::service_bucket(took)] += 1;
            if let Some(b) = begun {
                tap.send(super::trace::end(&reg, b, took));
            }
        }
        reg.collect_garbage();
    }
    let mut keep = true;
    for outcome in batch.outcomes.drain(..) {
        keep = keep && after_fault(core, vm, outcome, retry);
    }
    phases::lap(Phase::Loop);
    batch.laps.push(phases::take());
    if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
        if let Some(a) = v.adopted.as_mut() {
            a.fault_served();
        }
        for (a, b) in v.log.stats.service_us_log2.iter_mut().zip(service) {
            *a += b;
        }
        let p = &mut v.log.phases;
        for laps in &batch.laps {
            p.record(laps);
        }
        // The service time of each event: its own phases, the read
        // that brought it counted once.
        for laps in &batch.laps[..batch.laps.len() - 1] {
            p.service.record(laps.iter().sum());
        }
        if woken {
            p.woken_events += count;
        } else {
            p.polled_events += count;
        }
    }
    keep
}

/// Act on how a fault of `vm` was handled: log a failure, park a fault
/// that waits for decoded frames (it comes back through `retry`), or
/// mark the VMM gone. Returns whether to keep serving the uffd.
fn after_fault(
    core: &Core,
    vm: VmId,
    outcome: Handled,
    retry: &mpsc::UnboundedSender<(u64, bool)>,
) -> bool {
    match outcome {
        Handled::Ok => true,
        Handled::Failed(reason) => {
            log_failure(core, vm, &reason);
            true
        }
        Handled::Wait {
            page,
            ready,
            write_protect,
        } => {
            let retry = retry.clone();
            tokio::task::spawn_local(async move {
                for r in ready {
                    let _ = r.await;
                }
                let _ = retry.send((page, write_protect));
            });
            true
        }
        Handled::VmmGone => {
            mark_exited(core, vm, "vmm address space is gone (ESRCH)");
            false
        }
    }
}
