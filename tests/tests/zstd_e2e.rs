//! Compressed memory images (`memory.zst`) end to end: images made by
//! `uffdctl image compress`, served lazily by a real server to real VMMs
//! on KVM and to a Firecracker-protocol client, decoded on the server's
//! frame pool. Memory is compared whole (`digest`, or the client's
//! byte-by-byte check) with the original bytes; corrupt images fail only
//! the VM that reads them.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use pagefork_tests::{
    bin, expected_digest, from_snapshot, new_vm, op, pages_by, pages_of, realistic_memory,
    require_kvm_uffd, server_on_xfs, zstd_source, FcClient, RandomImage, TestServer,
};
use proto::api::{CreateListener, CreateSnapshot, CreateVm, MemorySource, RunState, SnapshotMode};
use serde_json::Value;

fn inspect(file: &Path) -> Value {
    let o = Command::new(bin("uffdctl"))
        .args(["--json", "image", "inspect"])
        .arg(file)
        .output()
        .expect("run uffdctl image inspect");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("inspect prints JSON")
}

fn zstd_vm(s: &TestServer, mib: u64, path: &Path) -> String {
    s.create_vm(&CreateVm {
        memory_source: Some(zstd_source(path)),
        ..new_vm(mib)
    })
}

#[test]
fn a_vm_created_from_a_compressed_file_reads_exactly_the_original() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 32;
    let raw = RandomImage::from_bytes(realistic_memory(mib));
    let dir = tempfile::tempdir().expect("tempdir");
    let zst = dir.path().join("memory.zst");
    // 192 KiB frames: 8192 pages are 170 frames and a partial one.
    pagefork_tests::compress_image(raw.file.path(), &zst, Some(192));
    let info = inspect(&zst);
    assert_eq!(info["memory_bytes"], mib << 20, "{info}");
    assert_eq!(info["frames"], 171, "{info}");
    assert!(info["zero_frames"].as_u64().unwrap() >= 1, "{info}");
    assert!(info["ratio"].as_f64().unwrap() > 1.5, "{info}");

    let s = TestServer::start();
    let id = zstd_vm(&s, mib, &zst);
    let before = s.vm(&id);
    assert!(pages_by(&before, "zstd") > 0, "{before:?}");
    let pages = pages_of(mib);
    assert_eq!(
        s.digest(&id, 0, pages),
        expected_digest(&raw.bytes, 0, pages),
        "memory served from memory.zst differs from the original"
    );
    let after = s.vm(&id);
    assert!(
        after.faults.frame_waits > 0,
        "no fault waited for a frame: {after:?}"
    );
    // The VM writes over what it read, as any VM does.
    s.fill(&id, 100, 50, 3);
    assert_eq!(s.verify(&id, 100, 50, 3), 0);

    // Prefetched before it starts (frames decoded by the pool while the
    // create waits): every byte there without a single fault.
    let pre = s.create_vm(&CreateVm {
        memory_source: Some(zstd_source(zst)),
        prefetch: true,
        ..new_vm(mib)
    });
    assert_eq!(
        s.digest(&pre, 0, pages),
        expected_digest(&raw.bytes, 0, pages),
        "prefetched from memory.zst"
    );
    assert_eq!(s.vm(&pre).faults.missing, 0, "{:?}", s.vm(&pre));
    s.assert_healthy();
}

