//! Reclaim's pages, one VM at a time, through the real path (KVM, the
//! VMM's uffd, the swap store's file): `POST /v1/vms/{id}/reclaim` gives
//! back every page it can, and every later read, fork, snapshot, restore,
//! rollback and restart of the server finds the VM's bytes as they were
//! (`digest`, every byte). And the bad cases: a swap store whose disk is
//! full, a damaged frame, a server SIGKILLed with pages swapped out.
//!
//! - `a_reclaimed_vm_reads_its_bytes_back_through_every_operation`
//! - `a_crash_with_pages_swapped_out_serves_them_after_the_restart`
//! - `a_damaged_swap_frame_fails_only_its_vm_with_the_reason`
//! - `a_full_swap_disk_keeps_written_pages_and_still_drops_clean_ones`
//! - `an_opted_out_vm_is_never_reclaimed`
//! - `a_vm_on_a_shared_base_gives_back_the_pages_it_wrote`
//! - `a_fork_child_keeps_the_frames_its_parent_swaps_again`
//! - `operations_wait_for_a_reclaim_pass_over_a_vm_on_a_shared_base`

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use pagefork_tests::{
    new_vm, require_kvm_uffd, signal, wait_for, OneShot, RandomImage, TestServer,
};
use proto::api::{CreateVm, ReclaimPolicy, RunState, SnapshotMode};

/// Guest RAM of the VMs here.
const MIB: u64 = 32;
const PAGES: u64 = MIB * 256;
/// The first half is written (swapped when reclaimed), the second read
/// only (zero pages: dropped).
const WRITTEN: u64 = PAGES / 2;

/// A VM whose first half holds `seed`'s pattern and whose second half
/// was read (zero pages present); returns its id and whole digest.
fn half_written(s: &TestServer, seed: u64) -> (String, u64) {
    let vm = s.create_vm(&new_vm(MIB));
    s.fill(&vm, 0, WRITTEN, seed);
    s.touch(&vm, WRITTEN, PAGES - WRITTEN, false);
    let d = s.digest(&vm, 0, PAGES);
    (vm, d)
}

/// Reclaim `vm` and check it gave back both kinds of page.
fn reclaim_all(s: &TestServer, vm: &str) {
    let r = s.reclaim(vm);
    assert!(
        r.swapped_pages >= WRITTEN * 9 / 10,
        "{vm}: the written half was not swapped: {r:?}"
    );
    assert!(
        r.dropped_pages >= (PAGES - WRITTEN) * 9 / 10,
        "{vm}: the zero half was not dropped: {r:?}"
    );
    let v = s.vm(vm);
    assert!(
        v.resident_pages < PAGES / 10,
        "{vm}: {} pages still resident after reclaim",
        v.resident_pages
    );
    assert_eq!(v.reclaim.swapped_pages, r.swapped_pages, "{v:?}");
}

/// The swap store's file of the server on `state`.
fn store_file(state: &Path) -> PathBuf {
    state.join("swap").join("pages")
}

