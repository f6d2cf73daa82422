//! Shared bases in the core: which VMs map one, and the steps that put a
//! VM on one (see [`crate::bases`] for what a base is).
//!
//! - A VM made from an image (a restore, a clone, a raw or compressed
//!   image) maps the image's base from the start ([`attach_image`]).
//! - The children of a fork of a VM on a base map the same base; the
//!   children of a paused VM on its own memfd (a template) map that memfd,
//!   frozen as a template base ([`for_children`]). The template moves onto
//!   it, private, before it runs again ([`move_onto_base`]).
//! - The children of a running VM on its own memfd copy what they read,
//!   as before: its memfd keeps changing under them.
//!
//! A VM on a base writes private pages of its VMM. Every page it maps
//! from the base (and every zero page) is mapped write-protected, so its
//! first write to one faults and its table names the page as its own from
//! then on (`fault::install::Target::map_from_base`): the table is exact
//! without asking the kernel, and a fork's pause scans nothing. What the
//! kernel says ([`sync_private`], `PAGEMAP_SCAN`) stays the check where a
//! table may lag: after a restart (a page installed, or a protection
//! lifted, just before the crash; pages a server of an older version
//! mapped unprotected, see [`protect_shared`]), and before a snapshot
//! saves, a rollback drops or a view shows a VM.

pub mod state;

use std::os::fd::OwnedFd;
use std::rc::Rc;

use proto::vmm::{Reply, Request};
use shared::VmId;
use tracing::info;

use self::state::OnBase;
use crate::core::error::{Error, Result};
use crate::core::link::requests::{await_reply, send_request_with_fds};
use crate::core::registry::Registry;
use crate::core::state::Core;
use crate::memory::GuestMemory;
use crate::pages::process::ProcessPages;
use crate::pages::{FrozenKind, PageSource, SourceId, VmPages};

/// Put `vm`, being made with a table that reads the image source `src`,
/// on that image's base (made empty if it is the first VM of it). A
/// source without an identity (not an image), or a base that cannot be
/// made, leaves the VM on its own memfd, copying what it reads.
pub(crate) fn attach_image(reg: &mut Registry, vm: VmId, src: SourceId) {
    let Some(source) = reg.arena.get(src).cloned() else {
        return;
    };
    let Some(identity) = source.identity() else {
        return;
    };
    let Registry { vms, bases, .. } = reg;
    let Some(v) = vms.get_mut(&vm) else {
        return;
    };
    let page_size = v.memory.page_size();
    let key = crate::bases::ImageKey::new(identity, page_size);
    match bases.for_image(key, &source.describe(), v.memory.size(), page_size) {
        Ok(base) => v.base.on = Some(OnBase { base, src }),
        Err(e) => tracing::warn!(
            "{vm}: copies what it reads of {}: {}",
            source.describe(),
            shared::error_chain(&e)
        ),
    }
}

/// The base the children of a fork of `parent` map: its own base, or,
/// when it is a paused VM on its own memfd (`template`), that memfd
/// frozen as a template base. `None`: the children copy what they read
/// (a running parent on its own memfd keeps writing it).
pub(crate) fn for_children(reg: &mut Registry, parent: VmId, template: bool) -> Option<OnBase> {
    let Registry { vms, bases, .. } = reg;
    let p = vms.get_mut(&parent)?;
    if let Some(on) = &p.base.on {
        return Some(on.clone());
    }
    if !template {
        return None;
    }
    let base = match &p.base.frozen_for {
        Some(b) => Rc::clone(b),
        None => {
            let b = bases.template(parent, Rc::clone(&p.memory));
            info!("{parent}: its memory is {} of its children now", b.name());
            p.base.frozen_for = Some(Rc::clone(&b));
            b
        }
    };
    Some(OnBase {
        base,
        src: p.self_src,
    })
}