#[test]
fn a_vm_restored_from_a_compressed_snapshot_reads_its_memory() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let mib = 64;
    let pages = pages_of(mib);
    let vm = s.create_vm(&new_vm(mib));
    s.fill(&vm, 0, 3000, 1);
    s.fill(&vm, 9000, 333, 7);
    let want = s.digest(&vm, 0, pages);
    let r = s
        .try_snapshot(
            &vm,
            &CreateSnapshot {
                name: "z1".into(),
                mode: SnapshotMode::Full,
                compress: true,
            },
        )
        .unwrap_or_else(|r| panic!("{r}"));
    let zbytes = r.compressed_bytes.expect("compressed_bytes");
    let zpath = s.state_dir().join("snapshots/z1/memory.zst");
    assert_eq!(std::fs::metadata(&zpath).expect("memory.zst").len(), zbytes);
    let info = s.snapshot_info("z1");
    assert_eq!(info.compressed_bytes, Some(zbytes), "{info:?}");
    s.fill(&vm, 0, 10, 2); // the original moves on

    let restored = s.create_vm(&from_snapshot("z1"));
    let v = s.vm(&restored);
    assert!(pages_by(&v, "zstd") > 0, "served from memory.zst: {v:?}");
    // Where an untouched page's bytes are: the compressed snapshot, which
    // frame, and where that frame starts in memory.zst.
    let page = 9100;
    let e = s.explain(&restored, page);
    let chain = &e.explain.as_ref().expect("a chain").chain;
    let last = chain.last().expect("a step");
    assert_eq!(last.kind, "zstd", "{e:?}");
    assert_eq!(last.at, "snapshot:z1 (zstd)", "{e:?}");
    assert_eq!(last.frame, Some(page / 64), "256 KiB frames: {e:?}");
    assert_eq!(
        last.file.as_deref(),
        Some(zpath.display().to_string().as_str()),
        "{e:?}"
    );
    let img = zst::Image::open(&zpath).expect("memory.zst");
    assert_eq!(
        last.offset,
        Some(img.entries()[usize::try_from(page / 64).unwrap()].offset),
        "{e:?}"
    );
    let src = s.sources(&restored);
    assert!(
        src.by_source.contains_key("snapshot:z1 (zstd)"),
        "sources name the compressed snapshot: {src:?}"
    );
    assert_eq!(
        s.digest(&restored, 0, pages),
        want,
        "restored memory differs"
    );

    // An incremental snapshot of it takes memory.img of z1 as its base.
    s.fill(&restored, 500, 20, 9);
    let want2 = s.digest(&restored, 0, pages);
    let r = s.snapshot(&restored, "z2", SnapshotMode::Incremental);
    assert_eq!(r.mode_used, SnapshotMode::Incremental, "{r:?}");
    let again = s.create_vm(&from_snapshot("z2"));
    assert_eq!(s.digest(&again, 0, pages), want2, "incremental over zstd");

    // A Firecracker-protocol client served from the compressed snapshot.
    let l =
        s.add_listener(&s.listener_request("fc-z1", MemorySource::Snapshot { name: "z1".into() }));
    let socket = Path::new(&l.socket);
    let raw = s.state_dir().join("snapshots/z1/memory.img");
    let check = format!("check:{}", raw.display());
    let mut client = FcClient::spawn(socket, &["--mib", &mib.to_string()], &[&check]);
    let checked = client.until(&check);
    assert_eq!(checked["mismatched_pages"], 0, "{checked}");
    client.finish();
    s.assert_healthy();
}

