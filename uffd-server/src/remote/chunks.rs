//! Chunks of snapshots in the object store, for faults: fetcher threads
//! that read chunks through the on-disk [`ChunkCache`] (from the store
//! once, from the state directory after), and a bounded map of the chunks
//! in memory that the core thread copies pages out of. The core never
//! waits for the network or the disk: a fault on a chunk not in memory is
//! parked until a fetcher has it, as a fault on a compressed frame is
//! (`images/zst.rs`).
//!
//! ```text
//!  core thread                          remote-fetch-N threads
//!  ───────────                          ──────────────────────
//!  fault on page p of a remote source
//!    chunk c in memory? ── yes ─▶ copy its pages, UFFDIO_COPY
//!        │ no
//!        ▼
//!  ChunkPool::wait(c) ──urgent job──▶ ChunkCache::load(c): the cached file,
//!  (the vCPU stays in its fault;        checked, or one range GET, checked
//!   the fault is parked)                and cached; into the memory map,
//!  waiter fires ─▶ retry the fault      notify every waiter of c
//!  working-set prefetch ──bulk jobs──▶  (taken only when no urgent job waits)
//! ```
//!
//! Invariants:
//! - a chunk enters the memory map only after its digest matched (the
//!   cache checks every chunk it returns), so a damaged chunk is never
//!   served, and it is not cached;
//! - at most one fetch of a chunk runs at a time (the cache's rule too);
//!   a fault on a chunk queued for bulk prefetch moves it to the urgent
//!   queue, so a guest never waits behind a working set it is not using;
//! - a chunk that could not be had (the store down or slow past the
//!   fetch deadline, the chunk missing or damaged) is remembered as failed
//!   for [`FAILURE_KEPT`], long enough for every fault waiting on it to
//!   fail with the reason rather than fetch again; a fault after that tries
//!   again (the store may be back);
//! - the memory map stays under its capacity, evicting in insertion order;
//!   the chunk just inserted always stays, so its waiters find it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use pagefork_remote::{ChunkCache, ChunkRef};
use tokio::sync::oneshot;
use tracing::warn;

/// How long a chunk that could not be had stays failed.
pub const FAILURE_KEPT: Duration = Duration::from_secs(5);

/// A chunk's key: its XXH3-128 digest as a number.
pub type ChunkKey = u128;

/// The key of digest `hex` (lowercase hex, checked by the manifest).
pub fn key_of(hex: &str) -> ChunkKey {
    ChunkKey::from_str_radix(hex, 16).unwrap_or_default()
}

/// Why a chunk cannot be served. Shared by every fault on it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ChunkError {
    /// Reading it from the cache or the store failed, or it is damaged
    /// (the message names the store, the chunk and the reason).
    #[error(transparent)]
    Load(Arc<pagefork_remote::Error>),
    /// The fetcher threads have exited (the server is stopping).
    #[error("the chunk fetcher threads are gone")]
    PoolGone,
}

/// How urgent a fetch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// A fault waits for it, or a sequential reader will soon.
    Urgent,
    /// A working set fetched ahead of the guest.
    Bulk,
}

#[derive(Debug)]
struct Job {
    key: ChunkKey,
    chunk: ChunkRef,
}

/// The fetch queues and who waits for what.
#[derive(Debug, Default)]
struct Queues {
    urgent: VecDeque<Job>,
    bulk: VecDeque<Job>,
    /// Chunks queued or being fetched, with who waits for each.
    inflight: HashMap<ChunkKey, Vec<oneshot::Sender<()>>>,
    /// Of those, the ones a fetcher has taken.
    started: HashSet<ChunkKey>,
    /// Of those queued only in bulk, which (to move them up).
    bulk_only: HashSet<ChunkKey>,
}

/// Counters of the pool since the server started.
#[derive(Debug, Default)]
pub struct PoolStats {
    /// Chunks fetched from the store, and their stored bytes.
    pub fetched_chunks: AtomicU64,
    pub fetched_bytes: AtomicU64,
    /// Chunk loads that failed.
    pub failures: AtomicU64,
}

