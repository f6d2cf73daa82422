//! The image writer: a thread of its own that writes page runs into a
//! `memory.img` being made, so the core thread (which must never block on
//! a file, and serves every VM's faults) does as little as it can.
//!
//! In a large save, runs of pages the VM holds in its own memfd are
//! copied by the writer itself, straight from a read-only mapping of that
//! memfd into the image's page cache ([`WriterHandle::copy`], [`Memory`]):
//! one copy, off the core thread. Everything else (a small save, where
//! the core's reads overlapping these writes finish sooner; pages from a
//! fork parent or an image; pages the fault path saves) comes as bytes
//! the core read ([`WriterHandle::pages`]). Copied runs are digested from
//! the image, read back, since the guest may have changed the memory by
//! then.
//!
//! Messages are written in the order they were sent; all-zero pages become
//! holes. Bulk runs take a permit from a small gate first (at most
//! [`IN_FLIGHT`] runs queued), so memory in flight stays bounded; single
//! pages from the fault path never wait. Written buffers pass to a second
//! thread that starts their writeback (`sync_file_range`, every MiB), so
//! the disk works while pages are still being saved and the commit's
//! fsync has little left, and digests the checksum chunks they cover
//! whole ([`StreamSums`]), so the commit reads back only chunks written
//! in part. Submitting writeback costs CPU (a reflinked image allocates
//! its new blocks then): on that thread it overlaps the writes instead of
//! delaying them, and a MiB at a time leaves the fsync after the last
//! write one MiB to start, not up to eight.
//! The writer reports as soon as its last write returns and goes on to
//! fsync the image ([`Synced`]); the digests follow ([`Digests`]), so the
//! fsync runs while the last buffers are still being hashed and while the
//! commit prepares the rest. Bulk buffers then go back to a pool
//! the whole server shares ([`WriterHandle::buffer`]): saving a GiB
//! allocates a few dozen buffers, not a thousand that the kernel zeroes
//! on the way in and unmaps on the way out, and the next snapshot finds
//! them mapped (a small one needs no new memory at all). The pool keeps
//! [`IN_FLIGHT`] + 1 buffers at most (17 MiB). A bulk run's permit is
//! held until its buffer is digested too.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use shared::PAGE_SIZE;
use tokio::sync::{oneshot, Notify, OwnedSemaphorePermit, Semaphore};
use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, VolatileMemory, VolatileSlice};

use super::checksum::{Algorithm, Piece, StreamSums};
use super::error::SnapshotError;
use super::image::ImageWriter;

/// Bulk runs queued for the writer at most.
pub const IN_FLIGHT: usize = 16;

/// Bytes of a reusable bulk buffer: the largest run the core saves at once.
pub const BUFFER_BYTES: usize = 1 << 20;

/// Written bulk buffers, kept for the next full-size runs of any
/// snapshot. Each is [`BUFFER_BYTES`] long; shorter runs (a run's tail, a
/// page the fault path saves) get a buffer of their own.
#[derive(Debug)]
struct Buffers(Mutex<Vec<Vec<u8>>>);

static BUFFERS: Buffers = Buffers(Mutex::new(Vec::new()));

impl Buffers {
    fn take(&self, len: usize) -> Vec<u8> {
        if len != BUFFER_BYTES {
            return vec![0u8; len];
        }
        let kept = self.0.lock().unwrap_or_else(|p| p.into_inner()).pop();
        kept.unwrap_or_else(|| vec![0u8; BUFFER_BYTES])
    }

    fn give_back(&self, buf: Vec<u8>) {
        if buf.len() != BUFFER_BYTES {
            return;
        }
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() <= IN_FLIGHT {
            kept.push(buf);
        }
    }
}

enum Job {
    Pages {
        first: u64,
        bytes: Vec<u8>,
        _permit: Option<OwnedSemaphorePermit>,
    },
    /// Pages `[first, first + pages)` to copy out of the VM's memory by
    /// the writer itself ([`WriterHandle::copy`]).
    Copy {
        first: u64,
        pages: u64,
        _permit: Option<OwnedSemaphorePermit>,
    },
    /// A copied run, passed to the digesting thread, which reads it back
    /// from the image (the VM's memory may have changed since).
    Copied {
        first: u64,
        pages: u64,
        _permit: Option<OwnedSemaphorePermit>,
    },
    Punch {
        first: u64,
        pages: u64,
    },
    /// Runs `(first, pages)` to read into the page cache ahead.
    Prefetch(Vec<(u64, u64)>),
}

