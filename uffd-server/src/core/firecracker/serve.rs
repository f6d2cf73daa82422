//! The tasks that serve a Firecracker VM: its uffd event loop (with EAGAIN
//! deferral) and the bulk prefetch of a recorded working set.

use std::rc::Rc;
use std::time::Duration;

use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot};
use tracing::info;
use userfaultfd::{Event, EventBuffer, FaultKind, Uffd};

use super::vm::Resolved;
use crate::core::fault::serve::{poll_window, read_pending};
use crate::core::state::Core;
use crate::observe::phases::{self, Phase};

/// Handle a batch of events for a Firecracker VM (read after a wake-up of
/// the event loop if `woken`, else by polling); faults to retry go to
/// `deferred` (EAGAIN: after the next events) or come back through
/// `retry` (waiting for decoded frames). Returns whether to keep serving.
fn handle_batch(
    core: &Core,
    id: VmId,
    events: &mut Vec<Event>,
    deferred: &mut Vec<u64>,
    retry: &mpsc::UnboundedSender<u64>,
    woken: bool,
) -> bool {
    phases::lap(Phase::Read);
    let mut reg = core.reg.borrow_mut();
    let reg = &mut *reg;
    let Some(v) = reg.fc_vms.get_mut(&id) else {
        return false;
    };
    let record = v.fault_order.len() < (1 << 22);
    // Events that change the address space (REMOVE) apply before retrying
    // deferred faults, so a removed page is installed as zero.
    let mut faults = std::mem::take(deferred);
    let retried = faults.len();
    for ev in events.drain(..) {
        match ev {
            Event::Pagefault {
                kind: FaultKind::Missing,
                addr,
                ..
            } => faults.push(addr as u64),
            Event::Pagefault { addr, .. } => v.wake(addr as u64),
            Event::Remove { start, end } => v.remove(start as u64, end as u64),
            _ => {}
        }
    }
    let fresh = (faults.len() - retried) as u64;
    v.stats.missing += fresh;
    if woken {
        v.phases.woken_events += fresh;
    } else {
        v.phases.polled_events += fresh;
    }
    for addr in faults {
        let t0 = std::time::Instant::now();
        let resolved = v.resolve(&reg.arena, addr, record);
        let took = t0.elapsed();
        phases::lap(Phase::Resolve);
        let laps = phases::take();
        v.phases.record(&laps);
        let spent: u64 = laps.iter().sum();
        if spent > 0 {
            v.phases.service.record(spent);
        }
        core.fault_seconds.observe(took.as_secs_f64());
        v.stats.service_us_log2[crate::observe::stats::service_bucket(took)] += 1;
        match resolved {
            Resolved::Ok => {}
            Resolved::Again => {
                v.stats.deferred += 1;
                deferred.push(addr);
            }
            Resolved::Wait(ready) => park(addr, ready, retry),
            Resolved::Gone => return false,
        }
    }
    phases::lap(Phase::Loop);
    v.phases.record(&phases::take());
    true
}

/// Send `addr` back through `retry` once every receiver of `ready` fired.
fn park(addr: u64, ready: Vec<oneshot::Receiver<()>>, retry: &mpsc::UnboundedSender<u64>) {
    let retry = retry.clone();
    tokio::task::spawn_local(async move {
        for r in ready {
            let _ = r.await;
        }
        let _ = retry.send(addr);
    });
}

