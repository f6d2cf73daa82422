//! One page resolver for both kinds of VM: a pagefork VM (guest RAM in a
//! memfd, pages written through the server's mapping) and a Firecracker
//! client (anonymous memory, pages installed with UFFDIO_COPY) read the
//! same image with the same fault-around and readahead settings and the
//! same access pattern. They must be given the same pages, with the same
//! number of MISSING faults, and read the image's bytes exactly.
//!
//! Needs KVM and userfaultfd: without them it skips with a printed reason,
//! and fails under `CI=true`.

use std::time::{Duration, Instant};

use pagefork_tests::{
    expected_digest, fault_counter, pages_of, require_kvm_uffd, FcClient, RandomImage, TestServer,
};
use serde_json::{json, Value};

/// How long a client command or a state change may take.
const TIMEOUT: Duration = Duration::from_secs(120);

/// Page ranges `(start, pages)` read in this order by both VMs: a long
/// sequential read (readahead grows), an unaligned jump, a re-read of
/// installed pages running on into new ones, the end of memory, one lone
/// page.
const PATTERN: [(u64, u64); 5] = [(0, 600), (1005, 40), (590, 60), (4076, 20), (2051, 1)];

/// Start a Firecracker listener serving `image`; returns its socket.
fn add_listener(
    s: &TestServer,
    image: &RandomImage,
    fault_around_kib: u64,
    readahead_kib: u64,
) -> std::path::PathBuf {
    let socket = s.state_dir().join("fc.sock");
    let body = json!({
        "socket": socket,
        "memory_source": image.source(),
        "fault_around_kib": fault_around_kib,
        "readahead_kib": readahead_kib,
    });
    let (status, v) = s.api("POST", "/v1/firecracker/listeners", Some(body.clone()));
    assert_eq!(status, 201, "POST /v1/firecracker/listeners {body}: {v}");
    socket
}

/// The Firecracker VM of client `pid` as `GET /v1/vms/{id}` shows it.
fn fc_vm(s: &TestServer, pid: u32) -> Value {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let (status, v) = s.api("GET", "/v1/vms", None);
        assert_eq!(status, 200, "GET /v1/vms: {v}");
        let id = v["vms"].as_array().and_then(|vms| {
            vms.iter()
                .find(|vm| {
                    vm["kind"] == "firecracker" && vm["pid"].as_u64() == Some(u64::from(pid))
                })
                .and_then(|vm| vm["id"].as_str().map(str::to_owned))
        });
        if let Some(id) = id {
            return s.vm(&id);
        }
        assert!(
            Instant::now() < deadline,
            "fc_client pid {pid} never listed: {v}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The VM's table as `(start_page, pages, kind)` extents, where kind is
/// "installed" for the VM's own pages and the source kind otherwise.
fn installed_extents(s: &TestServer, vm: &Value) -> Vec<(u64, u64, String)> {
    let id = vm["id"].as_str().expect("vm id");
    let (status, v) = s.api("GET", &format!("/v1/vms/{id}/sources"), None);
    assert_eq!(status, 200, "GET /v1/vms/{id}/sources: {v}");
    v["extents"]
        .as_array()
        .unwrap_or_else(|| panic!("no extents in {v}"))
        .iter()
        .map(|e| {
            let source = e["source"].as_str().expect("extent source");
            let kind = if source == id {
                "installed".to_owned()
            } else {
                source.split(':').next().unwrap_or(source).to_owned()
            };
            let n = |k: &str| e[k].as_u64().unwrap_or_else(|| panic!("no {k} in {e}"));
            (n("start_page"), n("pages"), kind)
        })
        .collect()
}

#[test]
fn pagefork_and_firecracker_vms_install_the_same_pages_for_the_same_reads() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 16;
    let pages = pages_of(mib);
    let image = RandomImage::new(mib, 0x5e50_1e00);
    // Fault-around off; and 64 KiB blocks with readahead up to 512 KiB.
    for (fault_around_kib, readahead_kib) in [(0, 0), (64, 512)] {
        let what = format!("fault_around_kib {fault_around_kib}, readahead_kib {readahead_kib}");
        let s = TestServer::start();

        // Arrange: a pagefork VM and a Firecracker client on one image.
        let ours = s.create_vm(json!({
            "memory_mib": mib,
            "memory_source": image.source(),
            "fault_around_kib": fault_around_kib,
            "readahead_kib": readahead_kib,
        }));
        let socket = add_listener(&s, &image, fault_around_kib, readahead_kib);
        let mut commands: Vec<String> = PATTERN
            .iter()
            .map(|(start, n)| format!("zero:{start}:{n}"))
            .collect();
        let last_read = commands.last().cloned().expect("a pattern");
        commands.push("hold".into());
        let check = format!("check:{}", image.path());
        commands.push(check.clone());

        // Act: the same reads on both, page by page in the same order.
        for (start, n) in PATTERN {
            s.touch(&ours, start, n, false);
        }
        let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
        let mut client = FcClient::spawn(&socket, &["--mib", &mib.to_string()], &commands);
        client.until(&last_read);

        // Assert: the same faults and the same pages installed.
        let ours_vm = s.vm(&ours);
        let fc = fc_vm(&s, client.pid());
        for counter in ["missing", "pages_installed"] {
            assert_eq!(
                fault_counter(&ours_vm, counter),
                fault_counter(&fc, counter),
                "{what}: {counter} differs: pagefork {ours_vm} vs firecracker {fc}"
            );
        }
        let touched: u64 = PATTERN.iter().map(|(_, n)| n).sum();
        let missing = fault_counter(&fc, "missing");
        assert!(missing > 0, "{what}: no faults at all: {fc}");
        if fault_around_kib > 0 {
            assert!(
                missing < touched / 4,
                "{what}: fault-around saves no faults: {fc}"
            );
        }
        assert_eq!(
            installed_extents(&s, &ours_vm),
            installed_extents(&s, &fc),
            "{what}: different pages installed"
        );

        // And both read the image's bytes exactly, every page.
        client.release();
        let checked = client.until(&check);
        assert_eq!(
            checked["mismatched_pages"], 0,
            "{what}: firecracker: {checked}"
        );
        client.finish();
        assert_eq!(
            s.digest(&ours, 0, pages),
            expected_digest(&image.bytes, 0, pages),
            "{what}: pagefork VM's memory differs from the image"
        );
        s.assert_healthy();
    }
}
