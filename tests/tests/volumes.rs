//! Volume engine on a real loop-mounted XFS with reflink=1.
//!
//! `PAGEFORK_XFS_DIR` names the mount (`scripts/xfs-loop.sh up DIR`); each
//! test works in its own subdirectory. Without it the tests skip with a
//! reason, except under `CI=true`, where they fail. The refusal test uses
//! `PAGEFORK_NOREFLINK_DIR` or `/dev/shm` (tmpfs).

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};

use volume::{Reflink, Repair, VolumeEngine, VolumeError};

const MIB: u64 = 1 << 20;

/// A fresh directory for `test` on the XFS mount, or `None` (skip).
fn xfs_root(test: &str) -> Option<PathBuf> {
    let Some(base) = std::env::var_os("PAGEFORK_XFS_DIR") else {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("PAGEFORK_XFS_DIR is unset under CI=true: run `scripts/xfs-loop.sh up DIR` and export it");
        }
        eprintln!("skipping {test}: PAGEFORK_XFS_DIR is unset (scripts/xfs-loop.sh up DIR sets up an XFS)");
        return None;
    };
    let dir = Path::new(&base).join(test);
    match fs::remove_dir_all(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("cannot clear {}: {e}", dir.display()),
    }
    fs::create_dir_all(&dir).unwrap();
    Some(dir)
}

/// Open the engine on `root`, which must be able to reflink.
fn engine(root: &Path) -> VolumeEngine {
    let e = VolumeEngine::open(root).unwrap();
    assert_eq!(
        e.reflink(),
        &Reflink::Supported,
        "PAGEFORK_XFS_DIR must be XFS with reflink=1"
    );
    e
}

/// Deterministic bytes, different for each seed.
fn pattern(len: u64, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

fn write_at(path: &Path, offset: u64, bytes: &[u8]) {
    let f = OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, offset).unwrap();
    f.sync_all().unwrap();
}

/// A volume `name` of `size` bytes filled with `pattern(size, seed)`.
fn filled_volume(e: &VolumeEngine, name: &str, size: u64, seed: u64) -> Vec<u8> {
    e.create(name, size).unwrap();
    let data = pattern(size, seed);
    let (f, len) = e.open_for_vm(name).unwrap();
    assert_eq!(len, size);
    f.write_all_at(&data, 0).unwrap();
    f.sync_all().unwrap();
    data
}

fn snapshot_path(root: &Path, volume: &str, snap: &str) -> PathBuf {
    root.join("volumes").join(volume).join(snap)
}

#[test]
fn create_makes_a_sparse_file_of_the_requested_size() {
    let Some(root) = xfs_root("create_sparse") else {
        return;
    };
    let e = engine(&root);
    let info = e.create("v", 64 * MIB).unwrap();
    let path = root.join("volumes/v/v");
    assert_eq!(fs::metadata(&path).unwrap().len(), 64 * MIB);
    assert_eq!(info.size_bytes, 64 * MIB);
    assert_eq!(
        info.usage.allocated_bytes, 0,
        "a new volume allocates nothing"
    );
    assert!(fs::read(&path).unwrap().iter().all(|&b| b == 0));
    let listed = e.list().unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].name, "v");
}

#[test]
fn snapshot_shares_every_extent_and_a_write_makes_the_written_range_exclusive() {
    let Some(root) = xfs_root("snapshot_fiemap") else {
        return;
    };
    let e = engine(&root);
    let data = filled_volume(&e, "v", 8 * MIB, 1);

    let snap = e.snapshot("v", "s1").unwrap();
    assert_eq!(fs::read(snapshot_path(&root, "v", "s1")).unwrap(), data);
    assert_eq!(snap.usage.allocated_bytes, 8 * MIB);
    assert_eq!(snap.usage.shared_bytes, 8 * MIB, "{snap:?}");
    let vol = e.show("v").unwrap();
    assert_eq!(vol.usage.shared_bytes, 8 * MIB, "{vol:?}");
    assert_eq!(vol.usage.exclusive_bytes, 0);
    assert_eq!(vol.snapshots, 1);

    let new = pattern(2 * MIB, 2);
    write_at(&e.volume_path("v"), 0, &new);
    let vol = e.show("v").unwrap();
    assert_eq!(vol.usage.exclusive_bytes, 2 * MIB, "{vol:?}");
    assert_eq!(vol.usage.shared_bytes, 6 * MIB, "{vol:?}");
    let snap = e.snapshot_info("s1").unwrap();
    assert_eq!(snap.usage.shared_bytes, 6 * MIB, "{snap:?}");
    assert_eq!(snap.usage.exclusive_bytes, 2 * MIB, "{snap:?}");
    assert_eq!(
        fs::read(snapshot_path(&root, "v", "s1")).unwrap(),
        data,
        "snapshot must not change"
    );
    let mut expect = data.clone();
    expect[..new.len()].copy_from_slice(&new);
    assert_eq!(fs::read(e.volume_path("v")).unwrap(), expect);
}

