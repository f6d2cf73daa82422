//! The tasks that serve a Firecracker VM: its uffd event loop (with EAGAIN
//! deferral) and the bulk prefetch of a recorded working set.

use std::rc::Rc;
use std::time::Duration;

use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tracing::info;
use userfaultfd::{Event, EventBuffer, FaultKind, Uffd};

use super::vm::Resolved;
use crate::core::Core;

/// Handle a batch of events for a Firecracker VM; returns faults to retry.
fn handle_batch(core: &Core, id: VmId, events: Vec<Event>, deferred: &mut Vec<u64>) -> bool {
    let mut reg = core.reg.borrow_mut();
    let reg = &mut *reg;
    let Some(v) = reg.fc_vms.get_mut(&id) else {
        return false;
    };
    let record = v.fault_order.len() < (1 << 22);
    // Events that change the address space (REMOVE) apply before retrying
    // deferred faults, so a removed page is installed as zero.
    let mut faults = Vec::new();
    for ev in events {
        match ev {
            Event::Pagefault {
                kind: FaultKind::Missing,
                addr,
                ..
            } => faults.push(addr as u64),
            Event::Pagefault { addr, .. } => v.wake(addr as u64 & !(PAGE_SIZE - 1), PAGE_SIZE),
            Event::Remove { start, end } => v.remove(start as u64, end as u64),
            _ => {}
        }
    }
    v.stats.missing += faults.len() as u64;
    let retry: Vec<u64> = std::mem::take(deferred);
    for addr in retry.into_iter().chain(faults) {
        let t0 = std::time::Instant::now();
        let resolved = v.resolve(&reg.arena, addr, record);
        let took = t0.elapsed();
        core.fault_seconds.observe(took.as_secs_f64());
        v.stats.service_us_log2[crate::core::vm::service_bucket(took)] += 1;
        match resolved {
            Resolved::Ok => {}
            Resolved::Again => {
                v.stats.deferred += 1;
                deferred.push(addr);
            }
            Resolved::Gone => return false,
        }
    }
    true
}

pub(super) async fn serve_fc(
    core: Rc<Core>,
    id: VmId,
    uffd: Rc<AsyncFd<Uffd>>,
    closed: Rc<tokio::sync::Notify>,
) {
    let mut buf = EventBuffer::new(64);
    let mut deferred: Vec<u64> = Vec::new();
    loop {
        let events: Vec<Event> = if deferred.is_empty() {
            let mut guard = tokio::select! {
                g = uffd.readable() => match g {
                    Ok(g) => g,
                    Err(_) => return,
                },
                () = closed.notified() => return,
            };
            match guard.get_inner().read_events(&mut buf) {
                Ok(it) => {
                    let evs: Vec<Event> = it.filter_map(Result::ok).collect();
                    if evs.is_empty() {
                        guard.clear_ready();
                        if !core.reg.borrow().fc_vms.contains_key(&id) {
                            return;
                        }
                        continue;
                    }
                    evs
                }
                Err(_) => return,
            }
        } else {
            // Deferred faults wait for the pending event that made the
            // install fail with EAGAIN. It is normally queued already: read
            // it and retry at once, since the discarding thread may start
            // its next discard soon after this one completes. Only if
            // nothing is there yet, give it a moment.
            let evs: Vec<Event> = match uffd.get_ref().read_events(&mut buf) {
                Ok(it) => it.filter_map(Result::ok).collect(),
                Err(_) => return,
            };
            if evs.is_empty() {
                tokio::time::sleep(Duration::from_micros(50)).await;
            }
            evs
        };
        if !handle_batch(&core, id, events, &mut deferred) {
            return;
        }
    }
}

/// Install a recorded working set in bulk, a batch at a time, yielding to
/// the fault task between batches.
pub(super) async fn prefetch_working_set(core: Rc<Core>, id: VmId, pages: Rc<Vec<u64>>) {
    let t = std::time::Instant::now();
    let mut installed = 0u64;
    for chunk in pages.chunks(256) {
        {
            let mut reg = core.reg.borrow_mut();
            let reg = &mut *reg;
            let Some(v) = reg.fc_vms.get_mut(&id) else {
                return;
            };
            for &p in chunk {
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
                if let Resolved::Gone = v.resolve(&reg.arena, addr, false) {
                    return;
                }
                installed += v.stats.pages_installed - before;
            }
        }
        tokio::task::yield_now().await;
    }
    info!(
        "{id}: working set prefetched: {installed} pages in {:?}",
        t.elapsed()
    );
}
