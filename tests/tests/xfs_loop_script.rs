//! `scripts/xfs-loop.sh`, which sets up and tears down the loop-mounted XFS
//! the volume tests use (issue 18, item 7). Each test makes its own small
//! XFS (its own image and mount point under /var/tmp); the shared
//! `PAGEFORK_XFS_DIR` is never touched. Needs root.

use std::process::Command;

use pagefork_tests::{require_root, ScratchXfs};

/// Loop devices bound to any image in `dir`.
fn loop_devices_of_images_in(dir: &std::path::Path) -> String {
    let out = Command::new("losetup")
        .arg("-a")
        .output()
        .expect("cannot run losetup -a");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains(&*dir.to_string_lossy()))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn down_unmounts_and_detaches_a_shut_down_xfs_and_says_so() {
    if !require_root("mounting a loop XFS") {
        return;
    }
    let xfs = ScratchXfs::new();
    std::fs::write(xfs.path().join("f"), b"data").expect("cannot write to the scratch XFS");
    assert!(
        !loop_devices_of_images_in(xfs.image_dir()).is_empty(),
        "no loop device after up"
    );
    xfs.shutdown();
    assert!(
        std::fs::metadata(xfs.path()).is_err(),
        "the shut-down XFS still answers stat: the test does not reproduce the EIO"
    );

    let out = xfs.down();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "down failed: {said}");
    assert!(
        !xfs.is_mounted(),
        "down returned {} but {} is still mounted: {said}",
        out.status,
        xfs.path().display()
    );
    let loops = loop_devices_of_images_in(xfs.image_dir());
    assert!(
        loops.is_empty(),
        "down left the loop device attached: {loops}; it said: {said}"
    );
    assert!(said.contains("unmounted"), "down did not say so: {said:?}");
    assert!(said.contains("detached"), "down did not say so: {said:?}");
}

#[test]
fn down_of_a_healthy_xfs_and_of_nothing_mounted_both_succeed() {
    if !require_root("mounting a loop XFS") {
        return;
    }
    let xfs = ScratchXfs::new();
    let out = xfs.down();
    assert!(
        out.status.success(),
        "down failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!xfs.is_mounted());
    assert!(loop_devices_of_images_in(xfs.image_dir()).is_empty());
    // Again, with nothing mounted: still success (idempotent).
    let out = xfs.down();
    assert!(
        out.status.success(),
        "a second down failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
