//! The volume engine: operations on volumes and snapshots.
//!
//! Every mutation runs under the index's write lock: checking and
//! reserving the name, the filesystem change (mkdir, FICLONE, rename,
//! unlink) and the index update form one critical section. They are
//! constant-time metadata operations (a reflink shares extents, it copies
//! no data), so serializing them costs little and rules out every
//! interleaving (a snapshot racing the deletion of its volume, two creators
//! of one name). Reads take the read lock only
//! to copy names, then stat and FIEMAP outside it.
//!
//! Each mutation is crash-safe with the rules of [`crate::index`]: new
//! volumes and rollbacks are written to a hidden temporary file and renamed
//! into place; a snapshot is created empty, tagged with its sequence number
//! and filled by one FICLONE, so a crash leaves at most a zero-byte file.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use proto::api::{VolumeInfo, VolumeRollback as Rollback, VolumeSnapshotInfo as SnapshotInfo};
use reflink::Reflink;

use crate::error::{Result, VolumeError};
use crate::index::{self, mtime_ns, Index, Order, Repair, Snap, SEQ_XATTR};
use crate::{name, xattr};

/// The staging directory for imports under `root` ([`crate::import`]),
/// emptied when the engine opens.
pub(crate) fn staging_dir(root: &Path) -> PathBuf {
    root.join("staging")
}

/// Sizes are multiples of this (one sector of the guest block device).
pub const SECTOR: u64 = 512;

/// The reflink volume engine over `ROOT/volumes/`. `Send + Sync`; share it
/// with an `Arc`.
#[derive(Debug)]
pub struct VolumeEngine {
    pub(super) root: PathBuf,
    pub(super) volumes_dir: PathBuf,
    pub(super) reflink: Reflink,
    pub(super) repairs: Vec<Repair>,
    pub(super) index: RwLock<Index>,
    /// Volumes attached to VMs: name → holder (e.g. `vm-3`).
    pub(super) attached: std::sync::Mutex<std::collections::HashMap<String, String>>,
}

impl VolumeEngine {
    /// Open the engine on `root`: create `root/volumes/` if needed, probe
    /// reflink support, and rebuild the index from the filesystem with the
    /// crash rules. Opening succeeds on a filesystem that cannot reflink;
    /// every operation then fails with [`VolumeError::ReflinkUnsupported`].
    pub fn open(root: &Path) -> Result<Self> {
        let volumes_dir = root.join("volumes");
        fs::create_dir_all(&volumes_dir).map_err(|source| VolumeError::OpenRoot {
            path: volumes_dir.clone(),
            source,
        })?;
        let reflink = reflink::probe(root).map_err(|source| VolumeError::Probe {
            path: root.to_owned(),
            source,
        })?;
        if let Reflink::Unsupported { fs, errno } = &reflink {
            tracing::warn!(
                root = %root.display(), fs, errno,
                "volumes disabled: the state directory cannot reflink; use XFS with reflink=1 or btrfs"
            );
        }
        // Imports that died before their rename leave only staging files.
        let _ = fs::remove_dir_all(staging_dir(root));
        let (index, repairs) = index::scan(&volumes_dir).map_err(|source| VolumeError::Scan {
            path: volumes_dir.clone(),
            source,
        })?;
        for r in &repairs {
            tracing::warn!("volume index: {r}");
        }
        Ok(VolumeEngine {
            root: root.to_owned(),
            volumes_dir,
            reflink,
            repairs,
            index: RwLock::new(index),
            attached: std::sync::Mutex::default(),
        })
    }

    /// The state directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Whether the filesystem can reflink (volumes are available).
    pub fn reflink(&self) -> &Reflink {
        &self.reflink
    }

    /// What the start-up scan repaired or skipped.
    pub fn repairs(&self) -> &[Repair] {
        &self.repairs
    }