#[test]
fn snapshot_of_a_snapshot_is_recorded_against_the_volume() {
    let Some(root) = xfs_root("snapshot_flat") else {
        return;
    };
    let e = engine(&root);
    let data = filled_volume(&e, "base", 4 * MIB, 3);
    e.snapshot("base", "s1").unwrap();
    write_at(&e.volume_path("base"), 0, &pattern(MIB, 4));
    let s2 = e.snapshot("s1", "s2").unwrap();
    assert_eq!(s2.volume, "base");
    assert_eq!(fs::read(snapshot_path(&root, "base", "s2")).unwrap(), data);
    let names: Vec<_> = e
        .list_snapshots("base")
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["s1", "s2"]);
    // Flat: deleting the middle one is one unlink and leaves s2 intact.
    e.delete_snapshot("s1").unwrap();
    assert!(!snapshot_path(&root, "base", "s1").exists());
    assert_eq!(fs::read(snapshot_path(&root, "base", "s2")).unwrap(), data);
}

#[test]
fn clone_of_a_snapshot_is_an_independent_volume() {
    let Some(root) = xfs_root("clone") else {
        return;
    };
    let e = engine(&root);
    let data = filled_volume(&e, "v", 4 * MIB, 5);
    e.snapshot("v", "s").unwrap();
    let c = e.clone_snapshot("s", "c").unwrap();
    assert_eq!(c.size_bytes, 4 * MIB);
    assert_eq!(c.usage.shared_bytes, 4 * MIB);
    assert_eq!(fs::read(e.volume_path("c")).unwrap(), data);

    write_at(&e.volume_path("c"), MIB, &pattern(MIB, 6));
    assert_eq!(
        fs::read(e.volume_path("v")).unwrap(),
        data,
        "origin unchanged"
    );
    assert_eq!(
        fs::read(snapshot_path(&root, "v", "s")).unwrap(),
        data,
        "snapshot unchanged"
    );
    assert_ne!(fs::read(e.volume_path("c")).unwrap(), data);
}

#[test]
fn reflink_volume_copies_a_live_volume_without_a_snapshot() {
    let Some(root) = xfs_root("reflink_volume") else {
        return;
    };
    let e = engine(&root);
    let data = filled_volume(&e, "parent", 4 * MIB, 7);
    let child = e.reflink_volume("parent", "child").unwrap();
    assert_eq!(child.snapshots, 0);
    assert_eq!(child.usage.shared_bytes, 4 * MIB);
    assert_eq!(fs::read(e.volume_path("child")).unwrap(), data);
    write_at(&e.volume_path("child"), 0, &pattern(MIB, 8));
    assert_eq!(fs::read(e.volume_path("parent")).unwrap(), data);
    assert!(e.list_snapshots("parent").unwrap().is_empty());
}

#[test]
fn grow_extends_the_volume_keeps_its_data_and_refuses_to_shrink() {
    let Some(root) = xfs_root("grow") else { return };
    let e = engine(&root);
    let data = filled_volume(&e, "v", 2 * MIB, 9);
    let info = e.grow("v", 6 * MIB).unwrap();
    assert_eq!(info.size_bytes, 6 * MIB);
    let bytes = fs::read(e.volume_path("v")).unwrap();
    assert_eq!(&bytes[..data.len()], &data[..]);
    assert!(bytes[data.len()..].iter().all(|&b| b == 0));
    assert!(matches!(e.grow("v", MIB), Err(VolumeError::Shrink { .. })));
    assert_eq!(fs::metadata(e.volume_path("v")).unwrap().len(), 6 * MIB);
}

