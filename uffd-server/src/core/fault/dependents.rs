//! The copy-on-write step of a live fork: before a VM overwrites a page,
//! a layer being filled from it saves the page (`fork::layer`), and every
//! VM whose table still reads that page from it (a fork child, a frozen
//! VM's reader) gets the page's current bytes, through its own uffd when
//! its VMM runs. A dependent that cannot take them is failed, never
//! left reading the writer's later bytes.

use std::rc::Rc;

use shared::{VmId, PAGE_SIZE};
use tracing::{error, warn};
use uffd_abi::{Errno, Install};

use super::books::target;
use crate::core::registry::Registry;
use crate::core::vm::Vm;
use crate::memory::{GuestMemory, MemoryError};
use crate::observe::access::By;
use crate::pages::{ResolveError, SourceId};

/// Why the pre-write copy of a page could not be given to a dependent.
#[derive(Debug, thiserror::Error)]
enum PreserveError {
    #[error("the page is already present although the table says it is not")]
    AlreadyPresent,
    #[error("UFFDIO_COPY failed")]
    Copy(#[source] Errno),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// The writer's page could not be read out of its VMM.
    #[error("{0}")]
    Read(String),
}

/// Before `vm` overwrites `page`, copy its current bytes to every VM whose
/// table still reads that page from `vm`. Returns how many VMs got a copy.
pub(crate) fn preserve_for_dependents(reg: &mut Registry, vm: VmId, page: u64) -> u64 {
    // A layer a fork is filling from this VM takes the page first.
    if let Some(v) = reg.vms.get(&vm) {
        v.fork.save_before_write(page, v.table.get(page));
    }
    let Some(src) = reg.arena.vm_id(vm) else {
        return 0;
    };
    let Some(mem) = reg.vms.get(&vm).map(|v| Rc::clone(&v.memory)) else {
        return 0;
    };
    if mem.unit_pages() > 1 {
        return preserve_block(reg, vm, src, page);
    }
    // A VM on a shared base holds its own pages in its VMM: the page's
    // bytes are read from there once (it is present: it was just about
    // to be written), and copied from this buffer.
    let held = match reg.arena.memory_of(vm) {
        Some(crate::pages::VmPages::Process(p)) => {
            let mut buf = vec![0u8; shared::geometry::usize_of(PAGE_SIZE)];
            let read = p
                .read(page, &vm_memory::VolatileSlice::from(&mut buf[..]))
                .map_err(|e| shared::error_chain(&e));
            Some(read.map(|()| buf))
        }
        _ => None,
    };
    let mut given = 0;
    let mut lost = Vec::new();
    for (id, dep) in reg.vms.iter_mut() {
        // A VM that lost a copy from `vm` has everything it read from `vm`
        // poisoned (see `fail_dependent`).
        if *id == vm || dep.faults.lost_from.contains(&src) || dep.table.get(page) != src {
            continue;
        }
        let copied = match &held {
            None => install_copy(dep, &mem, page),
            Some(Ok(bytes)) => install_bytes(dep, page, bytes),
            Some(Err(e)) => Err(PreserveError::Read(e.clone())),
        };
        let copied = match copied {
            // The server before this one copied the page and died before
            // the table said so: the copy is there, and the writer's page
            // has not changed since (its write is the one held now).
            Err(PreserveError::AlreadyPresent) if dep.adopted.is_some() => Ok(()),
            other => other.map_err(|e| shared::error_chain(&e)),
        };
        if let Err(e) = copied {
            lost.push((
                *id,
                format!("its page {page} could not be kept when {vm} wrote it: {e}"),
            ));
            continue;
        }
        let me = dep.self_src;
        dep.table.set(page, me);
        dep.log.stats.pages_installed += 1;
        dep.log.pages.installed_run(page, 1, page, By::WpCopy, src);
        given += 1;
    }
    for (id, reason) in lost {
        fail_dependent(reg, id, src, reason);
    }
    reg.installed += given;
    if let Some(v) = reg.vms.get_mut(&vm) {
        v.log.stats.wp_copies += given;
    }
    given
}

/// A page's pre-write copy had nowhere to go in `id`: it can no longer be
/// given its memory as it was. Fail it, saying why, rather than let it read
/// what the VM it shared the page with writes next: every page it still
/// reads from that VM (`src`) is poisoned, so an access to one ends its VMM
/// instead of fetching the new bytes (as for a page that cannot be served),
/// and later writes of that VM skip it.
fn fail_dependent(reg: &mut Registry, id: VmId, src: SourceId, reason: String) {
    let Some(dep) = reg.vms.get_mut(&id) else {
        return;
    };
    if dep.faults.lost_from.contains(&src) {
        return;
    }
    dep.faults.lost_from.push(src);
    if dep.failure().is_none() {
        error!("{id}: failed: {reason}");
        dep.fail(reason);
    } else {
        warn!("{id}: {reason}");
    }
    let Some(uffd) = dep.faults.uffd.clone() else {
        return;
    };
    let t = target(dep, &uffd);
    for (first, n) in dep.table.ranges_of(src) {
        match t.poison(first, n) {
            Install::Done | Install::Gone => {}
            other => warn!(
                "{id}: cannot poison pages {first}..{}: {other:?}",
                first + n
            ),
        }
    }
}

/// [`preserve_for_dependents`] on hugetlb: every VM that reads a page of
/// `page`'s block from `vm` gets its whole block (its other pages from
/// their own sources), installed whole. Returns the pages given, like the
/// 4 KiB path (one per VM and page).
fn preserve_block(reg: &mut Registry, vm: VmId, src: SourceId, page: u64) -> u64 {
    let Some((lo, hi)) = reg
        .vms
        .get(&vm)
        .map(|v| v.memory.unit_range(page, page + 1))
    else {
        return 0;
    };
    let deps: Vec<VmId> = reg
        .vms
        .iter()
        .filter(|(id, d)| {
            **id != vm
                && !d.faults.lost_from.contains(&src)
                && (lo..hi).any(|p| d.table.get(p) == src)
        })
        .map(|(id, _)| *id)
        .collect();
    let mut given = 0;
    for id in deps {
        let Some(dep) = reg.vms.get(&id) else {
            continue;
        };
        let done = super::install::read_block(&reg.arena, &dep.table, lo, hi, |bytes| {
            install_block_copy(dep, lo, bytes)
        })
        .map_err(PreserveError::from)
        .and_then(|r| r);
        if let Err(e) = done {
            let why = if crate::memory::hugepages_exhausted() {
                ResolveError::HugePagesExhausted { first: lo }.to_string()
            } else {
                shared::error_chain(&e)
            };
            fail_dependent(
                reg,
                id,
                src,
                format!("its block at page {lo} could not be kept when {vm} wrote it: {why}"),
            );
            continue;
        }
        if let Some(dep) = reg.vms.get_mut(&id) {
            let me = dep.self_src;
            dep.table.set_range(lo, hi - lo, me);
            dep.log.stats.pages_installed += hi - lo;
            dep.log
                .pages
                .installed_run(lo, hi - lo, page, By::WpCopy, src);
        }
        reg.installed += hi - lo;
        given += hi - lo;
    }
    if let Some(v) = reg.vms.get_mut(&vm) {
        v.log.stats.wp_copies += given;
    }
    given
}

/// Put `bytes` (a whole hugetlb block) at page `lo` of `dep`: through its
/// uffd while its VMM runs (see [`install_copy`]), else allocated and
/// written through the server's mapping.
fn install_block_copy(dep: &Vm, lo: u64, bytes: &[u8]) -> Result<(), PreserveError> {
    if let Some(uffd) = dep.faults.uffd.clone() {
        // SAFETY: `bytes` is borrowed for the call.
        match unsafe { target(dep, &uffd).copy(bytes.as_ptr(), lo, bytes.len() as u64) } {
            Install::Done => return Ok(()),
            Install::Exists { .. } => return Err(PreserveError::AlreadyPresent),
            Install::Gone | Install::Again { .. } => {}
            Install::Failed(errno) => return Err(PreserveError::Copy(errno)),
        }
    }
    Ok(dep.memory.write_block(lo, bytes)?)
}

/// Put a copy of `src`'s `page` into `dep`.
///
/// A dependent whose VMM runs may be touching that very page: UFFDIO_COPY
/// through its uffd installs the page whole (and wakes any thread faulting
/// on it), where a memcpy through the server's mapping would make the page
/// present at its first byte and let the guest see or lose a torn page.
/// Without a running VMM (not yet connected, exited, frozen) the memcpy is
/// safe.
fn install_copy(dep: &Vm, src: &GuestMemory, page: u64) -> Result<(), PreserveError> {
    if let Some(uffd) = dep.faults.uffd.clone() {
        let from = src.page_ptr(page)?;
        // A dependent whose writes are tracked keeps the page protected
        // (the target's copy mode).
        // SAFETY: `from` is one page inside the source VM's live mapping,
        // which `src` keeps alive for the call.
        match unsafe { target(dep, &uffd).copy(from, page, PAGE_SIZE) } {
            Install::Done => return Ok(()),
            Install::Exists { .. } => return Err(PreserveError::AlreadyPresent),
            // Gone: the VMM died, nobody touches the memfd any more.
            // Again: a non-cooperative event (REMOVE) is pending on the
            // dependent's uffd, which the VMM only raises while it discards
            // memory; the event is read on this same thread, so waiting here
            // cannot help. Both fall back to the memcpy.
            Install::Gone | Install::Again { .. } => {}
            Install::Failed(errno) => return Err(PreserveError::Copy(errno)),
        }
    }
    Ok(dep.memory.copy_page_from(src, page)?)
}

/// [`install_copy`] of a page's `bytes` read out of its VM's VMM.
fn install_bytes(dep: &Vm, page: u64, bytes: &[u8]) -> Result<(), PreserveError> {
    if let Some(uffd) = dep.faults.uffd.clone() {
        // SAFETY: `bytes` is borrowed for the call.
        match unsafe { target(dep, &uffd).copy(bytes.as_ptr(), page, PAGE_SIZE) } {
            Install::Done => return Ok(()),
            Install::Exists { .. } => return Err(PreserveError::AlreadyPresent),
            Install::Gone | Install::Again { .. } => {}
            Install::Failed(errno) => return Err(PreserveError::Copy(errno)),
        }
    }
    Ok(dep.memory.write_block(page, bytes)?)
}

/// Receivers that fire when every VM that reads `page`'s unit from `vm`
/// and whose uffd is pending has its uffd; `None` if none waits.
pub(super) fn wait_for_dependents(
    reg: &mut Registry,
    vm: VmId,
    page: u64,
) -> Option<Vec<tokio::sync::oneshot::Receiver<()>>> {
    let src = reg.arena.vm_id(vm)?;
    let (lo, hi) = reg.vms.get(&vm)?.memory.unit_range(page, page + 1);
    let mut ready = Vec::new();
    for (id, d) in reg.vms.iter_mut() {
        if *id != vm && d.uffd_pending() && (lo..hi).any(|p| d.table.get(p) == src) {
            let (tx, rx) = tokio::sync::oneshot::channel();
            d.faults.on_uffd.push(tx);
            ready.push(rx);
        }
    }
    (!ready.is_empty()).then_some(ready)
}