/// What the writer did.
#[derive(Debug, Default)]
pub struct WriteReport {
    /// Bytes of data written (zero pages excluded).
    pub bytes_written: u64,
    /// The first failure; later jobs were skipped.
    pub error: Option<SnapshotError>,
    /// Digests of the checksum chunks the writes covered whole.
    pub chunk_digests: Digests,
    /// The image's fsync, started after the last write (none after a
    /// failure).
    pub synced: Synced,
}

/// The writer's fsync of the image, under way.
#[derive(Debug, Default)]
pub struct Synced(Option<mpsc::Receiver<std::io::Result<()>>>);

impl Synced {
    /// Wait for the fsync to end; if the writer did not start one, fsync
    /// `file` (the image) here.
    pub fn wait(self, file: &File) -> std::io::Result<()> {
        match self.0.map(|rx| rx.recv()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(std::io::Error::other("the snapshot writer thread died")),
            None => file.sync_all(),
        }
    }
}

/// The digests of the checksum chunks a writer's writes covered whole, by
/// chunk: still being computed when the writer reports.
#[derive(Debug, Default)]
pub struct Digests(Option<std::thread::JoinHandle<BTreeMap<u64, String>>>);

impl Digests {
    /// Wait for them. None if the digesting thread died: nothing is lost,
    /// the commit reads every chunk back.
    pub fn wait(self) -> BTreeMap<u64, String> {
        match self.0.map(std::thread::JoinHandle::join) {
            Some(Ok(digests)) => digests,
            Some(Err(_)) => {
                tracing::warn!("the snapshot digest thread panicked");
                BTreeMap::new()
            }
            None => BTreeMap::new(),
        }
    }
}

/// The core's end of a writer thread.
#[derive(Debug)]
pub struct WriterHandle {
    tx: mpsc::Sender<Job>,
    gate: Arc<Semaphore>,
    done: oneshot::Receiver<WriteReport>,
    /// Whether [`WriterHandle::copy`] may be used: the writer was given
    /// the VM's memory.
    copies: bool,
    /// Copy jobs queued so far.
    queued: AtomicU64,
    progress: Arc<CopyProgress>,
}

/// How far the writer got through the copy jobs, shared with the core.
#[derive(Debug, Default)]
struct CopyProgress {
    /// Copy jobs finished (written, or skipped after a failure).
    copied: AtomicU64,
    /// The writer thread has ended: nothing more will be copied.
    gone: AtomicBool,
    /// Notified after each copy job and when the thread ends.
    notify: Notify,
}

impl CopyProgress {
    /// Copy jobs finished, or `u64::MAX` once the writer thread is gone
    /// (nothing queued is still to come).
    fn copied(&self) -> u64 {
        if self.gone.load(Ordering::Acquire) {
            return u64::MAX;
        }
        self.copied.load(Ordering::Acquire)
    }
}

/// Marks the writer thread gone when it ends, by return or by panic, so
/// the core never waits on copies that will not come.
struct Departure(Arc<CopyProgress>);

impl Drop for Departure {
    fn drop(&mut self) {
        self.0.gone.store(true, Ordering::Release);
        self.0.notify.notify_one();
    }
}

/// Guest memory the writer copies runs out of itself: the VM's memfd,
/// mapped read-only by the writer thread for one snapshot and unmapped
/// when it is done.
///
/// Bulk runs of pages the VM holds itself go this way (one copy, from
/// the page cache of the memfd into the image's) instead of being read
/// by the core into a buffer that the writer then writes (two copies, on
/// two threads). The VM's pages may change under the mapping once the
/// guest writes them: a page is only protected until the fault handler
/// lifts its protection, which it does for a page still in flight here
/// only after queueing its pre-write bytes behind the run
/// ([`WriterHandle::copied`]); the later write wins.
#[derive(Debug)]
pub struct Memory {
    pub memfd: Arc<File>,
    pub len: u64,
    /// For tests: wait this long before the first copy run, so that guest
    /// writes meet runs still in flight (zero in service).
    pub hold: std::time::Duration,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Job::Pages { first, bytes, .. } => write!(f, "Pages({first}, {} bytes)", bytes.len()),
            Job::Copy { first, pages, .. } => write!(f, "Copy({first}, {pages})"),
            Job::Copied { first, pages, .. } => write!(f, "Copied({first}, {pages})"),
            Job::Punch { first, pages } => write!(f, "Punch({first}, {pages})"),
            Job::Prefetch(runs) => write!(f, "Prefetch({} runs)", runs.len()),
        }
    }
}

