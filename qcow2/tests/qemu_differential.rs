//! Differential tests against qemu-img 10: on images qemu makes (several
//! cluster sizes, refcount widths, extended L2 on and off, compressed
//! clusters, 0/1/20 snapshots, sparse and full), every create / apply /
//! delete leaves a file byte-identical to what `qemu-img snapshot` leaves
//! (the date is taken from qemu's run), `qemu-img check` finds no errors,
//! and `qemu-img snapshot -l` prints what our listing prints. Crash tests
//! stop each operation after each of its write groups and check that the
//! file is clean or only leaks, with the old or the new snapshot list.
//!
//! Needs qemu-img and qemu-io (Debian qemu-utils; scripts/setup.sh installs
//! them): skips with a reason without them, fails under CI=true.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::Command;

use qcow2::ops::{self, SnapshotTime};
use qcow2::{Error, Image, Stage};

fn have_qemu() -> bool {
    let ok = Command::new("qemu-img")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
        && Command::new("qemu-io")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
    if !ok {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("CI=true but qemu-img/qemu-io are missing: run scripts/setup.sh");
        }
        eprintln!("skipping: qemu-img/qemu-io not installed (Debian qemu-utils)");
    }
    ok
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

/// qemu-img check's verdict: 0 clean, 3 leaks only, 2 corrupt.
fn check_code(path: &Path) -> (i32, String) {
    let out = Command::new("qemu-img")
        .args(["check", p(path)])
        .output()
        .expect("qemu-img check");
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn assert_clean(path: &Path, what: &str) {
    let (code, text) = check_code(path);
    assert_eq!(code, 0, "{what}: qemu-img check is not clean:\n{text}");
}

#[derive(Debug, Clone, Copy)]
struct Config {
    cluster: u32,
    refcount_bits: u32,
    extended_l2: bool,
    compat: &'static str,
    compression: &'static str,
    snapshots: usize,
    full: bool,
}

const MIB: u64 = 1 << 20;

fn disk_size(c: &Config) -> u64 {
    if c.cluster <= 4096 {
        MIB
    } else {
        4 * MIB
    }
}

/// Build the image with qemu's tools: data (some of it compressed),
/// then `snapshots` snapshots with writes between them.
fn make_image(dir: &Path, c: &Config) -> PathBuf {
    let path = dir.join("base.qcow2");
    let size = disk_size(c);
    let mut opts = format!(
        "cluster_size={},refcount_bits={},compat={}",
        c.cluster, c.refcount_bits, c.compat
    );
    if c.extended_l2 {
        opts += ",extended_l2=on";
    }
    if c.compat != "0.10" {
        opts += &format!(",compression_type={}", c.compression);
    }
    run(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            &opts,
            p(&path),
            &size.to_string(),
        ],
    );
    let cs = u64::from(c.cluster);
    let mut io: Vec<String> = Vec::new();
    if c.full {
        // All but the last 32 clusters, kept for compressed writes (qemu
        // compresses only into unallocated clusters).
        io.push(format!("write -P 0x5a 0 {}", size - 32 * cs));
    } else {
        io.push(format!("write -P 0x11 0 {}", 8 * cs));
        io.push(format!("write -P 0x22 {} {}", size / 2, 3 * cs));
        io.push(format!("write -z {} {}", size / 4, 2 * cs));
    }
    io.push(format!("write -c -P 0x33 {} {}", size - 4 * cs, 2 * cs));
    qemu_io(&path, &io);
    for i in 0..c.snapshots {
        run("qemu-img", &["snapshot", "-c", &format!("s{i}"), p(&path)]);
        // Plain writes stay in the lower half; compressed ones go to
        // never-written clusters near the end.
        let at = (i as u64 * 7 * cs) % (size / 2);
        let mut w = vec![format!("write -P {:#x} {at} {}", 0x40 + i, cs + 512)];
        if i % 3 == 0 {
            w.push(format!(
                "write -c -P {:#x} {} {}",
                0x80 + i,
                size - (5 + i as u64) * cs,
                cs
            ));
        }
        if i % 4 == 1 {
            w.push(format!("write -z {} {}", (at + 9 * cs) % (size - cs), cs));
        }
        qemu_io(&path, &w);
    }
    assert_clean(&path, "the qemu-made image");
    path
}

