//! Our VMs' uffd events, one at a time: a MISSING fault installs the page
//! (and its run) through the installer ([`super::install`]); a
//! write-protect fault first gives the page's pre-write bytes to the VMs
//! that still read it from this one ([`super::dependents`]), then lifts
//! the protection; a MINOR fault maps a page the memfd holds, or replaces a
//! stale one; a REMOVE drops pages the guest gave back.
//!
//! Before a write lands (a write fault of any kind, a REMOVE), the VM's
//! dirty log, the arming set of a fork or snapshot under way, and a
//! snapshot still saving see it first (`snapshot::track::before_write`).

use proto::api::FaultKind as ApiKind;
use shared::VmId;
use tracing::{debug, warn};
use userfaultfd::{Event, FaultKind, ReadWrite};

use super::books::{handled, install_target, target, unservable, Handled, OurBooks};
use super::install::{self, Request, Served};
use crate::core::ratelimit::suppressed_note;
use crate::core::registry::Registry;
use crate::core::snapshot::track::before_write;
use crate::observe::phases::{self, Phase};
use crate::pages::{ResolveError, UNINITIALIZED};

/// Handle one uffd event of `vm`.
pub fn handle_event(reg: &mut Registry, vm: VmId, event: Event) -> Handled {
    match event {
        Event::Pagefault { kind, rw, addr, .. } => {
            handle_fault(reg, vm, kind, rw == ReadWrite::Write, addr as u64)
        }
        Event::Remove { start, end } => handle_remove(reg, vm, start as u64, end as u64),
        other => {
            debug!("{vm}: ignoring uffd event {other:?}");
            Handled::Ok
        }
    }
}

fn handle_fault(reg: &mut Registry, vm: VmId, kind: FaultKind, write: bool, addr: u64) -> Handled {
    let Some(v) = reg.vms.get_mut(&vm) else {
        return Handled::Ok;
    };
    let Some(page) = v.page_of(addr) else {
        if let Some(n) = v.faults.warnings.allow() {
            warn!(
                "{vm}: fault at {addr:#x} outside guest RAM; ignoring{}",
                suppressed_note(n)
            );
        }
        return Handled::Ok;
    };
    v.log.pages.fault(
        page,
        match kind {
            FaultKind::WriteProtected => ApiKind::Wp,
            FaultKind::Missing | FaultKind::Minor => ApiKind::Missing,
        },
    );
    if write || kind == FaultKind::WriteProtected {
        // A write is coming: the dirty log and a snapshot still saving
        // this page see it first.
        before_write(reg, vm, page);
    }
    let based = reg.is_based(vm);
    if kind == FaultKind::Missing || kind == FaultKind::Minor && based {
        // Memory is near its limit and reclaim has not caught up: the
        // fault waits for it (`core::reclaim::gate`), then is retried.
        if let Some(ready) = reg.gate.hold(reg.installed) {
            return Handled::Wait {
                page,
                ready: vec![ready],
                write_protect: false,
            };
        }
    }
    match kind {
        FaultKind::Missing => resolve_missing(reg, vm, page, write),
        FaultKind::WriteProtected => resolve_write_protect(reg, vm, page),
        // Over a base, MINOR is how a page the base holds faults first.
        FaultKind::Minor if based => {
            if let Some(v) = reg.vms.get_mut(&vm) {
                v.log.stats.minor += 1;
            }
            resolve_missing(reg, vm, page, write)
        }
        FaultKind::Minor => resolve_minor(reg, vm, page),
    }
}

/// Make `page` (and the run planned around it) present in `vm`'s memory
/// from its source, and wake the faulting thread (see
/// [`install::serve_missing`]). A VM whose VMM is gone (a fault retried
/// after it exited) gets the page through the server's mapping. `write`:
/// the fault is a write (over a base, the page is the VM's own from now
/// on; a retried fault whose kind is forgotten passes `false`, and its
/// write then faults once more, write-protected).
pub(crate) fn resolve_missing(reg: &mut Registry, vm: VmId, page: u64, write: bool) -> Handled {
    let Some(uffd) = reg.vms.get(&vm).and_then(|v| v.faults.uffd.clone()) else {
        return super::materialize::without_vmm(reg, vm, page);
    };
    let Registry {
        vms,
        arena,
        installed,
        readahead_piece_pages,
        ..
    } = reg;
    let Some(v) = vms.get_mut(&vm) else {
        return Handled::Ok;
    };
    let on = v.base.on.clone();
    let t = install_target(v, &uffd, on.as_ref());
    let piece = match *readahead_piece_pages {
        0 => 0,
        n => n.max(v.faults.fault_around_pages),
    };
    let req = Request {
        page,
        bounds: 0..v.memory.pages(),
        fault_around: v.faults.fault_around_pages,
        track: true,
        piece,
        // Over a base, a never-written page maps the zero page (until the
        // guest writes it); in a memfd of its own it must be allocated.
        zero_pages: on.is_some() && v.memory.unit_pages() == 1,
        blocks_ahead: true,
        write,
    };
    let mut books = OurBooks { v, installed };
    let served = install::serve_missing(&mut books, arena, &t, &req);
    let served = match served {
        // A pending event (the VMM discarding memory) is read on this
        // thread after this batch: the woken thread faults again.
        Served::Again => install::wake(&mut books, &t, page),
        other => other,
    };
    if !matches!(served, Served::Wait(_)) {
        books.v.log.stats.missing += 1;
    }
    handled(served, page, false)
}