    /// Create an empty sparse volume of `size` bytes.
    pub fn create(&self, name: &str, size: u64) -> Result<VolumeInfo> {
        self.available()?;
        validate(name)?;
        validate_size(size)?;
        let mut index = self.write();
        reserve(&index, name)?;
        let err = |source| VolumeError::Create {
            name: name.to_owned(),
            source,
        };
        self.materialize(name, |file| file.set_len(size))
            .map_err(err)?;
        index.volumes.insert(name.to_owned());
        drop(index);
        self.show(name)
    }

    /// Create volume `name` from snapshot `snapshot` (one FICLONE).
    pub fn clone_snapshot(&self, snapshot: &str, name: &str) -> Result<VolumeInfo> {
        self.available()?;
        validate(name)?;
        let mut index = self.write();
        reserve(&index, name)?;
        let snap = index
            .snapshots
            .get(snapshot)
            .ok_or_else(|| VolumeError::SnapshotNotFound(snapshot.into()))?;
        let src_path = self.file_path(&snap.volume, snapshot);
        self.clone_into_new(&mut index, &src_path, snapshot, name)?;
        drop(index);
        self.show(name)
    }

    /// Create volume `name` as a reflink of the live volume `src`, without
    /// a snapshot (for forks: pause the writer first so the copy is
    /// consistent).
    pub fn reflink_volume(&self, src: &str, name: &str) -> Result<VolumeInfo> {
        self.available()?;
        validate(name)?;
        let mut index = self.write();
        reserve(&index, name)?;
        if !index.volumes.contains(src) {
            return Err(VolumeError::VolumeNotFound(src.into()));
        }
        let src_path = self.volume_path(src);
        self.clone_into_new(&mut index, &src_path, src, name)?;
        drop(index);
        self.show(name)
    }

    /// Grow volume `name` to `size` bytes (equal size is a no-op).
    pub fn grow(&self, name: &str, size: u64) -> Result<VolumeInfo> {
        self.available()?;
        validate_size(size)?;
        let index = self.write();
        if !index.volumes.contains(name) {
            return Err(VolumeError::VolumeNotFound(name.into()));
        }
        let err = |source| VolumeError::Grow {
            name: name.to_owned(),
            source,
        };
        let file = OpenOptions::new()
            .write(true)
            .open(self.volume_path(name))
            .map_err(err)?;
        let current = file.metadata().map_err(err)?.len();
        if size < current {
            return Err(VolumeError::Shrink {
                name: name.into(),
                current,
                requested: size,
            });
        }
        file.set_len(size).map_err(err)?;
        file.sync_all().map_err(err)?;
        drop(index);
        self.show(name)
    }

    /// Delete volume `name`. Its snapshots stay (and keep the name reserved
    /// until the last one is deleted).
    pub fn delete(&self, name: &str) -> Result<()> {
        self.available()?;
        self.check_detached(name)?;
        let mut index = self.write();
        if !index.volumes.contains(name) {
            return Err(VolumeError::VolumeNotFound(name.into()));
        }
        let err = |source| VolumeError::Delete {
            name: name.to_owned(),
            source,
        };
        fs::remove_file(self.volume_path(name)).map_err(err)?;
        index.volumes.remove(name);
        if !index.has_snapshots(name) {
            self.remove_dir(name);
        }
        sync_dir(&self.volumes_dir).map_err(err)
    }