#[test]
fn a_reclaimed_vm_reads_its_bytes_back_through_every_operation() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let (vm, d) = half_written(&s, 0x51);
    s.snapshot(&vm, "before", SnapshotMode::Full);
    reclaim_all(&s, &vm);

    // Explain names the page's place in the store.
    let info = s.explain(&vm, 3);
    let last = info
        .explain
        .as_ref()
        .and_then(|e| e.chain.last().cloned())
        .expect("a chain");
    assert_eq!(last.kind, "swap", "{info:?}");
    assert!(
        last.file
            .as_deref()
            .is_some_and(|f| f.ends_with("swap/pages")),
        "{info:?}"
    );
    assert!(last.offset.is_some(), "{info:?}");
    let m = s.memory();
    assert!(m.reclaim, "{m:?}");
    assert!(m.swap.pages >= WRITTEN * 9 / 10, "{m:?}");
    assert!(m.given_back_bytes >= (PAGES * 9 / 10) * 4096, "{m:?}");

    // A fork shares the swapped pages; a snapshot reads them from the
    // store; both see every byte.
    let child = s.fork_one(&vm);
    assert_eq!(
        s.digest(&child, 0, PAGES),
        d,
        "the fork child of a reclaimed VM"
    );
    s.snapshot(&vm, "after", SnapshotMode::Full);
    let restored = s.restore("after");
    assert_eq!(
        s.digest(&restored, 0, PAGES),
        d,
        "a restore of its snapshot"
    );
    // The VM itself, and after its pages came back.
    assert_eq!(s.digest(&vm, 0, PAGES), d, "the reclaimed VM");
    assert_eq!(s.verify(&vm, 0, WRITTEN, 0x51), 0);
    assert!(s.vm(&vm).reclaim.refaults > 0);
    // Reclaimed again, then written over, then rolled back.
    s.reclaim(&vm);
    s.fill(&vm, 0, 64, 0x52);
    s.reclaim(&vm);
    assert_eq!(s.verify(&vm, 0, 64, 0x52), 0);
    s.rollback(&vm, "before");
    assert_eq!(
        s.digest(&vm, 0, PAGES),
        d,
        "rolled back to before the reclaim"
    );
    // The child still reads the frames its parent no longer names.
    s.reclaim(&child);
    assert_eq!(
        s.digest(&child, 0, PAGES),
        d,
        "the child after its own reclaim"
    );
    for id in [&child, &restored, &vm] {
        s.delete_vm(id);
    }
    // Nothing names a frame any more: the store lets them go (within a
    // window of the reclaim loop).
    let emptied = wait_for(Duration::from_secs(10), || {
        (s.memory().swap.pages == 0).then_some(())
    });
    assert!(emptied.is_some(), "frames left: {:?}", s.memory().swap);
    s.assert_healthy();
    assert_first_process(&s);
}

#[test]
fn a_crash_with_pages_swapped_out_serves_them_after_the_restart() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let (vm, d) = half_written(&s, 0x61);
    reclaim_all(&s, &vm);
    // A child made after the reclaim reads its parent's frames.
    let child = s.fork_one(&vm);
    assert!(s.vm(&child).reclaim.swapped_pages >= WRITTEN * 9 / 10);
    crash_and_expect(&s, &[(&vm, d), (&child, d)]);
    // The store still serves them after a second reclaim, in the new
    // process.
    s.fill(&vm, 0, 16, 0x62);
    s.reclaim(&vm);
    assert_eq!(s.verify(&vm, 0, 16, 0x62), 0);
    assert_eq!(s.verify(&vm, 16, WRITTEN - 16, 0x61), 0);
}

#[test]
fn a_damaged_swap_frame_fails_only_its_vm_with_the_reason() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let (a, _) = half_written(&s, 0x71);
    let (b, db) = half_written(&s, 0x72);
    reclaim_all(&s, &a);
    reclaim_all(&s, &b);
    // Damage the payload of a's page 5 in the store's file (its frame's
    // header is 56 bytes; the compressed page is a few dozen more).
    let info = s.explain(&a, 5);
    let offset = info
        .explain
        .as_ref()
        .and_then(|e| e.chain.last())
        .and_then(|l| l.offset)
        .expect("the frame's offset");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(store_file(s.state_dir()))
        .expect("the swap store's file");
    let at = offset + 56 + 6;
    let mut byte = [0u8; 1];
    f.read_exact_at(&mut byte, at).expect("read the frame");
    byte[0] ^= 0xff;
    f.write_all_at(&byte, at).expect("damage the frame");
    drop(f);

    let r = s.try_exec(&a, &pagefork_tests::op::verify(5, 1, 0x71));
    assert!(r.is_err(), "a read a damaged page: {r:?}");
    let v = s.vm(&a);
    assert_eq!(v.state, RunState::Failed, "{v:?}");
    let why = v.failure.unwrap_or_default();
    assert!(
        why.contains("swap store") && why.contains("damaged"),
        "the failure does not say why: {why}"
    );
    // b, which shares the store, is whole.
    assert_eq!(s.digest(&b, 0, PAGES), db);
    s.delete_vm(&a);
    s.delete_vm(&b);
}

