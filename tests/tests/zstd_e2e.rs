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
    bin, expected_digest, fault_counter, pages_by, pages_of, realistic_memory, require_kvm_uffd,
    server_on_xfs, FcClient, RandomImage, TestServer,
};
use serde_json::{json, Value};

/// `uffdctl image compress` of `raw` into `out`.
fn compress(raw: &Path, out: &Path, frame_kib: u64) {
    let o = Command::new(bin("uffdctl"))
        .args(["image", "compress"])
        .arg(raw)
        .arg(out)
        .args(["--frame-kib", &frame_kib.to_string()])
        .output()
        .expect("run uffdctl image compress");
    assert!(
        o.status.success(),
        "uffdctl image compress failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

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
    s.create_vm(json!({
        "memory_mib": mib,
        "memory_source": {"kind": "zstd", "path": path},
    }))
}

fn wait_failed(s: &TestServer, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = s.vm(id);
        if v["state"] == "failed" {
            return v;
        }
        assert!(Instant::now() < deadline, "{id} did not fail: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
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
    compress(raw.file.path(), &zst, 192);
    let info = inspect(&zst);
    assert_eq!(info["memory_bytes"], mib << 20, "{info}");
    assert_eq!(info["frames"], 171, "{info}");
    assert!(info["zero_frames"].as_u64().unwrap() >= 1, "{info}");
    assert!(info["ratio"].as_f64().unwrap() > 1.5, "{info}");

    let s = TestServer::start();
    let id = zstd_vm(&s, mib, &zst);
    let before = s.vm(&id);
    assert!(pages_by(&before, "zstd") > 0, "{before}");
    let pages = pages_of(mib);
    assert_eq!(
        s.digest(&id, 0, pages),
        expected_digest(&raw.bytes, 0, pages),
        "memory served from memory.zst differs from the original"
    );
    let after = s.vm(&id);
    assert!(
        fault_counter(&after, "frame_waits") > 0,
        "no fault waited for a frame: {after}"
    );
    // The VM writes over what it read, as any VM does.
    s.fill(&id, 100, 50, 3);
    assert_eq!(s.verify(&id, 100, 50, 3), 0);

    // Prefetched before it starts (frames decoded by the pool while the
    // create waits): every byte there without a single fault.
    let pre = s.create_vm(json!({
        "memory_mib": mib,
        "memory_source": {"kind": "zstd", "path": zst},
        "prefetch": true,
    }));
    assert_eq!(
        s.digest(&pre, 0, pages),
        expected_digest(&raw.bytes, 0, pages),
        "prefetched from memory.zst"
    );
    assert_eq!(fault_counter(&s.vm(&pre), "missing"), 0, "{}", s.vm(&pre));
    s.assert_healthy();
}

#[test]
fn a_vm_restored_from_a_compressed_snapshot_reads_its_memory() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let mib = 64;
    let pages = pages_of(mib);
    let vm = s.create_vm(json!({ "memory_mib": mib }));
    s.fill(&vm, 0, 3000, 1);
    s.fill(&vm, 9000, 333, 7);
    let want = s.digest(&vm, 0, pages);
    let (st, r) = s.api(
        "POST",
        &format!("/v1/vms/{vm}/snapshots"),
        Some(json!({"name": "z1", "compress": true})),
    );
    assert_eq!(st, 201, "{r}");
    let zbytes = r["compressed_bytes"].as_u64().expect("compressed_bytes");
    let zpath = s.state_dir().join("snapshots/z1/memory.zst");
    assert_eq!(std::fs::metadata(&zpath).expect("memory.zst").len(), zbytes);
    let (_, info) = s.api("GET", "/v1/snapshots/z1", None);
    assert_eq!(info["compressed_bytes"], zbytes, "{info}");
    s.fill(&vm, 0, 10, 2); // the original moves on

    let restored = s.create_vm(json!({ "from_snapshot": "z1" }));
    let v = s.vm(&restored);
    assert!(pages_by(&v, "zstd") > 0, "served from memory.zst: {v}");
    // Where an untouched page's bytes are: the compressed snapshot, which
    // frame, and where that frame starts in memory.zst.
    let page = 9100;
    let (st, e) = s.api(
        "GET",
        &format!("/v1/vms/{restored}/pages/{page}?explain=true"),
        None,
    );
    assert_eq!(st, 200, "{e}");
    let chain = e["explain"]["chain"].as_array().expect("a chain");
    let last = chain.last().expect("a step");
    assert_eq!(last["kind"], "zstd", "{e}");
    assert_eq!(last["at"], "snapshot:z1 (zstd)", "{e}");
    assert_eq!(last["frame"], page / 64, "256 KiB frames: {e}");
    assert_eq!(last["file"], zpath.display().to_string(), "{e}");
    let img = zst::Image::open(&zpath).expect("memory.zst");
    assert_eq!(
        last["offset"].as_u64(),
        Some(img.entries()[usize::try_from(page / 64).unwrap()].offset),
        "{e}"
    );
    let (_, src) = s.api("GET", &format!("/v1/vms/{restored}/sources"), None);
    assert!(
        src["by_source"].get("snapshot:z1 (zstd)").is_some(),
        "sources name the compressed snapshot: {src}"
    );
    assert_eq!(
        s.digest(&restored, 0, pages),
        want,
        "restored memory differs"
    );

    // An incremental snapshot of it takes memory.img of z1 as its base.
    s.fill(&restored, 500, 20, 9);
    let want2 = s.digest(&restored, 0, pages);
    let (st, r) = s.api(
        "POST",
        &format!("/v1/vms/{restored}/snapshots"),
        Some(json!({"name": "z2", "mode": "incremental"})),
    );
    assert_eq!(st, 201, "{r}");
    assert_eq!(r["mode_used"], "incremental", "{r}");
    let again = s.create_vm(json!({ "from_snapshot": "z2" }));
    assert_eq!(s.digest(&again, 0, pages), want2, "incremental over zstd");

    // A Firecracker-protocol client served from the compressed snapshot.
    let socket = s.state_dir().join("fc-z1.sock");
    let (st, l) = s.api(
        "POST",
        "/v1/firecracker/listeners",
        Some(json!({"socket": socket, "memory_source": {"kind": "snapshot", "name": "z1"}})),
    );
    assert_eq!(st, 201, "{l}");
    let raw = s.state_dir().join("snapshots/z1/memory.img");
    let check = format!("check:{}", raw.display());
    let mut client = FcClient::spawn(&socket, &["--mib", &mib.to_string()], &[&check]);
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
    compress(raw.file.path(), &zst, 64);
    let s = TestServer::start();
    let socket = s.state_dir().join("fc.sock");
    let (st, l) = s.api(
        "POST",
        "/v1/firecracker/listeners",
        Some(json!({"socket": socket, "memory_source": {"kind": "zstd", "path": zst}})),
    );
    assert_eq!(st, 201, "{l}");
    assert_eq!(l["memory_source"]["kind"], "zstd", "{l}");
    let check = format!("check:{}", raw.path());
    let mut client = FcClient::spawn(
        &socket,
        &["--mib", &mib.to_string()],
        &["zero:0:2000", "zero:5000:40", &check],
    );
    let checked = client.until(&check);
    assert_eq!(checked["mismatched_pages"], 0, "{checked}");
    client.finish();

    // A recorded working set is prefetched from the compressed image too:
    // the second client's check hardly faults, and reads the right bytes.
    let ws_socket = s.state_dir().join("fc-ws.sock");
    let (st, l) = s.api(
        "POST",
        "/v1/firecracker/listeners",
        Some(json!({"socket": ws_socket, "working_set": true,
                    "memory_source": {"kind": "zstd", "path": zst}})),
    );
    assert_eq!(st, 201, "{l}");
    let lid = l["id"].as_str().expect("listener id").to_owned();
    FcClient::spawn(&ws_socket, &["--mib", &mib.to_string()], &["touch-seq"]).finish();
    let recorded = || {
        let (_, v) = s.api("GET", "/v1/firecracker/listeners", None);
        v["listeners"]
            .as_array()
            .and_then(|a| a.iter().find(|l| l["id"] == lid.as_str()).cloned())
            .unwrap_or_default()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while recorded()["recorded_pages"].as_u64().unwrap_or(0) == 0 {
        assert!(
            Instant::now() < deadline,
            "no working set was recorded: {}",
            recorded()
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
    let (_, vms) = s.api("GET", "/v1/vms", None);
    let fc = vms["vms"]
        .as_array()
        .and_then(|a| {
            a.iter()
                .find(|v| v["pid"].as_u64() == Some(u64::from(client.pid())))
                .cloned()
        })
        .expect("the client's VM is listed");
    let v = s.vm(fc["id"].as_str().expect("id"));
    assert!(
        fault_counter(&v, "missing") < pages_of(mib) / 10,
        "the working set was not prefetched from memory.zst: {v}"
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
    compress(raw.file.path(), &good, 64);
    let s = TestServer::start();
    let other = s.create_vm(json!({"memory_mib": 16}));
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
    let socket = s.state_dir().join("fc-bad.sock");
    let (st, l) = s.api(
        "POST",
        "/v1/firecracker/listeners",
        Some(json!({"socket": socket, "memory_source": {"kind": "zstd", "path": flipped}})),
    );
    assert_eq!(st, 201, "{l}");
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
        let (status, body) =
            s.try_exec(&id, json!({"op": "touch", "start_page": page, "pages": 1}));
        assert!(
            status >= 400,
            "touching a corrupt frame answered {status}: {body}"
        );
        let v = wait_failed(&s, &id);
        let failure = v["failure"].as_str().unwrap_or_default();
        assert!(
            failure.contains(&format!("frame {bad}"))
                && why.split('|').any(|w| failure.contains(w)),
            "the failure does not say which frame and why ({why}): {v}"
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
        let (status, v) = s.api(
            "POST",
            "/v1/vms",
            Some(json!({"memory_mib": mib, "memory_source": {"kind": "zstd", "path": path}})),
        );
        assert!(
            (400..500).contains(&status),
            "{}: {status} {v}",
            path.display()
        );
        let msg = v["error"].as_str().unwrap_or_default();
        assert!(
            msg.contains("memory.zst") && msg.contains(want),
            "{}: the error does not say why: {v}",
            path.display()
        );
    }
    assert_eq!(s.verify(&other, 0, pages_of(16), 4), 0);
    s.assert_healthy();
}
