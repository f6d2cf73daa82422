//! The reclaim loop: every tick, read what is in use against the limit;
//! above the watermark, give back pages from the coldest VMs first (those
//! whose faults stopped longest ago) until usage would be under the low
//! watermark; a VM over its own limit gives back its excess whatever the
//! pressure. Work goes in small steps with a yield between, so faults of
//! every VM are served meanwhile. Each window (a second), VMs that fault
//! back much of what was reclaimed from them are reported as thrashing,
//! and frames nothing names any more leave the swap store.

use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use shared::{VmId, PAGE_SIZE};
use tracing::{info, warn};

use super::pass::{self, Took};
use crate::core::registry::Registry;
use crate::core::state::Core;
use crate::pages::{PageSource, SourceId};
use crate::reclaim::store::SwapStore;

/// Pages one step reclaims at most before it yields to the faults.
const STEP_PAGES: u64 = 256;
/// Ticks while usage is near or over the watermark, and otherwise.
const BUSY_TICK: Duration = Duration::from_millis(5);
const IDLE_TICK: Duration = Duration::from_millis(100);
/// A thrashing window.
const WINDOW: Duration = Duration::from_secs(1);
/// Usage over the watermark this long with nothing left to give back
/// makes reclaim "behind": new VMs are refused.
const BEHIND_AFTER: Duration = Duration::from_millis(500);

/// Start the reclaim loop (if reclaim is on), after the swap store is
/// trimmed to what the tables name (frames a crash left behind).
pub fn start(core: &Rc<Core>) {
    if !core.reclaim.borrow().on() {
        info!("reclaim off (--reclaim off): the kernel's OOM killer decides under pressure");
        return;
    }
    {
        let mut reg = core.reg.borrow_mut();
        adopt_swap_sources(&mut reg);
        collect_frames(&reg, core.reclaim.borrow().store_for_reading());
    }
    let r = core.reclaim.borrow_mut().read().clone();
    info!(
        "reclaim on: limit {} MiB ({}), watermark {} MiB",
        r.limit.unwrap_or(0) >> 20,
        r.source,
        core.reclaim.borrow().watermark().unwrap_or(0) >> 20
    );
    watch_pressure(core);
    tokio::task::spawn_local(run(core.clone()));
}

/// Wake the loop when the kernel reports memory stalls (a PSI trigger):
/// then it gives back down to the low watermark even under the high one.
/// Without a trigger (no PSI in this kernel, or refused) the loop polls.
fn watch_pressure(core: &Rc<Core>) {
    let trigger = core.reclaim.borrow().pressure_trigger();
    let trigger = match trigger {
        Ok(t) => t,
        Err(e) => {
            info!("no memory pressure trigger ({e}); reclaim polls usage only");
            return;
        }
    };
    let path = trigger.path().display().to_string();
    // SAFETY: the trigger owns its fd, which stays open and unchanged
    // until the trigger (moved into the AsyncFd) is dropped.
    let afd = match unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(trigger, tokio::io::Interest::PRIORITY)
    } {
        Ok(a) => a,
        Err(e) => {
            warn!("cannot wait on the memory pressure trigger {path}: {e}");
            return;
        }
    };
    info!("reclaim wakes on memory stalls ({path})");
    let kick = core.reg.borrow().gate.kick();
    let core = Rc::clone(core);
    tokio::task::spawn_local(async move {
        loop {
            match afd.ready(tokio::io::Interest::PRIORITY).await {
                Ok(mut ready) => {
                    ready.clear_ready();
                    if afd.get_ref().fired().is_err() {
                        warn!("the memory pressure trigger {path} is gone");
                        return;
                    }
                    core.reclaim.borrow_mut().stalled();
                    kick.notify_one();
                }
                Err(e) => {
                    warn!("cannot wait on the memory pressure trigger {path}: {e}");
                    return;
                }
            }
        }
    });
}

async fn run(core: Rc<Core>) {
    let mut window = Instant::now();
    let mut over_since: Option<Instant> = None;
    let kick = core.reg.borrow().gate.kick();
    loop {
        let busy = tick(&core, &mut over_since).await;
        if window.elapsed() >= WINDOW {
            window = Instant::now();
            end_window(&core);
        }
        // The next tick, or at once when a fault finds the gate's budget
        // spent.
        tokio::select! {
            () = tokio::time::sleep(if busy { BUSY_TICK } else { IDLE_TICK }) => {}
            () = kick.notified() => {}
        }
    }
}