/// Pages written since the last early writeback was started.
#[derive(Debug, Default)]
struct Unsynced {
    /// The range they span, `[lo, hi)`.
    lo: u64,
    hi: u64,
    pages: u64,
}

/// Start writing back after this many pages (1 MiB) were written.
const WRITEBACK_PAGES: u64 = (1 << 20) / PAGE_SIZE;

impl Unsynced {
    /// Count `pages` at `first`; the range to write back once enough were
    /// written.
    fn add(&mut self, first: u64, pages: u64) -> Option<(u64, u64)> {
        if self.pages == 0 {
            (self.lo, self.hi) = (first, first + pages);
        } else {
            self.lo = self.lo.min(first);
            self.hi = self.hi.max(first + pages);
        }
        self.pages += pages;
        if self.pages < WRITEBACK_PAGES {
            return None;
        }
        self.pages = 0;
        Some((self.lo, self.hi - self.lo))
    }
}

/// Start a writer for `file` (at `path`). `fresh`: the image is all holes
/// (zero pages need no punching). Whole chunks written are digested with
/// `alg`. `memory`: the VM's memory, for runs the writer copies itself
/// ([`WriterHandle::copy`]).
pub fn spawn(
    file: File,
    path: PathBuf,
    fresh: bool,
    alg: Algorithm,
    memory: Option<Memory>,
) -> std::io::Result<WriterHandle> {
    let len = file.metadata()?.len();
    let copies = memory.is_some();
    let progress = Arc::new(CopyProgress::default());
    let (tx, rx) = mpsc::channel::<Job>();
    let (done_tx, done) = oneshot::channel();
    // The digesting thread: takes each job after it is written, starts
    // its writeback and digests it.
    let (htx, hrx) = mpsc::channel::<Job>();
    let flushed = ImageWriter {
        path: path.clone(),
        file: file.try_clone()?,
    };
    let hasher = std::thread::Builder::new()
        .name("snapshot-digest".into())
        .spawn(move || digest_jobs(&flushed, alg, len, hrx))?;
    let departure = Departure(Arc::clone(&progress));
    std::thread::Builder::new()
        .name("snapshot-writer".into())
        .spawn(move || {
            let _departure = departure;
            let image = ImageWriter { path, file };
            let mut view = MemoryView::new(memory);
            let mut report = WriteReport::default();
            for job in rx {
                let copy = matches!(job, Job::Copy { .. });
                if report.error.is_some() {
                    if copy {
                        _departure.copied();
                    }
                    continue;
                }
                let r = match &job {
                    Job::Pages { first, bytes, .. } => {
                        write_sparse(&image, fresh, *first, Bytes::Owned(bytes))
                    }
                    Job::Copy { first, pages, .. } => view
                        .slice(*first, *pages)
                        .map_err(SnapshotError::io("map the memory of", &image.path))
                        .and_then(|b| write_sparse(&image, fresh, *first, Bytes::Mapped(b))),
                    Job::Punch { first, pages } if !fresh => {
                        image.punch(*first, *pages).map(|()| 0)
                    }
                    Job::Punch { .. } | Job::Copied { .. } => Ok(0),
                    Job::Prefetch(runs) => {
                        image.prefetch(runs);
                        continue;
                    }
                };
                if copy {
                    _departure.copied();
                }
                match r {
                    Ok(n) => {
                        report.bytes_written += n;
                        let job = match job {
                            Job::Copy {
                                first,
                                pages,
                                _permit,
                            } => Job::Copied {
                                first,
                                pages,
                                _permit,
                            },
                            other => other,
                        };
                        let _ = htx.send(job);
                    }
                    Err(e) => report.error = Some(e),
                }
            }
            drop(htx);
            report.chunk_digests = Digests(Some(hasher));
            if report.error.is_some() {
                let _ = done_tx.send(report);
                return;
            }
            let (stx, srx) = mpsc::channel();
            report.synced = Synced(Some(srx));
            let _ = done_tx.send(report);
            let _ = stx.send(image.file.sync_all());
            // The mapping goes last: unmapping it is no part of the save.
            drop(view);
        })?;
    Ok(WriterHandle {
        tx,
        gate: Arc::new(Semaphore::new(IN_FLIGHT)),
        done,
        copies,
        queued: AtomicU64::new(0),
        progress,
    })
}

