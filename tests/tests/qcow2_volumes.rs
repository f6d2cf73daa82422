//! qcow2 interchange of reflink volumes on a real XFS, against qemu-img:
//! import of a qemu-made image with internal snapshots (each volume
//! snapshot equals qemu's view of its internal snapshot, and FIEMAP shows
//! the clusters qcow2 shared stayed shared), export back (`qemu-img check`
//! clean, `qemu-img compare` equal per snapshot, shared data written once),
//! the API's answers to bad files, and the `uffdctl` commands, including
//! the offline `uffdctl qcow2 snapshot -l` against `qemu-img snapshot -l`.
//!
//! Needs `PAGEFORK_XFS_DIR` (an XFS with reflink=1) and qemu-img/qemu-io:
//! skips with a reason without them, fails under CI=true.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use pagefork_tests::{server_on_xfs, uffdctl_ok, TestServer};
use proto::api::{ExportVolume, ImportVolume};
use volume::{Reflink, VolumeEngine, VolumeError};

const MIB: u64 = 1 << 20;
const CS: u64 = 65536;

fn have_qemu() -> bool {
    let ok = Command::new("qemu-img")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("CI=true but qemu-img is missing: run scripts/setup.sh");
        }
        eprintln!("skipping: qemu-img not installed (Debian qemu-utils)");
    }
    ok
}

/// A fresh directory for `test` on the XFS mount, or `None` (skip).
fn xfs_root(test: &str) -> Option<PathBuf> {
    let Some(base) = std::env::var_os("PAGEFORK_XFS_DIR") else {
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("PAGEFORK_XFS_DIR is unset under CI=true: run `scripts/xfs-loop.sh up DIR` and export it");
        }
        eprintln!("skipping {test}: PAGEFORK_XFS_DIR is unset");
        return None;
    };
    if !have_qemu() {
        return None;
    }
    let dir = Path::new(&base).join(test);
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).expect("test directory");
    Some(dir)
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// An 8 MiB image written in full, then three snapshots with two clusters
/// rewritten (one of them compressed) and a zeroed range between each.
const SNAPS: [&str; 3] = ["base", "mid", "late"];
fn qemu_image(dir: &Path) -> PathBuf {
    let img = dir.join("orig.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", p(&img), "8M"]);
    run(
        "qemu-io",
        &["-f", "qcow2", "-c", "write -P 0x11 0 7M", p(&img)],
    );
    for (i, s) in SNAPS.iter().enumerate() {
        run("qemu-img", &["snapshot", "-c", s, p(&img)]);
        let at = (i as u64 + 1) * MIB;
        run(
            "qemu-io",
            &[
                "-f",
                "qcow2",
                "-c",
                &format!("write -P {:#x} {at} {}", 0x20 + i, 2 * CS),
                "-c",
                &format!(
                    "write -c -P {:#x} {} {CS}",
                    0x30 + i,
                    7 * MIB + i as u64 * CS
                ),
                "-c",
                &format!("write -z {} {CS}", at + 4 * CS),
                p(&img),
            ],
        );
    }
    img
}

/// qemu's view of a snapshot (or of the active image) as raw bytes.
fn qemu_view(img: &Path, snapshot: Option<&str>, out: &Path) -> Vec<u8> {
    let _ = fs::remove_file(out);
    let opt = snapshot.map(|s| format!("snapshot.name={s}"));
    let mut args = vec!["convert", "-O", "raw"];
    if let Some(o) = &opt {
        args.extend(["-l", o]);
    }
    args.extend([p(img), p(out)]);
    run("qemu-img", &args);
    fs::read(out).expect("raw view")
}

fn engine(root: &Path) -> VolumeEngine {
    let e = VolumeEngine::open(root).expect("engine");
    assert_eq!(
        e.reflink(),
        &Reflink::Supported,
        "PAGEFORK_XFS_DIR must reflink"
    );
    e
}

