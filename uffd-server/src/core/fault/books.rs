//! Our VMs' side of the installer ([`super::install`]): what an install
//! records in one of our VMs (its table, counters, page log), the
//! installer's view of its memory through its VMM's uffd, and what the
//! serving loop makes of each outcome.

use proto::api::FaultKind as ApiKind;
use shared::VmId;
use tokio::io::unix::AsyncFd;
use userfaultfd::Uffd;

use super::install::{self, Books, How, Served, Target};
use crate::core::base::state::OnBase;
use crate::core::ratelimit::RateLimit;
use crate::core::registry::Registry;
use crate::core::vm::Vm;
use crate::observe::access::By;
use crate::observe::stats::FaultStats;
use crate::pages::{PageTable, Readahead, ResolveError, SourceId};

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

/// What an install into one of our VMs records: the table, the counters,
/// the page log, and the server's count of installed pages (the trace
/// reads what one event installed from it).
pub(crate) struct OurBooks<'a> {
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
    fn mapped_shared(&mut self, lo: u64, n: u64, how: How) {
        let v = &mut *self.v;
        v.log.stats.pages_shared += n;
        v.log
            .pages
            .installed_run(lo, n, how.fault, By::Shared, how.from);
        *self.installed += n;
    }
    fn before_install(&mut self, lo: u64, hi: u64) -> Result<(), ResolveError> {
        self.v.scrub(lo, hi).map_err(ResolveError::Memory)
    }
    fn fail(&mut self, reason: &str) -> bool {
        self.v.fail(reason)
    }
}

/// Record pages `[lo, lo + n)` of `v` as present, installed as `how` says.
pub(crate) fn mark_present(v: &mut Vm, lo: u64, n: u64, how: How) {
    let me = v.self_src;
    v.reclaim.installed(lo, n, how.from);
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
        shared: None,
    }
}

/// [`target`] for installs: with the shared base `on` (the VM's own,
/// cloned out of it so the installer may change the VM meanwhile).
pub(crate) fn install_target<'a>(
    v: &Vm,
    uffd: &'a AsyncFd<Uffd>,
    on: Option<&'a OnBase>,
) -> Target<'a> {
    Target {
        shared: on.map(|on| install::OnBase {
            base: &on.base,
            src: on.src,
        }),
        ..target(v, uffd)
    }
}

/// Our loop's outcome of what the installer served.
pub(crate) fn handled(served: Served, page: u64, write_protect: bool) -> Handled {
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

/// `page` of `vm` cannot be served: fail the VM and poison the page (see
/// [`install::unservable`]); a VM whose VMM is gone has nothing to poison.
pub(crate) fn unservable(reg: &mut Registry, vm: VmId, page: u64, e: &ResolveError) -> Handled {
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