/// Move `vm`, whose memfd became the base of its children, onto that
/// base before it runs or its memfd could be written: its VMM maps the
/// memfd private (`Request::Rebase`, while paused), its table's pages of
/// the memfd read from the frozen memfd from now on, and what it writes
/// is its own. Nothing to do for any other VM.
pub(crate) async fn move_onto_base(core: &Rc<Core>, vm: VmId) -> Result<()> {
    let base = {
        let reg = core.reg.borrow();
        match reg.vms.get(&vm).and_then(|v| v.base.frozen_for.clone()) {
            Some(b) => b,
            None => return Ok(()),
        }
    };
    let fd = base
        .memory
        .memfd()
        .try_clone()
        .map_err(|e| Error::CreateMemory(crate::memory::MemoryError::Read(e)))?;
    let rx = send_request_with_fds(core, vm, Request::Rebase, vec![OwnedFd::from(fd)])?;
    match await_reply(vm, rx, core.settings.vmm_deadline).await? {
        Reply::Done => {}
        other => {
            return Err(crate::core::link::error::LinkError::UnexpectedReply {
                vm,
                request: "rebase",
                reply: format!("{other:?}"),
            }
            .into())
        }
    }
    let mut reg = core.reg.borrow_mut();
    let Registry { vms, arena, .. } = &mut *reg;
    let Some(v) = vms.get_mut(&vm) else {
        return Ok(());
    };
    // The memfd's source stays, frozen, under the id the tables (this
    // VM's included) name it by; the VM gets a new id for its own pages.
    let Some(frozen) = arena.freeze(vm) else {
        return Ok(());
    };
    v.self_src = arena.vm(vm);
    if let Some(pid) = v.link.pid {
        if let Ok(pages) = ProcessPages::open(pid, v.faults.vmm_base, v.link.anchor.clone()) {
            arena.vm_in_process(vm, pages);
        }
    }
    // Nothing may write the base through the VM's memory from now on.
    let name = format!("pagefork-{vm}");
    v.memory = Rc::new(
        GuestMemory::create_with(&name, v.memory.size(), v.memory.page_size())
            .map_err(Error::CreateMemory)?,
    );
    v.base.on = Some(OnBase { base, src: frozen });
    v.base.frozen_for = None;
    // Its pages' protection went with the old mapping.
    v.fork.forget_template();
    info!("{vm}: moved onto its children's base");
    Ok(())
}

/// Mark in `vm`'s table the pages its VMM holds as its own, as the
/// kernel says (`PAGEMAP_SCAN`): a check, since every first write to a
/// page mapped from the base faults (see the module doc). Pages its
/// table names by one of its own layers stay so: it holds them as the
/// layer does until it writes them, which faults. Returns how many pages
/// were new to the table. Nothing to do for a VM on its own memfd, or
/// before its VMM runs.
pub(crate) fn sync_private(reg: &mut Registry, vm: VmId) -> Result<u64> {
    Ok(sync_private_runs(reg, vm)?.iter().map(|r| r.1).sum())
}

/// [`sync_private`], returning the runs `(first, n)` of pages that were
/// new to the table.
pub(crate) fn sync_private_runs(reg: &mut Registry, vm: VmId) -> Result<Vec<(u64, u64)>> {
    sync_private_with(reg, vm, true)
}

/// After a restart: every page `vm`'s VMM maps shared is protected
/// ([`protect_shared`]), then every page it holds is its own, its layers'
/// included (a write whose protection was lifted just before the crash
/// may have left the journal naming the layer for a page it changed
/// since). In that order: a write after the protection faults, one before
/// it made its page private before the scan. Returns how many pages were
/// new to the table.
pub(crate) fn sync_after_restart(reg: &mut Registry, vm: VmId) -> Result<u64> {
    protect_shared(reg, vm)?;
    Ok(sync_private_with(reg, vm, false)?.iter().map(|r| r.1).sum())
}

/// Write-protect every page `vm` maps from its base (or as the zero page)
/// now, as the fault path maps them: a server of an older version mapped
/// them unprotected. Returns how many pages.
fn protect_shared(reg: &Registry, vm: VmId) -> Result<u64> {
    let Some(VmPages::Process(p)) = reg.arena.memory_of(vm) else {
        return Ok(0);
    };
    let Some(v) = reg.vms.get(&vm) else {
        return Ok(0);
    };
    if !v.base.is_based() || v.faults.uffd.is_none() {
        return Ok(0);
    }
    let runs = p
        .shared_runs(v.memory.pages())
        .map_err(|source| Error::BaseSync {
            vm,
            source: crate::pages::ResolveError::Process(source),
        })?;
    crate::core::snapshot::arm::protect(v, &runs)?;
    Ok(runs.iter().map(|r| r.1).sum())
}

/// [`sync_private`]; `keep_layers`: pages named by one of the VM's own
/// layers stay so.
fn sync_private_with(reg: &mut Registry, vm: VmId, keep_layers: bool) -> Result<Vec<(u64, u64)>> {
    let Some(VmPages::Process(p)) = reg.arena.memory_of(vm) else {
        return Ok(Vec::new());
    };
    let Some(v) = reg.vms.get_mut(&vm) else {
        return Ok(Vec::new());
    };
    if !v.base.is_based() {
        return Ok(Vec::new());
    }
    if v.faults.uffd.is_none() {
        // Its VMM is gone (exited, killed): nothing can change any more,
        // and its pagemap cannot be read. The table is all that is known
        // (a read-only view of such a VM must not fail for it).
        return Ok(Vec::new());
    }
    let runs = p
        .private_runs(v.memory.pages())
        .map_err(|source| Error::BaseSync {
            vm,
            source: crate::pages::ResolveError::Process(source),
        })?;
    let me = v.self_src;
    // Pages it holds as one of its layers does are named by the layer
    // until it writes them (see `fork::layer`).
    let arena = &reg.arena;
    let own_layer = |src| keep_layers && layer_of(arena, vm, src);
    let mut new: Vec<(u64, u64)> = Vec::new();
    for (first, n) in runs {
        for page in first..first + n {
            let now = v.table.get(page);
            if now != me && !own_layer(now) {
                v.table.set(page, me);
                match new.last_mut() {
                    Some((f, k)) if *f + *k == page => *k += 1,
                    _ => new.push((page, 1)),
                }
            }
        }
    }
    Ok(new)
}

