//! Serving `memory.zst` images: a small pool of decoder threads and a
//! bounded cache of decoded frames they share, so the core thread never
//! decompresses while it serves faults.
//!
//! ```text
//!  core thread                        zstd-N worker threads
//!  ───────────                        ─────────────────────
//!  fault on page p of a zstd source
//!    frame f cached? ── yes ─▶ copy its pages, UFFDIO_COPY (as for a file)
//!        │ no
//!        ▼
//!  FramePool::wait(f) ──job──────────▶ pread frame f, zstd-decode, check
//!  (the vCPU stays in its fault;       its XXH3, insert into the cache,
//!   the fault is parked)               notify every waiter of f
//!  waiter fires ─▶ retry the fault ─▶ cached now: install
//! ```
//!
//! The cache is a [`DashMap`] (sharded locks: the core thread's lookups do
//! not wait behind a worker's insert of another frame) bounded in bytes,
//! evicting in insertion order. A frame that cannot be decoded (truncated
//! file, checksum mismatch, decoder error, the image changed) is remembered
//! as failed with its [`FrameError`]: every fault on it fails the same way
//! at once instead of decoding again.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

use dashmap::DashMap;
use tokio::sync::oneshot;
use tracing::warn;

use super::{Changed, Pin};

/// A cache key: (image, frame).
type Key = (u64, u64);

/// Why a frame of a `memory.zst` cannot be served. A failed frame is
/// remembered and every later fault on it gets a clone of this error, so
/// the causes are shared.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FrameError {
    /// The client's file changed since it was opened (an image served
    /// from the file itself, see [`Pin::Stamp`]).
    #[error(transparent)]
    Changed(Arc<Changed>),
    /// This thread cannot get a zstd decompression context.
    #[error("cannot create a zstd decoder")]
    CreateDecoder(#[source] Arc<std::io::Error>),
    /// Reading or decoding the frame failed (truncated file, checksum
    /// mismatch, data zstd refuses); the error names the frame.
    #[error(transparent)]
    Decode(Arc<zst::Error>),
    /// The decoder threads have exited (the server is stopping).
    #[error("the zstd decoder threads are gone")]
    PoolGone,
}

/// Result of serving one frame.
pub type FrameResult<T> = Result<T, FrameError>;

/// An open `memory.zst` and what the server knows of it.
#[derive(Debug)]
pub struct ZstdImage {
    /// Unique among the images this server opened (the cache key).
    key: u64,
    /// The path as given (a file) or the snapshot's image path.
    pub path: PathBuf,
    /// The snapshot this image belongs to, if any.
    pub snapshot: Option<String>,
    /// How the file is kept from changing under its readers.
    pub pin: Pin,
    /// The image's identity when opened (see `FileSource::identity`).
    pub identity: Option<super::Identity>,
    image: zst::Image,
    pool: Arc<FramePool>,
}

impl ZstdImage {
    /// The open file.
    pub fn file(&self) -> &File {
        self.image.file()
    }

    /// The header (memory size, frame geometry).
    pub fn header(&self) -> &zst::Header {
        self.image.header()
    }

    /// The frames holding pages `pages`.
    pub fn frames_of(&self, pages: Range<u64>) -> Range<u64> {
        let h = self.header();
        h.frame_of(pages.start)..h.frame_of(pages.end.saturating_sub(1).max(pages.start)) + 1
    }

    /// The pages of guest memory that are not in zero frames, as runs
    /// `(first, count)`: what a table reads from this image (the rest is
    /// `Uninitialized`).
    pub fn data_pages(&self) -> Vec<(u64, u64)> {
        let h = self.header();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (f, e) in (0u64..).zip(self.image.entries()) {
            if e.zero {
                continue;
            }
            let r = h.frame_range(f);
            match runs.last_mut() {
                Some((first, n)) if *first + *n == r.start => *n += r.end - r.start,
                _ => runs.push((r.start, r.end - r.start)),
            }
        }
        runs
    }

    /// Frame `frame`'s bytes if decoded; `Err` with the reason if it
    /// cannot be.
    pub fn cached(&self, frame: u64) -> FrameResult<Option<Arc<[u8]>>> {
        self.pool.lookup((self.key, frame))
    }

    /// Decode `frame` on this thread (and cache it): only for paths that
    /// cannot wait for the pool (see `core/snapshot/track.rs`).
    pub fn decode_now(&self, frame: u64) -> FrameResult<Arc<[u8]>> {
        if let Some(b) = self.cached(frame)? {
            return Ok(b);
        }
        let r = decode(self, frame);
        self.pool.finish((self.key, frame), r.clone());
        r
    }

    /// Where frame `frame`'s compressed data starts in the file (`None`
    /// for a zero frame, which has none).
    pub fn frame_offset(&self, frame: u64) -> Option<u64> {
        usize::try_from(frame)
            .ok()
            .and_then(|i| self.image.entries().get(i))
            .filter(|e| !e.zero)
            .map(|e| e.offset)
    }

