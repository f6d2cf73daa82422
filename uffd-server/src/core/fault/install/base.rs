//! Installs of a VM on a shared base: clean pages mapped from the base
//! (`UFFDIO_CONTINUE`, write-protected), written ones copied out of it.

use shared::PAGE_SIZE;
use uffd_abi::Install;

use crate::bases::Base;
use crate::observe::access::By;
use crate::observe::phases::{self, Phase};
use crate::pages::{PageSource, ResolveError, SourceArena};

use super::plan::Plan;
use super::target::{Books, How, OnBase, Page, Request, Target};

/// Map the run planned around `req.page` from the client's shared base
/// (4 KiB pages): the base is filled first where it lacks pages of it
/// (the faulting page's piece first), then the faulting page's piece is
/// mapped from the faulting page on (UFFDIO_CONTINUE wakes its thread),
/// then the rest of the run behind it. A page of the run mapped already
/// (the VM mapped it, or wrote it, since) ends that piece: the table does
/// not record which pages a VM maps from its base.
pub(super) fn map_run(
    b: &mut impl Books,
    t: &Target<'_>,
    req: &Request,
    plan: &Plan,
    on: OnBase<'_>,
) -> Result<Page, ResolveError> {
    let page = req.page;
    let (lo, hi) = (plan.lo, plan.hi);
    let first_end = if req.piece == 0 || hi - lo <= req.piece {
        hi
    } else {
        (page + 1).max(lo + req.piece).min(hi)
    };
    let how = How {
        fault: page,
        by: By::Missing,
        from: plan.src,
    };
    on.base.fill(&plan.source, lo, first_end)?;
    drop_decoded(on.base, &plan.source, lo, first_end);
    phases::lap(Phase::Resolve);
    // A write's page goes in alone, copied, as the VM's own (the table
    // never names as its own a page it maps shared), and the rest of its
    // piece behind it, mapped.
    let head = if req.write { page + 1 } else { first_end };
    let res = if req.write {
        t.copy_from_base(on.base, page, 1)?
    } else {
        t.map_from_base(page, first_end - page)
    };
    phases::lap(Phase::Install);
    let at = match res {
        Install::Done => Page::Woken,
        Install::Exists { copied } if copied > 0 => Page::Woken,
        Install::Exists { .. } => Page::Present,
        Install::Again { .. } => return Ok(Page::Again),
        Install::Gone => return Ok(Page::Gone),
        Install::Failed(errno) => return Err(ResolveError::Install { first: page, errno }),
    };
    let mut mapped = match res {
        Install::Done => head - page,
        Install::Exists { copied } => copied / PAGE_SIZE,
        _ => 0,
    };
    if req.write {
        if mapped > 0 {
            b.mark(page, 1, how);
        }
        if matches!(res, Install::Done) && head < first_end {
            let rest = match t.map_from_base(head, first_end - head) {
                Install::Done => first_end - head,
                Install::Exists { copied } | Install::Again { copied } => copied / PAGE_SIZE,
                Install::Gone | Install::Failed(_) => 0,
            };
            b.mapped_shared(head, rest, how);
            mapped += rest;
        }
    } else {
        b.mapped_shared(page, mapped, how);
    }
    // The pages before the faulting one, and the rest of a readahead
    // window, behind the woken thread.
    if lo < page && matches!(t.map_from_base(lo, page - lo), Install::Done) {
        b.mapped_shared(lo, page - lo, how);
    }
    let mut end = page + mapped;
    if matches!(res, Install::Done) && end == first_end && first_end < hi {
        let piece = req.piece.max(1);
        let mut at = first_end;
        while at < hi {
            let e = (at + piece).min(hi);
            if on.base.fill(&plan.source, at, e).is_err() {
                break;
            }
            drop_decoded(on.base, &plan.source, at, e);
            match t.map_from_base(at, e - at) {
                Install::Done => {
                    b.mapped_shared(at, e - at, how);
                    at = e;
                }
                Install::Exists { copied } | Install::Again { copied } => {
                    b.mapped_shared(at, copied / PAGE_SIZE, how);
                    at += copied / PAGE_SIZE;
                    break;
                }
                Install::Gone | Install::Failed(_) => break,
            }
        }
        end = at;
    }
    if let Some(window) = plan.window {
        let ra = b.readahead_mut();
        ra.window = window;
        if req.track {
            ra.next = end;
        }
    }
    Ok(at)
}

/// The frames of a compressed `source` whose pages `[lo, hi)` just went
/// into `base`, dropped from the frame cache once the base holds them
/// whole: the base is the one decoded copy the host keeps.
fn drop_decoded(base: &Base, source: &PageSource, lo: u64, hi: u64) {
    let Some(z) = source.zstd() else {
        return;
    };
    let h = z.header();
    let frames = z.frames_of(lo..hi);
    for f in frames {
        let r = h.frame_range(f);
        if base.holds(r.start, r.end.min(base.memory.pages())) {
            z.drop_decoded(f..f + 1);
        }
    }
}

/// Map the hugetlb block `[lo, hi)`, all of it pages of the client's
/// shared base, from the base (filled first if it lacks it), for a fault
/// on `page`; a `write`'s block is copied, the client's own from now on.
pub(super) fn map_block(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    on: OnBase<'_>,
    (page, write): (u64, bool),
    lo: u64,
    hi: u64,
) -> Result<Page, ResolveError> {
    let source = arena
        .get(on.src)
        .cloned()
        .ok_or(ResolveError::UnknownSource(on.src))?;
    if let Err(e) = on.base.fill(&source, lo, hi) {
        // Filling a hugetlb base takes a huge page from the pool: a pool
        // used up makes the fill fail (EFAULT in the read), and that, not
        // the read, is what the VM's failure must say.
        if crate::memory::hugepages_exhausted() {
            return Err(ResolveError::HugePagesExhausted { first: lo });
        }
        return Err(e);
    }
    drop_decoded(on.base, &source, lo, hi);
    phases::lap(Phase::Resolve);
    let res = if write {
        t.copy_from_base(on.base, lo, hi - lo)?
    } else {
        t.map_from_base(lo, hi - lo)
    };
    phases::lap(Phase::Install);
    let how = How {
        fault: page,
        by: By::Missing,
        from: on.src,
    };
    match res {
        Install::Done if write => {
            b.mark(lo, hi - lo, how);
            Ok(Page::Woken)
        }
        Install::Done => {
            b.mapped_shared(lo, hi - lo, how);
            Ok(Page::Woken)
        }
        // No page to copy it into (see `hugepages_exhausted`).
        Install::Exists { .. } if write && crate::memory::hugepages_exhausted() => {
            Err(ResolveError::HugePagesExhausted { first: lo })
        }
        Install::Exists { .. } => Ok(Page::Present),
        Install::Again { .. } => Ok(Page::Again),
        Install::Gone => Ok(Page::Gone),
        Install::Failed(errno) => Err(ResolveError::Install { first: lo, errno }),
    }
}