impl Departure {
    /// One more copy job finished.
    fn copied(&self) {
        self.0.copied.fetch_add(1, Ordering::Release);
        self.0.notify.notify_one();
    }
}

/// The digesting thread's work: start the writeback of what was written
/// and digest the checksum chunks it covers whole.
fn digest_jobs(
    image: &ImageWriter,
    alg: Algorithm,
    len: u64,
    jobs: mpsc::Receiver<Job>,
) -> BTreeMap<u64, String> {
    let mut sums = StreamSums::new(alg, len);
    let mut unsynced = Unsynced::default();
    let mut writeback = |first: u64, pages: u64| {
        if let Some((lo, n)) = unsynced.add(first, pages) {
            // Best effort: the fsync at the commit reports what failed.
            if let Err(e) = image.start_writeback(lo, n) {
                tracing::debug!("early writeback of {}: {e}", image.path.display());
            }
        }
    };
    for job in jobs {
        match job {
            Job::Pages { first, bytes, .. } => {
                writeback(first, bytes.len() as u64 / PAGE_SIZE);
                sums.feed(first * PAGE_SIZE, Piece::Bytes(&bytes));
                BUFFERS.give_back(bytes);
            }
            Job::Copied { first, pages, .. } => {
                writeback(first, pages);
                // Read back from the image, whose bytes are the ones
                // saved: the VM's memory may hold later ones by now. A
                // failed read leaves the chunk undigested (the commit
                // reads it back).
                let mut buf = BUFFERS.take(shared::geometry::usize_of(pages * PAGE_SIZE));
                match image.read_pages(first, &mut buf) {
                    Ok(()) => sums.feed(first * PAGE_SIZE, Piece::Bytes(&buf)),
                    Err(e) => {
                        tracing::debug!("read back {}: {e}", image.path.display());
                        sums.forget(first * PAGE_SIZE, pages * PAGE_SIZE);
                    }
                }
                BUFFERS.give_back(buf);
            }
            Job::Punch { first, pages } => {
                sums.feed(first * PAGE_SIZE, Piece::Zeroes(pages * PAGE_SIZE));
            }
            Job::Copy { .. } | Job::Prefetch(_) => {}
        }
    }
    sums.finish()
}

/// The writer's read-only mapping of the VM's memory, made at the first
/// run it copies.
struct MemoryView {
    memory: Option<Memory>,
    map: Option<MmapRegion>,
}

impl MemoryView {
    fn new(memory: Option<Memory>) -> Self {
        Self { memory, map: None }
    }

    /// Pages `[first, first + pages)`, made present in the mapping.
    fn slice(&mut self, first: u64, pages: u64) -> std::io::Result<VolatileSlice<'_>> {
        if self.map.is_none() {
            let m = self
                .memory
                .as_ref()
                .ok_or_else(|| std::io::Error::other("the writer was given no memory"))?;
            if !m.hold.is_zero() {
                std::thread::sleep(m.hold);
            }
            let len = usize::try_from(m.len).map_err(std::io::Error::other)?;
            let map = MmapRegion::build(
                Some(FileOffset::from_arc(Arc::clone(&m.memfd), 0)),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
            )
            .map_err(std::io::Error::other)?;
            self.map = Some(map);
        }
        let map = self
            .map
            .as_ref()
            .ok_or_else(|| std::io::Error::other("unmapped"))?;
        let off = shared::geometry::usize_of(first * PAGE_SIZE);
        let len = shared::geometry::usize_of(pages * PAGE_SIZE);
        let slice = map.get_slice(off, len).map_err(std::io::Error::other)?;
        // Map the run's pages in one call instead of a fault per 16 of
        // them in the write below. Best effort: the write faults in what
        // this leaves out.
        // SAFETY: the range lies inside the mapping, which outlives the
        // call; MADV_POPULATE_READ only fills page tables.
        unsafe {
            libc::madvise(
                slice.ptr_guard().as_ptr().cast_mut().cast(),
                len,
                libc::MADV_POPULATE_READ,
            );
        }
        Ok(slice)
    }
}