    /// Size, ratio and frame counts.
    pub fn stats(&self) -> zst::Stats {
        self.image.stats()
    }

    /// Drop this image's decoded frames from the cache (it is released).
    pub fn release_cache(&self) {
        self.pool.forget(self);
    }

    /// Drop the decoded `frames` from the cache: their pages are in a
    /// shared base now, which every VM of this image maps, and a second
    /// copy of them would only take memory (a frame is decoded again if
    /// something else asks for it).
    pub fn drop_decoded(&self, frames: Range<u64>) {
        for f in frames {
            if let Some((_, v)) = self.pool.cache.remove(&(self.key, f)) {
                self.pool.bytes.fetch_sub(v.len() as u64, Ordering::Relaxed);
            }
        }
    }
}

/// A decode job.
struct Job {
    image: Arc<ZstdImage>,
    frame: u64,
}

/// The decoder threads and the frame cache.
#[derive(Debug)]
pub struct FramePool {
    cache: DashMap<Key, Arc<[u8]>>,
    /// Insertion order, for eviction.
    order: Mutex<VecDeque<(Key, usize)>>,
    bytes: AtomicU64,
    capacity: u64,
    /// Frames being decoded, with who waits for each.
    inflight: Mutex<HashMap<Key, Vec<oneshot::Sender<()>>>>,
    /// Frames that cannot be decoded, with the reason.
    failed: DashMap<Key, FrameError>,
    jobs: Mutex<Option<Sender<Job>>>,
    next_key: AtomicU64,
    /// Frames decoded by the workers (for `/metrics`).
    pub decoded: AtomicU64,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Job({}, frame {})",
            self.image.path.display(),
            self.frame
        )
    }
}

impl FramePool {
    /// Start `workers` decoder threads sharing a cache of `capacity`
    /// bytes of decoded frames.
    pub fn start(workers: usize, capacity: u64) -> std::io::Result<Arc<Self>> {
        let (tx, rx) = channel::<Job>();
        let pool = Arc::new(FramePool {
            cache: DashMap::new(),
            order: Mutex::new(VecDeque::new()),
            bytes: AtomicU64::new(0),
            capacity,
            inflight: Mutex::new(HashMap::new()),
            failed: DashMap::new(),
            jobs: Mutex::new(Some(tx)),
            next_key: AtomicU64::new(1),
            decoded: AtomicU64::new(0),
        });
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..workers.max(1) {
            let rx = Arc::clone(&rx);
            let weak = Arc::downgrade(&pool);
            std::thread::Builder::new()
                .name(format!("zstd-{i}"))
                .spawn(move || worker(&rx, &weak))?;
        }
        Ok(pool)
    }

    /// Open `file` (already pinned) as a zstd image served by this pool.
    pub fn open(
        self: &Arc<Self>,
        file: File,
        path: PathBuf,
        pin: Pin,
        snapshot: Option<String>,
        identity: Option<super::Identity>,
    ) -> Result<Arc<ZstdImage>, zst::Error> {
        let image = zst::Image::from_file(file)?;
        Ok(Arc::new(ZstdImage {
            key: self.next_key.fetch_add(1, Ordering::Relaxed),
            path,
            snapshot,
            pin,
            identity,
            image,
            pool: Arc::clone(self),
        }))
    }

    fn lookup(&self, key: Key) -> FrameResult<Option<Arc<[u8]>>> {
        if let Some(b) = self.cache.get(&key) {
            return Ok(Some(Arc::clone(&b)));
        }
        if let Some(e) = self.failed.get(&key) {
            return Err(e.clone());
        }
        Ok(None)
    }

    /// A receiver that fires when every frame of `frames` of `image` is
    /// decoded or has failed; decoding starts now for those not cached.
    pub fn wait(image: &Arc<ZstdImage>, frames: Range<u64>) -> Vec<oneshot::Receiver<()>> {
        frames
            .filter_map(|f| image.pool.request(image, f, true))
            .collect()
    }

    /// Start decoding `frames` of `image` (readahead): nobody waits. A
    /// zero frame is skipped: its pages never read from the image (the
    /// table has them as never written), so decoding it would only fill
    /// the cache with zeroes.
    pub fn prefetch(image: &Arc<ZstdImage>, frames: Range<u64>) {
        let entries = image.image.entries();
        for f in frames.take_while(|f| *f < image.header().frames) {
            let zero = usize::try_from(f)
                .ok()
                .and_then(|i| entries.get(i))
                .is_some_and(|e| e.zero);
            if !zero {
                let _ = image.pool.request(image, f, false);
            }
        }
    }