#[test]
fn import_keeps_every_snapshot_and_the_sharing_then_export_round_trips() {
    let Some(dir) = xfs_root("qcow2-roundtrip") else {
        return;
    };
    let root = dir.join("state");
    let e = engine(&root);
    let img = qemu_image(&dir);
    let imported = e.import_qcow2(&img, "disk", "disk-").expect("import");
    let names: Vec<String> = SNAPS.iter().map(|s| format!("disk-{s}")).collect();
    assert_eq!(imported.snapshots, names);
    let raw = dir.join("view.raw");
    let vol_dir = root.join("volumes/disk");
    for (s, n) in SNAPS.iter().zip(&names) {
        assert!(
            fs::read(vol_dir.join(n)).expect("snapshot file") == qemu_view(&img, Some(s), &raw),
            "snapshot {s} differs from qemu's view"
        );
    }
    assert!(
        fs::read(vol_dir.join("disk")).expect("volume") == qemu_view(&img, None, &raw),
        "the volume differs from qemu's active image"
    );
    // The states share what qcow2 shared: with the source gone, each file
    // holds ~7 MiB but only the clusters its state rewrote are its own.
    let exported = dir.join("export.qcow2");
    fs::copy(&img, dir.join("orig-kept.qcow2")).expect("keep a copy");
    fs::remove_file(&img).expect("remove the source");
    let img = dir.join("orig-kept.qcow2");
    for n in names.iter().chain(std::iter::once(&"disk".to_string())) {
        let u = reflink::usage(&fs::File::open(vol_dir.join(n)).expect("open")).expect("usage");
        assert!(u.allocated_bytes >= 6 * MIB, "{n}: {u:?}");
        assert!(u.exclusive_bytes <= 6 * CS, "{n} lost its sharing: {u:?}");
    }
    // Export and compare every state with the original.
    let out = e.export_qcow2("disk", &exported).expect("export");
    assert_eq!(out.snapshots, names);
    run("qemu-img", &["check", p(&exported)]);
    for (s, n) in SNAPS.iter().zip(&names) {
        let a = dir.join("a.raw");
        let b = dir.join("b.raw");
        qemu_view(&img, Some(s), &a);
        qemu_view(&exported, Some(n), &b);
        run(
            "qemu-img",
            &["compare", "-f", "raw", "-F", "raw", p(&a), p(&b)],
        );
    }
    run("qemu-img", &["compare", p(&img), p(&exported)]);
    // Shared data is written once: four 8 MiB states in about one's room.
    let len = fs::metadata(&exported).expect("stat").len();
    assert!(
        len < 9 * MIB,
        "the export holds {len} bytes: sharing was lost"
    );
    let list = run("qemu-img", &["snapshot", "-l", p(&exported)]);
    let order: Vec<usize> = names
        .iter()
        .map(|n| list.find(n.as_str()).expect("listed"))
        .collect();
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "snapshots out of order:\n{list}"
    );
    // An existing target is refused, and nothing was left behind.
    assert!(matches!(
        e.export_qcow2("disk", &exported),
        Err(VolumeError::ExportExists { .. })
    ));
}

#[test]
fn importing_what_is_not_a_usable_qcow2_is_refused_and_leaves_nothing() {
    let Some(dir) = xfs_root("qcow2-refused") else {
        return;
    };
    let root = dir.join("state");
    let e = engine(&root);
    let junk = dir.join("junk.qcow2");
    fs::write(&junk, vec![0x5a; 4096]).expect("junk");
    let err = e.import_qcow2(&junk, "v", "").unwrap_err();
    assert!(
        err.to_string().contains("cannot import") && err.chain().contains("magic"),
        "{}",
        err.chain()
    );
    let backed = dir.join("backed.qcow2");
    let base = dir.join("base.qcow2");
    run("qemu-img", &["create", "-q", "-f", "qcow2", p(&base), "1M"]);
    run(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            p(&base),
            "-F",
            "qcow2",
            p(&backed),
        ],
    );
    let err = e.import_qcow2(&backed, "v", "").unwrap_err();
    assert!(err.chain().contains("backing file"), "{}", err.chain());
    assert!(e.list().expect("list").is_empty());
    assert!(!root.join("volumes/v").exists());
}

fn api_server() -> Option<TestServer> {
    if !have_qemu() {
        return None;
    }
    server_on_xfs(&[])
}

#[test]
fn api_and_cli_import_and_export_and_answer_bad_files_with_400() {
    let Some(server) = api_server() else { return };
    let dir = tempfile::tempdir().expect("tempdir on the XFS (TMPDIR)");
    let img = qemu_image(dir.path());
    let junk = dir.path().join("junk.qcow2");
    fs::write(&junk, b"QFI\xfbnot really").expect("junk");
    for path in [p(&junk), "relative.qcow2"] {
        let r = server
            .try_import_volume(&ImportVolume {
                name: "j".into(),
                path: path.into(),
                snapshot_prefix: String::new(),
            })
            .unwrap_err();
        assert_eq!(r.status, 400, "{r}");
    }
    server.assert_healthy();
    let cli = |args: &[&str]| uffdctl_ok(&server, args);
    let shown = cli(&[
        "volume",
        "import",
        p(&img),
        "apivol",
        "--snapshot-prefix",
        "api-",
    ]);
    assert!(shown.contains("api-base, api-mid, api-late"), "{shown}");
    let exported = dir.path().join("out.qcow2");
    cli(&["volume", "export", "apivol", p(&exported)]);
    run("qemu-img", &["check", p(&exported)]);
    run("qemu-img", &["compare", p(&img), p(&exported)]);
    for (path, want) in [(p(&exported), 409), ("/etc/not-an-image", 400)] {
        let r = server
            .try_export_volume("apivol", &ExportVolume { path: path.into() })
            .unwrap_err();
        assert_eq!(r.status, want, "{r}");
    }
    assert!(!Path::new("/etc/not-an-image").exists());
    // The offline snapshot commands list what qemu-img lists.
    assert_eq!(
        cli(&["qcow2", "snapshot", "-l", p(&exported)]),
        run("qemu-img", &["snapshot", "-l", p(&exported)])
    );
    cli(&["qcow2", "snapshot", "-c", "fresh", p(&exported)]);
    cli(&["qcow2", "snapshot", "-a", "api-base", p(&exported)]);
    cli(&["qcow2", "snapshot", "-d", "api-mid", p(&exported)]);
    run("qemu-img", &["check", p(&exported)]);
    assert_eq!(
        cli(&["qcow2", "snapshot", "-l", p(&exported)]),
        run("qemu-img", &["snapshot", "-l", p(&exported)])
    );
    server.assert_healthy();
}
