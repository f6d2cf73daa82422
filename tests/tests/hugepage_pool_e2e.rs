//! A hugepage VM that touches more 2 MiB blocks than the host has free
//! huge pages (guest RAM is mapped without a reservation, so a VM may be
//! larger than the pool): its VM fails with an error that says so, and
//! the server goes on serving everyone else.
//!
//! This uses up the host's whole pool for a moment, so it lives in a test
//! binary of its own: `scripts/test.sh` (`cargo test`) runs binaries one
//! after another, and nothing else takes huge pages meanwhile.

use std::time::{Duration, Instant};

use pagefork_tests::{free_hugepages, new_vm, op, require_hugepages, Reply, TestServer};
use proto::api::{CreateVm, RunState};

/// 4 KiB pages per block.
const BLOCK: u64 = 512;

/// Write one page per block of hugepage VM `id` until a write is refused.
/// Returns the block it failed at and the answer.
fn write_until_refused(s: &TestServer, id: &str, blocks: u64) -> (u64, Reply) {
    for b in 0..blocks {
        if let Err(v) = s.try_exec(id, &op::fill(b * BLOCK, 1, 1)) {
            return (b, v);
        }
    }
    panic!(
        "{id} wrote {blocks} blocks with {} huge pages free: {:?}",
        free_hugepages(),
        s.vm(id)
    );
}

/// Wait until the host has `free` huge pages free again.
fn wait_free(free: u64, after: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while free_hugepages() < free {
        assert!(
            Instant::now() < deadline,
            "{} huge pages free 10 s after {after}, {free} before",
            free_hugepages()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Both cases in one test: each uses up the whole pool for a moment.
///
/// 1. The kernel answers a UFFDIO_COPY it finds no huge page for with
///    EEXIST (not ENOMEM) once the block's page table exists. Taken for
///    "already there", the block was marked present and its fault woken
///    again and again: the guest spun on one page and its request never
///    returned. Now the VM fails and says why.
/// 2. A fork child whose pre-write block cannot be kept (no huge page to
///    copy it into) is marked failed, instead of reading its parent's
///    write from then on.
#[test]
fn a_used_up_hugepage_pool_fails_the_vm_that_needs_a_page_and_nobody_else() {
    if !require_hugepages(16) {
        return;
    }
    let s = TestServer::start();
    let other = s.create_vm(&new_vm(4));

    // 1. A VM larger than the pool touches a block too many.
    let free = free_hugepages();
    let blocks = free + 4;
    let id = s.create_vm(&CreateVm {
        hugepages: Some(true),
        ..new_vm(blocks * 2)
    });
    let (b, answer) = write_until_refused(&s, &id, blocks);
    assert!(
        b >= free.saturating_sub(8),
        "{id} failed at block {b} with {free} huge pages free: {answer}"
    );
    let v = s.vm(&id);
    assert_eq!(v.state, RunState::Failed, "{v:?}");
    let failure = v.failure.as_deref().unwrap_or_default();
    assert!(
        failure.contains("huge page") && failure.contains("nr_hugepages"),
        "the failure does not say the pool is used up: {v:?}"
    );
    s.fill(&other, 0, 1024, 3);
    assert_eq!(s.verify(&other, 0, 1024, 3), 0);
    s.delete_vm(&id);
    wait_free(free, &format!("deleting {id}"));

    // 2. A parent writes a block its child still reads, with no page left
    //    for the child's copy.
    let parent = s.create_vm(&CreateVm {
        hugepages: Some(true),
        ..new_vm(8)
    });
    s.fill(&parent, 0, 4 * BLOCK, 1);
    let child = s.fork_one(&parent);
    let free = free_hugepages();
    let hog = s.create_vm(&CreateVm {
        hugepages: Some(true),
        ..new_vm((free + 4) * 2)
    });
    let _ = write_until_refused(&s, &hog, free + 4);
    s.fill(&parent, 0, 1, 2);
    let v = s.vm(&child);
    assert_eq!(
        v.state,
        RunState::Failed,
        "{child} still runs on a block it lost: {v:?}"
    );
    let failure = v.failure.as_deref().unwrap_or_default();
    assert!(
        failure.contains("could not be kept") && failure.contains("nr_hugepages"),
        "the child's failure does not say why: {v:?}"
    );
    // The parent wrote, and keeps its memory; everyone else goes on.
    assert_eq!(s.verify(&parent, 0, 1, 2), 0);
    assert_eq!(s.verify(&parent, 1, 4 * BLOCK - 1, 1), 0);
    s.fill(&other, 0, 1024, 4);
    assert_eq!(s.verify(&other, 0, 1024, 4), 0);
    for id in [&hog, &child, &parent] {
        s.delete_vm(id);
    }
}
