//! 4 KiB installs: the faulting page's piece first, then the rest of its
//! run streamed through the staging buffer (`UFFDIO_COPY`, or
//! `UFFDIO_ZEROPAGE` for never-written anonymous memory).

use shared::PAGE_SIZE;
use uffd_abi::Install;
use vm_memory::VolatileSlice;

use crate::observe::access::By;
use crate::observe::phases::{self, Phase};
use crate::pages::{read_pages, PageSource, ResolveError, SourceArena, SourceId, UNINITIALIZED};

use super::base::map_run;
use super::plan::{plan, Plan};
use super::target::{Books, How, Page, Request, Target, STAGING};

/// Install the run planned around `req.page` (4 KiB pages): the piece
/// holding the faulting page first, whose copy wakes its thread, then the
/// rest behind it ([`stream_rest`]).
pub(super) fn install_run(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    req: &Request,
) -> Result<Page, ResolveError> {
    let page = req.page;
    let Some(plan) = plan(b.table(), b.self_src(), arena, b.readahead(), req, t.shared)? else {
        return Ok(Page::Present); // A concurrent fault installed it.
    };
    if let Some(on) = t.shared.filter(|on| on.src == plan.src) {
        return map_run(b, t, req, &plan, on);
    }
    if t.shared.is_some() && req.write && plan.src == UNINITIALIZED {
        // A write to a never-written page over a base: that page alone,
        // copied (zero), is the VM's own. Its neighbours stay unmapped: the
        // zero page would have to go in protected, for faults they may
        // never take.
        let how = How {
            fault: page,
            by: By::Missing,
            from: plan.src,
        };
        b.before_install(page, page + 1)?;
        let one = Request {
            zero_pages: false,
            ..req.clone()
        };
        return install_one(b, arena, t, &one, how);
    }
    let Plan {
        src,
        lo,
        hi,
        window,
        ..
    } = plan;
    b.before_install(lo, hi)?;
    let first_end = if req.piece == 0 || hi - lo <= req.piece {
        hi
    } else {
        (page + 1).max(lo + req.piece).min(hi)
    };
    let how = How {
        fault: page,
        by: By::Missing,
        from: src,
    };
    let (res, zero_page) = copy_or_zero(arena, t, &plan.source, src, lo, first_end, req)?;
    let installed = match res {
        Install::Done => first_end - lo,
        Install::Exists { copied } | Install::Again { copied } => copied / PAGE_SIZE,
        Install::Gone => 0,
        Install::Failed(errno) => return Err(ResolveError::Install { first: lo, errno }),
    };
    if t.shared.is_some() && zero_page {
        // The zero page is no page of the VM's own: it stays zero in the
        // table until the guest writes it (a write-protect fault, see
        // `fault::resolve`).
        b.mapped_shared(lo, installed, how);
    } else {
        b.mark(lo, installed, how);
    }
    let mut end = lo + installed;
    let at = match res {
        Install::Done => {
            if first_end < hi {
                end = stream_rest(b, arena, t, &plan.source, first_end, hi, req.piece, how);
            }
            Page::Woken
        }
        // The faulting page itself is in the client's memory already (put
        // there by another path): it is present; say so, so the next fault
        // does not try to install it again.
        Install::Exists { .. } if end == page => {
            b.mark(page, 1, how);
            Page::Present
        }
        // A page before it was there: install just the faulting page.
        Install::Exists { .. } if page > end && first_end - lo > 1 => {
            return install_one(b, arena, t, req, how)
        }
        Install::Exists { .. } => Page::Present,
        Install::Again { .. } => Page::Again,
        Install::Gone | Install::Failed(_) => Page::Gone,
    };
    if let Some(window) = window {
        let ra = b.readahead_mut();
        ra.window = window;
        // Only a fault that feeds readahead moves it on (a bulk prefetch
        // of a working set does not).
        if req.track {
            ra.next = end;
        }
    }
    Ok(at)
}

