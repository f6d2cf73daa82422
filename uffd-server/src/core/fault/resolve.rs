//! Our VMs' uffd events, one at a time: a MISSING fault installs the page
//! (and its run) through the installer ([`super::install`]); a
//! write-protect fault first gives the page's pre-write bytes to the VMs
//! that still read it from this one ([`super::dependents`]), then lifts
//! the protection; a MINOR fault maps a page the memfd holds, or replaces a
//! stale one; a REMOVE drops pages the guest gave back.
//!
//! Before a write lands (a write fault of any kind, a REMOVE), the VM's
//! dirty log, the arming set of a fork or snapshot under way, and a
//! snapshot still saving see it first (`Registry::before_write`).

use proto::api::FaultKind as ApiKind;
use shared::VmId;
use tokio::io::unix::AsyncFd;
use tracing::{debug, warn};
use userfaultfd::{Event, FaultKind, ReadWrite, Uffd};

use super::install::{self, Books, How, Request, Served, Target};
use crate::core::ratelimit::{suppressed_note, RateLimit};
use crate::core::vm::{RunState, Vm};
use crate::core::Registry;
use crate::observe::access::By;
use crate::observe::phases::{self, Phase};
use crate::observe::stats::FaultStats;
use crate::pages::{PageTable, Readahead, ResolveError, SourceId, UNINITIALIZED};

/// Outcome of handling one event.
#[derive(Debug)]
pub enum Handled {
    Ok,
    /// The VMM's address space is gone (ESRCH): treat the VMM as exited.
    VmmGone,
    /// The VM failed just now: a fault could not be served, for this
    /// reason. The page is poisoned (see [`install::unservable`]).
    Failed(String),
    /// The fault on `page` waits for frames of a compressed image being
    /// decoded off the core thread, or for a dependent's uffd; retry it
    /// when every receiver fired. The faulting thread stays asleep until
    /// then.
    Wait {
        page: u64,
        ready: Vec<tokio::sync::oneshot::Receiver<()>>,
        /// The fault is a write-protect fault (else a missing one).
        write_protect: bool,
    },
}

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
        reg.before_write(vm, page);
    }
    match kind {
        FaultKind::Missing => resolve_missing(reg, vm, page),
        FaultKind::WriteProtected => resolve_write_protect(reg, vm, page),
        FaultKind::Minor => resolve_minor(reg, vm, page),
    }
}

/// What an install into one of our VMs records: the table, the counters,
/// the page log, and the server's count of installed pages (the trace
/// reads what one event installed from it).
pub(super) struct OurBooks<'a> {
    pub v: &'a mut Vm,
    pub installed: &'a mut u64,
}

impl Books for OurBooks<'_> {
    fn id(&self) -> VmId {
        self.v.id
    }
    fn table(&self) -> &PageTable {
        &self.v.table
    }
    fn self_src(&self) -> SourceId {
        self.v.self_src
    }
    fn readahead(&self) -> &Readahead {
        &self.v.faults.readahead
    }
    fn readahead_mut(&mut self) -> &mut Readahead {
        &mut self.v.faults.readahead
    }
    fn stats(&mut self) -> &mut FaultStats {
        &mut self.v.log.stats
    }
    fn warnings(&mut self) -> &mut RateLimit {
        &mut self.v.faults.warnings
    }
    fn mark(&mut self, lo: u64, n: u64, how: How) {
        mark_present(self.v, lo, n, how);
        *self.installed += n;
    }
    fn before_install(&mut self, lo: u64, hi: u64) -> Result<(), ResolveError> {
        self.v.scrub(lo, hi).map_err(ResolveError::Memory)
    }
    fn fail(&mut self, reason: &str) -> bool {
        if self.v.failure.is_some() {
            return false;
        }
        self.v.failure = Some(reason.to_owned());
        self.v.state = RunState::Failed;
        true
    }
}

/// Record pages `[lo, lo + n)` of `v` as present, installed as `how` says.
pub(super) fn mark_present(v: &mut Vm, lo: u64, n: u64, how: How) {
    let me = v.self_src;
    v.table.set_range(lo, n, me);
    v.log.stats.pages_installed += n;
    v.log
        .pages
        .installed_run(lo, n, how.fault, how.by, how.from);
    if how.by == By::Prefetch {
        for p in lo..lo + n {
            v.log.pages.fault(p, ApiKind::Prefetch);
        }
    }
}

/// The installer's view of `v`'s memory through its VMM's `uffd`.
pub(crate) fn target<'a>(v: &Vm, uffd: &'a AsyncFd<Uffd>) -> Target<'a> {
    Target {
        uffd: uffd.get_ref(),
        base: v.faults.vmm_base,
        unit: v.memory.unit_pages(),
        mode: v.copy_mode(),
    }
}

/// Make `page` (and the run planned around it) present in `vm`'s memory
/// from its source, and wake the faulting thread (see
/// [`install::serve_missing`]). A VM whose VMM is gone (a fault retried
/// after it exited) gets the page through the server's mapping.
pub(crate) fn resolve_missing(reg: &mut Registry, vm: VmId, page: u64) -> Handled {
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
    let t = target(v, &uffd);
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
        zero_pages: false,
        blocks_ahead: true,
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

/// Our loop's outcome of what the installer served.
pub(super) fn handled(served: Served, page: u64, write_protect: bool) -> Handled {
    match served {
        Served::Done | Served::Again => Handled::Ok,
        Served::Wait(ready) => Handled::Wait {
            page,
            ready,
            write_protect,
        },
        Served::Gone => Handled::VmmGone,
        Served::Failed(reason) => Handled::Failed(reason),
    }
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
        return resolve_missing(reg, vm, page);
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

/// `page` of `vm` cannot be served: fail the VM and poison the page (see
/// [`install::unservable`]); a VM whose VMM is gone has nothing to poison.
pub(super) fn unservable(reg: &mut Registry, vm: VmId, page: u64, e: &ResolveError) -> Handled {
    let Registry { vms, installed, .. } = reg;
    let Some(v) = vms.get_mut(&vm) else {
        return Handled::Ok;
    };
    v.log.stats.missing += 1;
    let uffd = v.faults.uffd.clone();
    let t = uffd.as_ref().map(|u| target(v, u));
    let mut books = OurBooks { v, installed };
    handled(
        install::unservable(&mut books, t.as_ref(), page, e),
        page,
        false,
    )
}

/// Copy-on-write step for a WP fault: give the pre-write page to every VM
/// that still reads it from `vm`, then lift the protection. On hugetlb the
/// unit is the whole block: its pre-write copy goes to the dependents and
/// its protection is lifted whole.
///
/// A dependent whose VMM has connected but whose uffd has not arrived can
/// take the copy neither way (its guest may run already, see
/// [`Vm::uffd_pending`]): the write waits, protected, until the uffd is
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
    let Some(v) = reg.vms.get_mut(&vm) else {
        return Handled::Ok;
    };
    v.log.stats.write_protect += 1;
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
        reg.before_write(vm, p);
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
