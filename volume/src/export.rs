//! Export of a volume and its snapshots as one qcow2 v3 file.
//!
//! The snapshots become internal snapshots in their history order and the
//! volume the active image. A cluster's identity is the list of physical
//! extents (FIEMAP) that hold it, so data physically shared between the
//! snapshot files (reflinks) becomes one host cluster, referenced from
//! every state that shares it, with qemu's refcounts and COPIED flags
//! (`qcow2::writer`). Holes and unwritten extents stay unallocated (they
//! read as zeroes). Each distinct cluster is reflinked into the new file
//! when it is on the same filesystem, and copied otherwise.
//!
//! The file is written under a hidden temporary name next to the target,
//! fsynced, and renamed into place; an existing target is refused.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use proto::api::ExportedVolume;
use qcow2::writer::{self, State};
use qcow2::SnapshotTime;
use reflink::{Extent, FIEMAP_EXTENT_NO_IDENTITY, FIEMAP_EXTENT_UNWRITTEN};

use crate::engine::{sync_dir, VolumeEngine};
use crate::error::{Result, VolumeError};

/// 64 KiB clusters, qemu's default.
const CLUSTER_BITS: u32 = 16;
const CS: u64 = 1 << CLUSTER_BITS;

/// Physical pieces of one cluster: (offset in the cluster, device offset,
/// length). `None` when the filesystem gives no stable identity.
type Key = Vec<(u64, u64, u64)>;

/// What one cluster of a file holds: nothing (zeroes), or data with or
/// without a physical identity.
fn cluster_key(extents: &[Extent], at: u64, len: u64) -> Option<Option<Key>> {
    let end = at + len;
    let first = extents.partition_point(|e| e.logical + e.length <= at);
    let mut key = Vec::new();
    let mut anonymous = false;
    for e in &extents[first..] {
        if e.logical >= end {
            break;
        }
        if e.flags & FIEMAP_EXTENT_UNWRITTEN != 0 {
            continue;
        }
        if e.flags & FIEMAP_EXTENT_NO_IDENTITY != 0 {
            anonymous = true;
        }
        let s = e.logical.max(at);
        let t = (e.logical + e.length).min(end);
        key.push((s - at, e.physical + (s - e.logical), t - s));
    }
    if key.is_empty() {
        None
    } else if anonymous {
        Some(None)
    } else {
        Some(Some(key))
    }
}

impl VolumeEngine {
    /// Export volume `name` and its snapshots to a new qcow2 file at `path`.
    pub fn export_qcow2(&self, name: &str, path: &Path) -> Result<ExportedVolume> {
        self.available()?;
        self.check_detached(name)?;
        let bad = |reason| VolumeError::ExportPath {
            path: path.to_owned(),
            reason,
        };
        if !path.is_absolute() {
            return Err(bad("give an absolute path"));
        }
        let (Some(parent), Some(file_name)) = (path.parent(), path.file_name()) else {
            return Err(bad("the path names no file"));
        };
        // A suffix guard: the server writes where a client says, so a
        // stray or fuzzed path must not name an arbitrary file.
        if path.extension().is_none_or(|e| e != "qcow2") {
            return Err(bad("the file name must end in .qcow2"));
        }
        if !parent.is_dir() {
            return Err(bad("its directory does not exist"));
        }
        if fs::symlink_metadata(path).is_ok() {
            return Err(VolumeError::ExportExists {
                path: path.to_owned(),
            });
        }
        let io_err = |source| VolumeError::Export {
            name: name.to_owned(),
            path: path.to_owned(),
            source,
        };
        // Open every file under the read lock; the descriptors keep the
        // data even if a snapshot is deleted meanwhile.
        let (files, snap_names) = {
            let index = self.read();
            if !index.volumes.contains(name) {
                return Err(VolumeError::VolumeNotFound(name.into()));
            }
            let mut snaps = index.snapshots_of(name);
            snaps.sort_by(|a, b| (a.1.order, &a.0).cmp(&(b.1.order, &b.0)));
            let mut files = Vec::new();
            for (s, _) in &snaps {
                files.push(File::open(self.file_path(name, s)).map_err(io_err)?);
            }
            files.push(File::open(self.volume_path(name)).map_err(io_err)?);
            (files, snaps.into_iter().map(|(s, _)| s).collect::<Vec<_>>())
        };
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(file_name);
        tmp_name.push(".pagefork-export");
        let tmp: PathBuf = parent.join(tmp_name);
        let _ = fs::remove_file(&tmp);
        let out = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(io_err)?;
        let result = write_export(&out, &files, &snap_names);
        let done = result.and_then(|()| {
            fs::rename(&tmp, path).map_err(ExportError::Io)?;
            sync_dir(parent).map_err(ExportError::Io)
        });
        if done.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        done.map_err(|e| match e {
            ExportError::Io(source) => io_err(source),
            ExportError::Format(source) => VolumeError::ExportFormat {
                name: name.to_owned(),
                path: path.to_owned(),
                source,
            },
        })?;
        let size_bytes = fs::metadata(path).map_err(io_err)?.len();
        Ok(ExportedVolume {
            volume: name.to_owned(),
            path: path.display().to_string(),
            snapshots: snap_names,
            size_bytes,
        })
    }
}

enum ExportError {
    Io(io::Error),
    Format(qcow2::Error),
}

fn write_export(
    out: &File,
    files: &[File],
    snap_names: &[String],
) -> std::result::Result<(), ExportError> {
    let mut ids: HashMap<Key, u32> = HashMap::new();
    // Where each data id's bytes are: (file, offset, length).
    let mut sources: Vec<(usize, u64, u64)> = Vec::new();
    let mut states = Vec::new();
    for (k, f) in files.iter().enumerate() {
        let meta = f.metadata().map_err(ExportError::Io)?;
        let size = meta.len();
        let extents = reflink::fiemap(f).map_err(ExportError::Io)?;
        let mut clusters = Vec::new();
        for c in 0..size.div_ceil(CS) {
            let at = c * CS;
            let len = CS.min(size - at);
            let id = match cluster_key(&extents, at, len) {
                None => None,
                Some(key) => {
                    let next = u32::try_from(sources.len())
                        .map_err(|_| ExportError::Io(io::Error::other("too many clusters")))?;
                    let id = match key {
                        Some(key) => *ids.entry(key).or_insert(next),
                        None => next,
                    };
                    if id == next {
                        sources.push((k, at, len));
                    }
                    Some(id)
                }
            };
            clusters.push(id);
        }
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .unwrap_or_default();
        states.push(State {
            name: snap_names.get(k).cloned(),
            size,
            date: SnapshotTime {
                sec: u32::try_from(mtime.as_secs()).unwrap_or(u32::MAX),
                nsec: mtime.subsec_nanos(),
            },
            clusters,
        });
    }
    let n = u32::try_from(sources.len())
        .map_err(|_| ExportError::Io(io::Error::other("too many clusters")))?;
    let mut buf = vec![0u8; usize::try_from(CS).unwrap_or(0)];
    let mut copy = |d: u32, host: u64| -> io::Result<()> {
        let (k, at, len) = sources[d as usize];
        let src = &files[k];
        if len.is_multiple_of(4096) && reflink::ficlonerange(out, host, src, at, len).is_ok() {
            return Ok(());
        }
        #[allow(clippy::cast_possible_truncation)] // len <= CS
        let b = &mut buf[..len as usize];
        src.read_exact_at(b, at)?;
        out.write_all_at(b, host)
    };
    writer::write(out, CLUSTER_BITS, &states, n, &mut copy).map_err(ExportError::Format)?;
    Ok(())
}