fn qemu_io(path: &Path, cmds: &[String]) {
    let mut args = vec!["-f".to_string(), "qcow2".to_string()];
    for c in cmds {
        args.push("-c".into());
        args.push(c.clone());
    }
    args.push(p(path).into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run("qemu-io", &args);
}

fn rw(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open image")
}

fn snapshots(path: &Path) -> Vec<(String, String)> {
    let f = File::open(path).expect("open image");
    ops::list(&f)
        .expect("list")
        .iter()
        .map(|s| (s.id_str(), s.name_str()))
        .collect()
}

fn assert_same_file(qemu: &Path, ours: &Path, what: &str) {
    let a = std::fs::read(qemu).expect("read qemu's file");
    let b = std::fs::read(ours).expect("read our file");
    if a != b {
        let first = a.iter().zip(&b).position(|(x, y)| x != y);
        panic!(
            "{what}: files differ (qemu {} bytes, ours {} bytes, first difference at {first:?})",
            a.len(),
            b.len()
        );
    }
    assert_clean(ours, what);
    let ours_list =
        qcow2::list::format(&ops::list(&File::open(ours).expect("open")).expect("list"));
    let qemu_list = run("qemu-img", &["snapshot", "-l", p(ours)]);
    assert_eq!(ours_list, qemu_list, "{what}: listings differ");
}

/// The date qemu gave the newest snapshot, so ours can use the same one.
fn last_date(path: &Path) -> SnapshotTime {
    let f = File::open(path).expect("open");
    let s = ops::list(&f).expect("list").pop().expect("a snapshot");
    SnapshotTime {
        sec: s.date_sec,
        nsec: s.date_nsec,
    }
}

fn differential(c: Config) {
    if !have_qemu() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let base = make_image(dir.path(), &c);
    let qemu = dir.path().join("qemu.qcow2");
    let ours = dir.path().join("ours.qcow2");
    std::fs::copy(&base, &qemu).expect("copy");
    std::fs::copy(&base, &ours).expect("copy");
    let what = |op: &str| format!("{c:?} {op}");

    // create, twice (the second reuses the first's name).
    for name in ["new", "new"] {
        run("qemu-img", &["snapshot", "-c", name, p(&qemu)]);
        ops::create(&rw(&ours), name, last_date(&qemu), &mut ops::no_hook).expect("create");
        assert_same_file(&qemu, &ours, &what("create"));
    }
    // Dirty the active image identically, then apply an older snapshot.
    let cs = u64::from(c.cluster);
    for f in [&qemu, &ours] {
        qemu_io(f, &[format!("write -P 0x77 {} {}", 3 * cs, 2 * cs)]);
    }
    let target = if c.snapshots > 0 { "s0" } else { "1" };
    run("qemu-img", &["snapshot", "-a", target, p(&qemu)]);
    ops::apply(&rw(&ours), target, &mut ops::no_hook).expect("apply");
    assert_same_file(&qemu, &ours, &what("apply"));
    // Delete: the first "new", then an older one, then everything.
    let mut names: Vec<String> = vec!["new".into()];
    if c.snapshots > 1 {
        names.push(format!("s{}", c.snapshots / 2));
    }
    for name in &names {
        run("qemu-img", &["snapshot", "-d", name, p(&qemu)]);
        ops::delete(&rw(&ours), name, &mut ops::no_hook).expect("delete");
        assert_same_file(&qemu, &ours, &what(&format!("delete {name}")));
    }
    for (_, name) in snapshots(&qemu) {
        run("qemu-img", &["snapshot", "-d", &name, p(&qemu)]);
        ops::delete(&rw(&ours), &name, &mut ops::no_hook).expect("delete");
    }
    assert_same_file(&qemu, &ours, &what("delete all"));
    assert!(snapshots(&ours).is_empty());
}

fn cfg(
    cluster: u32,
    refcount_bits: u32,
    extended_l2: bool,
    snapshots: usize,
    full: bool,
) -> Config {
    Config {
        cluster,
        refcount_bits,
        extended_l2,
        compat: "1.1",
        compression: "zlib",
        snapshots,
        full,
    }
}

#[test]
fn matches_qemu_with_512_byte_clusters_refcount16_sparse_1_snapshot() {
    differential(cfg(512, 16, false, 1, false));
}

#[test]
fn matches_qemu_with_512_byte_clusters_refcount64_sparse_20_snapshots() {
    differential(cfg(512, 64, false, 20, false));
}

#[test]
fn matches_qemu_with_4k_clusters_refcount16_full_20_snapshots() {
    differential(cfg(4096, 16, false, 20, true));
}

#[test]
fn matches_qemu_with_4k_clusters_refcount64_full_0_snapshots() {
    differential(cfg(4096, 64, false, 0, true));
}

#[test]
fn matches_qemu_with_64k_clusters_refcount16_sparse_0_snapshots() {
    differential(cfg(65536, 16, false, 0, false));
}

#[test]
fn matches_qemu_with_64k_clusters_extended_l2_refcount64_sparse_20_snapshots() {
    differential(cfg(65536, 64, true, 20, false));
}

#[test]
fn matches_qemu_with_16k_clusters_extended_l2_refcount16_full_1_snapshot() {
    differential(cfg(16384, 16, true, 1, true));
}

#[test]
fn matches_qemu_with_zstd_compression() {
    differential(Config {
        compression: "zstd",
        ..cfg(4096, 16, false, 1, false)
    });
}

#[test]
fn matches_qemu_on_a_version_2_image() {
    differential(Config {
        compat: "0.10",
        ..cfg(65536, 16, false, 1, false)
    });
}

#[test]
fn matches_qemu_with_one_bit_refcounts_until_a_refcount_overflows() {
    // 1-bit refcounts cannot share a cluster: qemu refuses a snapshot of
    // data; an image without data still works.
    if !have_qemu() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let qemu = dir.path().join("qemu.qcow2");
    let ours = dir.path().join("ours.qcow2");
    run(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "refcount_bits=1",
            p(&qemu),
            "1M",
        ],
    );
    std::fs::copy(&qemu, &ours).expect("copy");
    run("qemu-img", &["snapshot", "-c", "a", p(&qemu)]);
    ops::create(&rw(&ours), "a", last_date(&qemu), &mut ops::no_hook).expect("create");
    assert_same_file(&qemu, &ours, "1-bit create");
    qemu_io(&ours, &["write -P 1 0 4k".into()]);
    let before = std::fs::read(&ours).expect("read");
    let e = ops::create(&rw(&ours), "b", SnapshotTime::now(), &mut ops::no_hook).unwrap_err();
    assert!(matches!(e, Error::Invalid(_)), "{e}");
    assert_eq!(
        std::fs::read(&ours).expect("read"),
        before,
        "a refused create wrote nothing"
    );
}

