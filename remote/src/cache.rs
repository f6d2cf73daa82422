//! A bounded cache of chunks on local disk, for worker threads that serve
//! faults from a remote snapshot: [`ChunkCache::get`] returns a chunk's
//! bytes, reading its file when it is cached and fetching it from the
//! store once otherwise, however many threads ask for it at the same time.
//!
//! Invariants:
//! - a file `DIR/<digest>` holds the uncompressed chunk of that XXH3-128
//!   digest, written under a temporary name and renamed, and is checked
//!   against the digest each time it is read: a damaged file is deleted
//!   and fetched again, never served;
//! - a chunk that fails its check when fetched is not cached;
//! - the cached bytes stay under the capacity: the least recently used
//!   chunks are deleted first (at start-up, the oldest files first);
//! - at most one fetch of a digest runs at a time; the other threads
//!   asking for it wait for it, and try again themselves if it failed.
//!
//! Chunks are content-addressed, so one cache serves every snapshot and
//! every store.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use bytes::Bytes;
use tracing::warn;

use crate::chunk::{self, ChunkRef};
use crate::error::{Error, Result};
use crate::store::Remote;

/// Counters of a cache since it was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Gets served from a cached file.
    pub hits: u64,
    /// Fetches from the store (successful or not).
    pub fetches: u64,
    /// Gets that waited for another thread's fetch of the same chunk.
    pub waits: u64,
    /// Chunks deleted to stay under the capacity.
    pub evictions: u64,
    /// Cached files that failed their check and were deleted.
    pub damaged: u64,
    /// Chunks and bytes cached now.
    pub entries: u64,
    pub bytes: u64,
}

#[derive(Debug, Default)]
struct State {
    /// Digest → (length, last use).
    entries: HashMap<String, (u64, u64)>,
    /// Last use → digest: the eviction order.
    lru: BTreeMap<u64, String>,
    clock: u64,
    /// Digests being fetched.
    fetching: HashSet<String>,
    stats: CacheStats,
}

impl State {
    fn touch(&mut self, digest: &str) {
        self.clock += 1;
        let now = self.clock;
        if let Some((_, used)) = self.entries.get_mut(digest) {
            self.lru.remove(used);
            *used = now;
            self.lru.insert(now, digest.to_owned());
        }
    }

    fn insert(&mut self, digest: &str, len: u64) {
        self.clock += 1;
        if let Some((old, used)) = self.entries.insert(digest.to_owned(), (len, self.clock)) {
            self.lru.remove(&used);
            self.stats.bytes -= old;
            self.stats.entries -= 1;
        }
        self.lru.insert(self.clock, digest.to_owned());
        self.stats.bytes += len;
        self.stats.entries += 1;
    }

    fn remove(&mut self, digest: &str) -> bool {
        match self.entries.remove(digest) {
            Some((len, used)) => {
                self.lru.remove(&used);
                self.stats.bytes -= len;
                self.stats.entries -= 1;
                true
            }
            None => false,
        }
    }
}

/// A chunk [`ChunkCache::load`] returned.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The chunk's bytes, checked against its digest.
    pub bytes: Bytes,
    /// Fetched from the store by this call (else read from the cache).
    pub fetched: bool,
}

/// Chunks of remote snapshots on local disk, at most `capacity` bytes.
#[derive(Debug)]
pub struct ChunkCache {
    dir: PathBuf,
    capacity: u64,
    remote: Remote,
    runtime: tokio::runtime::Handle,
    state: Mutex<State>,
    fetched: Condvar,
}

impl ChunkCache {
    /// The cache in `dir` (created if missing; what an earlier cache left
    /// there is kept, oldest first in line for eviction), fetching from
    /// `remote` on `runtime`.
    pub fn open(
        dir: &Path,
        capacity: u64,
        remote: Remote,
        runtime: tokio::runtime::Handle,
    ) -> Result<Self> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(Error::io("create", dir))?;
        let mut found: Vec<(SystemTime, String, u64)> = Vec::new();
        for e in fs::read_dir(dir).map_err(Error::io("list", dir))? {
            let e = e.map_err(Error::io("list", dir))?;
            let name = e.file_name().to_string_lossy().into_owned();
            let meta = e.metadata().map_err(Error::io("stat", e.path()))?;
            if proto::manifest::is_digest(&name) && meta.is_file() {
                found.push((
                    meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    name,
                    meta.len(),
                ));
            } else if name.starts_with(".tmp-") {
                let _ = fs::remove_file(e.path());
            }
        }
        found.sort();
        let mut state = State::default();
        for (_, digest, len) in &found {
            state.insert(digest, *len);
        }
        let cache = Self {
            dir: dir.to_owned(),
            capacity,
            remote,
            runtime,
            state: Mutex::new(state),
            fetched: Condvar::new(),
        };
        let mut st = cache.lock();
        cache.evict(&mut st);
        drop(st);
        Ok(cache)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Where chunk `digest` is cached.
    pub fn path_of(&self, digest: &str) -> PathBuf {
        self.dir.join(digest)
    }

