//! Installing pages of one of our VMs that no fault asked for yet (a
//! working set prefetched while the guest runs), through its uffd and the
//! one installer ([`super::install`]), as a fault on the page would: the
//! run around it, mapped from the VM's shared base or copied with
//! `UFFDIO_COPY` (write-protected while writes are tracked), the table and
//! page log marked. It never moves readahead on,
//! and it never fails the VM for data that is not here: a chunk or frame
//! not fetched or decoded yet is waited for, one that cannot be had is
//! left to the guest's own fault, if it comes.

use shared::VmId;
use tokio::sync::oneshot;

use super::books::{install_target, OurBooks};
use super::install::{self, Request, Served};
use crate::core::registry::Registry;
use crate::pages::PageSource;

/// The least run a prefetch installs at once, in pages (256 KiB): fewer,
/// larger copies for the same working set.
const MIN_RUN: u64 = 64;

/// What became of a page to install ahead.
#[derive(Debug)]
pub(crate) enum Ahead {
    /// Installed (with the run around it), or present already.
    Done,
    /// Its data is on its way: retry when these fire.
    Wait(Vec<oneshot::Receiver<()>>),
    /// Not now (the VM's VMM has not sent its uffd yet, or an operation
    /// that pauses it runs): retry a little later.
    Later,
    /// Its data cannot be had: skip it (the guest's fault will say why).
    Skip,
    /// The VM is gone or stopped: stop prefetching.
    Stop,
}

/// Install `page` of `vm` ahead of its guest.
pub(crate) fn install_ahead(reg: &mut Registry, vm: VmId, page: u64) -> Ahead {
    let Registry {
        vms,
        arena,
        installed,
        ..
    } = reg;
    let Some(v) = vms.get_mut(&vm) else {
        return Ahead::Stop;
    };
    if v.is_deleted() || v.is_over() {
        return Ahead::Stop;
    }
    if v.busy.is_busy() {
        return Ahead::Later;
    }
    let Some(uffd) = v.faults.uffd.clone() else {
        return Ahead::Later;
    };
    let src = v.table.get(page);
    if src == v.self_src {
        return Ahead::Done;
    }
    // A VM on a shared base maps the base's pages, as its faults do:
    // installing ahead of the guest is no reason to copy them, nor to
    // fetch or decode what the base holds already.
    let on = v.base.on.clone();
    let held = |lo, hi| {
        on.as_ref()
            .is_some_and(|on| on.src == src && on.base.holds(lo, hi))
    };
    match arena.get(src).map(|s| &**s) {
        Some(PageSource::Remote(_) | PageSource::Zstd(_)) if held(page, page + 1) => {}
        Some(PageSource::Remote(r)) => {
            let chunk = r.image.chunk_of(page);
            match r.image.cached(chunk) {
                Ok(Some(_)) => {}
                Ok(None) => return Ahead::Wait(r.image.wait(chunk..chunk + 1)),
                Err(_) => return Ahead::Skip,
            }
        }
        Some(PageSource::Zstd(z)) => {
            let frame = z.image.header().frame_of(page);
            match z.image.cached(frame) {
                Ok(Some(_)) => {}
                Ok(None) => {
                    return Ahead::Wait(crate::images::zst::FramePool::wait(
                        &z.image,
                        frame..frame + 1,
                    ))
                }
                Err(_) => return Ahead::Skip,
            }
        }
        Some(_) => {}
        None => return Ahead::Skip,
    }
    let t = install_target(v, &uffd, on.as_ref());
    let req = Request {
        page,
        bounds: 0..v.memory.pages(),
        fault_around: v.faults.fault_around_pages.max(MIN_RUN),
        track: false,
        piece: 0,
        zero_pages: on.is_some() && v.memory.unit_pages() == 1,
        blocks_ahead: false,
        write: false,
    };
    let mut books = OurBooks { v, installed };
    match install::serve_missing(&mut books, arena, &t, &req) {
        Served::Done | Served::Again => Ahead::Done,
        Served::Wait(ready) => Ahead::Wait(ready),
        Served::Gone | Served::Failed(_) => Ahead::Stop,
    }
}