/// Serve a Firecracker VM's uffd until it closes or the VM is gone; after
/// served events the uffd is polled for the configured window (see
/// `core/fault/serve.rs`).
pub(crate) async fn serve_fc(
    core: Rc<Core>,
    id: VmId,
    uffd: Rc<AsyncFd<Uffd>>,
    closed: Rc<tokio::sync::Notify>,
) {
    let mut buf = EventBuffer::new(64);
    let mut events: Vec<Event> = Vec::with_capacity(64);
    let mut deferred: Vec<u64> = Vec::new();
    let window = core.settings.fault_poll;
    let (retry_tx, mut retry_rx) = mpsc::unbounded_channel::<u64>();
    loop {
        if deferred.is_empty() {
            let mut guard = tokio::select! {
                g = uffd.readable() => match g {
                    Ok(g) => g,
                    Err(_) => return,
                },
                Some(addr) = retry_rx.recv() => {
                    // A fault whose frames are decoded now.
                    deferred.push(addr);
                    if !handle_batch(&core, id, &mut events, &mut deferred, &retry_tx, true) {
                        return;
                    }
                    continue;
                }
                () = closed.notified() => return,
            };
            phases::start();
            if read_pending(id, guard.get_inner(), &mut buf, &mut events).is_err() {
                return;
            }
            if events.is_empty() {
                guard.clear_ready();
                phases::stop();
                if !core.reg.borrow().fc_vms.contains_key(&id) {
                    return;
                }
                continue;
            }
        } else {
            // Deferred faults wait for the pending event that made the
            // install fail with EAGAIN. It is normally queued already: read
            // it and retry at once, since the discarding thread may start
            // its next discard soon after this one completes. Only if
            // nothing is there yet, give it a moment.
            phases::start();
            if read_pending(id, uffd.get_ref(), &mut buf, &mut events).is_err() {
                return;
            }
            if events.is_empty() {
                tokio::time::sleep(Duration::from_micros(50)).await;
                phases::start();
            }
        }
        let mut woken = true;
        loop {
            if !handle_batch(&core, id, &mut events, &mut deferred, &retry_tx, woken) {
                return;
            }
            if window.is_zero() || !deferred.is_empty() {
                break;
            }
            let mut idle = 0;
            let found =
                poll_window(id, uffd.get_ref(), &mut buf, &mut events, window, &mut idle).await;
            if let Some(v) = core.reg.borrow_mut().fc_vms.get_mut(&id) {
                v.phases.poll_idle_ns += idle;
            }
            match found {
                Ok(true) => woken = false,
                Ok(false) => break,
                Err(_) => return,
            }
        }
        phases::stop();
    }
}

/// Install a recorded working set in bulk, a batch at a time, yielding to
/// the fault task between batches.
pub(super) async fn prefetch_working_set(core: Rc<Core>, id: VmId, pages: Rc<Vec<u64>>) {
    let t = std::time::Instant::now();
    let mut installed = 0u64;
    let mut chunks: std::collections::VecDeque<Vec<u64>> =
        pages.chunks(256).map(<[u64]>::to_vec).collect();
    while let Some(chunk) = chunks.pop_front() {
        // Pages whose compressed frames are being decoded: installed once
        // they are (the decoding runs on the frame pool's threads).
        let mut waiting = Vec::new();
        let mut ready = Vec::new();
        {
            let mut reg = core.reg.borrow_mut();
            let reg = &mut *reg;
            let Some(v) = reg.fc_vms.get_mut(&id) else {
                return;
            };
            for &p in &chunk {
                let Some(r) = v
                    .regions
                    .iter()
                    .copied()
                    .find(|r| p * PAGE_SIZE >= r.offset && p * PAGE_SIZE < r.offset + r.size)
                else {
                    continue;
                };
                if v.table.get(p) == v.self_src {
                    continue;
                }
                let addr = r.base + (p * PAGE_SIZE - r.offset);
                let before = v.stats.pages_installed;
                match v.resolve(&reg.arena, addr, false) {
                    Resolved::Gone => return,
                    Resolved::Wait(r) => {
                        waiting.push(p);
                        ready.extend(r);
                    }
                    Resolved::Ok | Resolved::Again => {}
                }
                installed += v.stats.pages_installed - before;
            }
        }
        for r in ready {
            let _ = r.await;
        }
        if !waiting.is_empty() {
            chunks.push_front(waiting);
        }
        tokio::task::yield_now().await;
    }
    info!(
        "{id}: working set prefetched: {installed} pages in {:?}",
        t.elapsed()
    );
}
