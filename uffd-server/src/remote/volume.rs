//! A volume snapshot from the store, written whole into a local file: the
//! disk of a VM restored from a remote snapshot, or of a pulled one. Its
//! chunks are read through the chunk cache (checked, fetched once) by a
//! few threads of its own (the cache blocks, and refuses runtime threads),
//! and written where they occur; holes stay holes.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use pagefork_remote::{ChunkRef, Manifest};
use tokio::sync::oneshot;

use super::chunks::ChunkPool;

/// Threads writing one volume.
const THREADS: usize = 4;

/// Why a volume could not be written.
#[derive(Debug, thiserror::Error)]
pub enum VolumeWriteError {
    #[error(transparent)]
    Chunk(#[from] pagefork_remote::Error),
    #[error("cannot write {}", .0.display())]
    Write(PathBuf, #[source] std::io::Error),
    #[error("cannot start a thread to write a volume")]
    Thread(#[source] std::io::Error),
}

/// The stored chunks of manifest `m`'s volume: (offset, chunk).
pub fn volume_chunks(m: &Manifest) -> Vec<(u64, ChunkRef)> {
    m.volume_chunks()
        .iter()
        .filter_map(|c| ChunkRef::of(c).map(|r| (c.offset, r)))
        .collect()
}

/// Write `chunks` into `file` (at `path`, of the volume's size already)
/// on threads of their own, then fsync it; the receiver gets the bytes
/// written or the first error.
pub fn spawn_write(
    pool: Arc<ChunkPool>,
    chunks: Vec<(u64, ChunkRef)>,
    file: File,
    path: PathBuf,
) -> oneshot::Receiver<Result<u64, VolumeWriteError>> {
    let (tx, rx) = oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("remote-volume".into())
        .spawn(move || {
            let _ = tx.send(write_all(&pool, &chunks, &file, &path));
        });
    if let Err(e) = spawned {
        let (tx, rx) = oneshot::channel();
        let _ = tx.send(Err(VolumeWriteError::Thread(e)));
        return rx;
    }
    rx
}

fn write_all(
    pool: &ChunkPool,
    chunks: &[(u64, ChunkRef)],
    file: &File,
    path: &std::path::Path,
) -> Result<u64, VolumeWriteError> {
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<VolumeWriteError>> = Mutex::new(None);
    let written = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..THREADS.min(chunks.len()).max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((offset, c)) = chunks.get(i) else {
                    return;
                };
                if failed
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .is_some()
                {
                    return;
                }
                let r = pool
                    .cache()
                    .get(c)
                    .map_err(VolumeWriteError::from)
                    .and_then(|bytes| {
                        file.write_all_at(&bytes, *offset)
                            .map_err(|e| VolumeWriteError::Write(path.to_owned(), e))?;
                        written.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                        Ok(())
                    });
                if let Err(e) = r {
                    failed
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .get_or_insert(e);
                    return;
                }
            });
        }
    });
    if let Some(e) = failed
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        return Err(e);
    }
    file.sync_all()
        .map_err(|e| VolumeWriteError::Write(path.to_owned(), e))?;
    Ok(written.into_inner())
}