#[test]
fn a_full_swap_disk_keeps_written_pages_and_still_drops_clean_ones() {
    if !require_kvm_uffd() {
        return;
    }
    // A real full disk: the store on a 64 KiB tmpfs (a page of the
    // guest's fill pattern compresses to a frame of under 100 bytes).
    let dir = tempfile::tempdir().expect("a temp dir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
        .arg(dir.path())
        .status()
        .is_ok_and(|st| st.success());
    if !mounted {
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true"),
            "CI=true but a tmpfs cannot be mounted (the test needs root)"
        );
        eprintln!("skipping: cannot mount a tmpfs (not root?)");
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(dir.path().to_owned());
    let swap = dir.path().display().to_string();
    let s = TestServer::start_with_args(&["--swap-dir", &swap]);
    let (vm, d) = half_written(&s, 0x81);
    let r = s.reclaim(&vm);
    // At most what fits in 64 KiB went to the store; the zero half was
    // dropped all the same; the rest stays in memory.
    assert!(r.swapped_pages < WRITTEN / 2, "{r:?}");
    assert!(r.kept_pages > WRITTEN / 2, "{r:?}");
    assert!(r.dropped_pages >= (PAGES - WRITTEN) * 9 / 10, "{r:?}");
    // The store says it is full, or it has just been told to try again
    // (once per thrashing window), and then its file fills the disk.
    let m = s.memory();
    assert!(
        m.swap.full || m.swap.file_bytes + 4096 > 64 * 1024,
        "the store on a full 64 KiB disk: {m:?}"
    );
    assert_eq!(
        s.digest(&vm, 0, PAGES),
        d,
        "a VM reclaimed with its store full"
    );
    s.delete_vm(&vm);
}

#[test]
fn an_opted_out_vm_is_never_reclaimed() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let vm = s.create_vm(&CreateVm {
        reclaim: Some(ReclaimPolicy {
            enabled: false,
            limit_mib: None,
        }),
        ..new_vm(MIB)
    });
    s.fill(&vm, 0, 256, 0x91);
    let r = s
        .try_reclaim(&vm)
        .expect_err("reclaim of an opted-out VM answered");
    r.assert_error(409, "opted out", "reclaim of an opted-out VM");
    let v = s.vm(&vm);
    assert!(!v.reclaim.enabled, "{v:?}");
    assert_eq!(v.reclaim.swapped_pages, 0);
    // A VM with its own limit gives back what it holds beyond it, without
    // any pressure on the host.
    let capped = s.create_vm(&CreateVm {
        reclaim: Some(ReclaimPolicy {
            enabled: true,
            limit_mib: Some(4),
        }),
        ..new_vm(MIB)
    });
    s.fill(&capped, 0, WRITTEN, 0x92);
    let under = wait_for(Duration::from_secs(20), || {
        let v = s.vm(&capped);
        (v.resident_pages <= 4 * 256 + 256).then_some(v)
    });
    assert!(
        under.is_some(),
        "a VM limited to 4 MiB still holds {} pages",
        s.vm(&capped).resident_pages
    );
    assert_eq!(s.verify(&capped, 0, WRITTEN, 0x92), 0);
    s.delete_vm(&vm);
    s.delete_vm(&capped);
    assert_first_process(&s);
}