#[test]
fn deleting_a_volume_keeps_its_snapshots_which_hold_the_name_until_deleted() {
    let Some(root) = xfs_root("delete") else {
        return;
    };
    let e = engine(&root);
    let data = filled_volume(&e, "v", 2 * MIB, 10);
    e.snapshot("v", "s").unwrap();
    e.delete("v").unwrap();
    assert!(!e.volume_path("v").exists());
    assert_eq!(fs::read(snapshot_path(&root, "v", "s")).unwrap(), data);
    assert!(matches!(e.show("v"), Err(VolumeError::VolumeNotFound(_))));
    let snaps = e.list_snapshots("v").unwrap();
    assert_eq!(snaps.len(), 1);
    assert!(!snaps[0].volume_exists);
    assert!(matches!(
        e.create("v", MIB),
        Err(VolumeError::NameTaken { .. })
    ));
    // The snapshot can still be cloned back into a volume.
    e.clone_snapshot("s", "restored").unwrap();
    assert_eq!(fs::read(e.volume_path("restored")).unwrap(), data);

    e.delete_snapshot("s").unwrap();
    assert!(
        !root.join("volumes/v").exists(),
        "the last snapshot takes the directory"
    );
    e.create("v", MIB).unwrap();
    // A volume without snapshots takes its directory with it.
    e.delete("restored").unwrap();
    assert!(!root.join("volumes/restored").exists());
}

#[test]
fn rollback_restores_the_snapshot_and_keeps_newer_snapshots_by_default() {
    let Some(root) = xfs_root("rollback_keep") else {
        return;
    };
    let e = engine(&root);
    let d1 = filled_volume(&e, "v", 4 * MIB, 11);
    e.snapshot("v", "s1").unwrap();
    let d2 = pattern(4 * MIB, 12);
    write_at(&e.volume_path("v"), 0, &d2);
    e.snapshot("v", "s2").unwrap();
    e.grow("v", 8 * MIB).unwrap();
    write_at(&e.volume_path("v"), 0, &pattern(MIB, 13));

    let r = e.rollback("v", "s1", false).unwrap();
    assert!(r.deleted_snapshots.is_empty());
    assert_eq!(
        fs::read(e.volume_path("v")).unwrap(),
        d1,
        "content and size of s1"
    );
    assert_eq!(fs::read(snapshot_path(&root, "v", "s2")).unwrap(), d2);
    // And forward again to the kept newer snapshot.
    e.rollback("v", "s2", false).unwrap();
    assert_eq!(fs::read(e.volume_path("v")).unwrap(), d2);
    assert!(!root.join("volumes/v").read_dir().unwrap().any(|d| d
        .unwrap()
        .file_name()
        .to_string_lossy()
        .starts_with('.')));
}

#[test]
fn rollback_with_delete_newer_removes_only_later_snapshots_even_after_restart() {
    let Some(root) = xfs_root("rollback_delete") else {
        return;
    };
    let e = engine(&root);
    // Names sort against creation order, so order must come from the
    // recorded sequence, not from names.
    let d = filled_volume(&e, "v", 2 * MIB, 14);
    e.snapshot("v", "zz-first").unwrap();
    write_at(&e.volume_path("v"), 0, &pattern(MIB, 15));
    e.snapshot("v", "mm-second").unwrap();
    e.snapshot("v", "aa-third").unwrap();
    e.snapshot("mm-second", "bb-fourth").unwrap();
    drop(e);

    let e = engine(&root);
    let order: Vec<_> = e
        .list_snapshots("v")
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(order, ["zz-first", "mm-second", "aa-third", "bb-fourth"]);
    let r = e.rollback("v", "mm-second", true).unwrap();
    assert_eq!(r.deleted_snapshots, ["aa-third", "bb-fourth"]);
    assert!(!snapshot_path(&root, "v", "aa-third").exists());
    assert!(!snapshot_path(&root, "v", "bb-fourth").exists());
    assert!(snapshot_path(&root, "v", "zz-first").exists());
    let r = e.rollback("v", "zz-first", true).unwrap();
    assert_eq!(r.deleted_snapshots, ["mm-second"]);
    assert_eq!(fs::read(e.volume_path("v")).unwrap(), d);
}

