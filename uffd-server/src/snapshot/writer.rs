//! The image writer: a thread of its own that writes page runs into a
//! `memory.img` being made, so the core thread (which reads the pages, and
//! must never block on a file) only copies bytes into messages.
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
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use shared::PAGE_SIZE;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use super::checksum::{Algorithm, Piece, StreamSums};
use super::image::ImageWriter;
use super::SnapshotError;

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
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Job::Pages { first, bytes, .. } => write!(f, "Pages({first}, {} bytes)", bytes.len()),
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
/// `alg`.
pub fn spawn(
    file: File,
    path: PathBuf,
    fresh: bool,
    alg: Algorithm,
) -> std::io::Result<WriterHandle> {
    let len = file.metadata()?.len();
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
        .spawn(move || {
            let mut sums = StreamSums::new(alg, len);
            let mut unsynced = Unsynced::default();
            for job in hrx {
                match job {
                    Job::Pages { first, bytes, .. } => {
                        let pages = bytes.len() as u64 / PAGE_SIZE;
                        if let Some((lo, n)) = unsynced.add(first, pages) {
                            // Best effort: the fsync at the commit reports
                            // what failed.
                            if let Err(e) = flushed.start_writeback(lo, n) {
                                tracing::debug!(
                                    "early writeback of {}: {e}",
                                    flushed.path.display()
                                );
                            }
                        }
                        sums.feed(first * PAGE_SIZE, Piece::Bytes(&bytes));
                        BUFFERS.give_back(bytes);
                    }
                    Job::Punch { first, pages } => {
                        sums.feed(first * PAGE_SIZE, Piece::Zeroes(pages * PAGE_SIZE));
                    }
                    Job::Prefetch(_) => {}
                }
            }
            sums.finish()
        })?;
    std::thread::Builder::new()
        .name("snapshot-writer".into())
        .spawn(move || {
            let image = ImageWriter { path, file };
            let mut report = WriteReport::default();
            for job in rx {
                if report.error.is_some() {
                    continue;
                }
                let r = match &job {
                    Job::Pages { first, bytes, .. } => write_sparse(&image, fresh, *first, bytes),
                    Job::Punch { first, pages } if !fresh => {
                        image.punch(*first, *pages).map(|()| 0)
                    }
                    Job::Punch { .. } => Ok(0),
                    Job::Prefetch(runs) => {
                        image.prefetch(runs);
                        continue;
                    }
                };
                match r {
                    Ok(n) => {
                        report.bytes_written += n;
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
        })?;
    Ok(WriterHandle {
        tx,
        gate: Arc::new(Semaphore::new(IN_FLIGHT)),
        done,
    })
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

/// Write whole pages `buf` at `first` into `image`, leaving all-zero pages
/// as holes (punched, unless the image is `fresh`: all holes already).
/// Returns the bytes written.
fn write_sparse(
    image: &ImageWriter,
    fresh: bool,
    first: u64,
    buf: &[u8],
) -> Result<u64, SnapshotError> {
    let ps = shared::geometry::usize_of(PAGE_SIZE);
    let zero: Vec<bool> = buf
        .chunks_exact(ps)
        .map(|pg| pg.iter().all(|b| *b == 0))
        .collect();
    let mut written = 0;
    let mut i = 0;
    while i < zero.len() {
        let mut j = i + 1;
        while j < zero.len() && zero[j] == zero[i] {
            j += 1;
        }
        let at = first + i as u64;
        if !zero[i] {
            image.write_pages(at, &buf[i * ps..j * ps])?;
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
        let w = spawn(file, path.clone(), true, WRITE_ALGORITHM).unwrap();
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
}