    /// Snapshot `from` (a volume, or a snapshot: then the new one is
    /// recorded against the same volume) as `name`, with one FICLONE.
    pub fn snapshot(&self, from: &str, name: &str) -> Result<SnapshotInfo> {
        self.available()?;
        validate(name)?;
        let mut index = self.write();
        reserve(&index, name)?;
        let volume = if index.volumes.contains(from) {
            from.to_owned()
        } else if let Some(s) = index.snapshots.get(from) {
            s.volume.clone()
        } else {
            return Err(VolumeError::SourceNotFound(from.into()));
        };
        let seq = index.next_seq.max(1);
        let src_path = self.file_path(&volume, from);
        let path = self.file_path(&volume, name);
        let err = |source| VolumeError::Snapshot {
            from: from.to_owned(),
            name: name.to_owned(),
            source,
        };
        let created = write_snapshot(&src_path, &path, seq);
        if created.is_err() {
            let _ = fs::remove_file(&path);
        }
        let mtime_ns = created.map_err(err)?;
        index.snapshots.insert(
            name.to_owned(),
            Snap {
                volume,
                order: Order { seq, mtime_ns },
            },
        );
        index.next_seq = seq + 1;
        drop(index);
        self.snapshot_info(name)
    }

    /// Delete snapshot `name`; the directory of a deleted volume goes with
    /// its last snapshot.
    pub fn delete_snapshot(&self, name: &str) -> Result<()> {
        self.available()?;
        let mut index = self.write();
        let volume = match index.snapshots.get(name) {
            Some(s) => s.volume.clone(),
            None => return Err(VolumeError::SnapshotNotFound(name.into())),
        };
        let err = |source| VolumeError::DeleteSnapshot {
            name: name.to_owned(),
            source,
        };
        fs::remove_file(self.file_path(&volume, name)).map_err(err)?;
        index.snapshots.remove(name);
        if !index.volumes.contains(&volume) && !index.has_snapshots(&volume) {
            self.remove_dir(&volume);
        }
        sync_dir(&self.volumes_dir.join(&volume))
            .or_else(ignore_not_found)
            .map_err(err)
    }

    /// Roll volume `name` back to its snapshot `snapshot`: the volume's
    /// content and size become the snapshot's. Snapshots taken after it are
    /// deleted if `delete_newer` (ZFS `rollback -r`), kept otherwise
    /// (qemu-img `snapshot -a`). The swap is a rename, so a VM holding the
    /// volume open keeps the old data: stop it first.
    pub fn rollback(&self, name: &str, snapshot: &str, delete_newer: bool) -> Result<Rollback> {
        self.available()?;
        self.check_detached(name)?;
        let mut index = self.write();
        if !index.volumes.contains(name) {
            return Err(VolumeError::VolumeNotFound(name.into()));
        }
        let target = index
            .snapshots
            .get(snapshot)
            .ok_or_else(|| VolumeError::SnapshotNotFound(snapshot.into()))?;
        if target.volume != name {
            return Err(VolumeError::NotSnapshotOf {
                snapshot: snapshot.into(),
                volume: name.into(),
                owner: target.volume.clone(),
            });
        }
        let target_order = target.order;
        let err = |source| VolumeError::Rollback {
            name: name.to_owned(),
            snapshot: snapshot.to_owned(),
            source,
        };
        let dir = self.volumes_dir.join(name);
        let tmp = dir.join(format!(".tmp-rollback-{name}"));
        let replaced = replace_with_clone(
            &self.file_path(name, snapshot),
            &tmp,
            &self.volume_path(name),
        );
        if replaced.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        replaced.map_err(err)?;
        let mut deleted_snapshots = Vec::new();
        if delete_newer {
            for (sname, snap) in index.snapshots_of(name) {
                if (snap.order, sname.as_str()) > (target_order, snapshot) {
                    let del = |source| VolumeError::DeleteSnapshot {
                        name: sname.clone(),
                        source,
                    };
                    fs::remove_file(self.file_path(name, &sname)).map_err(del)?;
                    index.snapshots.remove(&sname);
                    deleted_snapshots.push(sname);
                }
            }
            sync_dir(&dir).map_err(err)?;
        }
        Ok(Rollback {
            volume: name.into(),
            snapshot: snapshot.into(),
            deleted_snapshots,
        })
    }