#[test]
fn a_vm_on_a_shared_base_gives_back_the_pages_it_wrote() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    // A VM from an image maps the image's shared base; what its guest
    // writes lives in its VMM's private pages, which the server cannot
    // punch: the VMM drops them (paused) once they are saved.
    let image = RandomImage::new(MIB, 0x5eed_0b5e);
    let vm = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        ..new_vm(MIB)
    });
    assert!(
        s.vm(&vm).memory.base.is_some(),
        "an image VM is not on a shared base: {:?}",
        s.vm(&vm).memory
    );
    s.fill(&vm, 0, WRITTEN, 0x71);
    s.touch(&vm, WRITTEN, PAGES - WRITTEN, false);
    let d = s.digest(&vm, 0, PAGES);
    let own = s.vm(&vm).memory.own_bytes;
    assert!(own >= WRITTEN * 4096 * 9 / 10, "{:?}", s.vm(&vm).memory);
    s.snapshot(&vm, "before", SnapshotMode::Full);

    let r = s.reclaim(&vm);
    assert!(
        r.swapped_pages >= WRITTEN * 9 / 10,
        "the written half was not swapped: {r:?}"
    );
    let after = s.vm(&vm);
    assert!(
        after.memory.own_bytes < own / 10,
        "its VMM still holds {} of {own} bytes after the reclaim",
        after.memory.own_bytes
    );
    assert_eq!(after.state, RunState::Running, "{after:?}");
    let last = s
        .explain(&vm, 3)
        .explain
        .and_then(|e| e.chain.last().cloned())
        .expect("a chain");
    assert_eq!(last.kind, "swap", "{last:?}");

    // Read back from the store; the image's half from the base.
    assert_eq!(s.digest(&vm, 0, PAGES), d, "the reclaimed VM");
    assert_eq!(s.verify(&vm, 0, WRITTEN, 0x71), 0);
    assert!(s.vm(&vm).reclaim.refaults > 0);
    // Written over, reclaimed again, forked, snapshotted, restored.
    s.reclaim(&vm);
    s.fill(&vm, 0, 64, 0x72);
    s.reclaim(&vm);
    assert_eq!(s.verify(&vm, 0, 64, 0x72), 0);
    let d2 = s.digest(&vm, 0, PAGES);
    s.reclaim(&vm);
    let child = s.fork_one(&vm);
    assert_eq!(s.digest(&child, 0, PAGES), d2, "its fork child");
    s.snapshot(&vm, "after", SnapshotMode::Full);
    let restored = s.restore("after");
    assert_eq!(s.digest(&restored, 0, PAGES), d2, "a restore of it");
    s.rollback(&vm, "before");
    assert_eq!(s.digest(&vm, 0, PAGES), d, "rolled back past the reclaims");
    s.assert_healthy();
    assert_first_process(&s);

    // A crash with its pages swapped out: served after the restart.
    s.reclaim(&vm);
    crash_and_expect(&s, &[(&vm, d), (&child, d2), (&restored, d2)]);
    for id in [&child, &restored, &vm] {
        s.delete_vm(id);
    }
    let emptied = wait_for(Duration::from_secs(10), || {
        (s.memory().swap.pages == 0).then_some(())
    });
    assert!(emptied.is_some(), "frames left: {:?}", s.memory().swap);
}

#[test]
fn a_fork_child_keeps_the_frames_its_parent_swaps_again() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    // The child copies its parent's entries, which name the parent's
    // swapped frames; the parent then rewrites those pages and swaps
    // them again: the child must still read the bytes it was forked
    // with, not the parent's new ones.
    let (vm, d) = half_written(&s, 0x81);
    reclaim_all(&s, &vm);
    let child = s.fork_one(&vm);
    s.fill(&vm, 0, WRITTEN, 0x82);
    let r = s.reclaim(&vm);
    assert!(r.swapped_pages >= WRITTEN * 9 / 10, "{r:?}");
    assert_eq!(
        s.digest(&child, 0, PAGES),
        d,
        "the child after its parent swapped again"
    );
    assert_eq!(s.verify(&vm, 0, WRITTEN, 0x82), 0, "the parent's new bytes");
    // The same over a shared base.
    let image = RandomImage::new(MIB, 0x5eed_0b5f);
    let based = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        ..new_vm(MIB)
    });
    s.fill(&based, 0, WRITTEN, 0x83);
    let d = s.digest(&based, 0, PAGES);
    s.reclaim(&based);
    let child = s.fork_one(&based);
    s.fill(&based, 0, WRITTEN, 0x84);
    s.reclaim(&based);
    assert_eq!(s.digest(&child, 0, PAGES), d, "the child of a VM on a base");
    assert_eq!(s.verify(&based, 0, WRITTEN, 0x84), 0);
    s.assert_healthy();
    assert_first_process(&s);
}

