//! Pull: a whole snapshot from the store into a local snapshot directory
//! (and its volume snapshot into a file), as a short list of steps:
//!
//! 1. GET and check the manifest;
//! 2. create `.tmp-<dir>` beside the target with a `memory.img` that is
//!    one hole of the memory's size (and the volume file likewise);
//! 3. fetch every distinct non-hole chunk in parallel (one range GET
//!    each, checked against its digest) and write it wherever it occurs,
//!    leaving its zero pages as holes;
//! 4. write `state.json`, fsync, rename the volume file into place, then
//!    the directory (the commit).
//!
//! A pull stopped before step 4 leaves only a `.tmp-` directory (which
//! uffd-server removes at start) and never a half snapshot under its name.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{StreamExt, TryStreamExt};
use proto::manifest::Manifest;

use crate::chunk::ChunkRef;
use crate::error::{Error, Result};
use crate::local::{self, SparseWriter};
use crate::push::Progress;
use crate::store::Remote;

/// Where a pull writes.
#[derive(Debug, Clone, Default)]
pub struct PullTarget {
    /// The snapshot directory to create (it must not exist). Its last
    /// component becomes the local snapshot's name.
    pub dir: PathBuf,
    /// Where to write the volume snapshot, if the snapshot has one and it
    /// is wanted (the file must not exist).
    pub volume: Option<PathBuf>,
}

/// What a pull did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullReport {
    pub name: String,
    /// Chunks of memory.img and of the volume (if pulled), holes included.
    pub chunks: u64,
    pub holes: u64,
    /// Distinct chunks fetched, their stored and uncompressed bytes.
    pub fetched: u64,
    pub fetched_bytes: u64,
    pub fetched_raw_bytes: u64,
    /// The volume file written, if any.
    pub volume: Option<PathBuf>,
    pub elapsed: Duration,
}

/// Which file a place is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum In {
    Memory,
    Volume,
}

