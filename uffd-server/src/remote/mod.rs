//! The server's side of the object store (`--remote s3://BUCKET[/PREFIX]`):
//! the store's client (the `pagefork-remote` crate), the runtime its
//! requests run on, the on-disk chunk cache and the fetcher threads that
//! serve faults from snapshots in the store. None of it runs on the core
//! thread: the core hands a push, a pull, a listing or a manifest read to
//! the `remote-io` runtime and awaits its handle, and parks a fault on a
//! chunk not yet here until a `remote-fetch-N` thread has it
//! ([`chunks`]).
//!
//! ```text
//!   core thread ──spawn──▶ remote-io runtime (2 threads): push, pull,
//!        ▲  await handle     list, delete, gc, manifests (object_store)
//!        │
//!        └── oneshot per ──  remote-fetch-N threads: ChunkCache::load
//!            parked fault    (STATE/remote-cache/<digest>, else one GET)
//! ```
//!
//! - [`chunks`]: the fetcher threads and the chunks in memory.
//! - [`image`]: a snapshot in the store as a page source.
//! - [`volume`]: a volume snapshot's chunks written into a local file.
//!
//! Credentials never reach a log line or an answer: the crate's
//! configuration redacts them, and its errors are scrubbed of them.

pub mod chunks;
pub mod image;
pub mod volume;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pagefork_remote::{ChunkCache, Remote, RemoteConfig};
use tokio::runtime::Handle;
use tokio::task::JoinHandle;

use chunks::ChunkPool;

/// The directory of the chunk cache in the state directory.
pub const CACHE_DIR: &str = "remote-cache";

/// How the server uses the store.
#[derive(Debug, Clone)]
pub struct RemoteSettings {
    pub config: RemoteConfig,
    /// Bytes of chunks cached on the state directory.
    pub cache_bytes: u64,
    /// Bytes of chunks kept in memory for faults.
    pub memory_bytes: u64,
    /// Fetcher threads.
    pub fetchers: usize,
}

/// Why the store cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("cannot set up the store client")]
    Client(#[source] pagefork_remote::Error),
    #[error("cannot open the chunk cache {}", .0.display())]
    Cache(PathBuf, #[source] pagefork_remote::Error),
    #[error("cannot start the chunk fetcher threads")]
    Threads(#[source] std::io::Error),
}

/// The store, its runtime, cache and fetchers. `Send + Sync`.
#[derive(Debug)]
pub struct RemoteService {
    pub remote: Remote,
    runtime: Handle,
    pub chunks: Arc<ChunkPool>,
}

impl RemoteService {
    /// Open the store of `settings` (no request is made yet), its cache in
    /// `state_dir`, its requests run on `runtime` (a multi-thread runtime
    /// of the caller's, not the core's).
    pub fn open(
        settings: &RemoteSettings,
        state_dir: &Path,
        runtime: Handle,
    ) -> Result<Self, ServiceError> {
        let remote = Remote::new(settings.config.clone()).map_err(ServiceError::Client)?;
        let dir = state_dir.join(CACHE_DIR);
        let cache = ChunkCache::open(&dir, settings.cache_bytes, remote.clone(), runtime.clone())
            .map_err(|e| ServiceError::Cache(dir, e))?;
        let chunks = ChunkPool::start(Arc::new(cache), settings.fetchers, settings.memory_bytes)
            .map_err(ServiceError::Threads)?;
        Ok(RemoteService {
            remote,
            runtime,
            chunks,
        })
    }

    /// The store, `s3://BUCKET[/PREFIX]`.
    pub fn url(&self) -> String {
        self.remote.url().to_string()
    }

    /// Run `fut` on the store's runtime; await the handle from anywhere.
    pub fn spawn<F>(&self, fut: F) -> JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.runtime.spawn(fut)
    }

    /// Run blocking `f` on the store's runtime's blocking threads (file
    /// work of a pull or push that is not the crate's).
    pub fn spawn_blocking<F, T>(&self, f: F) -> JoinHandle<T>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        self.runtime.spawn_blocking(f)
    }
}
