//! Push: a local snapshot directory (and its volume snapshot) into the
//! store, as a short list of steps:
//!
//! 1. read and check `state.json`; refuse a name the store already holds;
//! 2. take a push lock (waiting while a gc runs);
//! 3. for every distinct non-hole chunk, in parallel: HEAD its key; if the
//!    store has it, count it present; else read it, check it against its
//!    digest, compress it and PUT it;
//! 4. check the lock still holds, then PUT the manifest only if none is
//!    there: the commit point;
//! 5. drop the lock.
//!
//! A push stopped anywhere before step 4 leaves chunks no manifest names
//! (and a lock that goes stale): nothing is listed, and gc removes them.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use proto::manifest::{Manifest, PageRun, StoredVolume, MANIFEST_VERSION, MAX_STORED_BYTES};
use proto::snapshot::{Algorithm, FileSum, MEMORY_FILE};

use crate::chunk::{self, CHUNK_BYTES};
use crate::error::{Error, Result};
use crate::local;
use crate::lock::LockKind;
use crate::store::Remote;

/// What to push.
#[derive(Debug, Clone, Default)]
pub struct PushSource {
    /// The snapshot directory (`state.json`, `memory.img`).
    pub dir: PathBuf,
    /// The volume snapshot file taken with it (`state.volume_snapshot`),
    /// if it has one.
    pub volume: Option<PathBuf>,
    /// The pages a restore touched first, in order, if recorded.
    pub working_set: Option<Vec<PageRun>>,
}

/// How far a push or a pull is, after each chunk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Progress {
    /// Distinct non-hole chunks handled so far, and in all.
    pub chunks_done: u64,
    pub chunks_total: u64,
    /// Their uncompressed bytes, so far and in all.
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Chunks sent (push) or fetched (pull), and their stored bytes.
    pub chunks_moved: u64,
    pub stored_bytes_moved: u64,
    /// Chunks the store already had (push).
    pub chunks_present: u64,
}

/// What a push did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushReport {
    pub name: String,
    /// Chunks of memory.img and the volume, holes included.
    pub chunks: u64,
    /// Of those, holes (not stored).
    pub holes: u64,
    /// Distinct non-hole chunks.
    pub distinct: u64,
    /// Of those, uploaded by this push, and found in the store already.
    pub uploaded: u64,
    pub present: u64,
    /// Bytes uploaded (compressed), and what they hold uncompressed.
    pub uploaded_bytes: u64,
    pub uploaded_raw_bytes: u64,
    /// The manifest's size.
    pub manifest_bytes: u64,
    pub elapsed: Duration,
}

/// Which file a chunk is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Of {
    Memory,
    Volume,
}

/// One chunk to push.
#[derive(Debug)]
struct Job {
    of: Of,
    index: usize,
    offset: u64,
    len: u64,
    /// Known from state.json (memory), or computed from the bytes (volume).
    digest: Option<String>,
}

/// What became of a job.
#[derive(Debug)]
enum Done {
    Uploaded {
        digest: String,
        stored: u32,
    },
    Present {
        digest: String,
        stored: u32,
    },
    /// Another job of this push has the same digest.
    Duplicate {
        digest: String,
    },
    /// A volume chunk with data that is all zero.
    Zero,
}

/// The files of one push, shared with the chunk jobs.
#[derive(Debug)]
struct Files {
    memory: File,
    memory_path: PathBuf,
    volume: Option<(File, PathBuf)>,
}