impl WriterHandle {
    /// A buffer of `len` bytes for a run (contents unspecified: the caller
    /// overwrites all of it), reused from written runs when `len` is
    /// [`BUFFER_BYTES`] and one is free.
    pub fn buffer(&self, len: usize) -> Vec<u8> {
        BUFFERS.take(len)
    }

    /// Queue pages `first..` (whole pages) without waiting.
    pub fn pages(&self, first: u64, bytes: Vec<u8>) {
        let _ = self.tx.send(Job::Pages {
            first,
            bytes,
            _permit: None,
        });
    }

    /// Wait until a bulk run may be queued; queue it with the returned
    /// permit ([`WriterHandle::bulk`]).
    pub async fn room(&self) -> Option<OwnedSemaphorePermit> {
        self.gate().acquire_owned().await.ok()
    }

    /// The gate bulk runs pass (to wait on it without borrowing the
    /// handle).
    pub fn gate(&self) -> Arc<Semaphore> {
        self.gate.clone()
    }

    /// Queue a bulk run holding `permit` until it is written.
    pub fn bulk(&self, first: u64, bytes: Vec<u8>, permit: Option<OwnedSemaphorePermit>) {
        let _ = self.tx.send(Job::Pages {
            first,
            bytes,
            _permit: permit,
        });
    }

    /// Have the writer start reading `runs` (`(first page, pages)`) of the
    /// image into the page cache before anything else: the parent's bytes
    /// that the checksum of a chunk written in part reads back at the
    /// commit. A reflinked image shares no page cache with its parent, so
    /// without this that read waits on the disk after the last write.
    pub fn prefetch(&self, runs: Vec<(u64, u64)>) {
        if !runs.is_empty() {
            let _ = self.tx.send(Job::Prefetch(runs));
        }
    }

    /// Whether [`WriterHandle::copy`] may be used.
    pub fn copies(&self) -> bool {
        self.copies
    }

    /// Queue a bulk run of pages `[first, first + pages)` that the writer
    /// copies out of the VM's memory itself, holding `permit` until it is
    /// digested. Returns the run's number: it is in the image once
    /// [`WriterHandle::copied`] reaches it. Until then a page of it that
    /// is about to change must be saved again ([`WriterHandle::pages`]).
    pub fn copy(&self, first: u64, pages: u64, permit: Option<OwnedSemaphorePermit>) -> u64 {
        let _ = self.tx.send(Job::Copy {
            first,
            pages,
            _permit: permit,
        });
        self.queued.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Copy runs finished: every run numbered up to this is in the image
    /// (`u64::MAX` once the writer is gone).
    pub fn copied(&self) -> u64 {
        self.progress.copied()
    }

    /// A future that ends when every copy run queued so far is finished
    /// (or the writer is gone); it does not borrow the handle.
    pub fn copies_done_waiter(&self) -> impl std::future::Future<Output = ()> + 'static {
        let progress = Arc::clone(&self.progress);
        let queued = self.queued.load(Ordering::Relaxed);
        async move {
            loop {
                let notified = progress.notify.notified();
                if progress.copied() >= queued {
                    return;
                }
                notified.await;
            }
        }
    }

    /// Queue a hole for `[first, first + pages)`.
    pub fn punch(&self, first: u64, pages: u64) {
        let _ = self.tx.send(Job::Punch { first, pages });
    }

    /// Wait until everything queued is written.
    pub async fn finish(self) -> WriteReport {
        drop(self.tx);
        self.done.await.unwrap_or_else(|_| WriteReport {
            bytes_written: 0,
            chunk_digests: Digests::default(),
            synced: Synced::default(),
            error: Some(SnapshotError::Io {
                what: "write",
                path: PathBuf::from("memory.img"),
                source: std::io::Error::other("the snapshot writer thread died"),
            }),
        })
    }
}