    /// Make volume `name`'s content and size those of snapshot `snapshot`
    /// (any volume's) by FICLONE into the volume's own file: the inode
    /// stays, so a VMM holding the volume open sees the new content. For a
    /// VM rollback in place, with the VM's vCPUs paused.
    pub fn restore_in_place(&self, name: &str, snapshot: &str) -> Result<()> {
        self.available()?;
        let index = self.write();
        if !index.volumes.contains(name) {
            return Err(VolumeError::VolumeNotFound(name.into()));
        }
        let snap = index
            .snapshots
            .get(snapshot)
            .ok_or_else(|| VolumeError::SnapshotNotFound(snapshot.into()))?;
        let src_path = self.file_path(&snap.volume, snapshot);
        let err = |source| VolumeError::Rollback {
            name: name.to_owned(),
            snapshot: snapshot.to_owned(),
            source,
        };
        let src = File::open(&src_path).map_err(err)?;
        let len = src.metadata().map_err(err)?.len();
        let dst = OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.volume_path(name))
            .map_err(err)?;
        reflink::ficlone(&dst, &src)
            .and_then(|()| dst.set_len(len))
            .and_then(|()| dst.sync_all())
            .map_err(err)
    }

    /// The path of volume `name`'s file (whether or not it exists).
    pub fn volume_path(&self, name: &str) -> PathBuf {
        self.file_path(name, name)
    }

    pub(super) fn file_path(&self, volume: &str, file: &str) -> PathBuf {
        self.volumes_dir.join(volume).join(file)
    }

    /// Make volume `name` from a clone of `src_path`; `src` names the source
    /// in errors.
    fn clone_into_new(
        &self,
        index: &mut Index,
        src_path: &Path,
        src: &str,
        name: &str,
    ) -> Result<()> {
        let err = |source| VolumeError::Clone {
            from: src.to_owned(),
            name: name.to_owned(),
            source,
        };
        let src_file = File::open(src_path).map_err(err)?;
        self.materialize(name, |file| reflink::ficlone(file, &src_file))
            .map_err(err)?;
        index.volumes.insert(name.to_owned());
        Ok(())
    }

    /// Create `volumes/<name>/<name>`: mkdir, fill a hidden temporary file
    /// with `fill`, rename it into place. Undoes itself on failure.
    fn materialize(
        &self,
        name: &str,
        fill: impl FnOnce(&File) -> io::Result<()>,
    ) -> io::Result<()> {
        let dir = self.volumes_dir.join(name);
        fs::create_dir(&dir)?;
        let tmp = dir.join(format!(".tmp-{name}"));
        let result = (|| {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&tmp)?;
            fill(&file)?;
            file.sync_all()?;
            fs::rename(&tmp, dir.join(name))?;
            sync_dir(&dir)?;
            sync_dir(&self.volumes_dir)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
            let _ = fs::remove_file(dir.join(name));
            let _ = fs::remove_dir(&dir);
        }
        result
    }

    /// Remove the (now empty) directory of volume `name`; a failure leaves
    /// it for the next start-up scan.
    fn remove_dir(&self, name: &str) {
        if let Err(e) = fs::remove_dir(self.volumes_dir.join(name)) {
            tracing::warn!(volume = name, error = %e, "cannot remove the volume directory; the next start-up retries");
        }
    }

    pub(super) fn available(&self) -> Result<()> {
        match &self.reflink {
            Reflink::Supported => Ok(()),
            Reflink::Unsupported { fs, .. } => Err(VolumeError::ReflinkUnsupported {
                root: self.root.clone(),
                fs: fs.clone(),
            }),
        }
    }

    pub(super) fn read(&self) -> RwLockReadGuard<'_, Index> {
        // The index is updated only after its filesystem change succeeded,
        // so a panicking holder cannot leave it half-written.
        self.index.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn write(&self) -> RwLockWriteGuard<'_, Index> {
        self.index.write().unwrap_or_else(PoisonError::into_inner)
    }
}

