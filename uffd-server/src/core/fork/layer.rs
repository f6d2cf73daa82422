//! Layers: what a VM on a shared base wrote, copied out of its VMM when it
//! forks, so that no child ever depends on the parent's process.
//!
//! A VM on a base holds the pages its guest wrote as private pages of its
//! VMM. So a fork of such a VM copies the pages it holds, as the fork
//! captured them, into a memfd the server owns (a layer), and the children
//! read them there, whatever becomes of the parent:
//!
//! 1. In the pause ([`begin`]): a layer memfd is made (before the pause,
//!    [`prepare`]) and the parent's `Vm(parent)` source is frozen over it,
//!    so the children's tables, forked in the same pause, name the layer.
//!    The parent gets a new source for its own pages, and its table names
//!    them by it. Every page to copy is write-protected in the parent (the
//!    fork protected them), so its bytes cannot change before they are
//!    copied.
//! 2. The children start at once, as any fork's do; the fork answers
//!    without waiting for the copy.
//! 3. After the resume, in a task of its own ([`spawn_fill`]): the pages
//!    are copied out of the VMM (`process_vm_readv`) into the layer a few
//!    MiB at a time, with the rest of the core's work served between two
//!    steps. A read of a page not copied yet (a child's fault, a snapshot,
//!    anything through `pages::read_pages`) copies it first
//!    (`LayerFill::ensure`), and so does a write or a discard of the parent
//!    (`Layering::save`, from the write-protect and remove paths).
//!
//! What keeps the pages not copied yet readable whatever happens to the
//! parent's VMM (DELETE, exit, crash, SIGKILL) is its anchor, a process
//! that shares its address space (`pages::anchor`): they are read by the
//! anchor's pid, which the fill holds until the layer is whole. The one
//! death an anchor does not survive is the OOM killer's, which kills every
//! process of an address space; while the layer fills, the parent's VMM
//! and its anchor have the lowest `oom_score_adj` of all VMMs and the
//! children the highest, so the kernel kills a child (which loses only
//! itself) before the VMM whose pages others need. A restarted server
//! goes on filling from the journal (`Record::Filling`: the anchor by pid
//! and start time; the pages still to copy are those the tables name the
//! layer for that its memfd lacks). If the pages are lost all the same,
//! every read of one fails with the reason: no VM reads a page the layer
//! lacks.
//!
//! The parent's table goes on naming the layer for the pages it holds
//! unchanged: it holds them as the layer does until it writes one, and
//! that write faults (the fork protected them) and names the page its own
//! again (`Vm::own_written`). So a further fork, of a paused template or
//! of a running VM, copies only what the parent wrote since the fork
//! before, and its children share the earlier layers for the rest:
//! nothing is copied twice. A further fork waits for the layer before it
//! ([`wait_filled`]).

use std::rc::Rc;

use shared::VmId;
use tracing::{info, warn};

use super::error::LayerError;
use super::layering::Layering;
use crate::core::error::{Error, Result};
use crate::core::registry::Registry;
use crate::core::state::Core;
use crate::memory::GuestMemory;
use crate::pages::source::LayerFill;
use crate::pages::{PageSource, VmPages};
use crate::snapshot::PageSet;

/// Pages copied into a layer in one step of the fill (256 KiB).
const STEP_PAGES: u64 = 64;

/// The fill copies steps for at most this long before the core's other
/// work runs: the children it fills for start meanwhile, and every message
/// and fault of theirs waits for the step in progress.
const SLICE: std::time::Duration = std::time::Duration::from_micros(200);

/// Before the fork's pause: the memfd a layer of `parent` would be
/// filled into, made while the parent still runs (making it costs a few
/// hundred µs here, which the pause need not pay). `None` for a VM that
/// needs no layer (on its own memfd, or holding nothing of its own yet:
/// its writes before the pause fault, and `begin` makes the memfd), or a
/// memfd that cannot be made (then
/// `begin` tries again and says why).
pub(crate) fn prepare(reg: &Registry, parent: VmId) -> Option<Rc<GuestMemory>> {
    let v = reg.vms.get(&parent)?;
    // Nothing of its own (a template forked again, a VM that wrote
    // nothing since its last fork): no layer to make.
    if !v.base.is_based() || v.table.count_of(v.self_src) == 0 {
        return None;
    }
    GuestMemory::create_with(
        &format!("pagefork-{parent}-layer"),
        v.memory.size(),
        v.memory.page_size(),
    )
    .ok()
    .map(Rc::new)
}