#[test]
fn a_firecracker_client_is_served_from_a_compressed_image() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 32;
    let raw = RandomImage::from_bytes(realistic_memory(mib));
    let dir = tempfile::tempdir().expect("tempdir");
    let zst = dir.path().join("fc.zst");
    pagefork_tests::compress_image(raw.file.path(), &zst, Some(64));
    let s = TestServer::start();
    let l = s.add_listener(&s.listener_request("fc", zstd_source(&zst)));
    let socket = Path::new(&l.socket);
    assert!(
        matches!(l.memory_source, MemorySource::Zstd { .. }),
        "{l:?}"
    );
    let check = format!("check:{}", raw.path());
    let mut client = FcClient::spawn(
        socket,
        &["--mib", &mib.to_string()],
        &["zero:0:2000", "zero:5000:40", &check],
    );
    let checked = client.until(&check);
    assert_eq!(checked["mismatched_pages"], 0, "{checked}");
    client.finish();

    // A recorded working set is prefetched from the compressed image too:
    // the second client's check hardly faults, and reads the right bytes.
    let l = s.add_listener(&CreateListener {
        working_set: true,
        ..s.listener_request("fc-ws", zstd_source(&zst))
    });
    let ws_socket = std::path::PathBuf::from(&l.socket);
    let lid = l.id;
    FcClient::spawn(&ws_socket, &["--mib", &mib.to_string()], &["touch-seq"]).finish();
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.listener(&lid).recorded_pages == 0 {
        assert!(
            Instant::now() < deadline,
            "no working set was recorded: {:?}",
            s.listener(&lid)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut client = FcClient::spawn(
        &ws_socket,
        &["--mib", &mib.to_string()],
        &["sleep:1000", &check, "hold"],
    );
    let checked = client.until(&check);
    assert_eq!(checked["mismatched_pages"], 0, "{checked}");
    let fc = s
        .vms()
        .into_iter()
        .find(|v| v.pid == Some(client.pid()))
        .expect("the client's VM is listed");
    let v = s.vm(&fc.id);
    assert!(
        v.faults.missing < pages_of(mib) / 10,
        "the working set was not prefetched from memory.zst: {v:?}"
    );
    client.finish();
    s.assert_healthy();
}

/// Entry `frame` of `path`'s frame table.
fn entry(path: &Path, frame: usize) -> zst::Entry {
    let img = zst::Image::open(path).expect("a valid image");
    img.entries()[frame]
}

/// The first frame with data at or after `from`.
fn data_frame(path: &Path, from: usize) -> usize {
    let img = zst::Image::open(path).expect("a valid image");
    (from..img.entries().len())
        .find(|f| !img.entries()[*f].zero)
        .expect("a data frame")
}

#[test]
fn corrupt_compressed_images_fail_only_the_vm_that_reads_them() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 16;
    let raw = RandomImage::from_bytes(realistic_memory(mib));
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("good.zst");
    pagefork_tests::compress_image(raw.file.path(), &good, Some(64));
    let s = TestServer::start();
    let other = s.create_vm(&new_vm(16));
    s.fill(&other, 0, pages_of(16), 4);
    let frame_pages = 16u64;

    // A byte flipped inside a frame's data: its checksum (or zstd) says so.
    let flipped = dir.path().join("flipped.zst");
    std::fs::copy(&good, &flipped).expect("copy");
    let bad = data_frame(&flipped, 10);
    let e = entry(&flipped, bad);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(&flipped)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, e.offset + u64::from(e.compressed_len) / 2)
        .unwrap();
    f.write_all_at(&[b[0] ^ 0x10], e.offset + u64::from(e.compressed_len) / 2)
        .unwrap();
    // The frame's zstd magic overwritten: the decoder refuses it.
    let garbled = dir.path().join("garbled.zst");
    std::fs::copy(&good, &garbled).expect("copy");
    let e2 = entry(&garbled, bad);
    let g = std::fs::OpenOptions::new()
        .write(true)
        .open(&garbled)
        .unwrap();
    g.write_all_at(&[0xde, 0xad, 0xbe, 0xef], e2.offset)
        .unwrap();

    // A Firecracker-protocol client touching the corrupt frame gets SIGBUS
    // (the page is poisoned, never filled with wrong bytes); the server
    // says why, and keeps serving.
    let l = s.add_listener(&s.listener_request("fc-bad", zstd_source(&flipped)));
    let socket = std::path::PathBuf::from(&l.socket);
    let bad_page = bad as u64 * frame_pages + 1;
    let out = Command::new(bin("fc_client"))
        .arg("--socket")
        .arg(&socket)
        .args(["--mib", &mib.to_string(), &format!("zero:{bad_page}:1")])
        .output()
        .expect("run fc_client");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&out.status),
        Some(libc::SIGBUS),
        "the client reading a corrupt frame: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    let log = s.server_log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("failed") && l.contains(&format!("frame {bad}"))),
        "the server log does not say which frame failed:\n{}",
        s.server_log_tail(20)
    );
    assert_eq!(s.verify(&other, 0, pages_of(16), 4), 0);

    for (path, why) in [(&flipped, "checksum|decode"), (&garbled, "decode")] {
        let id = zstd_vm(&s, mib, path);
        // Pages of intact frames read right.
        assert_eq!(
            s.digest(&id, 0, 8),
            expected_digest(&raw.bytes, 0, 8),
            "{}",
            path.display()
        );
        let page = bad as u64 * frame_pages + 1;
        let r = s.try_exec(&id, &op::touch(page, 1, false)).unwrap_err();
        assert!(r.status >= 400, "touching a corrupt frame answered {r}");
        let v = s.wait_state(&id, RunState::Failed, Duration::from_secs(20));
        let failure = v.failure.as_deref().unwrap_or_default();
        assert!(
            failure.contains(&format!("frame {bad}"))
                && why.split('|').any(|w| failure.contains(w)),
            "the failure does not say which frame and why ({why}): {v:?}"
        );
        // Everyone else keeps running.
        assert_eq!(s.verify(&other, 0, pages_of(16), 4), 0);
        s.assert_healthy();
    }

    // Truncated inside the frame data, and a table entry pointing outside
    // the file: refused when the VM is created, saying why.
    let truncated = dir.path().join("truncated.zst");
    std::fs::copy(&good, &truncated).expect("copy");
    let len = std::fs::metadata(&truncated).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&truncated)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let outside = dir.path().join("outside.zst");
    {
        let img = zst::Image::open(&good).unwrap();
        let mut header = *img.header();
        let mut entries = img.entries().to_vec();
        let f = data_frame(&good, 3);
        entries[f].offset = len + 4096;
        let (table, sum) = zst::format::encode_table(&entries);
        header.table_checksum = sum;
        std::fs::copy(&good, &outside).expect("copy");
        let o = std::fs::OpenOptions::new()
            .write(true)
            .open(&outside)
            .unwrap();
        o.write_all_at(&header.encode(), 0).unwrap();
        o.write_all_at(&table, zst::format::HEADER_LEN).unwrap();
    }
    for (path, want) in [(&truncated, "outside"), (&outside, "outside")] {
        let v = s
            .try_create_vm(&CreateVm {
                memory_source: Some(zstd_source(path)),
                ..new_vm(mib)
            })
            .unwrap_err();
        assert!((400..500).contains(&v.status), "{}: {v}", path.display());
        let msg = v.error();
        assert!(
            msg.contains("memory.zst") && msg.contains(want),
            "{}: the error does not say why: {v}",
            path.display()
        );
    }
    assert_eq!(s.verify(&other, 0, pages_of(16), 4), 0);
    s.assert_healthy();
}
