//! Snapshots in an object store across two hosts, on a real Ceph RGW
//! (`scripts/ceph.sh`): host A (a server on the XFS of `PAGEFORK_XFS_DIR`)
//! takes and pushes snapshots; host B (a second server on an XFS of its
//! own, in a network namespace of its own that reaches RGW over a veth
//! pair, so nothing but the store is shared) restores and clones them
//! before their memory is there. Whole-memory checks are `digest`s.
//!
//! Skips with the reason without Ceph, KVM, the XFS mount or root; fails
//! under `CI=true`.

use std::time::Duration;

use pagefork_tests::{
    op, require_kvm_uffd, require_root, require_store, signal, wait_for, wait_until, xfs_dir,
    Netns, RandomImage, ScratchXfs, ServerOptions, Store, TestServer,
};
use proto::api::{CreateVm, PushState, RunState, SnapshotMode};

/// Pages per 1 MiB chunk of the store.
const CHUNK_PAGES: u64 = 256;

/// A location in the store and host A pushing to it.
struct HostA {
    store: &'static Store,
    url: String,
    a: TestServer,
}

/// Host A, or `None` when the test cannot run here (said why).
fn host_a(test: &str, extra: &[&str]) -> Option<HostA> {
    let store = require_store()?;
    let xfs = xfs_dir()?;
    if !require_kvm_uffd() {
        return None;
    }
    let url = store.fresh_url(test);
    let mut args = vec!["--remote", url.as_str()];
    args.extend_from_slice(extra);
    let a = TestServer::start_with_options(
        &args,
        &ServerOptions {
            parent: Some(xfs),
            env: store.server_env(None),
            ..ServerOptions::default()
        },
    );
    Some(HostA { store, url, a })
}

/// Host B: a server on its own XFS, in its own network namespace (as
/// root), reading the same location.
struct HostB {
    b: TestServer,
    _xfs: ScratchXfs,
    netns: Option<Netns>,
}

impl std::ops::Deref for HostB {
    type Target = TestServer;
    fn deref(&self) -> &TestServer {
        &self.b
    }
}

fn host_b(a: &HostA, test: &str, extra: &[&str]) -> Option<HostB> {
    if !require_root("a second host (its own XFS and network namespace)") {
        return None;
    }
    let xfs = ScratchXfs::new();
    let netns = Netns::up(test);
    let endpoint = netns
        .as_ref()
        .map(|n| format!("http://{}:{}", n.host_addr, a.store.port()));
    let mut args = vec!["--remote", a.url.as_str(), "--remote-cache-mib", "256"];
    args.extend_from_slice(extra);
    let b = TestServer::start_with_options(
        &args,
        &ServerOptions {
            parent: Some(xfs.path().to_owned()),
            env: a.store.server_env(endpoint.as_deref()),
            netns: netns.as_ref().map(|n| n.name.clone()),
            ..ServerOptions::default()
        },
    );
    Some(HostB {
        b,
        _xfs: xfs,
        netns,
    })
}

/// A VM on `s` of `mib` MiB of random memory (incompressible chunks, all
/// distinct); the image must outlive the VM.
fn random_vm(s: &TestServer, mib: u64, seed: u64) -> (String, RandomImage) {
    let img = RandomImage::new(mib, seed);
    let id = s.create_vm(&CreateVm {
        memory_source: Some(img.source()),
        ..pagefork_tests::new_vm(mib)
    });
    (id, img)
}