impl Remote {
    /// Push the snapshot in `src.dir` under its own name; `progress` is
    /// called after each chunk.
    pub async fn push(
        &self,
        src: &PushSource,
        progress: &(dyn Fn(&Progress) + Send + Sync),
    ) -> Result<PushReport> {
        let start = Instant::now();
        let bad = |reason: String| Error::LocalSnapshot {
            dir: src.dir.clone(),
            reason,
        };
        let state = local::read_state(&src.dir)?;
        let name = state.name.clone();
        let mem = state
            .files
            .get(MEMORY_FILE)
            .cloned()
            .ok_or_else(|| bad(format!("no checksum of {MEMORY_FILE}")))?;
        if mem.algorithm != Algorithm::Xxh3 {
            return Err(bad(format!(
                "its checksums are {:?} (format {}); the store keys chunks by XXH3-128 \
                 (format 3): take a new snapshot to push",
                mem.algorithm, state.format_version
            )));
        }
        match (&state.volume_snapshot, &src.volume) {
            (Some(v), None) => {
                return Err(bad(format!(
                    "it was taken with volume snapshot {v}: give its file to push it along"
                )))
            }
            (None, Some(p)) => {
                return Err(bad(format!(
                    "it has no volume snapshot, yet {} was given as one",
                    p.display()
                )))
            }
            _ => {}
        }
        if self.head(&self.manifest_key(&name)).await?.is_some() {
            return Err(Error::AlreadyExists {
                name,
                url: self.url().to_string(),
            });
        }
        let memory_path = local::memory_path(&src.dir);
        let memory = local::open_read(&memory_path)?;
        let len = memory
            .metadata()
            .map_err(Error::io("stat", &memory_path))?
            .len();
        if len != mem.bytes || mem.chunks.len() as u64 != mem.bytes.div_ceil(CHUNK_BYTES) {
            return Err(bad(format!(
                "{MEMORY_FILE} has {len} bytes and state.json {} bytes in {} chunks",
                mem.bytes,
                mem.chunks.len()
            )));
        }
        let volume = match &src.volume {
            Some(p) => Some((local::open_read(p)?, p.clone())),
            None => None,
        };
        let files = Arc::new(Files {
            memory,
            memory_path,
            volume,
        });

        let what = format!("the push of {name}");
        let lock = self.lock_for_push(&what).await?;
        let result = lock
            .hold(async {
                let (counts, manifest) = self
                    .push_chunks(&state, &mem, &files, src, progress)
                    .await?;
                lock.check()?;
                let manifest_bytes = self.commit(&manifest).await?;
                Ok(counts.into_report(name.clone(), manifest_bytes, start))
            })
            .await;
        lock.release().await;
        result
    }

    /// Take a push lock, waiting up to `busy_wait` while a gc holds one.
    async fn lock_for_push(&self, what: &str) -> Result<crate::lock::Lock> {
        let started = Instant::now();
        loop {
            match self.try_lock(LockKind::Push, what).await? {
                Ok(lock) => return Ok(lock),
                Err(gcs) if started.elapsed() >= self.tuning().busy_wait => {
                    return Err(Error::Busy {
                        url: self.url().to_string(),
                        what: format!("a gc is running ({})", gcs[0].key),
                    })
                }
                Err(_) => {
                    let jitter = Duration::from_millis(rand::random::<u64>() % 500);
                    tokio::time::sleep(Duration::from_millis(500) + jitter).await;
                }
            }
        }
    }