    /// The most bytes it keeps.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The counters so far.
    pub fn stats(&self) -> CacheStats {
        self.lock().stats
    }

    /// Chunk `c`'s bytes, from the cache or fetched once from the store.
    /// Blocks: call it from a worker thread, not from a thread of the
    /// runtime (that is refused).
    pub fn get(&self, c: &ChunkRef) -> Result<Bytes> {
        self.load(c).map(|l| l.bytes)
    }

    /// As [`ChunkCache::get`], saying whether this call fetched the chunk
    /// from the store (and so moved its stored bytes over the network).
    pub fn load(&self, c: &ChunkRef) -> Result<Loaded> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::Worker(
                "ChunkCache::get blocks: call it from a worker thread, not a runtime's".into(),
            ));
        }
        if !proto::manifest::is_digest(&c.digest) {
            return Err(self.remote.corrupt(c, "not a chunk name".into()));
        }
        let mut st = self.lock();
        loop {
            if st.entries.contains_key(&c.digest) {
                st.touch(&c.digest);
                st.stats.hits += 1;
                drop(st);
                match self.read(c) {
                    Ok(bytes) => {
                        return Ok(Loaded {
                            bytes,
                            fetched: false,
                        })
                    }
                    // Evicted by another thread since (or removed by
                    // hand): forget it and look again.
                    Err(None) => {
                        st = self.lock();
                        st.stats.hits -= 1;
                        if !self.path_of(&c.digest).exists() {
                            st.remove(&c.digest);
                        }
                        continue;
                    }
                    Err(Some(why)) => {
                        warn!(
                            "cached chunk {} is damaged ({why}); fetching it again",
                            c.digest
                        );
                        st = self.lock();
                        st.stats.hits -= 1;
                        st.stats.damaged += 1;
                        if st.remove(&c.digest) {
                            let _ = fs::remove_file(self.path_of(&c.digest));
                        }
                        continue;
                    }
                }
            }
            if st.fetching.contains(&c.digest) {
                st.stats.waits += 1;
                st = self
                    .fetched
                    .wait_while(st, |s| s.fetching.contains(&c.digest))
                    .unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            st.fetching.insert(c.digest.clone());
            st.stats.fetches += 1;
            break;
        }
        drop(st);
        let got = self
            .runtime
            .block_on(self.remote.fetch_chunk(c))
            .and_then(|b| self.write(c, &b).map(|()| b));
        let mut st = self.lock();
        st.fetching.remove(&c.digest);
        if got.is_ok() {
            st.insert(&c.digest, c.len);
            self.evict(&mut st);
        }
        drop(st);
        self.fetched.notify_all();
        got.map(|bytes| Loaded {
            bytes,
            fetched: true,
        })
    }

    /// The cached file of `c`, checked: `Err(None)` if it is gone,
    /// `Err(Some(why))` if it is not the chunk.
    fn read(&self, c: &ChunkRef) -> std::result::Result<Bytes, Option<String>> {
        let bytes = match fs::read(self.path_of(&c.digest)) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(None),
            Err(e) => return Err(Some(e.to_string())),
        };
        if bytes.len() as u64 != c.len {
            return Err(Some(format!(
                "{} bytes, the chunk has {}",
                bytes.len(),
                c.len
            )));
        }
        if chunk::digest(&bytes) != c.digest {
            return Err(Some("its bytes do not hash to its name".into()));
        }
        Ok(Bytes::from(bytes))
    }

    /// Cache `bytes` as chunk `c` (checked already).
    fn write(&self, c: &ChunkRef, bytes: &[u8]) -> Result<()> {
        let tmp = self
            .dir
            .join(format!(".tmp-{}-{:016x}", c.digest, rand::random::<u64>()));
        fs::write(&tmp, bytes)
            .and_then(|()| fs::rename(&tmp, self.path_of(&c.digest)))
            .map_err(|e| {
                let _ = fs::remove_file(&tmp);
                Error::Io {
                    op: "cache a chunk in",
                    path: self.dir.clone(),
                    source: e,
                }
            })
    }

    /// Delete the least recently used chunks past the capacity.
    fn evict(&self, st: &mut State) {
        while st.stats.bytes > self.capacity {
            let Some((_, digest)) = st.lru.pop_first() else {
                break;
            };
            if let Some((len, _)) = st.entries.remove(&digest) {
                st.stats.bytes -= len;
                st.stats.entries -= 1;
            }
            st.stats.evictions += 1;
            if let Err(e) = fs::remove_file(self.path_of(&digest)) {
                warn!("cannot evict cached chunk {digest}: {e}");
            }
        }
    }
}