/// Open the fault gate for what is left under the watermark `high` at
/// `usage` (at least a step), or, over it, for a step if reclaim gave
/// something back (`progress`), else wide: nothing left to give back,
/// the kernel decides.
fn open_gate(core: &Core, usage: u64, high: u64, progress: bool) {
    let mut reg = core.reg.borrow_mut();
    let installed = reg.installed;
    if usage <= high {
        let room = ((high - usage) / PAGE_SIZE).max(STEP_PAGES);
        reg.gate.open_for(installed, room);
    } else if progress {
        reg.gate.open_for(installed, STEP_PAGES);
    } else {
        reg.gate.open_wide();
    }
}

/// One tick; returns whether usage is near the watermark (tick fast).
async fn tick(core: &Rc<Core>, over_since: &mut Option<Instant>) -> bool {
    free_swapped_in(core);
    note_activity(core);
    for (vm, excess) in over_own_limit(core) {
        reclaim_steps(core, vm, excess, false).await;
    }
    let (usage, high, low) = {
        let mut rc = core.reclaim.borrow_mut();
        let usage = rc.read().usage;
        (usage, rc.watermark(), rc.low_watermark())
    };
    let (Some(high), Some(low)) = (high, low) else {
        core.reg.borrow_mut().gate.open_wide();
        return false;
    };
    // The kernel stalls on memory: give back down to the low watermark
    // even under the high one.
    let stalled = core.reclaim.borrow_mut().take_stalled() && usage > low;
    if usage <= high && !stalled {
        *over_since = None;
        core.reclaim.borrow_mut().set_behind(None);
        open_gate(core, usage, high, true);
        return usage > high / 10 * 8;
    }
    let mut need = (usage - low).div_ceil(PAGE_SIZE);
    // Cheapest first: image bases' pages (clean, counted once for all
    // their VMs), then each VM's.
    let wanted = need;
    need = need.saturating_sub(drop_base_pages(core, need));
    for vm in victims(core) {
        if need == 0 {
            break;
        }
        let took = reclaim_steps(core, vm, need, true).await;
        need = need.saturating_sub(took.freed());
    }
    let now = core.reclaim.borrow_mut().read().usage;
    open_gate(core, now, high, need < wanted);
    if need == 0 {
        *over_since = None;
        return true;
    }
    let since = *over_since.get_or_insert_with(Instant::now);
    if since.elapsed() >= BEHIND_AFTER {
        let why = behind_reason(core, usage, high);
        core.reclaim.borrow_mut().set_behind(Some(why));
    }
    true
}

/// Reclaim up to `want` pages of `vm`, a step at a time, letting faults
/// be served between steps; but not while usage is over the watermark
/// (`urgent`): then faults that would take more memory wait until the
/// pass is done, or the kernel's OOM killer would come first.
pub async fn reclaim_steps(core: &Rc<Core>, vm: VmId, want: u64, urgent: bool) -> Took {
    let mut total = Took::default();
    let mut looked = 0;
    let pages = core
        .reg
        .borrow()
        .vms
        .get(&vm)
        .map_or(0, |v| v.memory.pages());
    while total.freed() < want && looked < pages {
        let step = (want - total.freed()).min(STEP_PAGES);
        let took = super::step(core, vm, step, false).await;
        if took.examined == 0 {
            break;
        }
        looked += took.examined;
        total.examined += took.examined;
        total.dropped += took.dropped;
        total.swapped += took.swapped;
        total.kept += took.kept;
        if !urgent {
            tokio::task::yield_now().await;
        }
    }
    total
}

/// Drop up to `want` pages of the image bases (the image holds the same
/// bytes), each from where the last pass stopped; returns the pages
/// dropped.
fn drop_base_pages(core: &Core, want: u64) -> u64 {
    let bases = core.reg.borrow().bases.live();
    let mut rc = core.reclaim.borrow_mut();
    let mut dropped = 0;
    for b in bases {
        if dropped >= want {
            break;
        }
        let from = rc.base_hand(b.id);
        match b.drop_clean(from, want - dropped) {
            Ok((n, next)) => {
                dropped += n;
                rc.set_base_hand(b.id, next);
            }
            Err(e) => warn!("{}: cannot drop its pages: {e}", b.name()),
        }
    }
    rc.dropped_base_pages(dropped);
    dropped
}

/// VMs to reclaim from, coldest first: longest without a fault, then the
/// largest.
fn victims(core: &Core) -> Vec<VmId> {
    let reg = core.reg.borrow();
    let mut vms: Vec<(u64, u64, VmId)> = reg
        .vms
        .values()
        .filter(|v| pass::ineligible(v).is_none())
        .map(|v| (v.reclaim.idle_ticks, pass::held_bytes(&reg, v), v.id))
        .collect();
    vms.sort_by_key(|v| std::cmp::Reverse((v.0, v.1)));
    vms.into_iter().map(|(_, _, id)| id).collect()
}

