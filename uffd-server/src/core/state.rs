//! [`Core`]: the state the core thread owns and every feature works on
//! (the registry of VMs, the settings, the snapshot catalog, the volume
//! engine, the warm VMM pool, the object store, working sets, the fds
//! admitted), and its few methods of its own.
//!
//! Everything here runs on one tokio current-thread runtime inside a
//! `LocalSet`, so state is plain `Rc`/`RefCell`. No `RefCell` borrow is
//! held across an `.await`.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use tokio::sync::mpsc;
use tracing::info;

use crate::conn::{ConnEvent, PendingLaunches};
use crate::core::fd_budget::FdBudget;
use crate::core::pool::state::VmmPool;
use crate::core::reclaim::state::Reclaimer;
use crate::core::registry::Registry;
use crate::core::remote::state::RemoteState;
use crate::core::restart::state::Restart;
use crate::core::settings::Settings;
use crate::core::workset::state::WorkingSets;
use crate::images::zst::FramePool;
use crate::snapshot::Catalog;
use volume::VolumeEngine;

/// The core's state.
#[derive(Debug)]
pub struct Core {
    pub reg: RefCell<Registry>,
    pub settings: Settings,
    pub pending: PendingLaunches,
    pub volumes: Option<Arc<VolumeEngine>>,
    /// The complete VM snapshots of the state directory.
    pub snapshots: RefCell<Catalog>,
    /// Where connection threads (VMM and Firecracker) report.
    pub events: mpsc::UnboundedSender<ConnEvent>,
    /// Time spent on each uffd event (both kinds of VM), for `/metrics`.
    pub fault_seconds: prometheus_client::metrics::histogram::Histogram,
    /// The threads and cache that decode compressed images' frames.
    pub frames: Arc<FramePool>,
    /// VMMs started ahead of need (`--vmm-pool`).
    pub pool: RefCell<VmmPool>,
    /// The object store (`--remote`) and its pushes.
    pub remote: RemoteState,
    /// Working sets being recorded, and those read from snapshots.
    pub worksets: RefCell<WorkingSets>,
    /// The admission of file descriptors.
    pub fds: FdBudget,
    /// What outlives this process, and what it took back at start.
    pub restart: Restart,
    /// Reclaim under memory pressure: the limit, the swap store.
    pub reclaim: RefCell<Reclaimer>,
    /// Log lines that report a finished request, written once its answer
    /// is out (see [`Core::log_after_answer`]).
    after_answer: RefCell<Vec<String>>,
}

impl Core {
    /// A core with no VMs.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: Settings,
        pending: PendingLaunches,
        volumes: Option<Arc<VolumeEngine>>,
        snapshots: Catalog,
        events: mpsc::UnboundedSender<ConnEvent>,
        frames: Arc<FramePool>,
        remote: Option<Arc<crate::remote::RemoteService>>,
        restart: Restart,
    ) -> Rc<Self> {
        let reg = Registry::new(&settings.state_dir, settings.readahead_piece_pages);
        let pool = VmmPool::new(settings.vmm_pool);
        let reclaim = Reclaimer::new(&settings);
        Rc::new(Core {
            reg: RefCell::new(reg),
            settings,
            pending,
            volumes,
            snapshots: RefCell::new(snapshots),
            events,
            fault_seconds: crate::observe::metrics::fault_histogram(),
            frames,
            pool: RefCell::new(pool),
            remote: RemoteState {
                service: remote,
                ..RemoteState::default()
            },
            worksets: RefCell::new(WorkingSets::default()),
            fds: FdBudget::default(),
            restart,
            reclaim: RefCell::new(reclaim),
            after_answer: RefCell::new(Vec::new()),
        })
    }

    /// Log `line` (at info level) once the answer of the request that
    /// wrote it has gone out. A log line costs this thread 0.02–0.04 ms
    /// here, and the lines that report a started VM were on the start's
    /// path, between the VM answering `running` and the client hearing
    /// of it.
    pub fn log_after_answer(&self, line: String) {
        self.after_answer.borrow_mut().push(line);
    }

    /// Write the lines [`Self::log_after_answer`] holds, after letting the
    /// task that answers the client run.
    pub async fn flush_after_answer(&self) {
        if self.after_answer.borrow().is_empty() {
            return;
        }
        tokio::task::yield_now().await;
        let lines = std::mem::take(&mut *self.after_answer.borrow_mut());
        for line in lines {
            info!("{line}");
        }
    }
}