/// Step 1, in the fork's pause, after the children's tables were forked
/// and before anything awaits: if `parent` is a VM on a base holding
/// pages of its own, freeze them into a new (empty) layer and give the
/// parent a new source for the pages it writes from now on; its table
/// names the layer for the pages it holds. Nothing to copy: a VM on its
/// own memfd (whose memfd the server owns already), or a VM on a base
/// that wrote nothing since it last forked. Returns whether a layer is
/// to be filled. `made` is the memfd [`prepare`] made, if any.
pub(crate) fn begin(
    reg: &mut Registry,
    parent: VmId,
    made: Option<Rc<GuestMemory>>,
) -> Result<bool> {
    let Some(VmPages::Process(process)) = reg.arena.memory_of(parent) else {
        return Ok(false);
    };
    let Registry { vms, arena, .. } = reg;
    let Some(v) = vms.get_mut(&parent) else {
        return Ok(false);
    };
    if !v.base.is_based() {
        return Ok(false);
    }
    if v.fork.layering.is_some() {
        // `wait_filled` runs first: never two layers filling from one VM.
        return Err(Error::Layer(LayerError::Lost {
            vm: parent,
            why: "a layer is still being filled from it".into(),
        }));
    }
    let held = v.table.count_of(v.self_src);
    if held == 0 {
        return Ok(false);
    }
    let unit = v.memory.unit_pages();
    // 4 KiB pages: the set to copy is made after the resume (`plan`);
    // until then what the layer's memfd lacks is to copy. Hugepages (whose
    // memfd cannot say which blocks it holds): made now.
    let pending = (unit > 1).then(|| {
        let mut pending = PageSet::new(v.memory.pages());
        for (first, n) in v.table.ranges_of(v.self_src) {
            let (lo, hi) = v.memory.unit_range(first, first + n);
            pending.insert_range(lo, hi - lo);
        }
        pending
    });
    let layer = match made {
        Some(m) => m,
        None => Rc::new(
            GuestMemory::create_with(
                &format!("pagefork-{parent}-layer"),
                v.memory.size(),
                v.memory.page_size(),
            )
            .map_err(|source| Error::Layer(LayerError::Create { vm: parent, source }))?,
        ),
    };
    let Some(frozen) = arena.freeze_to_layer(parent, Rc::clone(&layer)) else {
        return Ok(false);
    };
    v.self_src = arena.vm(parent);
    let l = Rc::new(Layering::new(parent, frozen, layer, process, pending, unit));
    if let Some(PageSource::Frozen(f)) = arena.get(frozen).map(|s| &**s) {
        *f.filling.borrow_mut() = Some(Rc::clone(&l) as Rc<dyn LayerFill>);
    }
    v.fork.layering = Some(l);
    // Logged and scored after the resume (`spawn_fill`): a log line or a
    // write to /proc costs tens of µs, which the pause need not pay.
    Ok(true)
}

/// Step 2, after the resume: copy every pending page into the layer, a
/// step at a time, serving the rest of the core between steps, in a task
/// of its own: the children run meanwhile, and a read of a page not copied
/// yet copies it first (`Layering::ensure`).
pub(crate) fn spawn_fill(core: &Rc<Core>, l: Rc<Layering>) {
    plan(&core.reg.borrow(), &l);
    let core = Rc::clone(core);
    let parent = l.vm();
    // Until the layer is whole, the kernel's OOM killer must choose any
    // other VMM before this one (it cannot be forbidden to choose it: see
    // `pages::anchor`): the lowest score for the VMM and its anchor.
    if let Some(pid) = core.reg.borrow().vms.get(&parent).and_then(|v| v.link.pid) {
        set_oom_score_adj(pid, 0);
    }
    if let Some(a) = l.anchor() {
        a.set_oom_score_adj(0);
    }
    info!(
        "{parent}: {} pages it wrote are frozen into a layer for its children; filling it",
        l.pending()
    );
    tokio::task::spawn_local(async move {
        let t = std::time::Instant::now();
        let mut slice = std::time::Instant::now();
        loop {
            match l.step(STEP_PAGES) {
                Ok(true) if slice.elapsed() < SLICE => {}
                Ok(true) => {
                    tokio::task::yield_now().await;
                    slice = std::time::Instant::now();
                }
                Ok(false) => break,
                Err(e) => {
                    warn!(
                        "{parent}: its layer cannot be filled; the pages still to copy are lost: {}",
                        shared::error_chain(&e)
                    );
                    break;
                }
            }
        }
        finish(&core, &l);
        if l.failure().is_none() {
            info!(
                "{parent}: {} pages it wrote copied into a layer for its children in {} ms",
                l.copied(),
                t.elapsed().as_millis()
            );
        }
    });
}

