//! Pages put into a VM's memfd through the server's own mapping, for a VM
//! whose VMM does not run: a prefetch before its start, a fault retried
//! after its VMM exited. Nothing maps the memory then, so nothing can see
//! a page half written; a running VM's pages go in only through its uffd
//! ([`super::install`]).

use std::rc::Rc;

use shared::VmId;

use super::books::{handled, mark_present, unservable, Handled};
use super::install::{self, How, Request};
use crate::core::registry::Registry;
use crate::observe::access::By;
use crate::pages::{read_pages, ResolveError};

/// Install `page` (and, for image sources, the surrounding fault-around
/// block or readahead window) into `vm`'s memfd through the server's
/// mapping. Returns the page range installed.
pub fn materialize(
    reg: &mut Registry,
    vm: VmId,
    page: u64,
    by: By,
) -> Result<(u64, u64), ResolveError> {
    let v = reg.vms.get(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
    if let Some(on) = v.base.on.clone() {
        return fill_base(reg, vm, page, &on);
    }
    if v.memory.unit_pages() > 1 {
        return materialize_block(reg, vm, page, by);
    }
    let req = Request {
        page,
        bounds: 0..v.memory.pages(),
        fault_around: v.faults.fault_around_pages,
        track: true,
        piece: 0,
        zero_pages: false,
        blocks_ahead: false,
        write: false,
    };
    let Some(plan) = install::plan(
        &v.table,
        v.self_src,
        &reg.arena,
        &v.faults.readahead,
        &req,
        None,
    )?
    else {
        return Ok((page, 1)); // Already present: a concurrent fault.
    };
    let (lo, hi) = (plan.lo, plan.hi);
    {
        let dst = v.memory.slice(lo, hi - lo)?;
        let arena = &reg.arena;
        read_pages(&plan.source, lo, &dst, &|id| arena.memory_of(id))?;
    }
    let how = How {
        fault: page,
        by,
        from: plan.src,
    };
    let v = reg.vms.get_mut(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
    mark_present(v, lo, hi - lo, how);
    if let Some(window) = plan.window {
        v.faults.readahead.next = hi;
        v.faults.readahead.window = window;
    }
    reg.installed += hi - lo;
    Ok((lo, hi - lo))
}

/// [`materialize`] for a VM on a shared base: a page of the base goes
/// into the base (with its fault-around run), which the VM will map when
/// it runs; any other page has nowhere to go before its VMM runs (its
/// private pages are that process's) and is left to its fault. Returns
/// the page range done.
fn fill_base(
    reg: &mut Registry,
    vm: VmId,
    page: u64,
    on: &crate::core::base::state::OnBase,
) -> Result<(u64, u64), ResolveError> {
    let v = reg.vms.get(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
    if v.table.get(page) != on.src {
        return Ok((page, 1));
    }
    let req = Request {
        page,
        bounds: 0..v.memory.pages(),
        fault_around: v.faults.fault_around_pages.max(v.memory.unit_pages()),
        track: false,
        piece: 0,
        zero_pages: false,
        blocks_ahead: false,
        write: false,
    };
    let Some(plan) = install::plan(
        &v.table,
        v.self_src,
        &reg.arena,
        &v.faults.readahead,
        &req,
        None,
    )?
    else {
        return Ok((page, 1));
    };
    let (lo, hi) = v.memory.unit_range(plan.lo, plan.hi);
    on.base.fill(&plan.source, lo, hi)?;
    Ok((lo, hi - lo))
}

/// [`materialize`] on hugetlb: the whole block, allocated first (see
/// [`crate::memory::GuestMemory::write_block`]).
fn materialize_block(
    reg: &mut Registry,
    vm: VmId,
    page: u64,
    by: By,
) -> Result<(u64, u64), ResolveError> {
    let v = reg.vms.get(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
    let (lo, hi) = v.memory.unit_range(page, page + 1);
    let src = v.table.get(page);
    if src == v.self_src {
        return Ok((lo, hi - lo));
    }
    let memory = Rc::clone(&v.memory);
    install::read_block(&reg.arena, &v.table, lo, hi, |bytes| {
        memory.write_block(lo, bytes)
    })??;
    let how = How {
        fault: page,
        by,
        from: src,
    };
    let v = reg.vms.get_mut(&vm).ok_or(ResolveError::NoSuchVm(vm))?;
    mark_present(v, lo, hi - lo, how);
    reg.installed += hi - lo;
    Ok((lo, hi - lo))
}

/// A MISSING fault of a VM whose VMM is gone (retried after it exited):
/// the page goes in through the server's mapping, where the VMs reading
/// from this one find it.
pub(super) fn without_vmm(reg: &mut Registry, vm: VmId, page: u64) -> Handled {
    match materialize(reg, vm, page, By::Missing) {
        Ok(_) => {
            if let Some(v) = reg.vms.get_mut(&vm) {
                v.log.stats.missing += 1;
            }
            Handled::Ok
        }
        Err(ResolveError::NotDecoded { image, frames }) => {
            if let Some(v) = reg.vms.get_mut(&vm) {
                v.log.stats.frame_waits += 1;
            }
            let ready = crate::images::zst::FramePool::wait(&image, frames);
            handled(install::Served::Wait(ready), page, false)
        }
        Err(ResolveError::NotFetched { image, chunks }) => {
            if let Some(v) = reg.vms.get_mut(&vm) {
                v.log.stats.chunk_waits += 1;
            }
            handled(install::Served::Wait(image.wait(chunks)), page, false)
        }
        Err(e) => unservable(reg, vm, page, &e),
    }
}
