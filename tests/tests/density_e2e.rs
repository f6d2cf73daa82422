//! Shared bases end to end: VMs forked from one paused template, restored
//! from one snapshot, or made from one compressed image map the clean
//! pages they read from one shared base instead of each copying them
//! (`uffd-server/src/bases.rs`). Real server, VMMs, KVM and userfaultfd.
//!
//! Host memory is what `/proc/meminfo` says holds guest RAM: `Shmem`
//! (memfds, bases), `AnonPages` (the pages VMs write, private to their
//! VMMs) and the huge pages in use. Each test measures it side by side:
//! after the VMs started (their fixed cost) and after each read its whole
//! working set, and checks every VM's memory exactly (`verify` and
//! `digest`). A base an image's first reader fills is paid once, by that
//! reader: the VMs measured come after it.
//!
//! Run: `cargo build --workspace && cargo test -p pagefork-tests --test
//! density_e2e -- --test-threads=1`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use pagefork_tests::{
    expected_digest, filled_zero_memory, new_vm, require_kvm_uffd, zstd_source, TestServer,
};
use proto::api::{CreateVm, SnapshotMode};

/// Guest RAM of each VM.
const MIB: u64 = 256;
/// Pages the template writes and each VM reads: 64 MiB.
const WORKING_SET: u64 = 16384;
/// VMs measured per test.
const VMS: u32 = 16;
const SEED: u64 = 7;
/// Host memory each VM may add by reading the working set: 5 % of it.
const READ_ALLOWANCE_KIB: u64 = WORKING_SET * 4 * 5 / 100;

/// These tests measure host-wide memory: one at a time.
static HOST: Mutex<()> = Mutex::new(());

/// A `kB` field of /proc/meminfo.
fn meminfo_kib(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").expect("read /proc/meminfo");
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/meminfo"))
}

/// Host memory holding guest RAM, KiB: Shmem + AnonPages + huge pages in
/// use.
fn host_kib() -> u64 {
    let huge = meminfo_kib("HugePages_Total:").saturating_sub(meminfo_kib("HugePages_Free:"));
    meminfo_kib("Shmem:") + meminfo_kib("AnonPages:") + huge * meminfo_kib("Hugepagesize:")
}

/// [`host_kib`] once it stopped moving (VMMs that just started, pages
/// freed late), within a few seconds.
fn settled_host_kib() -> u64 {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut last = host_kib();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = host_kib();
        if now.abs_diff(last) < 512 || Instant::now() > deadline {
            return now.min(last);
        }
        last = now;
    }
}

/// The `digest` of the working set as the template wrote it.
fn working_set_digest() -> u64 {
    let mem = filled_zero_memory(WORKING_SET * 4 / 1024, SEED);
    expected_digest(&mem, 0, WORKING_SET)
}

/// Every VM of `vms` reads its whole working set and holds it exactly.
fn read_and_check(s: &TestServer, vms: &[String], want: u64) {
    for v in vms {
        assert_eq!(s.verify(v, 0, WORKING_SET, SEED), 0, "{v} verify");
        assert_eq!(s.digest(v, 0, WORKING_SET), want, "{v} digest");
    }
}

/// Check what `vms` added to host memory by reading their working sets
/// (`after - started`) against the allowance; print what they cost.
fn assert_shared(what: &str, vms: usize, before: u64, started: u64, after: u64) {
    let n = vms as u64;
    let per_vmm = started.saturating_sub(before) / n;
    let per_read = after.saturating_sub(started) / n;
    eprintln!(
        "{what}: {vms} VMs, each {per_vmm} KiB to start, {per_read} KiB to read {} KiB \
         ({:.3}x its working set)",
        WORKING_SET * 4,
        per_read as f64 / (WORKING_SET * 4) as f64
    );
    assert!(
        per_read <= READ_ALLOWANCE_KIB,
        "{what}: each VM added {per_read} KiB reading its {} KiB working set \
         (at most {READ_ALLOWANCE_KIB} KiB, 5 %): its clean pages are copied, not shared",
        WORKING_SET * 4
    );
}

/// Start the VMs `make` makes, have each read its working set (checked
/// against `want`), and assert they share what they read; returns them.
fn assert_vms_share(
    s: &TestServer,
    what: &str,
    want: u64,
    make: impl FnOnce() -> Vec<String>,
) -> Vec<String> {
    let before = settled_host_kib();
    let vms = make();
    let started = settled_host_kib();
    read_and_check(s, &vms, want);
    let after = settled_host_kib();
    assert_shared(what, vms.len(), before, started, after);
    vms
}

/// A 256 MiB VM that wrote its working set, paused.
fn template(s: &TestServer) -> String {
    let t = s.create_vm(&new_vm(MIB));
    s.fill(&t, 0, WORKING_SET, SEED);
    s.pause(&t);
    t
}