/// What a user can see of an image: its snapshot list and active data.
fn observable(path: &Path) -> (Vec<(String, String)>, Vec<u8>) {
    let f = File::open(path).expect("open image");
    let img = Image::open(&f).expect("open image");
    let mut data = vec![0u8; usize::try_from(img.header().size).expect("size")];
    img.read(qcow2::View::Active, 0, &mut data)
        .expect("read the active image");
    (snapshots(path), data)
}

/// Stop `op` after each of its write groups in turn; every stopped file is
/// clean or only leaks, and shows the old state before the commit point
/// and the new one from it on.
fn crash_each_group(
    c: Config,
    op: &dyn Fn(&File, ops::Hook<'_>) -> qcow2::Result<()>,
    groups: &[Stage],
) {
    if !have_qemu() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let base = make_image(dir.path(), &c);
    // Make the active image differ from every snapshot.
    qemu_io(&base, &[format!("write -P 0xee 0 {}", c.cluster)]);
    let before = observable(&base);
    let done = dir.path().join("done.qcow2");
    std::fs::copy(&base, &done).expect("copy");
    let mut seen = Vec::new();
    op(&rw(&done), &mut |s| {
        seen.push(s);
        Ok(())
    })
    .expect("the uninterrupted operation");
    assert_eq!(seen, groups, "the operation's write groups");
    assert_clean(&done, "uninterrupted");
    let after = observable(&done);
    assert_ne!(before, after, "the operation changes what a user sees");
    let commit = groups
        .iter()
        .position(|&g| matches!(g, Stage::HeaderCommitted | Stage::ActiveL1Replaced))
        .expect("a commit group");
    for (i, &stop) in groups.iter().enumerate() {
        let f = dir.path().join("crash.qcow2");
        std::fs::copy(&base, &f).expect("copy");
        let r = op(&rw(&f), &mut |s| {
            if s == stop {
                Err(Error::Injected(s))
            } else {
                Ok(())
            }
        });
        assert!(
            matches!(r, Err(Error::Injected(s)) if s == stop),
            "stopped at {stop:?}: {r:?}"
        );
        let (code, text) = check_code(&f);
        assert!(
            code == 0 || code == 3,
            "stopped after {stop:?}: qemu-img check says corrupt:\n{text}"
        );
        let seen = observable(&f);
        let want = if i >= commit { &after } else { &before };
        assert!(
            &seen == want,
            "stopped after {stop:?}: the file shows the {} state",
            if i >= commit { "old" } else { "new" }
        );
    }
}

#[test]
fn create_stopped_after_any_group_leaves_a_clean_or_leaking_file() {
    crash_each_group(
        cfg(4096, 16, false, 3, false),
        &|f, h| ops::create(f, "crash", SnapshotTime::now(), h).map(drop),
        &[
            Stage::CopiedL1,
            Stage::TableWritten,
            Stage::HeaderCommitted,
            Stage::OldTableFreed,
        ],
    );
}

#[test]
fn delete_stopped_after_any_group_leaves_a_clean_or_leaking_file() {
    crash_each_group(
        cfg(512, 64, false, 3, false),
        &|f, h| ops::delete(f, "s1", h).map(drop),
        &[Stage::TableWritten, Stage::HeaderCommitted, Stage::Released],
    );
}

#[test]
fn apply_stopped_after_any_group_leaves_a_clean_or_leaking_file() {
    crash_each_group(
        cfg(65536, 16, true, 3, false),
        &|f, h| ops::apply(f, "s0", h).map(drop),
        &[
            Stage::RefcountsRaised,
            Stage::ActiveL1Replaced,
            Stage::OldActiveReleased,
        ],
    );
}

#[test]
fn reader_sees_what_qemu_sees_in_every_snapshot() {
    if !have_qemu() {
        return;
    }
    for c in [
        cfg(4096, 16, false, 3, false),
        cfg(65536, 64, true, 3, false),
        Config {
            compression: "zstd",
            ..cfg(16384, 16, false, 3, true)
        },
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let base = make_image(dir.path(), &c);
        let f = File::open(&base).expect("open");
        let img = Image::open(&f).expect("open image");
        let size = usize::try_from(disk_size(&c)).expect("size");
        let mut views = vec![(qcow2::View::Active, None)];
        for (i, s) in img.snapshots().iter().enumerate() {
            views.push((qcow2::View::Snapshot(i), Some(s.name_str())));
        }
        for (view, name) in views {
            let raw = dir.path().join("view.raw");
            let mut args = vec!["convert", "-O", "raw"];
            let opt;
            if let Some(n) = &name {
                opt = format!("snapshot.name={n}");
                args.extend(["-l", &opt]);
            }
            args.extend([p(&base), p(&raw)]);
            run("qemu-img", &args);
            let want = std::fs::read(&raw).expect("raw");
            let mut got = vec![0u8; size];
            img.read(view, 0, &mut got).expect("read view");
            assert!(want == got, "{c:?} {view:?}: our read differs from qemu's");
        }
    }
}

#[test]
fn snapshot_extra_data_over_1024_bytes_is_refused_as_qemu_refuses_it() {
    if !have_qemu() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("extra.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", p(&path), "1M"]);
    run("qemu-img", &["snapshot", "-c", "a", p(&path)]);
    // Grow the entry's extra data to 1100 bytes (zeroes past the 24 known).
    let mut b = std::fs::read(&path).expect("read");
    let off = usize::try_from(u64::from_be_bytes(b[64..72].try_into().expect("8 bytes")))
        .expect("offset");
    let names = usize::from(u16::from_be_bytes([b[off + 12], b[off + 13]]))
        + usize::from(u16::from_be_bytes([b[off + 14], b[off + 15]]));
    let tail = b[off + 64..off + 64 + names].to_vec();
    b.truncate(off + 64);
    b[off + 36..off + 40].copy_from_slice(&1100u32.to_be_bytes());
    b.resize(off + 40 + 1100, 0);
    b.extend_from_slice(&tail);
    std::fs::write(&path, &b).expect("write");
    let qemu = Command::new("qemu-img")
        .args(["snapshot", "-l", p(&path)])
        .output()
        .expect("qemu-img");
    assert!(!qemu.status.success(), "qemu-img opened it");
    assert!(String::from_utf8_lossy(&qemu.stderr).contains("Too much extra metadata"));
    let e = ops::list(&File::open(&path).expect("open")).unwrap_err();
    assert!(
        matches!(&e, Error::Invalid(m) if m.contains("extra data")),
        "{e}"
    );
}