    /// Step 3: every chunk into the store; the manifest to commit.
    async fn push_chunks(
        &self,
        state: &proto::snapshot::StateFile,
        mem: &FileSum,
        files: &Arc<Files>,
        src: &PushSource,
        progress: &(dyn Fn(&Progress) + Send + Sync),
    ) -> Result<(Counts, Manifest)> {
        let mut counts = Counts::default();
        let mut jobs = Vec::new();
        for (index, d) in mem.chunks.iter().enumerate() {
            let offset = index as u64 * CHUNK_BYTES;
            let len = CHUNK_BYTES.min(mem.bytes - offset);
            if *d == chunk::zero_digest(len) {
                counts.holes += 1;
            } else {
                jobs.push(Job {
                    of: Of::Memory,
                    index,
                    offset,
                    len,
                    digest: Some(d.clone()),
                });
            }
        }
        let vol_bytes = match &files.volume {
            Some((f, p)) => f.metadata().map_err(Error::io("stat", p))?.len(),
            None => 0,
        };
        let vol_chunks = usize_of(vol_bytes.div_ceil(CHUNK_BYTES));
        let mut vol_digests: Vec<String> = Vec::with_capacity(vol_chunks);
        if let Some((f, p)) = &files.volume {
            let data =
                local::data_ranges(f, vol_bytes).map_err(Error::io("read the extents of", p))?;
            for index in 0..vol_chunks {
                let offset = index as u64 * CHUNK_BYTES;
                let len = CHUNK_BYTES.min(vol_bytes - offset);
                vol_digests.push(chunk::zero_digest(len));
                if local::has_data(&data, offset, offset + len) {
                    jobs.push(Job {
                        of: Of::Volume,
                        index,
                        offset,
                        len,
                        digest: None,
                    });
                } else {
                    counts.holes += 1;
                }
            }
        }
        counts.chunks = mem.chunks.len() as u64 + vol_chunks as u64;

        // Memory chunks with the same digest are one job; volume chunks
        // are deduplicated once hashed (`claimed`).
        let mut seen = HashSet::new();
        jobs.retain(|j| j.digest.as_ref().is_none_or(|d| seen.insert(d.clone())));
        let mut p = Progress {
            chunks_total: jobs.len() as u64,
            bytes_total: jobs.iter().map(|j| j.len).sum(),
            ..Progress::default()
        };
        progress(&p);
        let claimed = Arc::new(Mutex::new(seen));
        let stored: Mutex<HashMap<String, u32>> = Mutex::new(HashMap::new());
        let vol_found: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());
        futures_util::stream::iter(jobs)
            .map(|job| {
                let files = Arc::clone(files);
                let claimed = Arc::clone(&claimed);
                async move {
                    let (of, index, len) = (job.of, job.index, job.len);
                    self.push_chunk(job, files, claimed)
                        .await
                        .map(|d| (of, index, len, d))
                }
            })
            .buffer_unordered(self.tuning().concurrency.max(1))
            .try_for_each(|(of, index, len, done)| {
                p.chunks_done += 1;
                p.bytes_done += len;
                let digest = match &done {
                    Done::Uploaded { digest, stored: s } => {
                        p.chunks_moved += 1;
                        p.stored_bytes_moved += u64::from(*s);
                        counts.uploaded += 1;
                        counts.uploaded_bytes += u64::from(*s);
                        counts.uploaded_raw_bytes += len;
                        Some((digest.clone(), *s))
                    }
                    Done::Present { digest, stored: s } => {
                        p.chunks_present += 1;
                        counts.present += 1;
                        Some((digest.clone(), *s))
                    }
                    Done::Duplicate { digest } => {
                        if of == Of::Volume {
                            lock(&vol_found).push((index, digest.clone()));
                        }
                        None
                    }
                    Done::Zero => {
                        counts.holes += 1;
                        None
                    }
                };
                if let Some((d, s)) = digest {
                    if of == Of::Volume {
                        lock(&vol_found).push((index, d.clone()));
                    }
                    lock(&stored).insert(d, s);
                }
                progress(&p);
                futures_util::future::ready(Ok(()))
            })
            .await?;