#[test]
fn rollback_to_another_volumes_snapshot_is_refused() {
    let Some(root) = xfs_root("rollback_foreign") else {
        return;
    };
    let e = engine(&root);
    let a = filled_volume(&e, "a", MIB, 16);
    filled_volume(&e, "b", MIB, 17);
    e.snapshot("b", "sb").unwrap();
    let err = e.rollback("a", "sb", false).unwrap_err();
    assert!(matches!(err, VolumeError::NotSnapshotOf { .. }), "{err}");
    assert_eq!(fs::read(e.volume_path("a")).unwrap(), a);
}

#[test]
fn index_is_rebuilt_from_the_filesystem_on_restart() {
    let Some(root) = xfs_root("restart") else {
        return;
    };
    let e = engine(&root);
    filled_volume(&e, "v", MIB, 18);
    e.snapshot("v", "s").unwrap();
    e.create("w", 2 * MIB).unwrap();
    let before = (e.list().unwrap(), e.list_all_snapshots().unwrap());
    drop(e);
    let e = engine(&root);
    assert!(e.repairs().is_empty(), "{:?}", e.repairs());
    assert_eq!((e.list().unwrap(), e.list_all_snapshots().unwrap()), before);
}

#[test]
fn crash_rule_zero_byte_snapshot_is_deleted() {
    let Some(root) = xfs_root("crash_zero_snapshot") else {
        return;
    };
    let e = engine(&root);
    filled_volume(&e, "v", MIB, 19);
    e.snapshot("v", "good").unwrap();
    drop(e);
    // Died between creating the snapshot file and its FICLONE.
    File::create(snapshot_path(&root, "v", "half")).unwrap();

    let e = engine(&root);
    assert!(!snapshot_path(&root, "v", "half").exists());
    assert!(e
        .repairs()
        .contains(&Repair::RemovedEmptySnapshot(snapshot_path(
            &root, "v", "half"
        ))));
    let names: Vec<_> = e
        .list_snapshots("v")
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["good"]);
    e.snapshot("v", "half").unwrap();
}

#[test]
fn crash_rule_interrupted_create_leaves_nothing() {
    let Some(root) = xfs_root("crash_create") else {
        return;
    };
    // Died after mkdir and writing the temporary file, before its rename.
    let dir = root.join("volumes/v");
    fs::create_dir_all(&dir).unwrap();
    fs::write(dir.join(".tmp-v"), b"partial").unwrap();

    let e = engine(&root);
    assert!(e
        .repairs()
        .contains(&Repair::RemovedTemp(dir.join(".tmp-v"))));
    assert!(e.repairs().contains(&Repair::RemovedEmptyDir(dir.clone())));
    assert!(!dir.exists());
    e.create("v", MIB).unwrap();
}

#[test]
fn crash_rule_empty_orphan_directory_is_deleted() {
    let Some(root) = xfs_root("crash_empty_dir") else {
        return;
    };
    fs::create_dir_all(root.join("volumes/orphan")).unwrap();
    let e = engine(&root);
    assert_eq!(
        e.repairs(),
        [Repair::RemovedEmptyDir(root.join("volumes/orphan"))]
    );
    assert!(!root.join("volumes/orphan").exists());
    e.create("orphan", MIB).unwrap();
}

#[test]
fn crash_rule_directory_without_its_volume_keeps_the_snapshots() {
    let Some(root) = xfs_root("crash_orphan_snapshots") else {
        return;
    };
    let e = engine(&root);
    let data = filled_volume(&e, "v", MIB, 20);
    e.snapshot("v", "s").unwrap();
    drop(e);
    fs::remove_file(root.join("volumes/v/v")).unwrap();

    let e = engine(&root);
    assert!(
        matches!(e.repairs(), [Repair::OrphanSnapshots { volume, snapshots }] if volume == "v" && snapshots == &["s"])
    );
    assert_eq!(fs::read(snapshot_path(&root, "v", "s")).unwrap(), data);
    assert!(e.list().unwrap().is_empty());
    e.clone_snapshot("s", "back").unwrap();
    assert_eq!(fs::read(e.volume_path("back")).unwrap(), data);
}

