//! The in-memory index of volumes and snapshots, and its rebuild from the
//! filesystem at start-up.
//!
//! The filesystem is the only source of truth; the index is a cache of
//! `readdir`/`stat` of `ROOT/volumes/`:
//!
//! ```text
//! ROOT/volumes/<vol>/<vol>     the volume
//! ROOT/volumes/<vol>/<snap>    a snapshot of <vol> (or of another snapshot
//!                              of <vol>: flat, never chained)
//! ROOT/volumes/<vol>/.<tmp>    a temporary file of an unfinished operation
//! ```
//!
//! A snapshot's place in its volume's history is the `user.pagefork.seq`
//! extended attribute, written before its data is cloned in; snapshots
//! without it (made by hand) sort by mtime before numbered ones.
//!
//! Crash rules applied by [`scan`], each reported as a [`Repair`]:
//! - temporary file (leading `.`) → delete (an operation died before its
//!   rename; the target was never visible);
//! - zero-byte snapshot → delete (died between create and FICLONE);
//! - empty orphan directory → delete;
//! - directory without its volume but with snapshots → keep the snapshots,
//!   warn (also the normal state after deleting a volume that has snapshots);
//! - name collision in the global namespace → warn and skip the later file
//!   (directories in byte order, a volume before its snapshots).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CStr;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::{name, xattr};

/// The extended attribute holding a snapshot's creation sequence number.
pub const SEQ_XATTR: &CStr = c"user.pagefork.seq";

/// Where a snapshot sits in its volume's history: ordered by sequence number,
/// then mtime (for snapshots without a sequence number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Order {
    pub seq: u64,
    pub mtime_ns: i128,
}

/// One snapshot in the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snap {
    /// The volume (directory) the snapshot belongs to.
    pub volume: String,
    pub order: Order,
}

/// The index: every name of the global namespace.
#[derive(Debug, Default)]
pub struct Index {
    pub volumes: BTreeSet<String>,
    pub snapshots: BTreeMap<String, Snap>,
    /// The sequence number of the next snapshot.
    pub next_seq: u64,
}

impl Index {
    /// What holds `name`, if anything: a volume, a snapshot, or the
    /// directory of a deleted volume whose snapshots remain.
    pub fn holder(&self, name: &str) -> Option<String> {
        if self.volumes.contains(name) {
            return Some(format!("volume {name:?}"));
        }
        if let Some(s) = self.snapshots.get(name) {
            return Some(format!("a snapshot of volume {:?}", s.volume));
        }
        if self.has_snapshots(name) {
            return Some(format!(
                "the snapshots of deleted volume {name:?} (delete them to free the name)"
            ));
        }
        None
    }

    /// Whether directory `volume` holds any indexed snapshot.
    pub fn has_snapshots(&self, volume: &str) -> bool {
        self.snapshots.values().any(|s| s.volume == volume)
    }

    /// The snapshots of `volume`, oldest first.
    pub fn snapshots_of(&self, volume: &str) -> Vec<(String, Snap)> {
        let mut v: Vec<_> = self
            .snapshots
            .iter()
            .filter(|(_, s)| s.volume == volume)
            .map(|(n, s)| (n.clone(), s.clone()))
            .collect();
        v.sort_by(|a, b| (a.1.order, &a.0).cmp(&(b.1.order, &b.0)));
        v
    }

    fn insert_snapshot(&mut self, name: String, snap: Snap) {
        self.next_seq = self.next_seq.max(snap.order.seq.saturating_add(1));
        self.snapshots.insert(name, snap);
    }
}

/// What the start-up scan repaired or skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repair {
    /// A temporary file of an unfinished operation was deleted.
    RemovedTemp(PathBuf),
    /// A zero-byte snapshot (died before its FICLONE) was deleted.
    RemovedEmptySnapshot(PathBuf),
    /// An empty directory without volume or snapshots was deleted.
    RemovedEmptyDir(PathBuf),
    /// A directory has snapshots but no volume; the snapshots are kept.
    OrphanSnapshots {
        volume: String,
        snapshots: Vec<String>,
    },
    /// A file's name is already taken; the file is left alone, unindexed.
    SkippedCollision { path: PathBuf, holder: String },
    /// An entry that is not a valid volume or snapshot; left alone.
    SkippedInvalid { path: PathBuf, reason: String },
}