/// VMs holding more than their own limit, and by how many pages.
fn over_own_limit(core: &Core) -> Vec<(VmId, u64)> {
    let reg = core.reg.borrow();
    reg.vms
        .values()
        .filter_map(|v| {
            let limit = v.reclaim.limit_pages()?;
            let held = pass::held_bytes(&reg, v) / PAGE_SIZE;
            (held > limit && pass::ineligible(v).is_none()).then(|| (v.id, held - limit))
        })
        .collect()
}

/// Count ticks since each VM's last fault (the coldest go first).
fn note_activity(core: &Core) {
    let mut reg = core.reg.borrow_mut();
    for v in reg.vms.values_mut() {
        let faults = v.log.stats.missing + v.log.stats.write_protect;
        if faults == v.reclaim.last_faults {
            v.reclaim.idle_ticks += 1;
        } else {
            v.reclaim.last_faults = faults;
            v.reclaim.idle_ticks = 0;
        }
    }
}

/// Why reclaim cannot get usage under the watermark.
fn behind_reason(core: &Core, usage: u64, high: u64) -> String {
    let reg = core.reg.borrow();
    let mut held: HashMap<&'static str, u64> = HashMap::new();
    for v in reg.vms.values() {
        if let Some(why) = pass::ineligible(v) {
            *held.entry(why).or_default() += pass::held_bytes(&reg, v);
        }
    }
    let mut why = format!(
        "{} MiB in use, over the watermark of {} MiB, and nothing more can be given back now",
        usage >> 20,
        high >> 20
    );
    if !core.reclaim.borrow().can_swap() {
        why.push_str(" (the swap store is full)");
    }
    for (what, bytes) in held {
        why.push_str(&format!("; {} MiB held by VMs that {what}", bytes >> 20));
    }
    why
}

/// End a thrashing window in every VM; once in a while, the swap store
/// is tried again (if it was full), trimmed and compacted.
fn end_window(core: &Core) {
    {
        let mut reg = core.reg.borrow_mut();
        for v in reg.vms.values_mut() {
            if v.reclaim.end_window() {
                warn!(
                    "{}: thrashing: it faults back most of what is reclaimed from it (give it \
                     more memory, or opt it out of reclaim)",
                    v.id
                );
            }
        }
        collect_frames(&reg, core.reclaim.borrow().store_for_reading());
    }
    let mut rc = core.reclaim.borrow_mut();
    rc.retry_store();
    if let Some(store) = rc.store_for_reading().cloned() {
        let mut s = store.borrow_mut();
        if s.wants_compaction() {
            match s.compact() {
                Ok(bytes) => info!("swap store compacted: {} MiB given back", bytes >> 20),
                Err(e) => warn!("cannot compact the swap store: {e}"),
            }
        }
    }
}

/// Free the frames of pages that came back from the store, unless
/// another table still names them there.
fn free_swapped_in(core: &Core) {
    let mut reg = core.reg.borrow_mut();
    let mut back: Vec<(SourceId, Vec<u64>)> = Vec::new();
    for v in reg.vms.values_mut() {
        if let (Some(src), false) = (v.reclaim.swap_src, v.reclaim.swapped_in.is_empty()) {
            back.push((src, std::mem::take(&mut v.reclaim.swapped_in)));
        }
    }
    for (src, pages) in back {
        let Some(PageSource::Swap(w)) = reg.arena.get(src).map(|s| &**s) else {
            continue;
        };
        let mut store = w.store.borrow_mut();
        for p in pages {
            if !reg.vms.values().any(|v| v.table.get(p) == src) {
                store.remove(w.owner(), p);
            }
        }
    }
}

/// Drop every frame of `store` that no table names (a source released, a
/// page back in memory, frames a crash left behind).
fn collect_frames(reg: &Registry, store: Option<&Rc<std::cell::RefCell<SwapStore>>>) {
    let Some(store) = store else {
        return;
    };
    let mut by_key: HashMap<u64, SourceId> = HashMap::new();
    for (id, s) in reg.arena.iter() {
        if let PageSource::Swap(w) = &**s {
            by_key.insert(w.owner(), id);
        }
    }
    store.borrow_mut().retain(|key, page| {
        by_key
            .get(&key)
            .is_some_and(|src| reg.vms.values().any(|v| v.table.get(page) == *src))
    });
}

/// After a restart: each adopted VM's `Swap` source is its own again.
fn adopt_swap_sources(reg: &mut Registry) {
    let mut mine: HashMap<VmId, SourceId> = HashMap::new();
    for (id, s) in reg.arena.iter() {
        if let PageSource::Swap(w) = &**s {
            mine.insert(w.vm, id);
        }
    }
    for v in reg.vms.values_mut() {
        if let Some(src) = mine.get(&v.id) {
            v.reclaim.swap_src = Some(*src);
        }
    }
}