#[test]
fn crash_rule_name_collision_is_skipped_with_a_warning() {
    let Some(root) = xfs_root("crash_collision") else {
        return;
    };
    let e = engine(&root);
    filled_volume(&e, "a", MIB, 21);
    e.snapshot("a", "dup").unwrap();
    drop(e);
    // A volume directory whose name another snapshot already holds.
    let dup = root.join("volumes/dup");
    fs::create_dir_all(&dup).unwrap();
    fs::write(dup.join("dup"), pattern(4096, 22)).unwrap();

    let e = engine(&root);
    assert!(
        matches!(e.repairs(), [Repair::SkippedCollision { path, .. }] if *path == dup.join("dup"))
    );
    assert!(dup.join("dup").exists(), "skipped, not deleted");
    assert_eq!(e.snapshot_info("dup").unwrap().volume, "a");
    assert!(matches!(e.show("dup"), Err(VolumeError::VolumeNotFound(_))));
}

#[test]
fn sixteen_threads_racing_for_one_name_let_exactly_one_win() {
    let Some(root) = xfs_root("race") else { return };
    let e = Arc::new(engine(&root));
    e.create("src", MIB).unwrap();
    const THREADS: usize = 16;
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|i| {
            let (e, barrier) = (Arc::clone(&e), Arc::clone(&barrier));
            std::thread::spawn(move || {
                barrier.wait();
                // Half create a volume, half snapshot into the same name.
                if i % 2 == 0 {
                    e.create("contested", MIB).map(|_| ())
                } else {
                    e.snapshot("src", "contested").map(|_| ())
                }
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let winners = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(winners, 1, "{results:?}");
    for r in results.iter().filter_map(|r| r.as_ref().err()) {
        assert!(matches!(r, VolumeError::NameTaken { .. }), "{r}");
    }
    let on_disk = root.join("volumes/contested/contested").exists() as usize
        + root.join("volumes/src/contested").exists() as usize;
    assert_eq!(on_disk, 1);
}

#[test]
fn invalid_names_are_refused_with_the_reason() {
    let Some(root) = xfs_root("names") else {
        return;
    };
    let e = engine(&root);
    for bad in ["", "../etc", "a/b", ".hidden", "sp ace", &"x".repeat(65)] {
        let err = e.create(bad, MIB).unwrap_err();
        assert!(
            matches!(err, VolumeError::InvalidName { .. }),
            "{bad:?}: {err}"
        );
    }
    assert_eq!(fs::read_dir(root.join("volumes")).unwrap().count(), 0);
}

#[test]
fn filesystem_without_reflink_is_refused_naming_it_and_nothing_is_copied() {
    let base = std::env::var_os("PAGEFORK_NOREFLINK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/dev/shm".into());
    if !base.is_dir() {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("no tmpfs at {}: set PAGEFORK_NOREFLINK_DIR", base.display());
        }
        eprintln!(
            "skipping: {} does not exist; set PAGEFORK_NOREFLINK_DIR to a tmpfs",
            base.display()
        );
        return;
    }
    let root = base.join(format!("pagefork-noreflink-{}", std::process::id()));
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(&root).unwrap();
    let e = VolumeEngine::open(&root).unwrap();
    let result = e.create("v", MIB);
    let _cleanup = fs::remove_dir_all(&root);

    let Reflink::Unsupported { fs: fs_name, .. } = e.reflink() else {
        panic!("{} unexpectedly reflinks", base.display());
    };
    let err = result.unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, VolumeError::ReflinkUnsupported { .. }),
        "{msg}"
    );
    assert!(msg.contains(fs_name.as_str()), "{msg}");
    assert!(msg.contains("use XFS with reflink=1 or btrfs"), "{msg}");
    if base == Path::new("/dev/shm") {
        assert!(msg.contains("tmpfs"), "{msg}");
    }
    assert!(matches!(
        e.list(),
        Err(VolumeError::ReflinkUnsupported { .. })
    ));
}