/// Whole pages to write: the core's buffer, or the VM's memory mapped.
enum Bytes<'a> {
    Owned(&'a [u8]),
    Mapped(VolatileSlice<'a>),
}

impl Bytes<'_> {
    fn len(&self) -> usize {
        match self {
            Bytes::Owned(b) => b.len(),
            Bytes::Mapped(v) => v.len(),
        }
    }

    /// Whether page `i` is all zeroes.
    fn zero_page(&self, i: usize) -> bool {
        let ps = shared::geometry::usize_of(PAGE_SIZE);
        match self {
            Bytes::Owned(b) => b[i * ps..(i + 1) * ps].iter().all(|b| *b == 0),
            Bytes::Mapped(v) => {
                // The first word settles it for most data pages; only a
                // page that starts with zeroes is copied out and scanned.
                let Ok(first) = v.get_ref::<u64>(i * ps) else {
                    return false;
                };
                if first.load() != 0 {
                    return false;
                }
                let mut page = [0u8; 4096];
                const _: () = assert!(PAGE_SIZE == 4096);
                v.subslice(i * ps, ps)
                    .map(|p| p.copy_to(&mut page[..]))
                    .is_ok()
                    && page.iter().all(|b| *b == 0)
            }
        }
    }

    /// Write pages `[i, j)` at page `at` of `image`.
    fn write(&self, image: &ImageWriter, at: u64, i: usize, j: usize) -> Result<(), SnapshotError> {
        let ps = shared::geometry::usize_of(PAGE_SIZE);
        match self {
            Bytes::Owned(b) => image.write_pages(at, &b[i * ps..j * ps]),
            Bytes::Mapped(v) => {
                let part = v.subslice(i * ps, (j - i) * ps).map_err(|e| {
                    SnapshotError::io("write", &image.path)(std::io::Error::other(e))
                })?;
                image.write_volatile(at, &part)
            }
        }
    }
}

