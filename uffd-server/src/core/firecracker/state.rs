//! A Firecracker listener's state: its socket, what it serves, its
//! fault-around and readahead, and the working set its first VM recorded.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;

use proto::api::MemorySource;

use crate::conn::firecracker::ListenerStats;
use crate::pages::SourceId;

/// A Firecracker listener.
#[derive(Debug)]
pub struct FcListener {
    pub id: u32,
    pub socket: PathBuf,
    /// What the listener serves, as asked.
    pub memory_source: MemorySource,
    pub source: SourceId,
    /// The guest memory size a handshake's regions may cover.
    pub source_len: u64,
    /// Runs of source pages holding data (the rest, a compressed image's
    /// zero frames or a snapshot image's holes, read as zero).
    pub data: Rc<Vec<(u64, u64)>>,
    pub fault_around_pages: u64,
    /// Largest readahead window in pages.
    pub readahead_pages: u64,
    pub working_set: bool,
    /// Pages (source page index) the first VM faulted on, in order.
    pub recorded: Option<Rc<Vec<u64>>>,
    pub stats: Arc<ListenerStats>,
    /// The listening socket, shut down to stop the accept thread.
    pub sock: std::os::unix::net::UnixListener,
}

/// The listeners by id, kept in the registry.
pub type FcListeners = BTreeMap<u32, FcListener>;