#[test]
fn children_of_a_template_share_the_pages_they_read() {
    let _host = HOST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let t = template(&s);
    let want = working_set_digest();
    let children = assert_vms_share(&s, "template children", want, || s.fork(&t, VMS).children);
    // The template, resumed, still holds its own memory, and what it
    // writes now is its own: its children keep the pages as they were.
    s.resume(&t);
    assert_eq!(s.digest(&t, 0, WORKING_SET), want);
    s.fill(&t, 0, 64, SEED + 1);
    read_and_check(&s, &children[..2], want);
    s.assert_healthy();
}

/// Snapshot "gold" of a [`template`] (then deleted); returns the digest of
/// its working set.
fn gold_snapshot(s: &TestServer) -> u64 {
    let t = template(s);
    s.resume(&t);
    s.snapshot(&t, "gold", SnapshotMode::Full);
    s.delete_vm(&t);
    working_set_digest()
}

#[test]
fn restores_of_one_snapshot_share_the_pages_they_read() {
    let _host = HOST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let want = gold_snapshot(&s);
    // The first restore's reads fill the snapshot's base.
    let first = s.restore("gold");
    read_and_check(&s, std::slice::from_ref(&first), want);
    assert_vms_share(&s, "restores of one snapshot", want, || {
        (0..VMS).map(|_| s.restore("gold")).collect()
    });
    s.assert_healthy();
}

/// Restores that prefetch the working set the snapshot's first restore
/// recorded map it from the snapshot's base too: installing ahead of the
/// guest is not a reason to copy.
#[test]
fn restores_prefetching_a_recorded_working_set_share_it() {
    let _host = HOST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let want = gold_snapshot(&s);
    // The first restore records the working set as it reads it; a second
    // keeps the base it filled (a base lives while a VM maps it).
    let first = s.restore("gold");
    read_and_check(&s, std::slice::from_ref(&first), want);
    let keeper = s.restore("gold");
    read_and_check(&s, std::slice::from_ref(&keeper), want);
    s.delete_vm(&first);
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.snapshot_info("gold").working_set_pages < WORKING_SET {
        assert!(
            Instant::now() < deadline,
            "the working set was not recorded: {:?}",
            s.snapshot_info("gold")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let vms = assert_vms_share(&s, "restores prefetching their working set", want, || {
        let vms: Vec<String> = (0..4).map(|_| s.restore("gold")).collect();
        for v in &vms {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let f = s.vm(v).faults;
                if f.pages_installed + f.pages_shared >= WORKING_SET {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{v}: the prefetch did not end: {:?}",
                    s.vm(v).faults
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        vms
    });
    let log = s.server_log_text();
    for v in &vms {
        assert!(
            log.contains(&format!(
                "{v}: working set of {WORKING_SET} pages prefetched"
            )),
            "{v} did not prefetch its working set"
        );
        let m = s.vm(v).memory;
        assert!(
            m.own_bytes < WORKING_SET * 4096 / 20,
            "{v}: {} bytes of its own after the prefetch: {m:?}",
            m.own_bytes
        );
    }
    s.assert_healthy();
}

#[test]
fn vms_of_one_compressed_image_share_the_pages_they_read() {
    let _host = HOST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let dir = s.state_dir().join("..");
    let raw = dir.join("density.raw");
    let zst = dir.join("density.zst");
    let mut mem = vec![0u8; usize::try_from(MIB << 20).expect("size fits")];
    pagefork_tests::apply_fill(&mut mem, 0, WORKING_SET, SEED);
    std::fs::write(&raw, &mem).expect("write the raw image");
    drop(mem);
    pagefork_tests::compress_image(&raw, &zst, None);
    std::fs::remove_file(&raw).expect("remove the raw image");
    let want = working_set_digest();
    let vm = || {
        s.create_vm(&CreateVm {
            memory_source: Some(zstd_source(&zst)),
            ..new_vm(MIB)
        })
    };
    // The first VM's reads fill the image's base: decoded once per host.
    let first = vm();
    read_and_check(&s, std::slice::from_ref(&first), want);
    assert_vms_share(&s, "VMs of one compressed image", want, || {
        (0..VMS).map(|_| vm()).collect()
    });
    s.assert_healthy();
}

#[test]
fn writes_of_children_stay_their_own() {
    let _host = HOST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let t = template(&s);
    let children = s.fork(&t, 4).children;
    let half = WORKING_SET / 2;
    for (i, c) in children.iter().enumerate() {
        s.fill(c, 0, half, 100 + i as u64);
    }
    for (i, c) in children.iter().enumerate() {
        assert_eq!(s.verify(c, 0, half, 100 + i as u64), 0, "{c} its own half");
        assert_eq!(
            s.verify(c, half, WORKING_SET - half, SEED),
            0,
            "{c} the rest"
        );
    }
    let want = working_set_digest();
    s.resume(&t);
    assert_eq!(s.digest(&t, 0, WORKING_SET), want, "the template's memory");
    // A child's memory, its own pages and the base's, snapshotted and
    // restored whole.
    let c = &children[1];
    let mine = s.digest(c, 0, MIB * 256);
    s.snapshot(c, "child", SnapshotMode::Full);
    let r = s.restore("child");
    assert_eq!(
        s.digest(&r, 0, MIB * 256),
        mine,
        "a child's snapshot restores exactly"
    );
    s.assert_healthy();
}
