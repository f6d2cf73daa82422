//! Prefetching a working set into a running VM: its chunks in the object
//! store are all asked for at once (bulk, in first-touch order, so the
//! fetcher threads work on them in parallel and a guest fault elsewhere
//! goes first), and its pages are installed in that order as their data
//! arrives, a batch at a time, yielding to the VM's own faults between
//! batches ([`crate::core::fault::ahead`]).

use std::rc::Rc;
use std::time::{Duration, Instant};

use proto::manifest::PageRun;
use shared::VmId;
use tracing::info;

use crate::core::fault::ahead::{install_ahead, Ahead};
use crate::core::state::Core;
use crate::remote::chunks::Priority;

/// Pages looked at between two yields to the rest of the core.
const BATCH: u64 = 512;

/// Install `runs` (pages in first-touch order) of `id` ahead of its guest.
pub(crate) async fn prefetch(core: Rc<Core>, id: VmId, runs: Rc<Vec<PageRun>>) {
    let t0 = Instant::now();
    queue_chunks(&core, id, &runs);
    let mut looked = 0u64;
    for r in runs.iter() {
        let mut p = r.first;
        while p < r.first + r.pages {
            let ahead = install_ahead(&mut core.reg.borrow_mut(), id, p);
            match ahead {
                Ahead::Done | Ahead::Skip => p += 1,
                Ahead::Wait(ready) => {
                    for w in ready {
                        let _ = w.await;
                    }
                }
                Ahead::Later => tokio::time::sleep(Duration::from_millis(1)).await,
                Ahead::Stop => return,
            }
            looked += 1;
            if looked.is_multiple_of(BATCH) {
                tokio::task::yield_now().await;
            }
        }
    }
    let pages: u64 = runs.iter().map(|r| r.pages).sum();
    info!(
        "{id}: working set of {pages} pages prefetched in {:?}",
        t0.elapsed()
    );
}

/// Ask for the chunks of the pages of `runs` that `id` reads from a
/// snapshot in the object store, in the order of `runs`.
fn queue_chunks(core: &Core, id: VmId, runs: &[PageRun]) {
    let reg = core.reg.borrow();
    let Some(v) = reg.vms.get(&id) else {
        return;
    };
    let mut last = None;
    for r in runs {
        for p in r.first..(r.first + r.pages).min(v.memory.pages()) {
            let Some(img) = reg.arena.get(v.table.get(p)).and_then(|s| s.remote()) else {
                continue;
            };
            let chunk = img.chunk_of(p);
            if last != Some(chunk) {
                img.prefetch([chunk], Priority::Bulk);
                last = Some(chunk);
            }
        }
    }
}