/// The fetcher threads and the chunks in memory.
#[derive(Debug)]
pub struct ChunkPool {
    cache: Arc<ChunkCache>,
    mem: DashMap<ChunkKey, Arc<[u8]>>,
    /// Insertion order, for eviction.
    order: Mutex<VecDeque<(ChunkKey, usize)>>,
    bytes: AtomicU64,
    capacity: u64,
    queues: Mutex<Queues>,
    work: Condvar,
    failed: DashMap<ChunkKey, (ChunkError, Instant)>,
    stop: AtomicBool,
    pub stats: PoolStats,
}

impl ChunkPool {
    /// Start `fetchers` threads reading chunks through `cache` into a map
    /// of at most `capacity` bytes.
    pub fn start(
        cache: Arc<ChunkCache>,
        fetchers: usize,
        capacity: u64,
    ) -> std::io::Result<Arc<Self>> {
        let pool = Arc::new(ChunkPool {
            cache,
            mem: DashMap::new(),
            order: Mutex::new(VecDeque::new()),
            bytes: AtomicU64::new(0),
            capacity,
            queues: Mutex::new(Queues::default()),
            work: Condvar::new(),
            failed: DashMap::new(),
            stop: AtomicBool::new(false),
            stats: PoolStats::default(),
        });
        for i in 0..fetchers.max(1) {
            let weak = Arc::downgrade(&pool);
            std::thread::Builder::new()
                .name(format!("remote-fetch-{i}"))
                .spawn(move || fetcher(&weak))?;
        }
        Ok(pool)
    }

    /// The on-disk cache behind it.
    pub fn cache(&self) -> &ChunkCache {
        &self.cache
    }

    /// Chunks and bytes in memory now, and the most kept.
    pub fn memory(&self) -> (u64, u64, u64) {
        (
            self.mem.len() as u64,
            self.bytes.load(Ordering::Relaxed),
            self.capacity,
        )
    }

