//! Which pages a 4 KiB fault installs, and from where ([`Plan`]).

use std::rc::Rc;

use crate::pages::{
    fault_on, plan_run, Fault, PageSource, PageTable, Readahead, ResolveError, SourceArena,
    SourceId,
};

use super::target::{OnBase, Request};

/// What to install for a MISSING fault on a page that is not present:
/// its source, and the run `[lo, hi)` of pages around it that read from
/// that source (with the readahead window it used, for an image).
#[derive(Debug)]
pub struct Plan {
    pub src: SourceId,
    pub source: Rc<PageSource>,
    pub lo: u64,
    pub hi: u64,
    pub window: Option<u64>,
}

/// Plan the install of `req.page`: `None` when it is present already.
/// `shared` is the client's base, if any: frames and chunks of pages it
/// holds are not decoded or fetched ahead.
pub fn plan(
    table: &PageTable,
    self_src: SourceId,
    arena: &SourceArena,
    ra: &Readahead,
    req: &Request,
    shared: Option<OnBase<'_>>,
) -> Result<Option<Plan>, ResolveError> {
    let page = req.page;
    let src = table.get(page);
    if src == self_src {
        return Ok(None);
    }
    let source = arena
        .get(src)
        .cloned()
        .ok_or(ResolveError::UnknownSource(src))?;
    let run = source.fault_around().then(|| {
        let fault = Fault {
            page,
            bounds: req.bounds.clone(),
            block: req.fault_around,
            track: req.track,
        };
        // What the client's base holds is not decoded or fetched ahead.
        let held = |lo, hi| shared.is_some_and(|on| on.src == src && on.base.holds(lo, hi));
        let fault = fault_on(&source, fault, ra, &held);
        plan_run(table, src, &fault, ra)
    });
    let (lo, hi) = run.map_or((page, page + 1), |r| (r.lo, r.hi));
    Ok(Some(Plan {
        src,
        source,
        lo,
        hi,
        window: run.map(|r| r.window),
    }))
}