/// A page in the memfd that the VMM does not map: registered MINOR only
/// after a rollback discarded pages. A stale page (the table points
/// elsewhere) is punched and installed from the table like a missing one;
/// any other page is the VM's own and is mapped as it is
/// (UFFDIO_CONTINUE).
fn resolve_minor(reg: &mut Registry, vm: VmId, page: u64) -> Handled {
    let Some(v) = reg.vms.get_mut(&vm) else {
        return Handled::Ok;
    };
    v.log.stats.minor += 1;
    if v.table.get(page) != v.self_src || v.rollback.stale.contains(page) {
        // Whatever the memfd holds there is not the VM's page: drop it
        // (stale or not), then install the table's.
        v.rollback.stale.remove(page);
        if let Err(e) = v.memory.punch_hole(page, 1) {
            return unservable(reg, vm, page, &ResolveError::Memory(e));
        }
        return resolve_missing(reg, vm, page, false);
    }
    let Some(uffd) = v.faults.uffd.clone() else {
        return Handled::Ok;
    };
    let addr = v.addr_of(page);
    match uffd.get_ref().r#continue(
        addr.cast(),
        shared::geometry::usize_of(shared::PAGE_SIZE),
        true,
    ) {
        Ok(_) => Handled::Ok,
        // Mapped meanwhile, or the VMM is on its way out: a wake lets the
        // thread retry (or find out).
        Err(e) => {
            debug!("{vm}: UFFDIO_CONTINUE of page {page}: {e}");
            let t = target(v, &uffd);
            let mut books = OurBooks {
                v,
                installed: &mut reg.installed,
            };
            handled(install::wake(&mut books, &t, page), page, false)
        }
    }
}

/// Copy-on-write step for a WP fault: give the pre-write page to every VM
/// that still reads it from `vm`, then lift the protection. On hugetlb the
/// unit is the whole block: its pre-write copy goes to the dependents and
/// its protection is lifted whole.
///
/// A dependent whose VMM has connected but whose uffd has not arrived can
/// take the copy neither way (its guest may run already, see
/// [`crate::core::vm::Vm::uffd_pending`]): the write waits, protected, until the uffd is
/// there.
pub(crate) fn resolve_write_protect(reg: &mut Registry, vm: VmId, page: u64) -> Handled {
    if let Some(ready) = super::dependents::wait_for_dependents(reg, vm, page) {
        return Handled::Wait {
            page,
            ready,
            write_protect: true,
        };
    }
    super::dependents::preserve_for_dependents(reg, vm, page);
    let based = reg.is_based(vm);
    let Some(v) = reg.vms.get_mut(&vm) else {
        return Handled::Ok;
    };
    v.log.stats.write_protect += 1;
    if based {
        // A page mapped from the base (or the zero page), protected when
        // it was mapped: the write the protection lifts for copies it into
        // the VMM's own memory (see `Target::map_from_base`).
        let was = v.table.get(page);
        v.own_written(page);
        let emptied = was != v.self_src && v.table.count_of(was) == 0;
        if emptied && crate::core::base::is_own_layer(reg, vm, was) {
            // The last page this VM held as a layer holds it (see
            // `fork::layer`): the layer goes now if no other table reads
            // it (once per VM and layer, not per page).
            reg.release_unused_sources();
        }
    }
    let Some(v) = reg.vms.get_mut(&vm) else {
        return Handled::Ok;
    };
    let Some(uffd) = v.faults.uffd.clone() else {
        return Handled::Ok;
    };
    let t = target(v, &uffd);
    phases::lap(Phase::Resolve);
    let lifted = t.write_protect(page, 1, false);
    phases::lap(Phase::Install);
    match lifted {
        Ok(()) => Handled::Ok,
        Err(e) => handled(
            install::errno_outcome(vm, "remove write protection", e),
            page,
            true,
        ),
    }
}

fn handle_remove(reg: &mut Registry, vm: VmId, start: u64, end: u64) -> Handled {
    let Some(v) = reg.vms.get_mut(&vm) else {
        return Handled::Ok;
    };
    if v.rollback.discarding {
        // The server's own discard (a rollback), already accounted for.
        return Handled::Ok;
    }
    let (Some(first), Some(last)) = (v.page_of(start), v.page_of(end.saturating_sub(1))) else {
        return Handled::Ok;
    };
    let pages = last - first + 1;
    v.log.stats.removes += 1;
    for p in first..first + pages {
        v.log.pages.fault(p, ApiKind::Remove);
    }
    v.log.pages.dropped(first, pages);
    let me = v.self_src;
    let tracked = v.snapshot.dirty.is_some();
    let unit = shared::geometry::usize_of(v.memory.unit_pages());
    for p in (first..first + pages).step_by(unit) {
        before_write(reg, vm, p);
    }
    let Some(v) = reg.vms.get_mut(&vm) else {
        return Handled::Ok;
    };
    let present: Vec<u64> = (first..first + pages)
        .step_by(unit)
        .filter(|p| v.table.get(*p) == me)
        .collect();
    // Dependents that still read these pages from this VM get their copy
    // before the bytes are dropped.
    for p in present {
        super::dependents::preserve_for_dependents(reg, vm, p);
    }
    let Some(v) = reg.vms.get_mut(&vm) else {
        return Handled::Ok;
    };
    // The discarded pages read as zero from now on.
    v.table.set_range(first, pages, UNINITIALIZED);
    if let Err(e) = v.memory.punch_hole(first, pages) {
        warn!(
            "{vm}: cannot drop removed pages {first}..{}: {e}",
            first + pages
        );
    }
    if tracked {
        // Keep tracking writes to the discarded range.
        if let Some(uffd) = v.faults.uffd.clone() {
            if let Err(e) = target(v, &uffd).write_protect(first, pages, true) {
                return handled(
                    install::errno_outcome(vm, "write-protect removed pages", e),
                    first,
                    false,
                );
            }
        }
    }
    Handled::Ok
}
