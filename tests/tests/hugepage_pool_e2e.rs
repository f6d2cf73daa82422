//! A hugepage VM that touches more 2 MiB blocks than the host has free
//! huge pages (guest RAM is mapped without a reservation, so a VM may be
//! larger than the pool): its VM fails with an error that says so, and
//! the server goes on serving everyone else.
//!
//! This uses up the host's whole pool for a moment, so it lives in a test
//! binary of its own: `scripts/test.sh` (`cargo test`) runs binaries one
//! after another, and nothing else takes huge pages meanwhile.

use pagefork_tests::{free_hugepages, require_hugepages, TestServer};
use serde_json::json;

/// 4 KiB pages per block.
const BLOCK: u64 = 512;

/// The kernel answers a UFFDIO_COPY it finds no huge page for with EEXIST
/// (not ENOMEM) once the block's page table exists. Taken for "already
/// there", the block was marked present and its fault woken again and
/// again: the guest spun on one page and its request never returned.
#[test]
fn a_hugepage_vm_beyond_the_free_pool_fails_clearly_and_others_go_on() {
    if !require_hugepages(8) {
        return;
    }
    let s = TestServer::start();
    let other = s.create_vm(json!({"memory_mib": 4}));
    let free = free_hugepages();
    let blocks = free + 4;
    let id = s.create_vm(json!({"memory_mib": blocks * 2, "hugepages": true}));
    // One write per block, until one finds no page.
    let mut failed = None;
    for b in 0..blocks {
        let (status, v) = s.try_exec(
            &id,
            json!({"op": "fill", "start_page": b * BLOCK, "pages": 1, "seed": 1}),
        );
        if status != 200 {
            failed = Some((b, v));
            break;
        }
    }
    let (b, answer) = failed.unwrap_or_else(|| {
        panic!(
            "{id} wrote {blocks} blocks with {free} huge pages free: {}",
            s.vm(&id)
        )
    });
    assert!(
        b >= free.saturating_sub(8),
        "{id} failed at block {b} with {free} huge pages free: {answer}"
    );
    let v = s.vm(&id);
    assert_eq!(v["state"], "failed", "{v}");
    let failure = v["failure"].as_str().unwrap_or_default();
    assert!(
        failure.contains("huge page") && failure.contains("nr_hugepages"),
        "the failure does not say the pool is used up: {v}"
    );
    // Everyone else is served as before.
    s.fill(&other, 0, 1024, 3);
    assert_eq!(s.verify(&other, 0, 1024, 3), 0);
    // Deleting the VM gives its huge pages back.
    let (st, body) = s.api("DELETE", &format!("/v1/vms/{id}"), None);
    assert!(st < 300, "DELETE {id}: {body}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while free_hugepages() < free {
        assert!(
            std::time::Instant::now() < deadline,
            "{} huge pages free 10 s after deleting {id}, {free} before it",
            free_hugepages()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