/// Whether `src` is a layer of `vm`'s pages (see `fork::layer`).
pub(crate) fn is_own_layer(reg: &Registry, vm: VmId, src: SourceId) -> bool {
    layer_of(&reg.arena, vm, src)
}

fn layer_of(arena: &crate::pages::SourceArena, vm: VmId, src: SourceId) -> bool {
    arena.get(src).is_some_and(
        |s| matches!(&**s, PageSource::Frozen(f) if f.vm == vm && f.kind == FrozenKind::Layer),
    )
}

/// Which of `vm`'s pages its VMM holds privately now, one flag per page,
/// read from the kernel (`PAGEMAP_SCAN`); `None` for a VM on its own
/// memfd or whose VMM cannot be read.
pub(crate) fn private_pages(reg: &Registry, vm: VmId) -> Option<Vec<bool>> {
    let v = reg.vms.get(&vm)?;
    if !v.base.is_based() {
        return None;
    }
    let Some(VmPages::Process(p)) = reg.arena.memory_of(vm) else {
        return None;
    };
    let pages = v.memory.pages();
    let runs = p.private_runs(pages).ok()?;
    let mut held = vec![false; usize::try_from(pages).ok()?];
    for (first, n) in runs {
        for page in first..(first + n).min(pages) {
            held[shared::geometry::usize_of(page)] = true;
        }
    }
    Some(held)
}

/// `vm`'s uffd arrived: if it is on a base, its own pages are private
/// pages of its VMM, read from there by the VMs that read them from it.
pub(crate) fn on_uffd_ready(reg: &mut Registry, vm: VmId) {
    let Registry { vms, arena, .. } = reg;
    let Some(v) = vms.get(&vm) else {
        return;
    };
    if !v.base.is_based() {
        return;
    }
    let Some(pid) = v.link.pid else {
        return;
    };
    match ProcessPages::open(pid, v.faults.vmm_base, v.link.anchor.clone()) {
        Ok(pages) => arena.vm_in_process(vm, pages),
        Err(e) => tracing::warn!("{vm}: cannot read its VMM's pagemap: {e}"),
    }
}

/// Where `vm`'s guest RAM is in host memory, read from the kernel: its
/// own memfd's pages, or its VMM's private pages and the pages it maps
/// from its base (`PAGEMAP_SCAN`).
pub(crate) fn memory(reg: &Registry, vm: VmId) -> proto::api::VmMemory {
    let Some(v) = reg.vms.get(&vm) else {
        return proto::api::VmMemory::default();
    };
    if let Some(frozen) = &v.base.frozen_for {
        // A paused template whose memfd is its children's base: what it
        // holds is the base's (counted there once).
        return proto::api::VmMemory {
            own_bytes: 0,
            shared_bytes: v.memory.allocated_bytes(),
            base: Some(frozen.name()),
        };
    }
    let Some(on) = &v.base.on else {
        return proto::api::VmMemory {
            own_bytes: v.memory.allocated_bytes(),
            shared_bytes: 0,
            base: None,
        };
    };
    let (own, shared) = match reg.arena.memory_of(vm) {
        Some(VmPages::Process(p)) => p.counts(v.memory.pages()).unwrap_or_default(),
        _ => (0, 0),
    };
    proto::api::VmMemory {
        own_bytes: own * shared::PAGE_SIZE,
        shared_bytes: shared * shared::PAGE_SIZE,
        base: Some(on.base.name()),
    }
}

/// `GET /v1/bases`: every shared base, what it holds and who maps it.
pub(crate) fn list(reg: &Registry) -> proto::api::BaseList {
    let bases = reg
        .bases
        .live()
        .into_iter()
        .map(|b| {
            let users = reg
                .vms
                .values()
                .filter(|v| {
                    v.base
                        .on
                        .as_ref()
                        .is_some_and(|on| Rc::ptr_eq(&on.base, &b))
                })
                .map(|v| v.id.to_string())
                .collect();
            proto::api::BaseInfo {
                id: b.name(),
                kind: match b.origin {
                    crate::bases::Origin::Template(_) => "template",
                    crate::bases::Origin::Image { .. } => "image",
                }
                .into(),
                of: b.what.clone(),
                bytes: b.bytes(),
                size_bytes: b.memory.size(),
                users,
            }
        })
        .collect();
    proto::api::BaseList { bases }
}
