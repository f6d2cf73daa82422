//! Layers: what a VM on a shared base wrote, copied out of its VMM when it
//! forks, so that no child ever depends on the parent's process.
//!
//! A VM on a base holds the pages its guest wrote as private pages of its
//! VMM: they die with that process, and a SIGKILL gives no chance to copy
//! them anywhere. So a fork of such a VM copies the pages it holds, as the
//! fork captured them, into a memfd the server owns (a layer), and the
//! children read them there, whatever becomes of the parent:
//!
//! 1. In the pause ([`begin`]): a layer memfd is made and the parent's
//!    `Vm(parent)` source is frozen over it, so the children's tables,
//!    forked in the same pause, name the layer. The parent gets a new
//!    source for its own pages, and its table names them by it. Every
//!    page to copy is write-protected in the parent (the fork protected
//!    them), so its bytes cannot change before they are copied.
//! 2. After the resume ([`fill`]): the pages are copied out of the VMM
//!    (`process_vm_readv`) into the layer a few MiB at a time, with the
//!    rest of the core's work served between two steps. A write (or a
//!    discard) of the parent to a page not copied yet copies that page
//!    first (`Layering::save`, from the write-protect and remove paths).
//! 3. The children start once the layer is whole. If the parent's VMM
//!    dies before, the fork fails and its children are discarded: no VM
//!    ever reads a page the layer lacks.
//!
//! The parent's table goes on naming the layer for the pages it holds
//! unchanged: it holds them as the layer does until it writes one, and
//! that write faults (the fork protected them) and names the page its own
//! again (`Vm::own_written`). So a further fork, of a paused template or
//! of a running VM, copies only what the parent wrote since the fork
//! before, and its children share the earlier layers for the rest:
//! nothing is copied twice.

use std::rc::Rc;

use shared::VmId;
use tracing::info;

use super::error::LayerError;
use super::layering::Layering;
use crate::core::error::{Error, Result};
use crate::core::registry::Registry;
use crate::core::state::Core;
use crate::memory::GuestMemory;
use crate::pages::VmPages;
use crate::snapshot::PageSet;

/// Pages copied into a layer in one step of [`fill`] (4 MiB).
const STEP_PAGES: u64 = 1024;

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
    let runs = v.table.ranges_of(v.self_src);
    if runs.is_empty() {
        return Ok(false);
    }
    let unit = v.memory.unit_pages();
    let mut pending = PageSet::new(v.memory.pages());
    for &(first, n) in &runs {
        let (lo, hi) = v.memory.unit_range(first, first + n);
        pending.insert_range(lo, hi - lo);
    }
    let pages = pending.len();
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
    v.fork.layering = Some(Layering::new(parent, frozen, layer, process, pending, unit));
    info!("{parent}: {pages} pages it wrote are frozen into a layer for its children");
    Ok(true)
}

/// Step 2, after the resume: copy every pending page into the layer, a
/// step at a time, serving the rest of the core between steps. On
/// failure (the parent's VMM died), the error; the caller fails the fork.
pub(crate) async fn fill(core: &Rc<Core>, parent: VmId) -> Result<u64> {
    loop {
        let step = {
            let mut reg = core.reg.borrow_mut();
            let Some(l) = reg
                .vms
                .get_mut(&parent)
                .and_then(|v| v.fork.layering.as_mut())
            else {
                return Err(Error::NoSuchVm(parent));
            };
            if let Some(why) = l.take_failure() {
                Err(Error::LayerLost { vm: parent, why })
            } else {
                l.step(STEP_PAGES).map_err(Error::Layer)
            }
        };
        match step {
            Ok(true) => tokio::task::yield_now().await,
            Ok(false) => break,
            Err(e) => {
                end(core, parent, false);
                return Err(e);
            }
        }
    }
    let copied = end(core, parent, true);
    info!("{parent}: {copied} pages it wrote copied into a layer for its children");
    Ok(copied)
}

/// The layering of `parent` is over: filled, or failed (`filled` false:
/// its fork fails and discards the children, and its table, which named
/// the unfilled layer for the pages it holds, names them as its own
/// again). Later writes need no saving. Returns the pages copied.
pub(crate) fn end(core: &Core, parent: VmId, filled: bool) -> u64 {
    let mut reg = core.reg.borrow_mut();
    let Some(v) = reg.vms.get_mut(&parent) else {
        return 0;
    };
    let Some(l) = v.fork.layering.take() else {
        return 0;
    };
    if !filled {
        let me = v.self_src;
        for (first, n) in v.table.ranges_of(l.frozen()) {
            v.table.set_range(first, n, me);
        }
    }
    if !filled {
        // An unfilled layer no table reads any more goes now.
        reg.release_unused_sources();
    }
    l.copied()
}
