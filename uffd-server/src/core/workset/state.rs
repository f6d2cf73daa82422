//! The working-set feature's state on the core: recordings under way and
//! working sets waiting for their VM to run.

use std::collections::HashMap;
use std::rc::Rc;
use std::time::Instant;

use proto::manifest::PageRun;
use shared::VmId;

use crate::pages::SourceId;

/// A VM recording the working set of the snapshot it was restored from.
#[derive(Debug, Clone)]
pub struct Recording {
    pub snapshot: String,
    /// When the snapshot was created (a later snapshot of the same name is
    /// another snapshot).
    pub created: u64,
    /// The snapshot's source in the VM's table.
    pub src: SourceId,
    pub started: Instant,
}

/// Recordings and pending prefetches.
#[derive(Debug, Default)]
pub struct WorkingSets {
    /// VMs recording, by VM.
    pub recording: HashMap<VmId, Recording>,
    /// Working sets to prefetch once their VM runs (a remote restore's,
    /// from its manifest).
    pub pending: HashMap<VmId, Rc<Vec<PageRun>>>,
    /// Working sets read from local snapshots, by (name, created).
    pub loaded: HashMap<(String, u64), Option<Rc<Vec<PageRun>>>>,
}