/// SIGKILL the serving process; once the next one serves, each VM of
/// `want` answers its whole `digest` as expected, running.
/// A pass over a VM on a shared base pauses it while it saves what the
/// VM wrote: a snapshot, pause and resume sent meanwhile wait for the
/// pass to end (never 409), and the reclaim goes on after them.
#[test]
fn operations_wait_for_a_reclaim_pass_over_a_vm_on_a_shared_base() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let image = RandomImage::new(MIB, 0x5eed_0b5f);
    let vm = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        ..new_vm(MIB)
    });
    assert!(s.vm(&vm).memory.base.is_some(), "{:?}", s.vm(&vm).memory);
    let client = OneShot::new(s.api_sock(), Duration::from_secs(60));
    let mut overlapped = 0;
    for round in 0..4u64 {
        s.fill(&vm, 0, WRITTEN, 0x80 + round);
        let d = s.digest(&vm, 0, PAGES);
        let name = format!("during-{round}");
        let (reclaimed, asked, answered, sent) = std::thread::scope(|scope| {
            let reclaim = scope.spawn(|| {
                let t0 = Instant::now();
                let r = s.reclaim(&vm);
                (r, t0, Instant::now())
            });
            // Into the pass: it pauses the VM while it reads, compresses
            // and stores its 16 MiB.
            std::thread::sleep(Duration::from_millis(20));
            let sent = Instant::now();
            for (method, path, body) in [
                (
                    "POST",
                    format!("/v1/vms/{vm}/snapshots"),
                    Some(serde_json::json!({ "name": name, "mode": "full" })),
                ),
                ("POST", format!("/v1/vms/{vm}/pause"), None),
                ("POST", format!("/v1/vms/{vm}/resume"), None),
            ] {
                let r = client
                    .request(method, &path, body.as_ref())
                    .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
                assert!(
                    (200..300).contains(&r.status),
                    "{method} {path} during a reclaim pass: {r}"
                );
            }
            let (r, t0, t1) = reclaim.join().expect("the reclaim thread");
            (r, t0, t1, sent)
        });
        if sent > asked && sent < answered {
            overlapped += 1;
        }
        assert!(
            reclaimed.swapped_pages >= WRITTEN * 9 / 10,
            "round {round}: the reclaim did not go on after the operations: {reclaimed:?}"
        );
        assert_eq!(s.digest(&vm, 0, PAGES), d, "round {round}: the VM");
        let restored = s.restore(&name);
        assert_eq!(
            s.digest(&restored, 0, PAGES),
            d,
            "round {round}: its snapshot"
        );
        s.delete_vm(&restored);
    }
    assert!(
        overlapped > 0,
        "no operation was sent while a reclaim ran: the test proved nothing"
    );
    assert_eq!(s.vm(&vm).state, RunState::Running);
    s.assert_healthy();
}

fn crash_and_expect(s: &TestServer, want: &[(&String, u64)]) {
    let before = s.pid();
    signal(before, Signal::SIGKILL);
    let restarted = wait_for(Duration::from_secs(30), || {
        s.health_now().filter(|h| h.pid != before)
    });
    assert!(
        restarted.is_some(),
        "no new serving process after a SIGKILL"
    );
    for (id, d) in want {
        let digest = wait_for(Duration::from_secs(30), || {
            s.try_exec(id, &pagefork_tests::op::digest(0, PAGES)).ok()
        })
        .unwrap_or_else(|| panic!("{id} never answered after the restart"));
        assert_eq!(
            digest.result, *d,
            "{id} after a crash with its pages swapped"
        );
        assert_eq!(s.vm(id).state, RunState::Running);
    }
}

/// The serving process is the one that started: reclaim never crashed it
/// (its keeper would have started another, hiding the crash).
fn assert_first_process(s: &TestServer) {
    let h = s.health_now().expect("a health answer");
    assert_eq!(h.start, "first", "the serving process was restarted: {h:?}");
}