    /// Queue frame `frame` unless cached, failed or queued; with `wait`,
    /// return a receiver that fires when it is done.
    fn request(
        &self,
        image: &Arc<ZstdImage>,
        frame: u64,
        wait: bool,
    ) -> Option<oneshot::Receiver<()>> {
        let key = (image.key, frame);
        let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
        // Checked under the lock: a worker caches before it takes the lock
        // to notify, so a frame is either cached here or its waiters are
        // notified after this push.
        if self.cache.contains_key(&key) || self.failed.contains_key(&key) {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        match inflight.get_mut(&key) {
            Some(waiters) => {
                if wait {
                    waiters.push(tx);
                }
            }
            None => {
                inflight.insert(key, if wait { vec![tx] } else { Vec::new() });
                let job = Job {
                    image: Arc::clone(image),
                    frame,
                };
                let sent = self
                    .jobs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .as_ref()
                    .map(|tx| tx.send(job));
                if !matches!(sent, Some(Ok(()))) {
                    inflight.remove(&key);
                    self.failed.insert(key, FrameError::PoolGone);
                    return None;
                }
            }
        }
        wait.then_some(rx)
    }

    /// Record the outcome of decoding `key` and wake its waiters.
    fn finish(&self, key: Key, result: FrameResult<Arc<[u8]>>) {
        match result {
            Ok(bytes) => {
                let len = bytes.len();
                if self.cache.insert(key, bytes).is_none() {
                    self.bytes.fetch_add(len as u64, Ordering::Relaxed);
                    let mut order = self.order.lock().unwrap_or_else(|p| p.into_inner());
                    order.push_back((key, len));
                    // The frame just decoded (at the back) always stays, so
                    // its waiters find it even in a cache smaller than it.
                    while self.bytes.load(Ordering::Relaxed) > self.capacity && order.len() > 1 {
                        let Some((old, n)) = order.pop_front() else {
                            break;
                        };
                        if self.cache.remove(&old).is_some() {
                            self.bytes.fetch_sub(n as u64, Ordering::Relaxed);
                        }
                    }
                }
            }
            Err(reason) => {
                self.failed.insert(key, reason);
            }
        }
        let waiters = self
            .inflight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
        for w in waiters.into_iter().flatten() {
            let _ = w.send(());
        }
    }

    /// Bytes of decoded frames cached now.
    pub fn cached_bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Drop every cached frame and failure of an image that is released.
    pub fn forget(&self, image: &ZstdImage) {
        self.cache.retain(|k, v| {
            if k.0 == image.key {
                self.bytes.fetch_sub(v.len() as u64, Ordering::Relaxed);
                false
            } else {
                true
            }
        });
        self.failed.retain(|k, _| k.0 != image.key);
        self.order
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(k, _)| k.0 != image.key);
    }
}

thread_local! {
    /// Each decoder thread's zstd context and read buffer.
    static DECODER: std::cell::RefCell<Option<(zstd::bulk::Decompressor<'static>, Vec<u8>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Decode frame `frame` of `image` into a new buffer.
fn decode(image: &ZstdImage, frame: u64) -> FrameResult<Arc<[u8]>> {
    if let Pin::Stamp(stamp) = &image.pin {
        stamp
            .check(image.image.file())
            .map_err(|e| FrameError::Changed(Arc::new(e)))?;
    }
    let mut out = vec![0u8; image.image.frame_bytes(frame)];
    DECODER.with(|d| {
        let mut d = d.borrow_mut();
        let (dec, scratch) = match &mut *d {
            Some(ctx) => ctx,
            slot @ None => {
                let dec = zstd::bulk::Decompressor::new()
                    .map_err(|e| FrameError::CreateDecoder(Arc::new(e)))?;
                slot.insert((dec, Vec::new()))
            }
        };
        image
            .image
            .decode_frame(frame, dec, scratch, &mut out)
            .map_err(|e| FrameError::Decode(Arc::new(e)))
    })?;
    Ok(Arc::from(out))
}

/// How much lower than the server's the decoder threads' CPU priority
/// is: decoding is bulk work that must not take the CPU from vCPUs and the
/// core thread, which serve every other VM (on a host with few cores the
/// scheduler would otherwise share it evenly).
const DECODER_NICE: i32 = 10;

/// A decoder thread: take jobs until the pool is gone.
fn worker(rx: &Mutex<Receiver<Job>>, pool: &std::sync::Weak<FramePool>) {
    // SAFETY: gettid has no arguments and no memory effects.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority on this thread's own id; no memory effects.
    // Linux applies PRIO_PROCESS with a thread id to that thread only.
    let r = unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            tid.unsigned_abs(),
            libc::getpriority(libc::PRIO_PROCESS, 0) + DECODER_NICE,
        )
    };
    if r != 0 {
        warn!(
            "zstd decoder: cannot lower its priority: {}",
            std::io::Error::last_os_error()
        );
    }
    loop {
        let job = {
            let rx = rx.lock().unwrap_or_else(|p| p.into_inner());
            rx.recv()
        };
        let Ok(job) = job else { return };
        let result = decode(&job.image, job.frame);
        if let Err(e) = &result {
            warn!(
                "{}: zstd frame {} cannot be decoded: {}",
                job.image.path.display(),
                job.frame,
                shared::error_chain(e)
            );
        }
        let Some(pool) = pool.upgrade() else { return };
        pool.decoded.fetch_add(1, Ordering::Relaxed);
        pool.finish((job.image.key, job.frame), result);
    }
}
