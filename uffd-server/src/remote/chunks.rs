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
//!  working-set prefetch ──bulk jobs──▶  (taken only when no urgent job waits,
//!                                       by at most a quarter of the fetchers,
//!                                       at a lower CPU priority)
//! ```
//!
//! Invariants:
//! - a chunk enters the memory map only after its digest matched (the
//!   cache checks every chunk it returns), so a damaged chunk is never
//!   served, and it is not cached;
//! - at most one fetch of a chunk runs at a time (the cache's rule too);
//!   a fault on a chunk queued for bulk prefetch moves it to the urgent
//!   queue, so a guest never waits behind a working set it is not using;
//! - bulk jobs hold at most [`bulk_limit`] fetchers at a time, so a fault
//!   always finds one idle, and a bulk job runs at [`BULK_NICE`], so the
//!   chunk a fault waits for is not decoded at the pace of a dozen others
//!   (measured: with every fetcher on the working set, a restored guest
//!   answered 4.5 × later than with no prefetch);
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
    /// Taken from the bulk queue (counted in `bulk_running`).
    bulk: bool,
}

/// The fetch queues and who waits for what.
#[derive(Debug, Default)]
struct Queues {
    urgent: VecDeque<Job>,
    bulk: VecDeque<Job>,
    /// Chunks queued or being fetched, with who waits for each.
    inflight: HashMap<ChunkKey, Vec<oneshot::Sender<()>>>,
    /// Of those, the ones a fetcher has taken; for a bulk job no fault
    /// waits for yet, the fetcher's thread id (to raise its priority when
    /// one does).
    started: HashMap<ChunkKey, Option<libc::pid_t>>,
    /// Of those queued only in bulk, which (to move them up).
    bulk_only: HashSet<ChunkKey>,
    /// Bulk jobs a fetcher holds now.
    bulk_running: usize,
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
    /// The most bulk jobs fetched at once.
    bulk_limit: usize,
    /// The fetchers' CPU priorities.
    nice: FetcherNice,
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
            bulk_limit: bulk_limit(fetchers),
            nice: FetcherNice::probe(),
            failed: DashMap::new(),
            stop: AtomicBool::new(false),
            stats: PoolStats::default(),
        });
        let nice = pool.nice;
        for i in 0..fetchers.max(1) {
            let weak = Arc::downgrade(&pool);
            std::thread::Builder::new()
                .name(format!("remote-fetch-{i}"))
                .spawn(move || fetcher(&weak, nice))?;
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
        let job = |bulk| Job {
            key,
            chunk: chunk.clone(),
            bulk,
        };
        let q = &mut *q;
        match q.inflight.get_mut(&key) {
            Some(waiters) => {
                if wait {
                    waiters.push(tx);
                }
                if priority == Priority::Urgent {
                    // Queued for bulk prefetch only: a fault wants it now.
                    if q.bulk_only.remove(&key) {
                        q.urgent.push_back(job(false));
                        self.work.notify_one();
                    }
                    // Being fetched as bulk: at a fault's priority from now.
                    if let Some(tid) = q.started.get_mut(&key).and_then(Option::take) {
                        let _ = set_nice_of(tid, self.nice.normal);
                    }
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
                    Priority::Urgent => q.urgent.push_back(job(false)),
                    Priority::Bulk => {
                        q.bulk_only.insert(key);
                        q.bulk.push_back(job(true));
                    }
                }
                self.work.notify_one();
            }
        }
        wait.then_some(rx)
    }

    /// The next job for a fetcher: urgent ones first, bulk ones while
    /// fewer than `bulk_limit` run; `None` to stop.
    fn next_job(&self, tid: libc::pid_t) -> Option<Job> {
        let mut q = self.queues();
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return None;
            }
            let job = match q.urgent.pop_front() {
                Some(j) => Some(j),
                None if q.bulk_running < self.bulk_limit => q.bulk.pop_front(),
                None => None,
            };
            match job {
                // Taken already (queued twice), or done.
                Some(j) if q.started.contains_key(&j.key) || !q.inflight.contains_key(&j.key) => {}
                Some(j) => {
                    q.started.insert(j.key, j.bulk.then_some(tid));
                    // Under the lock, so a fault's raise (also under it)
                    // comes after. Set for every job, as a fault may have
                    // raised it on the last; best effort: where it cannot
                    // change, the order of the queues still puts faults
                    // first.
                    if self.nice.bulk != self.nice.normal {
                        let _ = set_nice(if j.bulk {
                            self.nice.bulk
                        } else {
                            self.nice.normal
                        });
                    }
                    q.bulk_only.remove(&j.key);
                    if j.bulk {
                        q.bulk_running += 1;
                    }
                    return Some(j);
                }
                None => {
                    q = self.work.wait(q).unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }

    /// Record what became of `job` and wake its waiters.
    fn finish(&self, job: &Job, result: Result<Arc<[u8]>, ChunkError>) {
        let key = job.key;
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
            if job.bulk {
                q.bulk_running -= 1;
                // A fetcher may wait with only bulk jobs queued.
                self.work.notify_one();
            }
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

/// The nice value of a fetcher while it holds a bulk job (the lowest
/// priority there is): a fault's chunk, at [`FETCHER_NICE`], gets about
/// seven times the CPU of each bulk chunk decoded beside it.
pub const BULK_NICE: i32 = 19;

/// The most bulk jobs of `fetchers` threads at once: a quarter, at least
/// one, and always one thread fewer than all.
pub fn bulk_limit(fetchers: usize) -> usize {
    (fetchers / 4).clamp(1, fetchers.saturating_sub(1).max(1))
}

/// The nice values of a fetcher, for fetches faults wait for and for bulk
/// ones.
#[derive(Debug, Clone, Copy)]
struct FetcherNice {
    normal: i32,
    bulk: i32,
}

impl FetcherNice {
    /// The fetchers' values in this process: bulk jobs go lower only where
    /// a thread may come back up (root, or `RLIMIT_NICE` allows it),
    /// which a throwaway thread tries once, so no fetcher is stuck low.
    fn probe() -> Self {
        // SAFETY: getpriority reads the calling thread's nice value; no
        // memory effects.
        let base = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let normal = (base + FETCHER_NICE).min(BULK_NICE);
        let round_trip =
            std::thread::spawn(move || set_nice(BULK_NICE).is_ok() && set_nice(normal).is_ok())
                .join()
                .unwrap_or(false);
        FetcherNice {
            normal,
            bulk: if round_trip { BULK_NICE } else { normal },
        }
    }
}

/// This thread's id.
fn gettid() -> libc::pid_t {
    // SAFETY: gettid has no arguments and no memory effects.
    unsafe { libc::gettid() }
}

/// Set this thread's nice value to `nice` (a fetcher is its own thread).
fn set_nice(nice: i32) -> std::io::Result<()> {
    set_nice_of(gettid(), nice)
}

/// Set the nice value of thread `tid` of this process to `nice`.
fn set_nice_of(tid: libc::pid_t, nice: i32) -> std::io::Result<()> {
    // SAFETY: setpriority on a thread id; no memory effects.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid.unsigned_abs(), nice) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A fetcher thread: take jobs until the pool stops or is gone.
fn fetcher(pool: &Weak<ChunkPool>, levels: FetcherNice) {
    if let Err(e) = set_nice(levels.normal) {
        warn!("chunk fetcher: cannot lower its priority: {e}");
    }
    let tid = gettid();
    loop {
        let Some(p) = pool.upgrade() else { return };
        let Some(job) = p.next_job(tid) else { return };
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
        p.finish(&job, result);
    }
}