pub(super) fn validate(name: &str) -> Result<()> {
    name::validate(name).map_err(|reason| VolumeError::InvalidName {
        name: name.into(),
        reason,
    })
}

pub(super) fn validate_size(size: u64) -> Result<()> {
    if size == 0 {
        return Err(VolumeError::InvalidSize {
            size,
            reason: "a volume needs at least one sector",
        });
    }
    if size & (SECTOR - 1) != 0 {
        return Err(VolumeError::InvalidSize {
            size,
            reason: "must be a multiple of 512",
        });
    }
    if i64::try_from(size).is_err() {
        return Err(VolumeError::InvalidSize {
            size,
            reason: "larger than the filesystem allows",
        });
    }
    Ok(())
}

pub(super) fn reserve(index: &Index, name: &str) -> Result<()> {
    match index.holder(name) {
        Some(holder) => Err(VolumeError::NameTaken {
            name: name.into(),
            holder,
        }),
        None => Ok(()),
    }
}

/// Create snapshot file `path` tagged with `seq` and clone `src_path` into
/// it; returns its mtime in nanoseconds.
fn write_snapshot(src_path: &Path, path: &Path, seq: u64) -> io::Result<i128> {
    let src = File::open(src_path)?;
    let dst = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)?;
    xattr::fsetxattr(&dst, SEQ_XATTR, seq.to_string().as_bytes())?;
    reflink::ficlone(&dst, &src)?;
    dst.sync_all()?;
    if let Some(dir) = path.parent() {
        sync_dir(dir)?;
    }
    let meta = dst.metadata()?;
    Ok(mtime_ns(&meta))
}

/// Atomically replace `target` with a clone of `src`, via `tmp`.
fn replace_with_clone(src: &Path, tmp: &Path, target: &Path) -> io::Result<()> {
    let src = File::open(src)?;
    let _ = fs::remove_file(tmp);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(tmp)?;
    reflink::ficlone(&file, &src)?;
    file.sync_all()?;
    fs::rename(tmp, target)?;
    match target.parent() {
        Some(dir) => sync_dir(dir),
        None => Ok(()),
    }
}

pub(super) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn ignore_not_found(e: io::Error) -> io::Result<()> {
    if e.kind() == io::ErrorKind::NotFound {
        Ok(())
    } else {
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_must_be_whole_sectors() {
        assert!(validate_size(0).is_err());
        assert!(validate_size(511).is_err());
        assert!(validate_size(u64::MAX - 511).is_err());
        assert!(validate_size(SECTOR).is_ok());
        assert!(validate_size(1 << 30).is_ok());
    }

    #[test]
    fn engine_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<VolumeEngine>();
    }

    /// /tmp may or may not reflink; whichever it is, the engine agrees with
    /// the probe and the refusal names the filesystem.
    #[test]
    fn operations_are_refused_with_the_filesystem_named_when_reflink_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let engine = VolumeEngine::open(dir.path()).unwrap();
        match engine.reflink() {
            Reflink::Supported => assert!(engine.create("v", 1 << 20).is_ok()),
            Reflink::Unsupported { fs, .. } => {
                let err = engine.create("v", 1 << 20).unwrap_err();
                let msg = err.to_string();
                assert!(matches!(err, VolumeError::ReflinkUnsupported { .. }));
                assert!(
                    msg.contains(fs.as_str()) && msg.contains("reflink=1"),
                    "{msg}"
                );
                assert!(!engine.volume_path("v").exists(), "nothing may be written");
            }
        }
    }

    #[test]
    fn invalid_names_are_refused_before_touching_the_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        let engine = VolumeEngine::open(dir.path()).unwrap();
        if engine.reflink() != &Reflink::Supported {
            return; // refused earlier, covered above
        }
        let err = engine.create("../x", 1 << 20).unwrap_err();
        assert!(matches!(err, VolumeError::InvalidName { .. }), "{err}");
    }
}