/// Write whole pages `buf` at `first` into `image`, leaving all-zero pages
/// as holes (punched, unless the image is `fresh`: all holes already).
/// Returns the bytes written.
fn write_sparse(
    image: &ImageWriter,
    fresh: bool,
    first: u64,
    buf: Bytes<'_>,
) -> Result<u64, SnapshotError> {
    let ps = shared::geometry::usize_of(PAGE_SIZE);
    let zero: Vec<bool> = (0..buf.len() / ps).map(|i| buf.zero_page(i)).collect();
    let mut written = 0;
    let mut i = 0;
    while i < zero.len() {
        let mut j = i + 1;
        while j < zero.len() && zero[j] == zero[i] {
            j += 1;
        }
        let at = first + i as u64;
        if !zero[i] {
            buf.write(image, at, i, j)?;
            written += ((j - i) * ps) as u64;
        } else if !fresh {
            image.punch(at, (j - i) as u64)?;
        }
        i = j;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::checksum::{sum_file, CHUNK_BYTES, WRITE_ALGORITHM};

    /// A new all-hole image of `len` bytes in a temporary directory, and a
    /// writer for it.
    fn fresh_image(len: u64) -> (tempfile::TempDir, PathBuf, ImageWriter, WriterHandle) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m");
        let img = ImageWriter::create(&path, len).unwrap();
        let file = img.file.try_clone().unwrap();
        let w = spawn(file, path.clone(), true, WRITE_ALGORITHM, None).unwrap();
        (dir, path, img, w)
    }

    #[tokio::test]
    async fn writes_in_order_and_leaves_zero_pages_as_holes() {
        let (_dir, path, _img, w) = fresh_image(8 * PAGE_SIZE);
        let mut two = vec![0u8; 2 * 4096];
        two[..4096].fill(1);
        let permit = w.room().await;
        w.bulk(2, two, permit);
        w.pages(2, vec![3u8; 4096]); // a later write of the same page wins
        let report = w.finish().await;
        assert!(report.error.is_none());
        assert_eq!(report.bytes_written, 2 * 4096);
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes[2 * 4096..3 * 4096].iter().all(|b| *b == 3));
        assert!(bytes[3 * 4096..].iter().all(|b| *b == 0));
    }

    #[tokio::test]
    async fn digests_the_chunks_it_wrote_whole() {
        let pages = CHUNK_BYTES / PAGE_SIZE;
        let (_dir, _path, img, w) = fresh_image(3 * CHUNK_BYTES);
        // Chunk 0: one bulk run with a zero page in it; chunk 1: punched
        // whole; chunk 2: one page only.
        let mut run = w.buffer(BUFFER_BYTES);
        run.fill(7);
        run[4096..8192].fill(0);
        let permit = w.room().await;
        w.bulk(0, run, permit);
        w.punch(pages, pages);
        w.pages(2 * pages + 3, vec![5u8; 4096]);
        let report = w.finish().await;
        assert!(report.error.is_none());
        let whole = sum_file(&img.file, WRITE_ALGORITHM).unwrap();
        let digests = report.chunk_digests.wait();
        assert_eq!(digests.len(), 2);
        assert_eq!(digests[&0], whole.chunks[0]);
        assert_eq!(digests[&1], whole.chunks[1]);
    }

    /// A memfd of `pages` pages with page `p` filled with `p + 1` (page 3
    /// left zero), and a writer for a fresh image that copies from it.
    fn copying_writer(
        pages: u64,
    ) -> (
        tempfile::TempDir,
        PathBuf,
        ImageWriter,
        WriterHandle,
        Arc<File>,
    ) {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m");
        let len = pages * PAGE_SIZE;
        let img = ImageWriter::create(&path, len).unwrap();
        let memfd = Arc::new(
            memfd::MemfdOptions::default()
                .create("copy-test")
                .unwrap()
                .into_file(),
        );
        memfd.set_len(len).unwrap();
        for p in (0..pages).filter(|p| *p != 3) {
            let fill = u8::try_from(p % 250 + 1).unwrap();
            memfd
                .write_all_at(&vec![fill; 4096], p * PAGE_SIZE)
                .unwrap();
        }
        let memory = Memory {
            memfd: Arc::clone(&memfd),
            len,
            hold: std::time::Duration::ZERO,
        };
        let file = img.file.try_clone().unwrap();
        let w = spawn(file, path.clone(), true, WRITE_ALGORITHM, Some(memory)).unwrap();
        (dir, path, img, w, memfd)
    }

    #[tokio::test]
    async fn copies_runs_out_of_memory_with_zero_pages_as_holes() {
        let pages = 2 * CHUNK_BYTES / PAGE_SIZE;
        let (_dir, path, img, w, memfd) = copying_writer(pages);
        assert!(w.copies());
        let permit = w.room().await;
        let first = w.copy(0, pages / 2, permit);
        let second = w.copy(pages / 2, pages / 2, None);
        assert_eq!((first, second), (1, 2));
        w.copies_done_waiter().await;
        assert_eq!(w.copied(), 2);
        let report = w.finish().await;
        assert!(report.error.is_none());
        assert_eq!(report.bytes_written, (pages - 1) * PAGE_SIZE);
        let bytes = std::fs::read(&path).unwrap();
        let mut want = vec![0u8; bytes.len()];
        std::os::unix::fs::FileExt::read_exact_at(&*memfd, &mut want, 0).unwrap();
        assert!(bytes == want, "the image holds the memory's bytes");
        let holes: Vec<_> = crate::snapshot::image::data_ranges(
            std::os::fd::AsRawFd::as_raw_fd(&img.file),
            bytes.len() as u64,
        )
        .unwrap();
        assert_eq!(holes.first(), Some(&(0, 3 * PAGE_SIZE)), "page 3 is a hole");
        let whole = sum_file(&img.file, WRITE_ALGORITHM).unwrap();
        let digests = report.chunk_digests.wait();
        assert_eq!(digests.len(), 2);
        assert_eq!(digests[&0], whole.chunks[0]);
        assert_eq!(digests[&1], whole.chunks[1]);
    }

    #[tokio::test]
    async fn a_page_saved_again_behind_its_copy_wins_and_its_chunk_is_read_back() {
        use std::os::unix::fs::FileExt;
        let pages = CHUNK_BYTES / PAGE_SIZE;
        let (_dir, path, img, w, memfd) = copying_writer(pages);
        let permit = w.room().await;
        w.copy(0, pages, permit);
        // Page 5's bytes at the pause, saved again by the fault path; the
        // memory changes after (the guest's write), maybe before the copy.
        let before = vec![6u8; 4096];
        w.pages(5, before.clone());
        memfd.write_all_at(&[0xee; 4096], 5 * PAGE_SIZE).unwrap();
        let report = w.finish().await;
        assert!(report.error.is_none());
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[5 * 4096..6 * 4096], &before[..]);
        let digests = report.chunk_digests.wait();
        let whole = sum_file(&img.file, WRITE_ALGORITHM).unwrap();
        // The copy's digest may hold the later bytes: the chunk is left to
        // the commit to read back.
        assert!(!digests.contains_key(&0));
        assert_eq!(whole.chunks.len(), 1);
    }
}