impl std::fmt::Display for Repair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Repair::RemovedTemp(p) => write!(f, "deleted temporary file {}", p.display()),
            Repair::RemovedEmptySnapshot(p) => {
                write!(f, "deleted zero-byte snapshot {} (its creation did not finish)", p.display())
            }
            Repair::RemovedEmptyDir(p) => write!(f, "deleted empty volume directory {}", p.display()),
            Repair::OrphanSnapshots { volume, snapshots } => write!(
                f,
                "volume {volume:?} is gone but its snapshots {snapshots:?} remain; clone one to get a volume back"
            ),
            Repair::SkippedCollision { path, holder } => {
                write!(f, "skipped {}: its name is already used by {holder}", path.display())
            }
            Repair::SkippedInvalid { path, reason } => write!(f, "skipped {}: {reason}", path.display()),
        }
    }
}

/// Rebuild the index from `volumes_dir`, applying the crash rules.
pub fn scan(volumes_dir: &Path) -> io::Result<(Index, Vec<Repair>)> {
    let mut index = Index::default();
    let mut repairs = Vec::new();
    for dname in sorted_names(volumes_dir)? {
        let dir = volumes_dir.join(&dname);
        let meta = fs::symlink_metadata(&dir)?;
        if !meta.is_dir() {
            repairs.push(Repair::SkippedInvalid {
                path: dir,
                reason: "not a directory".into(),
            });
            continue;
        }
        if let Err(e) = name::validate(&dname) {
            repairs.push(Repair::SkippedInvalid {
                path: dir,
                reason: e.to_string(),
            });
            continue;
        }
        scan_dir(&mut index, &mut repairs, &dir, &dname)?;
    }
    Ok((index, repairs))
}

fn scan_dir(
    index: &mut Index,
    repairs: &mut Vec<Repair>,
    dir: &Path,
    dname: &str,
) -> io::Result<()> {
    let mut has_volume = false;
    let mut kept_other = false;
    let mut snaps = Vec::new();
    for ename in sorted_names(dir)? {
        let path = dir.join(&ename);
        let meta = fs::symlink_metadata(&path)?;
        if ename.starts_with('.') && meta.is_file() {
            fs::remove_file(&path)?;
            repairs.push(Repair::RemovedTemp(path));
        } else if !meta.is_file() {
            kept_other = true;
            repairs.push(Repair::SkippedInvalid {
                path,
                reason: "not a regular file".into(),
            });
        } else if let Err(e) = name::validate(&ename) {
            kept_other = true;
            repairs.push(Repair::SkippedInvalid {
                path,
                reason: e.to_string(),
            });
        } else if ename == dname {
            has_volume = true;
        } else if meta.len() == 0 {
            fs::remove_file(&path)?;
            repairs.push(Repair::RemovedEmptySnapshot(path));
        } else {
            let order = read_order(&path, &meta)?;
            snaps.push((ename, order));
        }
    }
    if !has_volume && snaps.is_empty() {
        if !kept_other {
            fs::remove_dir(dir)?;
            repairs.push(Repair::RemovedEmptyDir(dir.to_owned()));
        }
        return Ok(());
    }
    if has_volume {
        match index.holder(dname) {
            Some(holder) => {
                repairs.push(Repair::SkippedCollision {
                    path: dir.join(dname),
                    holder,
                });
            }
            None => {
                index.volumes.insert(dname.to_owned());
            }
        }
    } else {
        let snapshots = snaps.iter().map(|(n, _)| n.clone()).collect();
        repairs.push(Repair::OrphanSnapshots {
            volume: dname.to_owned(),
            snapshots,
        });
    }
    for (sname, order) in snaps {
        match index.holder(&sname) {
            Some(holder) => repairs.push(Repair::SkippedCollision {
                path: dir.join(&sname),
                holder,
            }),
            None => index.insert_snapshot(
                sname,
                Snap {
                    volume: dname.to_owned(),
                    order,
                },
            ),
        }
    }
    Ok(())
}