/// Restarts RGW when dropped, so a failing test leaves the store up.
struct RgwDown(&'static Store);

impl Drop for RgwDown {
    fn drop(&mut self) {
        self.0.ceph("rgw-start");
    }
}

#[test]
fn a_snapshot_pushed_on_one_host_restores_and_clones_exactly_on_another() {
    let Some(store) = require_store() else { return };
    let _shared = store.shared();
    let Some(ha) = host_a("restore", &[]) else {
        return;
    };
    let a = &ha.a;
    // 128 MiB of random memory and a volume with a disk pattern.
    a.create_volume("data", 16);
    let img = RandomImage::new(128, 11);
    let vm = a.create_vm(&CreateVm {
        memory_source: Some(img.source()),
        volume: Some("data".into()),
        ..pagefork_tests::new_vm(128)
    });
    a.fill(&vm, 1000, 50, 5);
    a.exec(&vm, &op::disk_fill(0, 4096, 9));
    let pages = 128 * CHUNK_PAGES;
    let digest = a.digest(&vm, 0, pages);
    let disk = a.exec(&vm, &op::disk_checksum(0, 4096));
    a.snapshot(&vm, "s1", SnapshotMode::Full);
    let pushed = a.push_and_wait("s1");
    assert!(
        pushed.chunks_uploaded > 128,
        "memory and the volume's data: {pushed:?}"
    );

    let Some(b) = host_b(&ha, "restore", &[]) else {
        return;
    };
    assert_eq!(b.remote_snapshot_names(), ["s1"]);
    if let Some(n) = &b.netns {
        let endpoint = b.remote_status().endpoint;
        assert!(
            endpoint.contains(&n.host_addr),
            "B reaches the store over its veth pair: {endpoint}"
        );
    }
    let info = b.remote_snapshot("s1");
    assert_eq!((info.memory_mib, info.chunks, info.holes), (128, 128, 0));
    assert_eq!(info.volume_snapshot.as_deref(), Some("s1.disk"));

    // Lazily: the guest answers before its memory is here.
    let before = b.remote_status();
    let r = b.restore("remote:s1");
    let fetched = b.remote_status().fetched_bytes - before.fetched_bytes;
    assert!(
        fetched * 8 < info.stored_bytes,
        "{fetched} bytes fetched before the guest answered, of {}",
        info.stored_bytes
    );
    let remote_pages = b.vm(&r).pages.get("remote").copied().unwrap_or(0);
    assert!(
        remote_pages + CHUNK_PAGES >= pages,
        "{remote_pages} pages still remote"
    );
    // Exactly.
    assert_eq!(b.digest(&r, 0, pages), digest, "memory restored on B");
    assert_eq!(b.exec(&r, &op::disk_checksum(0, 4096)), disk, "disk on B");
    assert!(b.remote_status().fetched_chunks >= 128);

    // Ten clones, each exact; every chunk was fetched once.
    let fetched_chunks = b.remote_status().fetched_chunks;
    let clones = b.clone_remote("s1", 10, 5);
    assert_eq!(clones.clones.len(), 10);
    for c in &clones.clones {
        assert_eq!(b.vm(c).state, RunState::Running, "{c}");
        assert_eq!(b.digest(c, 0, pages), digest, "clone {c}");
    }
    assert_eq!(
        b.remote_status().fetched_chunks,
        fetched_chunks,
        "the clones read the chunks B has, not the store"
    );
    // And they map the snapshot's one base on B, as the restore does:
    // what they read is held once, not once per clone.
    let base = b.vm(&r).memory.base;
    assert!(base.is_some(), "the restore maps a base");
    for c in &clones.clones {
        let m = b.vm(c).memory;
        assert_eq!(m.base, base, "clone {c}");
        assert!(
            m.own_bytes * 16 < pages * 4096 && m.shared_bytes * 2 > pages * 4096,
            "clone {c} read all its memory and holds little of it: {m:?}"
        );
    }

    // Pulled into B's catalog, the snapshot restores as a local one.
    let pulled = b.pull_snapshot("s1", Some("s1-here"));
    assert_eq!(pulled.volume_snapshot.as_deref(), Some("s1-here.disk"));
    let l = b.restore("s1-here");
    assert_eq!(b.digest(&l, 0, pages), digest, "pulled snapshot");
    assert_eq!(b.exec(&l, &op::disk_checksum(0, 4096)), disk);
    drop(img);
}

#[test]
fn an_incremental_push_uploads_only_the_chunks_it_changed() {
    let Some(store) = require_store() else { return };
    let _shared = store.shared();
    let Some(ha) = host_a("incremental", &[]) else {
        return;
    };
    let a = &ha.a;
    let (vm, _img) = random_vm(a, 64, 21);
    a.snapshot(&vm, "base", SnapshotMode::Full);
    let first = a.push_and_wait("base");
    assert_eq!((first.chunks_uploaded, first.chunks_present), (64, 0));
    // Pages in three chunks change.
    for chunk in [3, 20, 41] {
        a.fill(&vm, chunk * CHUNK_PAGES + 7, 4, 99);
    }
    let dirty = a.snapshot(&vm, "next", SnapshotMode::Dirty);
    assert_eq!(dirty.mode_used, SnapshotMode::Dirty);
    let second = a.push_and_wait("next");
    assert_eq!(
        (second.chunks_uploaded, second.chunks_present),
        (3, 61),
        "{second:?}"
    );
    assert_eq!(a.remote_snapshot_names(), ["base", "next"]);
}

#[test]
fn a_push_killed_half_way_leaves_nothing_listed() {
    let Some(store) = require_store() else { return };
    let _shared = store.shared();
    let Some(mut ha) = host_a("killed", &[]) else {
        return;
    };
    let (vm, _img) = random_vm(&ha.a, 384, 31);
    ha.a.snapshot(&vm, "big", SnapshotMode::Full);
    ha.a.push_snapshot("big");
    let status = wait_until("the push to be half-way", Duration::from_secs(60), || {
        let s = ha.a.push_status("big");
        (s.chunks_done >= 2 || s.state != PushState::Running).then_some(s)
    });
    assert_eq!(
        status.state,
        PushState::Running,
        "the push ended too soon to kill it: {status:?}"
    );
    ha.a.kill_hard();
    let url = ha.url.clone();
    // Another host sees nothing committed; the chunks sent are garbage a
    // gc removes once the dead push's lock is stale.
    let Some(b) = host_b(&ha, "killed", &["--remote-lock-ttl-s", "1"]) else {
        return;
    };
    assert!(b.remote_snapshot_names().is_empty());
    assert!(
        !ha.store.list(&url, "chunks").is_empty(),
        "chunks were sent"
    );
    std::thread::sleep(Duration::from_secs(2));
    let gc = b.try_remote_gc().unwrap_or_else(|r| panic!("gc: {r}"));
    assert!(gc.chunks_deleted >= 2, "{gc:?}");
    assert!(gc.stale_locks_deleted >= 1, "{gc:?}");
    assert!(ha.store.list(&url, "chunks").is_empty());
    assert!(b.remote_snapshot_names().is_empty());
}

#[test]
fn the_store_stopping_mid_restore_fails_only_the_vm_that_needs_a_missing_chunk() {
    let Some(store) = require_store() else { return };
    if store.ceph_dir.is_none() {
        eprintln!("skipping: the store is not a cluster of scripts/ceph.sh (PAGEFORK_CEPH_DIR)");
        return;
    }
    let _outage = store.outage();
    let Some(ha) = host_a("outage", &[]) else {
        return;
    };
    let a = &ha.a;
    let (v1, _i1) = random_vm(a, 64, 41);
    let (v2, _i2) = random_vm(a, 64, 42);
    let d2 = a.digest(&v2, 0, 64 * CHUNK_PAGES);
    a.snapshot(&v1, "one", SnapshotMode::Full);
    a.snapshot(&v2, "two", SnapshotMode::Full);
    a.push_and_wait("one");
    a.push_and_wait("two");
    let Some(b) = host_b(&ha, "outage", &["--remote-fetch-deadline-ms", "3000"]) else {
        return;
    };
    // w2 has all its memory; w1 only its first chunk.
    let w2 = b.restore("remote:two");
    assert_eq!(b.digest(&w2, 0, 64 * CHUNK_PAGES), d2);
    let w1 = b.restore("remote:one");
    b.touch(&w1, 0, CHUNK_PAGES, false);
    let local = b.create_vm(&pagefork_tests::new_vm(16));

    assert!(store.ceph("rgw-stop"));
    let _up_again = RgwDown(store);
    let r = b.try_exec(&w1, &op::touch(40 * CHUNK_PAGES, 16, false));
    assert!(
        r.is_err(),
        "a touch of a chunk the store cannot give succeeded"
    );
    let failed = b.wait_state(&w1, RunState::Failed, Duration::from_secs(30));
    let why = failed.failure.unwrap_or_default();
    assert!(
        why.contains("remote snapshot one") && why.contains("store"),
        "the reason names the snapshot and the store: {why}"
    );
    // The others keep running, and B keeps serving.
    assert_eq!(b.digest(&w2, 0, 64 * CHUNK_PAGES), d2);
    b.fill(&local, 0, 64, 3);
    assert_eq!(b.verify(&local, 0, 64, 3), 0);
    assert!(b.answers_health());
    let other = b.create_vm(&pagefork_tests::new_vm(16));
    assert_eq!(b.vm(&other).state, RunState::Running);
    assert!(b.remote_status().fetch_failures >= 1);
}

#[test]
fn a_corrupted_chunk_fails_only_its_vm_and_is_never_cached() {
    let Some(store) = require_store() else { return };
    let _shared = store.shared();
    let Some(ha) = host_a("corrupt", &[]) else {
        return;
    };
    let a = &ha.a;
    let (vm, _img) = random_vm(a, 32, 51);
    a.snapshot(&vm, "s", SnapshotMode::Full);
    a.push_and_wait("s");
    // Chunk 10's object gets other bytes of the same length.
    let m = proto::manifest::parse_manifest(&store.get(&ha.url, "manifests/s"))
        .expect("the manifest parses");
    let c = m.memory_chunks()[10].clone();
    let digest = c.digest.to_owned();
    let len = usize::try_from(c.stored.expect("chunk 10 holds data")).expect("fits");
    let mut junk = RandomImage::new(1, 52).bytes;
    junk.truncate(len);
    store.put(&ha.url, &format!("chunks/{digest}"), junk);

    let Some(b) = host_b(&ha, "corrupt", &[]) else {
        return;
    };
    let w1 = b.restore("remote:s");
    let w2 = b.restore("remote:s");
    b.touch(&w2, 0, 4 * CHUNK_PAGES, false);
    let r = b.try_exec(&w1, &op::touch(10 * CHUNK_PAGES + 3, 1, false));
    assert!(r.is_err(), "a touch of the damaged chunk succeeded");
    let failed = b.wait_state(&w1, RunState::Failed, Duration::from_secs(30));
    let why = failed.failure.unwrap_or_default();
    assert!(why.contains(&digest) && why.contains("damaged"), "{why}");
    // The other VM of the same snapshot runs on; nothing damaged is cached.
    b.touch(&w2, 20 * CHUNK_PAGES, 8, false);
    assert_eq!(b.vm(&w2).state, RunState::Running);
    assert!(!b.state_dir().join("remote-cache").join(&digest).exists());
    assert!(b.remote_status().fetch_failures >= 1);
}

#[test]
fn a_restore_on_a_host_that_does_not_match_is_refused_with_the_reason() {
    let Some(store) = require_store() else { return };
    let _shared = store.shared();
    let Some(ha) = host_a("origin", &[]) else {
        return;
    };
    let a = &ha.a;
    let vm = a.create_vm(&pagefork_tests::new_vm(16));
    a.snapshot(&vm, "s", SnapshotMode::Full);
    a.push_and_wait("s");
    let key = "manifests/s";
    let mut m = proto::manifest::parse_manifest(&store.get(&ha.url, key)).expect("manifest");
    let origin = m
        .state
        .origin
        .as_mut()
        .expect("a snapshot records its origin");
    origin.cpu_flags.push("pagefork_no_such_flag".into());
    store.put(&ha.url, key, proto::manifest::encode_manifest(&m));
    let r = a
        .try_create_vm(&pagefork_tests::from_snapshot("remote:s"))
        .expect_err("a snapshot needing a CPU feature this host lacks restored");
    r.assert_error(
        409,
        "pagefork_no_such_flag",
        "restore needing a missing CPU flag",
    );

    let origin = m.state.origin.as_mut().expect("origin");
    origin.cpu_flags.pop();
    origin.pagefork_version = "0.0.0-elsewhere".into();
    store.put(&ha.url, key, proto::manifest::encode_manifest(&m));
    let r = a
        .try_create_vm(&pagefork_tests::from_snapshot("remote:s"))
        .expect_err("a snapshot of another pagefork version restored");
    r.assert_error(409, "0.0.0-elsewhere", "restore of another version");
}

#[test]
fn the_working_set_recorded_on_a_first_restore_travels_and_is_prefetched() {
    let Some(store) = require_store() else { return };
    let _shared = store.shared();
    let Some(ha) = host_a("workset", &[]) else {
        return;
    };
    let a = &ha.a;
    let (vm, _img) = random_vm(a, 64, 61);
    let pages = 64 * CHUNK_PAGES;
    let digest = a.digest(&vm, 0, pages);
    a.snapshot(&vm, "s", SnapshotMode::Full);
    // The first restore records what its guest touches.
    let first = a.restore("s");
    a.touch(&first, 2000, 3000, false);
    a.touch(&first, 9000, 500, false);
    a.delete_vm(&first);
    let ws = wait_until(
        "the working set to be recorded",
        Duration::from_secs(10),
        || {
            let n = a.snapshot_info("s").working_set_pages;
            (n > 0).then_some(n)
        },
    );
    assert!(ws >= 3500, "{ws} pages recorded");
    // A later local restore installs it while the guest runs.
    let again = a.restore("s");
    wait_until("the local prefetch", Duration::from_secs(30), || {
        let f = a.vm(&again).faults;
        (f.pages_installed + f.pages_shared >= ws).then_some(())
    });

    a.push_and_wait("s");
    let Some(b) = host_b(&ha, "workset", &[]) else {
        return;
    };
    assert_eq!(b.remote_snapshot("s").working_set_pages, ws);
    let r = b.restore("remote:s");
    wait_until("the remote prefetch", Duration::from_secs(60), || {
        let f = b.vm(&r).faults;
        (f.pages_installed + f.pages_shared >= ws).then_some(())
    });
    let missing = b.vm(&r).faults.missing;
    b.touch(&r, 2000, 3000, false);
    b.touch(&r, 9000, 500, false);
    assert_eq!(
        b.vm(&r).faults.missing,
        missing,
        "the guest's working set was there before it touched it"
    );
    assert_eq!(b.digest(&r, 0, pages), digest);
}

/// A VM restored lazily from the store survives its server: SIGKILLed
/// before it read half its memory, and then handed over to a new process,
/// it reads exactly what it held and the rest from the store.
#[test]
fn a_vm_restored_from_the_store_survives_a_crash_and_an_upgrade_of_its_server() {
    let Some(store) = require_store() else { return };
    let _shared = store.shared();
    let Some(ha) = host_a("survives", &[]) else {
        return;
    };
    let a = &ha.a;
    let (vm, img) = random_vm(a, 32, 23);
    let pages = 32 * CHUNK_PAGES;
    let digest = a.digest(&vm, 0, pages);
    a.snapshot(&vm, "s1", SnapshotMode::Full);
    a.push_and_wait("s1");
    let r = a.restore("remote:s1");
    // Its own writes on a third of it; the rest still in the store.
    a.fill(&r, 0, pages / 3, 77);
    let first = a.health();
    signal(first.pid, nix::sys::signal::Signal::SIGKILL);
    let crashed = wait_for(Duration::from_secs(30), || {
        a.health_now().filter(|h| h.pid != first.pid)
    })
    .expect("the keeper starts the server again");
    assert_eq!(crashed.start, "crash");
    assert!(crashed.lost_vms.is_empty(), "{:?}", crashed.lost_vms);
    assert_eq!(a.vm(&r).state, RunState::Running);
    assert_eq!(a.verify(&r, 0, pages / 3, 77), 0, "its writes");
    assert_eq!(
        a.digest(&r, pages / 3, pages - pages / 3),
        a.digest(&vm, pages / 3, pages - pages / 3),
        "the rest, from the store"
    );
    let r2 = a.raw("POST", "/v1/server/upgrade", Some(serde_json::json!({})));
    assert_eq!(r2.status, 200, "{r2}");
    let upgraded = wait_for(Duration::from_secs(30), || {
        a.health_now().filter(|h| h.pid != crashed.pid)
    })
    .expect("the new process serves");
    assert_eq!(upgraded.start, "upgrade");
    assert!(upgraded.lost_vms.is_empty(), "{:?}", upgraded.lost_vms);
    assert_eq!(a.verify(&r, 0, pages / 3, 77), 0, "its writes");
    assert_eq!(a.digest(&vm, 0, pages), digest, "the VM it was taken of");
    drop(img);
}
