//! Read-only operations of the volume engine: listings with space use,
//! and opening a volume for a VM.
//!
//! They copy names under the read lock and stat/FIEMAP outside it, so a
//! slow FIEMAP (it flushes dirty data) never blocks mutations; entries
//! deleted in between are skipped.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::Path;

use proto::api::{Usage, VolumeInfo, VolumeSnapshotInfo as SnapshotInfo};

use crate::engine::VolumeEngine;
use crate::error::{Result, VolumeError};
use crate::index::{mtime_ns, Snap};

impl VolumeEngine {
    /// All volumes, by name.
    pub fn list(&self) -> Result<Vec<VolumeInfo>> {
        self.available()?;
        let names: Vec<String> = self.read().volumes.iter().cloned().collect();
        let mut out = Vec::with_capacity(names.len());
        for n in names {
            match self.show(&n) {
                Ok(v) => out.push(v),
                // Deleted since the names were copied.
                Err(VolumeError::VolumeNotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// One volume.
    pub fn show(&self, name: &str) -> Result<VolumeInfo> {
        self.available()?;
        let snapshots = {
            let index = self.read();
            if !index.volumes.contains(name) {
                return Err(VolumeError::VolumeNotFound(name.into()));
            }
            index.snapshots_of(name).len()
        };
        let (size_bytes, usage, _) = match inspect(&self.volume_path(name)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(VolumeError::VolumeNotFound(name.into()))
            }
            r => r.map_err(|source| VolumeError::Inspect {
                name: name.into(),
                source,
            })?,
        };
        Ok(VolumeInfo {
            name: name.into(),
            size_bytes,
            usage,
            snapshots,
        })
    }

    /// The snapshots of `volume` (which may be deleted while its snapshots
    /// remain), oldest first.
    pub fn list_snapshots(&self, volume: &str) -> Result<Vec<SnapshotInfo>> {
        self.available()?;
        let snaps = {
            let index = self.read();
            let snaps = index.snapshots_of(volume);
            if snaps.is_empty() && !index.volumes.contains(volume) {
                return Err(VolumeError::VolumeNotFound(volume.into()));
            }
            snaps
        };
        self.snapshot_infos(snaps)
    }

    /// Every snapshot, grouped by volume, oldest first.
    pub fn list_all_snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        self.available()?;
        let snaps = {
            let index = self.read();
            let dirs: std::collections::BTreeSet<&String> =
                index.snapshots.values().map(|s| &s.volume).collect();
            dirs.into_iter()
                .flat_map(|d| index.snapshots_of(d))
                .collect()
        };
        self.snapshot_infos(snaps)
    }

    /// One snapshot.
    pub fn snapshot_info(&self, name: &str) -> Result<SnapshotInfo> {
        self.available()?;
        let snap = self.read().snapshots.get(name).cloned();
        let snap = snap.ok_or_else(|| VolumeError::SnapshotNotFound(name.into()))?;
        self.snapshot_infos(vec![(name.to_owned(), snap)])?
            .pop()
            .ok_or_else(|| VolumeError::SnapshotNotFound(name.into()))
    }

    /// Record that `holder` (a VM) uses volume `name`: until
    /// [`VolumeEngine::detach`], the volume cannot be deleted or rolled back.
    pub fn attach(&self, name: &str, holder: &str) {
        self.attached
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_owned(), holder.to_owned());
    }

    /// Forget that volume `name` is in use.
    pub fn detach(&self, name: &str) {
        self.attached
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
    }

    /// Refuse to change a volume a VM is using.
    pub(super) fn check_detached(&self, name: &str) -> Result<()> {
        match self
            .attached
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
        {
            Some(holder) => Err(VolumeError::InUse {
                name: name.to_owned(),
                holder: holder.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Open volume `name` read-write for a VM's block device; returns the
    /// file and its size.
    pub fn open_for_vm(&self, name: &str) -> Result<(File, u64)> {
        self.available()?;
        let index = self.read();
        if !index.volumes.contains(name) {
            return Err(VolumeError::VolumeNotFound(name.into()));
        }
        let err = |source| VolumeError::OpenForVm {
            name: name.to_owned(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.volume_path(name))
            .map_err(err)?;
        let size = file.metadata().map_err(err)?.len();
        Ok((file, size))
    }

    fn snapshot_infos(&self, snaps: Vec<(String, Snap)>) -> Result<Vec<SnapshotInfo>> {
        let mut out = Vec::with_capacity(snaps.len());
        for (name, snap) in snaps {
            let (size_bytes, usage, created_unix_ms) =
                match inspect(&self.file_path(&snap.volume, &name)) {
                    // Deleted since the names were copied.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    r => r.map_err(|source| VolumeError::Inspect {
                        name: name.clone(),
                        source,
                    })?,
                };
            let volume_exists = self.read().volumes.contains(&snap.volume);
            out.push(SnapshotInfo {
                name,
                volume: snap.volume,
                volume_exists,
                seq: snap.order.seq,
                created_unix_ms,
                size_bytes,
                usage,
            });
        }
        Ok(out)
    }
}

/// Size, usage and mtime (ms) of the file at `path`.
fn inspect(path: &Path) -> io::Result<(u64, Usage, i64)> {
    let file = File::open(path)?;
    let meta = file.metadata()?;
    let u = reflink::usage(&file)?;
    let usage = Usage {
        allocated_bytes: u.allocated_bytes,
        shared_bytes: u.shared_bytes,
        exclusive_bytes: u.exclusive_bytes,
    };
    let ms = i64::try_from(mtime_ns(&meta) / 1_000_000).unwrap_or(i64::MAX);
    Ok((meta.len(), usage, ms))
}