/// Wait until no layer is being filled from `parent`: a fork that froze
/// a new layer over it meanwhile would take the earlier layer's place in
/// the parent, whose writes must go on saving the earlier one's pages.
/// Fills are short (a few hundred MiB a second) and run on this thread.
pub(crate) async fn wait_filled(core: &Core, parent: VmId) {
    loop {
        let filling = core
            .reg
            .borrow()
            .vms
            .get(&parent)
            .is_some_and(|v| v.fork.layering.is_some());
        if !filling {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Pages `parent` holds of its own (what a layer frozen from it now
/// would be to copy).
pub(crate) fn held(core: &Core, parent: VmId) -> u64 {
    core.reg
        .borrow()
        .vms
        .get(&parent)
        .map_or(0, |v| v.table.count_of(v.self_src))
}

/// After the resume, before the fill: the set of pages `l` is to copy,
/// every page a table names its layer for, less what reads and saves
/// copied since the pause.
pub(crate) fn plan(reg: &Registry, l: &Layering) {
    if l.planned() {
        return;
    }
    let mut named = PageSet::new(l.layer().pages());
    for v in reg.vms.values() {
        for (first, n) in v.table.ranges_of(l.frozen()) {
            named.insert_range(first, n);
        }
    }
    l.plan(named);
}

/// The children of a fork whose layer is filling: until it is whole, the
/// OOM killer prefers them to the VMM they read from.
pub(crate) fn children_started(core: &Core, parent: VmId, children: &[VmId]) {
    let reg = core.reg.borrow();
    let Some(l) = reg.vms.get(&parent).and_then(|v| v.fork.layering.clone()) else {
        return;
    };
    for c in children {
        if let Some(pid) = reg.vms.get(c).and_then(|v| v.link.pid) {
            set_oom_score_adj(pid, 1000);
            l.add_dependent(pid);
        }
    }
}

/// A fill is over, whole or failed: the layer's readers read it as it is
/// (a failed one keeps failing the reads of the pages it lost), the
/// parent's writes need no saving, and the OOM scores are as before.
fn finish(core: &Core, l: &Rc<Layering>) {
    let mut reg = core.reg.borrow_mut();
    if l.failure().is_none() {
        if let Some(PageSource::Frozen(f)) = reg.arena.get(l.frozen()).map(|s| &**s) {
            f.filling.borrow_mut().take();
        }
    }
    let default = crate::core::link::process::vmm_oom_score_adj();
    if let Some(v) = reg.vms.get_mut(&l.vm()) {
        if v.fork.layering.as_ref().is_some_and(|m| Rc::ptr_eq(m, l)) {
            v.fork.layering = None;
        }
        if let Some(pid) = v.link.pid {
            set_oom_score_adj(pid, default);
        }
    }
    if let Some(a) = l.anchor() {
        a.set_oom_score_adj(default);
    }
    for pid in l.dependents() {
        set_oom_score_adj(pid, default);
    }
}

fn set_oom_score_adj(pid: u32, adj: i32) {
    let _ = std::fs::write(format!("/proc/{pid}/oom_score_adj"), adj.to_string());
}

/// The fork failed before its children started: the layering of `parent`
/// is undone (its table, which named the unfilled layer for the pages it
/// holds, names them as its own again, and the layer goes).
pub(crate) fn undo(core: &Core, parent: VmId) {
    let mut reg = core.reg.borrow_mut();
    let Some(v) = reg.vms.get_mut(&parent) else {
        return;
    };
    let Some(l) = v.fork.layering.take() else {
        return;
    };
    let me = v.self_src;
    for (first, n) in v.table.ranges_of(l.frozen()) {
        v.table.set_range(first, n, me);
    }
    if let Some(PageSource::Frozen(f)) = reg.arena.get(l.frozen()).map(|s| &**s) {
        f.filling.borrow_mut().take();
    }
    // An unfilled layer no table reads any more goes now.
    reg.release_unused_sources();
    drop(reg);
    finish(core, &l);
}