/// Install only `req.page` (after its run met a present page before it).
fn install_one(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    req: &Request,
    how: How,
) -> Result<Page, ResolveError> {
    let page = req.page;
    let src = b.table().get(page);
    if src == b.self_src() {
        return Ok(Page::Present);
    }
    let source = arena
        .get(src)
        .cloned()
        .ok_or(ResolveError::UnknownSource(src))?;
    match copy_or_zero(arena, t, &source, src, page, page + 1, req)?.0 {
        Install::Done => {
            b.mark(page, 1, how);
            Ok(Page::Woken)
        }
        Install::Exists { .. } => {
            b.mark(page, 1, how);
            Ok(Page::Present)
        }
        Install::Again { .. } => Ok(Page::Again),
        Install::Gone => Ok(Page::Gone),
        Install::Failed(errno) => Err(ResolveError::Install { first: page, errno }),
    }
}

/// Install pages `[at, hi)` of a run whose faulting page is in already
/// (and its thread woken), `piece` pages at a time. A thread that faults
/// on one of them meanwhile is woken by the UFFDIO_COPY of its piece
/// (which wakes every waiter in its range, its event unread included),
/// never later than if the run had gone in whole. Stops at a piece that
/// cannot be installed (a fault on it reports why). Returns the end of
/// what was installed.
#[allow(clippy::too_many_arguments)]
fn stream_rest(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    source: &PageSource,
    mut at: u64,
    hi: u64,
    piece: u64,
    how: How,
) -> u64 {
    while at < hi {
        let end = (at + piece).min(hi);
        let n = match copy_pages(arena, t, source, at, end) {
            Ok(Install::Done) => end - at,
            Ok(Install::Exists { copied } | Install::Again { copied }) => {
                b.mark(at, copied / PAGE_SIZE, how);
                return at + copied / PAGE_SIZE;
            }
            Ok(Install::Gone | Install::Failed(_)) | Err(_) => return at,
        };
        b.mark(at, n, how);
        at = end;
    }
    at
}

/// UFFDIO_ZEROPAGE `[lo, hi)` when the client takes zero pages and `src`
/// is never-written memory, else [`copy_pages`]. Returns the outcome and
/// whether the pages went in as the shared zero page (not the client's
/// own: a write to them faults).
fn copy_or_zero(
    arena: &SourceArena,
    t: &Target<'_>,
    source: &PageSource,
    src: SourceId,
    lo: u64,
    hi: u64,
    req: &Request,
) -> Result<(Install, bool), ResolveError> {
    // UFFDIO_ZEROPAGE has no write-protect mode: while the client's
    // writes are tracked, a zero page would take a write unseen. Nor can
    // it go over an empty entry that keeps a protection (a discarded
    // page's): EEXIST. Zeroes are copied then.
    let tracked = t.mode & uffd_abi::COPY_MODE_WP != 0;
    if req.zero_pages && !tracked && src == UNINITIALIZED {
        phases::lap(Phase::Resolve);
        let (at, len) = (t.addr(lo), (hi - lo) * PAGE_SIZE);
        // Over a base the zero page goes in protected (see
        // `Target::map_from_base`): the guest's first write faults.
        let (res, protected) = if t.shared.is_some() {
            uffd_abi::zeropage_protected(t.uffd, at, len)
        } else {
            (uffd_abi::zeropage(t.uffd, at, len), true)
        };
        phases::lap(Phase::Install);
        if !matches!(res, Install::Exists { copied: 0 }) {
            // Zero pages that could not be protected take a write unseen:
            // they are counted the client's own (as copies would be).
            return Ok((res, protected));
        }
    }
    Ok((copy_pages(arena, t, source, lo, hi)?, false))
}

/// Read pages `[lo, hi)` of `source` into the staging buffer and
/// UFFDIO_COPY them to the client.
pub fn copy_pages(
    arena: &SourceArena,
    t: &Target<'_>,
    source: &PageSource,
    lo: u64,
    hi: u64,
) -> Result<Install, ResolveError> {
    let len = (hi - lo) * PAGE_SIZE;
    STAGING.with(|buf| {
        let mut buf = buf.borrow_mut();
        let bytes = shared::geometry::usize_of(len);
        if buf.len() < bytes {
            buf.resize(bytes, 0);
        }
        let dst = VolatileSlice::from(&mut buf[..bytes]);
        read_pages(source, lo, &dst, &|id| arena.memory_of(id))?;
        phases::lap(Phase::Resolve);
        // SAFETY: `buf` holds `len` initialized bytes and stays borrowed
        // for the call.
        let res = unsafe { t.copy(buf.as_ptr(), lo, len) };
        phases::lap(Phase::Install);
        Ok(res)
    })
}