fn reftable_offset(path: &Path) -> u64 {
    let b = std::fs::read(path).expect("read");
    u64::from_be_bytes(b[48..56].try_into().expect("8 bytes"))
}

#[test]
fn matches_qemu_when_a_snapshot_create_grows_the_refcount_table() {
    // 512-byte clusters with 64-bit refcounts: the first table cluster
    // covers 4096 clusters (2 MiB). Fill the file to exactly 2 MiB with
    // qemu-io, so the snapshot's first allocation needs a larger table.
    if !have_qemu() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let qemu = dir.path().join("qemu.qcow2");
    let ours = dir.path().join("ours.qcow2");
    run(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=512,refcount_bits=64",
            p(&qemu),
            "4M",
        ],
    );
    let edge = 2 * MIB;
    let len = |f: &Path| std::fs::metadata(f).expect("stat").len();
    let mut guest = 0u64;
    while len(&qemu) < edge {
        let step = ((edge - len(&qemu)) / 2 / 512).max(1) * 512;
        qemu_io(&qemu, &[format!("write -P 7 {guest} {step}")]);
        guest += step;
    }
    assert_eq!(
        len(&qemu),
        edge,
        "qemu-io overshot the table's reach; adjust the fill"
    );
    let before = reftable_offset(&qemu);
    std::fs::copy(&qemu, &ours).expect("copy");
    run("qemu-img", &["snapshot", "-c", "grow", p(&qemu)]);
    ops::create(&rw(&ours), "grow", last_date(&qemu), &mut ops::no_hook).expect("create");
    assert_ne!(
        reftable_offset(&ours),
        before,
        "the create did not grow the refcount table"
    );
    assert_same_file(&qemu, &ours, "create growing the refcount table");
    // And the next operations on the grown image still match.
    run("qemu-img", &["snapshot", "-c", "next", p(&qemu)]);
    ops::create(&rw(&ours), "next", last_date(&qemu), &mut ops::no_hook).expect("create");
    assert_same_file(&qemu, &ours, "create after the growth");
    run("qemu-img", &["snapshot", "-d", "grow", p(&qemu)]);
    ops::delete(&rw(&ours), "grow", &mut ops::no_hook).expect("delete");
    assert_same_file(&qemu, &ours, "delete after the growth");
}