        let stored = stored
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let stored_of = |d: &str| stored.get(d).copied().unwrap_or(0);
        for (index, d) in vol_found
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            vol_digests[index] = d;
        }
        counts.distinct = counts.uploaded + counts.present;
        let mut st = state.clone();
        st.files.retain(|f, _| f == MEMORY_FILE);
        let manifest = Manifest {
            manifest_version: MANIFEST_VERSION,
            name: state.name.clone(),
            pushed: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            chunk_bytes: CHUNK_BYTES,
            memory: mem.chunks.iter().map(|d| stored_of(d)).collect(),
            volume: state.volume_snapshot.as_ref().map(|name| StoredVolume {
                name: name.clone(),
                sum: FileSum {
                    bytes: vol_bytes,
                    algorithm: Algorithm::Xxh3,
                    digest: chunk::file_digest(&vol_digests),
                    chunks: vol_digests.clone(),
                },
                stored: vol_digests.iter().map(|d| stored_of(d)).collect(),
            }),
            working_set: src.working_set.clone(),
            state: st,
        };
        manifest.validate().map_err(|e| Error::LocalSnapshot {
            dir: src.dir.clone(),
            reason: format!("its manifest would not be valid: {e}"),
        })?;
        Ok((counts, manifest))
    }

    /// One chunk: hash it if need be, skip it if another job has it or the
    /// store does, else upload it.
    async fn push_chunk(
        &self,
        job: Job,
        files: Arc<Files>,
        claimed: Arc<Mutex<HashSet<String>>>,
    ) -> Result<Done> {
        let read = |files: Arc<Files>, of: Of, offset: u64, len: u64| async move {
            tokio::task::spawn_blocking(move || {
                let (f, p) = match of {
                    Of::Memory => (&files.memory, &files.memory_path),
                    Of::Volume => match &files.volume {
                        Some((f, p)) => (f, p),
                        None => return Err(Error::Worker("no volume file".into())),
                    },
                };
                local::read_chunk(f, p, offset, len)
            })
            .await
            .map_err(|e| Error::Worker(e.to_string()))?
        };
        let (digest, mut bytes) = match job.digest {
            Some(d) => (d, None),
            None => {
                let b = read(Arc::clone(&files), job.of, job.offset, job.len).await?;
                let (b, d) = tokio::task::spawn_blocking(move || {
                    let d = chunk::digest(&b);
                    (b, d)
                })
                .await
                .map_err(|e| Error::Worker(e.to_string()))?;
                if d == chunk::zero_digest(job.len) {
                    return Ok(Done::Zero);
                }
                if !lock(&claimed).insert(d.clone()) {
                    return Ok(Done::Duplicate { digest: d });
                }
                (d, Some(b))
            }
        };
        let key = self.chunk_key(&digest);
        if let Some(meta) = self.head(&key).await? {
            if let Ok(s) = u32::try_from(meta.size) {
                if s > 0 && s <= MAX_STORED_BYTES {
                    return Ok(Done::Present { digest, stored: s });
                }
            }
        }
        let raw = match bytes.take() {
            Some(b) => b,
            None => read(Arc::clone(&files), job.of, job.offset, job.len).await?,
        };
        let level = self.tuning().zstd_level;
        let want = digest.clone();
        let path = match job.of {
            Of::Memory => files.memory_path.clone(),
            Of::Volume => files
                .volume
                .as_ref()
                .map(|(_, p)| p.clone())
                .unwrap_or_default(),
        };
        let index = job.index;
        let encoded = tokio::task::spawn_blocking(move || {
            if job.of == Of::Memory && chunk::digest(&raw) != want {
                return Err(Error::LocalSnapshot {
                    dir: path.parent().map(Path::to_owned).unwrap_or_default(),
                    reason: format!(
                        "chunk {index} of {MEMORY_FILE} does not match state.json: the \
                         snapshot is damaged (uffd-server quarantines such snapshots at start)"
                    ),
                });
            }
            chunk::encode(&raw, level).map_err(Error::io("compress a chunk of", path))
        })
        .await
        .map_err(|e| Error::Worker(e.to_string()))??;
        let stored = u32::try_from(encoded.len()).unwrap_or(u32::MAX);
        self.put(&key, Bytes::from(encoded), false).await?;
        Ok(Done::Uploaded { digest, stored })
    }

    /// Step 4: the manifest, only if no other push of the name committed.
    async fn commit(&self, m: &Manifest) -> Result<u64> {
        let bytes = proto::manifest::encode_manifest(m);
        let n = bytes.len() as u64;
        if !self
            .put(&self.manifest_key(&m.name), Bytes::from(bytes), true)
            .await?
        {
            return Err(Error::AlreadyExists {
                name: m.name.clone(),
                url: self.url().to_string(),
            });
        }
        Ok(n)
    }
}

/// Counts of a push as it goes.
#[derive(Debug, Default)]
struct Counts {
    chunks: u64,
    holes: u64,
    distinct: u64,
    uploaded: u64,
    present: u64,
    uploaded_bytes: u64,
    uploaded_raw_bytes: u64,
}

impl Counts {
    fn into_report(self, name: String, manifest_bytes: u64, start: Instant) -> PushReport {
        PushReport {
            name,
            chunks: self.chunks,
            holes: self.holes,
            distinct: self.distinct,
            uploaded: self.uploaded,
            present: self.present,
            uploaded_bytes: self.uploaded_bytes,
            uploaded_raw_bytes: self.uploaded_raw_bytes,
            manifest_bytes,
            elapsed: start.elapsed(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn usize_of(n: u64) -> usize {
    shared::geometry::usize_of(n)
}
