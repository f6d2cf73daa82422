//! Recording a snapshot's working set on its first restore: the VM's page
//! log already says which pages it installed from the snapshot and when,
//! so recording costs nothing on the fault path; [`finish`] reads the log
//! once, orders the pages by their install time and writes them into the
//! snapshot's directory (on a blocking thread, off the core).

use std::rc::Rc;
use std::time::Instant;

use proto::manifest::PageRun;
use shared::VmId;
use tracing::{info, warn};

use super::state::Recording;
use crate::core::state::Core;
use crate::observe::access::By;
use crate::snapshot::workset;

/// The working set recorded for the local snapshot `id` was restored
/// from, if it has one (read once per snapshot, then kept).
pub(crate) fn local_working_set(core: &Core, id: VmId) -> Option<Rc<Vec<PageRun>>> {
    let name = core
        .reg
        .borrow()
        .vms
        .get(&id)?
        .snapshot
        .base
        .as_ref()?
        .0
        .clone();
    let (dir, created, pages) = {
        let cat = core.snapshots.borrow();
        let st = cat.get(&name).ok()?;
        (
            cat.dir_of(&name),
            st.created,
            st.memory_bytes / shared::PAGE_SIZE,
        )
    };
    let key = (name, created);
    if let Some(known) = core.worksets.borrow().loaded.get(&key) {
        return known.clone();
    }
    let runs = match workset::read(&dir, pages) {
        Ok(runs) => runs.map(Rc::new),
        Err(e) => {
            warn!(
                "snapshot {}: its working set is not used: {}",
                key.0,
                shared::error_chain(&e)
            );
            None
        }
    };
    core.worksets.borrow_mut().loaded.insert(key, runs.clone());
    runs
}

/// Start recording the working set of the local snapshot `id` was
/// restored from, unless another VM records it already; the recording
/// ends at the VM's deletion or after the window.
pub(crate) fn start(core: &Rc<Core>, id: VmId) {
    let Some((name, src)) = core
        .reg
        .borrow()
        .vms
        .get(&id)
        .and_then(|v| v.snapshot.base.clone())
    else {
        return;
    };
    let Ok(created) = core.snapshots.borrow().get(&name).map(|s| s.created) else {
        return;
    };
    {
        let mut ws = core.worksets.borrow_mut();
        if ws
            .recording
            .values()
            .any(|r| r.snapshot == name && r.created == created)
        {
            return;
        }
        ws.recording.insert(
            id,
            Recording {
                snapshot: name,
                created,
                src,
                started: Instant::now(),
            },
        );
    }
    let window = core.settings.working_set_window;
    let core = core.clone();
    tokio::task::spawn_local(async move {
        tokio::time::sleep(window).await;
        finish(&core, id);
    });
}

/// End `id`'s recording, if it records: its working set goes into its
/// snapshot's directory (unless the snapshot is gone, or has one).
pub(crate) fn finish(core: &Core, id: VmId) {
    let Some(rec) = core.worksets.borrow_mut().recording.remove(&id) else {
        return;
    };
    let runs = {
        let reg = core.reg.borrow();
        let Some(v) = reg.vms.get(&id) else {
            return;
        };
        working_set_of(&v.log.pages, v.memory.pages(), rec.src)
    };
    if runs.is_empty() {
        return;
    }
    let dir = {
        let cat = core.snapshots.borrow();
        match cat.get(&rec.snapshot) {
            Ok(st) if st.created == rec.created => cat.dir_of(&rec.snapshot),
            _ => return,
        }
    };
    let pages = workset::page_count(&runs);
    let runs = Rc::new(runs);
    core.worksets
        .borrow_mut()
        .loaded
        .insert((rec.snapshot.clone(), rec.created), Some(Rc::clone(&runs)));
    let to_write = runs.to_vec();
    let name = rec.snapshot;
    let took = rec.started.elapsed();
    tokio::task::spawn_blocking(move || match workset::write(&dir, &to_write) {
        Ok(()) => info!(
            "snapshot {name}: recorded a working set of {pages} pages ({} runs, {took:?} of {id})",
            to_write.len()
        ),
        Err(e) => warn!(
            "snapshot {name}: cannot record its working set: {}",
            shared::error_chain(&e)
        ),
    });
}

/// The pages of a VM's page log installed from source `src` by a fault
/// or around one, in the order they were installed (pages installed in
/// the same millisecond in page order), as runs.
fn working_set_of(
    log: &crate::observe::access::PageLog,
    pages: u64,
    src: crate::pages::SourceId,
) -> Vec<PageRun> {
    let mut order: Vec<(u64, u64)> = (0..pages)
        .filter_map(|p| {
            let i = log.installed(p)?;
            (i.from == src && matches!(i.by, By::Missing | By::FaultAround | By::Shared))
                .then_some((i.unix_ms, p))
        })
        .collect();
    order.sort_unstable();
    workset::runs_of(order.into_iter().map(|(_, p)| p))
}