/// A snapshot's order from its `user.pagefork.seq` xattr and mtime.
fn read_order(path: &Path, meta: &fs::Metadata) -> io::Result<Order> {
    let file = File::open(path)?;
    let seq = xattr::fgetxattr(&file, SEQ_XATTR)?
        .and_then(|v| {
            std::str::from_utf8(&v)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    Ok(Order {
        seq,
        mtime_ns: mtime_ns(meta),
    })
}

/// The entry names of `dir` in byte order; names that are not UTF-8 are
/// returned lossily (they fail validation and are skipped).
fn sorted_names(dir: &Path) -> io::Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir)? {
        names.push(entry?.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(names)
}

/// A file's modification time in nanoseconds since the epoch.
pub(super) fn mtime_ns(meta: &std::fs::Metadata) -> i128 {
    i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn write(path: &Path, bytes: &[u8]) {
        fs::File::create(path).unwrap().write_all(bytes).unwrap();
    }

    fn tree() -> (tempfile::TempDir, PathBuf) {
        let root = tempfile::tempdir().unwrap();
        let vols = root.path().join("volumes");
        fs::create_dir(&vols).unwrap();
        (root, vols)
    }

    #[test]
    fn indexes_volumes_and_their_snapshots() {
        let (_root, vols) = tree();
        fs::create_dir(vols.join("a")).unwrap();
        write(&vols.join("a/a"), b"vol");
        write(&vols.join("a/s1"), b"snap");
        let (index, repairs) = scan(&vols).unwrap();
        assert!(repairs.is_empty(), "{repairs:?}");
        assert!(index.volumes.contains("a"));
        assert_eq!(index.snapshots["s1"].volume, "a");
    }

    #[test]
    fn zero_byte_snapshot_and_temp_files_are_deleted() {
        let (_root, vols) = tree();
        fs::create_dir(vols.join("a")).unwrap();
        write(&vols.join("a/a"), b"vol");
        write(&vols.join("a/s0"), b"");
        write(&vols.join("a/.tmp-x"), b"partial");
        let (index, repairs) = scan(&vols).unwrap();
        assert!(!vols.join("a/s0").exists());
        assert!(!vols.join("a/.tmp-x").exists());
        assert!(index.snapshots.is_empty());
        assert_eq!(repairs.len(), 2, "{repairs:?}");
    }

    #[test]
    fn empty_orphan_directory_is_deleted() {
        let (_root, vols) = tree();
        fs::create_dir(vols.join("gone")).unwrap();
        let (index, repairs) = scan(&vols).unwrap();
        assert!(!vols.join("gone").exists());
        assert_eq!(repairs, vec![Repair::RemovedEmptyDir(vols.join("gone"))]);
        assert!(index.holder("gone").is_none());
    }

    #[test]
    fn snapshots_without_their_volume_are_kept_and_hold_the_name() {
        let (_root, vols) = tree();
        fs::create_dir(vols.join("gone")).unwrap();
        write(&vols.join("gone/s1"), b"data");
        let (index, repairs) = scan(&vols).unwrap();
        assert!(vols.join("gone/s1").exists());
        assert_eq!(index.snapshots["s1"].volume, "gone");
        assert!(
            matches!(&repairs[..], [Repair::OrphanSnapshots { volume, .. }] if volume == "gone")
        );
        assert!(index.holder("gone").is_some());
    }

    #[test]
    fn colliding_names_are_skipped_and_left_on_disk() {
        let (_root, vols) = tree();
        fs::create_dir(vols.join("a")).unwrap();
        write(&vols.join("a/a"), b"vol");
        write(&vols.join("a/b"), b"snap named b");
        fs::create_dir(vols.join("b")).unwrap();
        write(&vols.join("b/b"), b"volume named b");
        let (index, repairs) = scan(&vols).unwrap();
        assert!(!index.volumes.contains("b"));
        assert_eq!(index.snapshots["b"].volume, "a");
        assert!(vols.join("b/b").exists());
        assert!(
            matches!(&repairs[..], [Repair::SkippedCollision { path, .. }] if *path == vols.join("b/b"))
        );
    }

    #[test]
    fn next_sequence_follows_the_highest_recorded() {
        let (_root, vols) = tree();
        fs::create_dir(vols.join("a")).unwrap();
        write(&vols.join("a/a"), b"vol");
        write(&vols.join("a/s1"), b"snap");
        let f = File::open(vols.join("a/s1")).unwrap();
        if xattr::fsetxattr(&f, SEQ_XATTR, b"41").is_err() {
            eprintln!("skipping: no user xattrs on this filesystem");
            return;
        }
        let (index, _) = scan(&vols).unwrap();
        assert_eq!(index.snapshots["s1"].order.seq, 41);
        assert_eq!(index.next_seq, 42);
    }
}