impl Remote {
    /// Pull snapshot `name` into `target`; `progress` is called after each
    /// chunk.
    pub async fn pull(
        &self,
        name: &str,
        target: &PullTarget,
        progress: &(dyn Fn(&Progress) + Send + Sync),
    ) -> Result<PullReport> {
        let start = Instant::now();
        let m = self.manifest(name).await?;
        let bad = |reason: String| Error::LocalSnapshot {
            dir: target.dir.clone(),
            reason,
        };
        let (parent, local_name) = match (target.dir.parent(), target.dir.file_name()) {
            (Some(p), Some(n)) => (p.to_owned(), n.to_string_lossy().into_owned()),
            _ => return Err(bad("not a directory path with a parent".into())),
        };
        proto::manifest::check_name(&local_name).map_err(|e| bad(e.to_string()))?;
        if target.dir.exists() {
            return Err(bad("it exists already".into()));
        }
        let volume_to = match (&m.volume, &target.volume) {
            (Some(_), Some(p)) if p.exists() => {
                return Err(bad(format!(
                    "the volume file {} exists already",
                    p.display()
                )))
            }
            (Some(_), Some(p)) => Some(p.clone()),
            _ => None,
        };

        let tmp = parent.join(format!(".tmp-{local_name}"));
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(Error::io("remove the leftover", &tmp))?;
        }
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&tmp)
            .map_err(Error::io("create", &tmp))?;
        let result = self
            .pull_into(&m, &tmp, volume_to.as_deref(), progress)
            .await
            .and_then(|(counts, vol_writer)| {
                let mut state = m.state.clone();
                state.name = local_name.clone();
                local::write_state(&tmp, &state)?;
                local::sync_dir(&tmp)?;
                // The volume first: the directory's rename is the commit.
                if let (Some(w), Some(p)) = (vol_writer, &volume_to) {
                    w.publish(p)?;
                }
                fs::rename(&tmp, &target.dir).map_err(Error::io("rename into", &target.dir))?;
                local::sync_dir(&parent)?;
                Ok(counts)
            });
        match result {
            Ok(c) => Ok(PullReport {
                name: name.to_owned(),
                chunks: c.chunks,
                holes: c.holes,
                fetched: c.fetched,
                fetched_bytes: c.fetched_bytes,
                fetched_raw_bytes: c.fetched_raw_bytes,
                volume: volume_to,
                elapsed: start.elapsed(),
            }),
            Err(e) => {
                let _ = fs::remove_dir_all(&tmp);
                if let Some(p) = &volume_to {
                    let _ = fs::remove_file(volume_tmp(p));
                    // Published, but its snapshot never committed (the
                    // file did not exist before this pull).
                    if !target.dir.exists() {
                        let _ = fs::remove_file(p);
                    }
                }
                Err(e)
            }
        }
    }

    /// Steps 2 and 3.
    async fn pull_into(
        &self,
        m: &Manifest,
        tmp: &Path,
        volume_to: Option<&Path>,
        progress: &(dyn Fn(&Progress) + Send + Sync),
    ) -> Result<(Counts, Option<SparseWriter>)> {
        let mem_bytes = m.state.memory_bytes;
        let memory = Arc::new(SparseWriter::create(&local::memory_path(tmp), mem_bytes)?);
        let volume = match (volume_to, &m.volume) {
            (Some(p), Some(v)) => {
                Some(Arc::new(SparseWriter::create(&volume_tmp(p), v.sum.bytes)?))
            }
            _ => None,
        };
        let mut counts = Counts::default();
        // Every place each distinct chunk goes.
        let mut places: HashMap<ChunkRef, Vec<(In, u64)>> = HashMap::new();
        let mut order: Vec<ChunkRef> = Vec::new();
        let files = [(In::Memory, m.memory_chunks())]
            .into_iter()
            .chain(volume.is_some().then(|| (In::Volume, m.volume_chunks())));
        for (which, chunks) in files {
            for c in &chunks {
                counts.chunks += 1;
                match ChunkRef::of(c) {
                    None => counts.holes += 1,
                    Some(r) => {
                        let at = places.entry(r.clone()).or_default();
                        if at.is_empty() {
                            order.push(r);
                        }
                        at.push((which, c.offset));
                    }
                }
            }
        }
        let mut p = Progress {
            chunks_total: order.len() as u64,
            bytes_total: order.iter().map(|c| c.len).sum(),
            ..Progress::default()
        };
        progress(&p);
        let places = Arc::new(places);
        futures_util::stream::iter(order)
            .map(|c| {
                let (memory, volume, places) =
                    (Arc::clone(&memory), volume.clone(), Arc::clone(&places));
                async move {
                    let bytes = self.fetch_chunk(&c).await?;
                    let stored = c.stored;
                    let len = c.len;
                    tokio::task::spawn_blocking(move || {
                        for &(which, offset) in places.get(&c).map_or(&[][..], Vec::as_slice) {
                            match (which, &volume) {
                                (In::Memory, _) => memory.write(offset, &bytes)?,
                                (In::Volume, Some(v)) => v.write(offset, &bytes)?,
                                (In::Volume, None) => {}
                            }
                        }
                        Ok::<_, Error>(())
                    })
                    .await
                    .map_err(|e| Error::Worker(e.to_string()))??;
                    Ok::<_, Error>((stored, len))
                }
            })
            .buffer_unordered(self.tuning().concurrency.max(1))
            .try_for_each(|(stored, len)| {
                p.chunks_done += 1;
                p.bytes_done += len;
                p.chunks_moved += 1;
                p.stored_bytes_moved += u64::from(stored);
                counts.fetched += 1;
                counts.fetched_bytes += u64::from(stored);
                counts.fetched_raw_bytes += len;
                progress(&p);
                futures_util::future::ready(Ok(()))
            })
            .await?;
        let memory = Arc::try_unwrap(memory)
            .map_err(|_| Error::Worker("a chunk writer outlived the pull".into()))?;
        memory.publish(&local::memory_path(tmp))?;
        let volume = match volume {
            Some(v) => Some(
                Arc::try_unwrap(v)
                    .map_err(|_| Error::Worker("a chunk writer outlived the pull".into()))?,
            ),
            None => None,
        };
        Ok((counts, volume))
    }
}

/// The temporary name of a volume file being pulled.
fn volume_tmp(p: &Path) -> PathBuf {
    let name = p
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    p.with_file_name(format!(".tmp-{name}"))
}

#[derive(Debug, Default)]
struct Counts {
    chunks: u64,
    holes: u64,
    fetched: u64,
    fetched_bytes: u64,
    fetched_raw_bytes: u64,
}