#[test]
fn image_locks_keep_offline_changes_and_a_running_qemu_apart() {
    if !have_qemu() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("busy.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", p(&path), "1M"]);
    // A qemu holding the image open read-write (it waits for commands).
    let mut qemu = Command::new("qemu-io")
        .args(["-f", "qcow2", p(&path)])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("qemu-io");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let refused = loop {
        let f = rw(&path);
        match qcow2::lock::acquire(&f, true) {
            Err(e) => break e.to_string(),
            Ok(()) if std::time::Instant::now() < deadline => {
                drop(f);
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Ok(()) => panic!("a running qemu-io did not hold its locks within 10 s"),
        }
    };
    assert!(refused.contains("in use"), "{refused}");
    drop(qemu.stdin.take());
    qemu.wait().expect("qemu-io exits when its input closes");
    // Free now; and while we hold the locks, qemu-img refuses the image.
    let f = rw(&path);
    qcow2::lock::acquire(&f, true).expect("the image is free");
    let out = Command::new("qemu-img")
        .args(["snapshot", "-c", "x", p(&path)])
        .output()
        .expect("qemu-img");
    assert!(!out.status.success(), "qemu-img changed an image we hold");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("lock"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(f);
    run("qemu-img", &["snapshot", "-c", "x", p(&path)]);
}
