//! A snapshot in the object store as a page source: its manifest's chunk
//! list (one chunk per MiB of memory, a hole or a stored chunk), served a
//! chunk at a time through the [`ChunkPool`]. Holes are `Uninitialized`
//! in the tables that read it and never fetched.

use std::ops::Range;
use std::sync::Arc;

use pagefork_remote::{ChunkRef, Manifest, CHUNK_BYTES};
use shared::PAGE_SIZE;
use tokio::sync::oneshot;

use super::chunks::{key_of, ChunkError, ChunkKey, ChunkPool, Priority};
use crate::images::ImageId;

/// Pages per chunk.
pub const CHUNK_PAGES: u64 = CHUNK_BYTES / PAGE_SIZE;

/// The memory of a snapshot in the store.
#[derive(Debug)]
pub struct RemoteImage {
    /// Its name in the store.
    pub snapshot: String,
    /// The store, `s3://BUCKET[/PREFIX]`.
    pub url: String,
    /// Guest memory it holds.
    pub memory_bytes: u64,
    /// Each chunk of memory: `None` for a hole.
    chunks: Vec<Option<(ChunkKey, ChunkRef)>>,
    pool: Arc<ChunkPool>,
    /// Its content's identity (VMs of equal images share a base).
    id: ImageId,
    /// The manifest it was made from (the restart journal records it, so
    /// that a new server opens the same image again without the store).
    pub manifest: Arc<Manifest>,
}

impl RemoteImage {
    /// The memory of the snapshot manifest `m` describes, in store `url`.
    pub fn new(m: &Manifest, url: String, pool: Arc<ChunkPool>) -> Self {
        let chunks: Vec<_> = m
            .memory_chunks()
            .iter()
            .map(|c| ChunkRef::of(c).map(|r| (key_of(&r.digest), r)))
            .collect();
        RemoteImage {
            snapshot: m.name.clone(),
            url,
            memory_bytes: m.state.memory_bytes,
            id: content_id(&chunks, m.state.memory_bytes),
            chunks,
            pool,
            manifest: Arc::new(m.clone()),
        }
    }

    /// Chunks of memory, holes included.
    pub fn chunk_count(&self) -> u64 {
        self.chunks.len() as u64
    }

    /// The chunk holding page `page`.
    pub fn chunk_of(&self, page: u64) -> u64 {
        page / CHUNK_PAGES
    }

    /// The pages of chunk `chunk`.
    pub fn chunk_pages(&self, chunk: u64) -> Range<u64> {
        let pages = self.memory_bytes / PAGE_SIZE;
        (chunk * CHUNK_PAGES).min(pages)..((chunk + 1) * CHUNK_PAGES).min(pages)
    }

    /// The chunks holding pages `pages`.
    pub fn chunks_of(&self, pages: Range<u64>) -> Range<u64> {
        self.chunk_of(pages.start)..self.chunk_of(pages.end.saturating_sub(1).max(pages.start)) + 1
    }

    /// The pages that are not in holes, as runs `(first, count)`: what a
    /// table reads from this image (the rest is `Uninitialized`).
    pub fn data_pages(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for (i, c) in (0u64..).zip(&self.chunks) {
            if c.is_none() {
                continue;
            }
            let r = self.chunk_pages(i);
            match runs.last_mut() {
                Some((first, n)) if *first + *n == r.start => *n += r.end - r.start,
                _ => runs.push((r.start, r.end - r.start)),
            }
        }
        runs
    }

    /// Chunk `chunk`'s bytes if in memory (`None` also for a hole or an
    /// index past the end); `Err` with the reason if it could not be had.
    pub fn cached(&self, chunk: u64) -> Result<Option<Arc<[u8]>>, ChunkError> {
        match self.entry(chunk) {
            Some((key, _)) => self.pool.lookup(*key),
            None => Ok(None),
        }
    }

    /// Whether chunk `chunk` is a hole (or past the end).
    pub fn is_hole(&self, chunk: u64) -> bool {
        self.entry(chunk).is_none()
    }

    fn entry(&self, chunk: u64) -> Option<&(ChunkKey, ChunkRef)> {
        usize::try_from(chunk)
            .ok()
            .and_then(|i| self.chunks.get(i))
            .and_then(Option::as_ref)
    }

    /// Receivers that fire when each of `chunks` is in memory or failed;
    /// fetching starts now, ahead of bulk prefetches.
    pub fn wait(&self, chunks: Range<u64>) -> Vec<oneshot::Receiver<()>> {
        chunks
            .filter_map(|c| self.entry(c))
            .filter_map(|(_, r)| self.pool.request(r, Priority::Urgent, true))
            .collect()
    }

    /// Start fetching `chunks` with `priority`, in the order given; nobody
    /// waits.
    pub fn prefetch(&self, chunks: impl IntoIterator<Item = u64>, priority: Priority) {
        for c in chunks {
            if let Some((_, r)) = self.entry(c) {
                let _ = self.pool.request(r, priority, false);
            }
        }
    }

    /// What its bytes are: equal for every snapshot with this memory.
    pub fn id(&self) -> ImageId {
        self.id
    }

    /// The chunk reference of chunk `chunk` (`None` for a hole).
    pub fn chunk_ref(&self, chunk: u64) -> Option<&ChunkRef> {
        self.entry(chunk).map(|(_, r)| r)
    }
}

/// The identity of memory of `memory_bytes` made of `chunks`: the
/// XXH3-128 of the list, a hole as one byte, a chunk as its key.
fn content_id(chunks: &[Option<(ChunkKey, ChunkRef)>], memory_bytes: u64) -> ImageId {
    let mut list = Vec::with_capacity(chunks.len() * 17);
    for c in chunks {
        match c {
            None => list.push(0),
            Some((key, _)) => {
                list.push(1);
                list.extend_from_slice(&key.to_le_bytes());
            }
        }
    }
    ImageId::Content {
        digest: xxhash_rust::xxh3::xxh3_128(&list),
        memory_bytes,
    }
}