    /// Stop the fetchers (they finish the chunk in hand).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.work.notify_all();
    }

    fn queues(&self) -> MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Chunk `key`'s bytes if in memory; `Err` with the reason if it
    /// could not be had lately.
    pub fn lookup(&self, key: ChunkKey) -> Result<Option<Arc<[u8]>>, ChunkError> {
        if let Some(b) = self.mem.get(&key) {
            return Ok(Some(Arc::clone(&b)));
        }
        if let Some(f) = self.failed.get(&key) {
            if f.1.elapsed() < FAILURE_KEPT {
                return Err(f.0.clone());
            }
        }
        Ok(None)
    }

    /// Ask for `chunk`: queue it unless it is in memory or failed lately;
    /// with `wait`, a receiver that fires when it is in memory or failed.
    pub fn request(
        &self,
        chunk: &ChunkRef,
        priority: Priority,
        wait: bool,
    ) -> Option<oneshot::Receiver<()>> {
        let key = key_of(&chunk.digest);
        let mut q = self.queues();
        // Checked under the lock: a fetcher inserts before it takes the
        // lock to notify, so a chunk is either found here or its waiters
        // are notified after this push.
        if self.mem.contains_key(&key) {
            return None;
        }
        if let Some(f) = self.failed.get(&key) {
            if f.1.elapsed() < FAILURE_KEPT {
                return None;
            }
        }
        let (tx, rx) = oneshot::channel();
        let job = || Job {
            key,
            chunk: chunk.clone(),
        };
        let q = &mut *q;
        match q.inflight.get_mut(&key) {
            Some(waiters) => {
                if wait {
                    waiters.push(tx);
                }
                // Queued for bulk prefetch only: a fault wants it now.
                if priority == Priority::Urgent && q.bulk_only.remove(&key) {
                    q.urgent.push_back(job());
                    self.work.notify_one();
                }
            }
            None => {
                if self.stop.load(Ordering::Relaxed) {
                    self.failed
                        .insert(key, (ChunkError::PoolGone, Instant::now()));
                    return None;
                }
                q.inflight
                    .insert(key, if wait { vec![tx] } else { Vec::new() });
                match priority {
                    Priority::Urgent => q.urgent.push_back(job()),
                    Priority::Bulk => {
                        q.bulk_only.insert(key);
                        q.bulk.push_back(job());
                    }
                }
                self.work.notify_one();
            }
        }
        wait.then_some(rx)
    }

    /// The next job for a fetcher: urgent ones first; `None` to stop.
    fn next_job(&self) -> Option<Job> {
        let mut q = self.queues();
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return None;
            }
            let job = match q.urgent.pop_front() {
                Some(j) => Some(j),
                None => q.bulk.pop_front(),
            };
            match job {
                // Taken already (queued twice), or done.
                Some(j) if q.started.contains(&j.key) || !q.inflight.contains_key(&j.key) => {}
                Some(j) => {
                    q.started.insert(j.key);
                    q.bulk_only.remove(&j.key);
                    return Some(j);
                }
                None => {
                    q = self.work.wait(q).unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }

    /// Record what became of chunk `key` and wake its waiters.
    fn finish(&self, key: ChunkKey, result: Result<Arc<[u8]>, ChunkError>) {
        match result {
            Ok(bytes) => {
                let len = bytes.len();
                self.failed.remove(&key);
                if self.mem.insert(key, bytes).is_none() {
                    self.bytes.fetch_add(len as u64, Ordering::Relaxed);
                    let mut order = self.order.lock().unwrap_or_else(PoisonError::into_inner);
                    order.push_back((key, len));
                    while self.bytes.load(Ordering::Relaxed) > self.capacity && order.len() > 1 {
                        let Some((old, n)) = order.pop_front() else {
                            break;
                        };
                        if self.mem.remove(&old).is_some() {
                            self.bytes.fetch_sub(n as u64, Ordering::Relaxed);
                        }
                    }
                }
            }
            Err(e) => {
                self.stats.failures.fetch_add(1, Ordering::Relaxed);
                self.failed.insert(key, (e, Instant::now()));
            }
        }
        let waiters = {
            let mut q = self.queues();
            q.started.remove(&key);
            q.inflight.remove(&key)
        };
        for w in waiters.into_iter().flatten() {
            let _ = w.send(());
        }
    }
}

/// How much lower than the server's the fetchers' CPU priority is: they
/// decode and check chunks, bulk work that must not take the CPU from the
/// vCPUs and the core thread (see `images/zst.rs`).
const FETCHER_NICE: i32 = 10;

/// A fetcher thread: take jobs until the pool stops or is gone.
fn fetcher(pool: &Weak<ChunkPool>) {
    // SAFETY: gettid has no arguments and no memory effects.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority on this thread's own id; no memory effects.
    let r = unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            tid.unsigned_abs(),
            libc::getpriority(libc::PRIO_PROCESS, 0) + FETCHER_NICE,
        )
    };
    if r != 0 {
        warn!(
            "chunk fetcher: cannot lower its priority: {}",
            std::io::Error::last_os_error()
        );
    }
    loop {
        let Some(p) = pool.upgrade() else { return };
        let Some(job) = p.next_job() else { return };
        let result = match p.cache.load(&job.chunk) {
            Ok(loaded) => {
                if loaded.fetched {
                    p.stats.fetched_chunks.fetch_add(1, Ordering::Relaxed);
                    p.stats
                        .fetched_bytes
                        .fetch_add(u64::from(job.chunk.stored), Ordering::Relaxed);
                }
                Ok(Arc::from(&loaded.bytes[..]))
            }
            Err(e) => {
                warn!(
                    "chunk {} cannot be had: {}",
                    job.chunk.digest,
                    shared::error_chain(&e)
                );
                Err(ChunkError::Load(Arc::new(e)))
            }
        };
        p.finish(job.key, result);
    }
}
