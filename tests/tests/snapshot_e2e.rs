//! End-to-end VM snapshots: real server, VMMs, KVM, userfaultfd and a
//! loop-mounted XFS (reflink=1, PAGEFORK_XFS_DIR) for the state directory.
//! Memory is compared whole with the VMM's `digest` of all RAM.

use std::path::PathBuf;

use pagefork_tests::{
    counts_4k_pages_only, from_snapshot, new_vm, op, pages_in_units, pages_of, server_on_xfs,
    uffdctl_json, vm_num, TestServer,
};
use proto::api::{
    CloneVm, ClonedVms, CreateSnapshot, CreateVm, RunState, SnapshotCreated, SnapshotDeleted,
    SnapshotInfo, SnapshotList, SnapshotMode, VmInfo, VmRolledBack,
};
use serde_json::json;

const MIB: u64 = 64;

/// A full snapshot named `name`.
fn full(name: &str) -> CreateSnapshot {
    CreateSnapshot {
        name: name.to_owned(),
        mode: SnapshotMode::Full,
        compress: false,
    }
}

fn all_ram_digest(s: &TestServer, id: &str) -> u64 {
    s.digest(id, 0, pages_of(MIB))
}

fn image(s: &TestServer, name: &str) -> PathBuf {
    s.state_dir()
        .join("snapshots")
        .join(name)
        .join("memory.img")
}

#[test]
fn full_snapshot_restores_exact_memory_and_guest_state() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let vm = s.create_vm(&new_vm(MIB));
    // Part of memory written, part only read, the rest never touched.
    s.fill(&vm, 0, 3000, 1);
    s.touch(&vm, 5000, 500, false);
    s.fill(&vm, 9000, 100, 7);
    let want = all_ram_digest(&s, &vm);

    let r = s.snapshot(&vm, "full-1", SnapshotMode::Full);
    assert_eq!(r.mode_used, SnapshotMode::Full, "{r:?}");
    assert_eq!(r.mode_requested, SnapshotMode::Full, "{r:?}");
    assert!(r.fallback_reason.is_none(), "{r:?}");
    // `digest` read every page into the VM: all are saved, but only the
    // written ones hold data; zero pages stay holes.
    assert_eq!(r.pages_written, pages_of(MIB), "{r:?}");
    assert_eq!(r.bytes_written, 3100 * 4096, "{r:?}");
    assert!(r.image_extents >= 1, "{r:?}");

    // The original moves on; the snapshot keeps the moment.
    s.fill(&vm, 0, 200, 2);
    assert_ne!(all_ram_digest(&s, &vm), want);

    let list = s.snapshots();
    assert_eq!(list.snapshots[0].name, "full-1", "{list:?}");
    let info = s.snapshot_info("full-1");
    assert_eq!(info.memory_mib, MIB, "{info:?}");
    assert_eq!(info.vm, vm, "{info:?}");
    assert_eq!(
        info.pages.data + info.pages.zero_hole,
        pages_of(MIB),
        "{info:?}"
    );
    let meta = std::fs::metadata(image(&s, "full-1")).unwrap();
    assert_eq!(meta.len(), MIB << 20);
    assert!(
        std::os::unix::fs::MetadataExt::blocks(&meta) * 512 < (MIB << 20) / 2,
        "memory.img is not sparse"
    );

    let restored = s.restore("full-1");
    let info = s.vm(&restored);
    assert_eq!(info.memory_mib, MIB, "{info:?}");
    assert!(pagefork_tests::pages_by(&info, "image") > 0, "{info:?}");
    // Deleting a snapshot a VM reads from is refused, naming the VM.
    let v = s.try_delete_snapshot("full-1").unwrap_err();
    assert_eq!(v.status, 409, "{v}");
    assert!(v.error().contains(&restored), "{v}");
    let src = s.sources(&restored);
    assert!(
        src.by_source.contains_key("snapshot:full-1"),
        "sources name the snapshot: {src:?}"
    );
    let node = s.tree_node(&restored).unwrap();
    assert!(
        node.reads_from["snapshot:full-1"] > 0,
        "the tree names the snapshot: {node:?}"
    );
    assert_eq!(
        all_ram_digest(&s, &restored),
        want,
        "restored memory differs"
    );
    assert_eq!(s.verify(&restored, 0, 3000, 1), 0);
    assert_eq!(s.verify(&restored, 9000, 100, 7), 0);
    // The guest agent carries on as itself and keeps working.
    assert_eq!(s.identity(&restored), vm_num(&restored));
    s.fill(&restored, 100, 10, 3);
    assert_eq!(s.verify(&restored, 100, 10, 3), 0);
    assert_eq!(s.verify(&vm, 0, 200, 2), 0, "the original is unaffected");

    s.delete_vm(&restored);
    s.delete_snapshot("full-1");
    assert!(!image(&s, "full-1").exists());
    let v = s.try_snapshot_info("full-1").unwrap_err();
    assert_eq!(v.status, 404);
}

#[test]
fn snapshot_names_are_checked_and_unique() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let vm = s.create_vm(&new_vm(16));
    s.snapshot(&vm, "one", SnapshotMode::Full);
    for (name, want) in [("one", 409), ("../x", 400), (".hidden", 400)] {
        let v = s.try_snapshot(&vm, &full(name)).unwrap_err();
        assert_eq!(v.status, want, "{name}: {v}");
    }
    // A mode no type can name.
    let body = json!({"name": "a", "mode": "soft"});
    let v = s.raw(
        "POST",
        &format!("/v1/vms/{vm}/snapshots"),
        Some(body.clone()),
    );
    assert_eq!(v.status, 400, "{body}: {v}");
    let v = s.try_snapshot("vm-999", &full("two")).unwrap_err();
    assert_eq!(v.status, 404, "{v}");
    // Nothing half-made is left behind by the refused requests.
    let leftovers: Vec<String> = std::fs::read_dir(s.state_dir().join("snapshots"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .collect();
    assert_eq!(leftovers, ["one"]);
}

fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    std::process::Command::new("cmp")
        .arg("-s")
        .arg(a)
        .arg(b)
        .status()
        .expect("cannot run cmp")
        .success()
}

#[test]
fn incremental_and_dirty_images_equal_full_images_of_the_same_moment() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let a = s.create_vm(&new_vm(MIB));
    s.fill(&a, 0, 4000, 1);
    s.snapshot(&a, "base", SnapshotMode::Full);

    // A VM restored from `base` writes some pages.
    let r = s.restore("base");
    s.fill(&r, 100, 200, 2);
    s.fill(&r, 8000, 50, 3);
    let inc = s.snapshot(&r, "inc", SnapshotMode::Incremental);
    assert_eq!(inc.mode_used, SnapshotMode::Incremental, "{inc:?}");
    assert_eq!(s.snapshot_info("inc").parent.as_deref(), Some("base"));
    // Pages the VM has not written or read since its start are not saved.
    assert!(inc.pages_written < 4000, "{inc:?}");
    let full = s.snapshot(&r, "inc-full", SnapshotMode::Full);
    assert_eq!(full.mode_used, SnapshotMode::Full);
    assert!(
        same_file(&image(&s, "inc"), &image(&s, "inc-full")),
        "incremental and full images of one moment differ"
    );
    let at_inc = all_ram_digest(&s, &r);

    // k page writes after a snapshot: a dirty snapshot writes exactly k.
    // (On hugepage guest RAM, the k pages' whole blocks.)
    let k = 37;
    s.fill(&r, 1000, k, 4);
    let before = s.snapshot_info("inc-full").exclusive_bytes;
    let d = s.snapshot(&r, "d1", SnapshotMode::Dirty);
    assert_eq!(d.mode_used, SnapshotMode::Dirty, "{d:?}");
    let dirty = pages_in_units(&[(1000, k)], s.unit_pages(&r));
    assert_eq!(d.pages_written, dirty, "{d:?}");
    assert_eq!(d.bytes_written, dirty * 4096, "{d:?}");
    assert_eq!(s.snapshot_info("d1").parent.as_deref(), Some("inc-full"));
    let excl = s.snapshot_info("d1").exclusive_bytes;
    assert!(
        (dirty * 4096..=dirty * 4096 + (64 << 10)).contains(&excl),
        "d1 holds {excl} bytes of its own for {k} pages (its parent {before})"
    );
    let d_full = s.snapshot(&r, "d1-full", SnapshotMode::Full);
    assert_eq!(d_full.mode_used, SnapshotMode::Full);
    assert!(same_file(&image(&s, "d1"), &image(&s, "d1-full")));
    let at_d1 = all_ram_digest(&s, &r);

    // A second dirty snapshot with nothing written saves nothing.
    let d2 = s.snapshot(&r, "d2", SnapshotMode::Dirty);
    assert_eq!(d2.mode_used, SnapshotMode::Dirty, "{d2:?}");
    assert_eq!(d2.pages_written, 0, "{d2:?}");

    // Every image restores to the memory of its moment.
    for (name, want) in [("inc", at_inc), ("d1", at_d1), ("d2", at_d1)] {
        let x = s.restore(name);
        assert_eq!(all_ram_digest(&s, &x), want, "restore of {name}");
        assert_eq!(s.verify(&x, 1000, k, 4), u64::from(name == "inc") * k);
        s.delete_vm(&x);
    }
}

#[test]
fn dirty_and_incremental_without_a_base_degrade_to_full_and_say_why() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let a = s.create_vm(&new_vm(16));
    s.fill(&a, 0, 10, 1);
    let d = s.snapshot(&a, "first", SnapshotMode::Dirty);
    assert_eq!(d.mode_requested, SnapshotMode::Dirty);
    assert_eq!(d.mode_used, SnapshotMode::Full, "{d:?}");
    let why = d.fallback_reason.as_deref().unwrap_or_default();
    assert!(why.contains("no snapshot"), "{d:?}");
    let i = s.snapshot(&a, "second", SnapshotMode::Incremental);
    assert_eq!(i.mode_used, SnapshotMode::Full, "{i:?}");
    assert!(
        i.fallback_reason
            .as_deref()
            .unwrap_or_default()
            .contains("did not start from a snapshot"),
        "{i:?}"
    );
    // Once it has a snapshot, dirty works; if that one is deleted, it
    // degrades again.
    let d = s.snapshot(&a, "third", SnapshotMode::Dirty);
    assert_eq!(d.mode_used, SnapshotMode::Dirty, "{d:?}");
    s.delete_snapshot("third");
    let d = s.snapshot(&a, "fourth", SnapshotMode::Dirty);
    assert_eq!(d.mode_used, SnapshotMode::Full, "{d:?}");
    assert!(
        d.fallback_reason
            .as_deref()
            .unwrap_or_default()
            .contains("third"),
        "{d:?}"
    );
}

#[test]
fn guest_writes_during_the_save_keep_the_snapshot_at_its_moment() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let mib = 256;
    let pages = pages_of(mib);
    let a = s.create_vm(&new_vm(mib));
    s.fill(&a, 0, pages, 1);
    let want = s.digest(&a, 0, pages);
    // The guest rewrites the last eighth of memory while the snapshot is
    // being saved (the writer goes up from page 0, so it reaches those
    // pages after the guest has started writing them). The guest starts
    // once the VM shows the snapshot saving, i.e. after the pause, so the
    // snapshot's moment is before every one of these writes. Every try
    // must be exact; at least one must overlap the save.
    let tail = pages / 8;
    let start = pages - tail;
    let mut overlapped = false;
    let mut want = want;
    for attempt in 0..3u64 {
        let name = format!("busy-{attempt}");
        let seed = 2 + attempt;
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            let writer = sc.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::Relaxed)
                    && s.vm(&a).snapshot_saving.is_none()
                {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                s.fill(&a, start, tail, seed);
            });
            let r = s.snapshot(&a, &name, SnapshotMode::Full);
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            eprintln!("snapshot while the guest writes: {r:?}");
            assert!(r.pause_us < 200_000, "{r:?}");
            overlapped |= r.pages_saved_ahead > 0;
            writer.join().unwrap();
        });
        assert_eq!(s.verify(&a, start, tail, seed), 0);
        let x = s.restore(&name);
        assert_eq!(s.digest(&x, 0, pages), want, "{name} is not of its moment");
        s.delete_vm(&x);
        want = s.digest(&a, 0, pages);
        if overlapped {
            break;
        }
    }
    assert!(overlapped, "the guest's writes never overlapped the save");
    // Dirty tracking saw every page the guest wrote after the last pause.
    let d = s.snapshot(&a, "after", SnapshotMode::Dirty);
    assert_eq!(d.mode_used, SnapshotMode::Dirty, "{d:?}");
    assert_eq!(d.pages_written, tail, "{d:?}");
    let y = s.restore("after");
    assert_eq!(s.digest(&y, 0, pages), want);
}

#[test]
fn guest_writes_to_pages_still_being_copied_keep_the_snapshot_at_its_moment() {
    // The writer copies runs of the VM's own pages out of its memory
    // itself, after the guest has resumed. Held before its first run, it
    // has the first MiBs queued but not copied when the guest writes them:
    // each write must save the page's bytes again first, or the copy
    // would take the guest's new bytes.
    let Some(s) = server_on_xfs(&["--snapshot-copy-hold-ms", "1500"]) else {
        return;
    };
    let mib = 32;
    let pages = pages_of(mib);
    // Only 4 KiB guest RAM takes this path (hugetlb memory is read by the
    // core), so the VM asks for it whatever the server's default.
    let a = s.create_vm(&CreateVm {
        hugepages: Some(false),
        ..new_vm(mib)
    });
    s.fill(&a, 0, pages, 1);
    let want = s.digest(&a, 0, pages);
    let n = 64;
    let r = std::thread::scope(|sc| {
        let writer = sc.spawn(|| {
            while s.vm(&a).snapshot_saving.is_none() {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            s.fill(&a, 0, n, 9);
        });
        let r = s.snapshot(&a, "held", SnapshotMode::Full);
        writer.join().unwrap();
        r
    });
    eprintln!("snapshot with its copies held: {r:?}");
    assert_eq!(s.verify(&a, 0, n, 9), 0);
    let x = s.restore("held");
    assert_eq!(
        s.digest(&x, 0, pages),
        want,
        "the snapshot took later bytes"
    );
    assert_eq!(r.pages_saved_ahead, n, "{r:?}");
}

/// Start a VM for a crash round: from an earlier snapshot when there is
/// one (so incremental snapshots have a base), else empty.
fn crash_round_vm(s: &TestServer, from: Option<&str>) -> String {
    match from {
        Some(name) => s.restore(name),
        None => s.create_vm(&new_vm(CRASH_MIB)),
    }
}

const CRASH_MIB: u64 = 32;

#[test]
fn sigkill_during_snapshots_never_lists_a_wrong_snapshot() {
    use rand::{Rng, SeedableRng};
    let Some(mut s) = server_on_xfs(&[]) else {
        return;
    };
    let seed: u64 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        .into();
    eprintln!("crash rounds seeded with {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let pages = pages_of(CRASH_MIB);
    // Name -> digest of all RAM at the snapshot's moment.
    let mut want: std::collections::BTreeMap<String, u64> = Default::default();
    let rounds = 24;
    let mut committed_by_crash = 0;
    for round in 0..rounds {
        let from = want.keys().last().cloned();
        let vm = crash_round_vm(&s, from.as_deref());
        let mode = [
            SnapshotMode::Full,
            SnapshotMode::Incremental,
            SnapshotMode::Dirty,
        ][round % 3];
        if mode == SnapshotMode::Dirty {
            let name = format!("r{round:02}-pre");
            s.fill(&vm, 0, pages, 100 + round as u64);
            s.snapshot(&vm, &name, SnapshotMode::Full);
            want.insert(name, s.digest(&vm, 0, pages));
        }
        let start = rng.gen_range(0..pages / 2);
        s.fill(&vm, start, pages / 2, round as u64);
        let digest = s.digest(&vm, 0, pages);
        let name = format!("r{round:02}-{mode}");
        let delay = rng.gen_range(0..120);
        let sock = s.api_sock();
        let body = pagefork_tests::body(&CreateSnapshot {
            name: name.clone(),
            mode,
            compress: false,
        });
        let path = format!("/v1/vms/{vm}/snapshots");
        // The server is killed under it: the call may fail, not panic.
        let request = std::thread::spawn(move || {
            let c = uffdctl::client::Client::new(sock);
            c.request("POST", &path, Some(&body)).ok().map(|r| r.status)
        });
        std::thread::sleep(std::time::Duration::from_millis(delay));
        s.kill_hard();
        let answered = request.join().unwrap();
        s.restart(&[]);

        let list = s.snapshots();
        assert!(list.quarantined.is_empty(), "round {round}: {list:?}");
        let listed: Vec<String> = list.snapshots.into_iter().map(|x| x.name).collect();
        let crashed_one_listed = listed.contains(&name);
        if answered == Some(201) {
            assert!(
                crashed_one_listed,
                "round {round}: answered 201, not listed"
            );
        }
        if crashed_one_listed {
            committed_by_crash += 1;
            want.insert(name.clone(), digest);
            let x = s.restore(&name);
            assert_eq!(s.digest(&x, 0, pages), digest, "round {round}: {name}");
            s.delete_vm(&x);
        }
        let expected: Vec<&String> = want.keys().collect();
        assert_eq!(
            listed.iter().collect::<Vec<_>>(),
            expected,
            "round {round} (killed after {delay} ms, answer {answered:?})"
        );
        let leftovers: Vec<String> = std::fs::read_dir(s.state_dir().join("snapshots"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().into_string().unwrap())
            .filter(|n| n.starts_with(".tmp-"))
            .collect();
        assert!(leftovers.is_empty(), "round {round}: {leftovers:?}");
    }
    eprintln!(
        "{rounds} rounds: {committed_by_crash} snapshots committed before the kill, {} in all",
        want.len()
    );
    // Every snapshot that survived restores to its moment.
    for (name, digest) in &want {
        let x = s.restore(name);
        assert_eq!(s.digest(&x, 0, pages), *digest, "{name}");
        s.delete_vm(&x);
    }
}

#[test]
fn a_snapshot_that_does_not_verify_is_quarantined_at_start() {
    use std::os::unix::fs::FileExt;
    let Some(mut s) = server_on_xfs(&[]) else {
        return;
    };
    let vm = s.create_vm(&new_vm(16));
    s.fill(&vm, 0, 100, 1);
    s.snapshot(&vm, "good", SnapshotMode::Full);
    s.snapshot(&vm, "bad", SnapshotMode::Full);
    s.stop(std::time::Duration::from_secs(20));
    // One flipped byte in a data page.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(image(&s, "bad"))
        .unwrap();
    f.write_all_at(&[0x5a], 4096 * 10 + 17).unwrap();
    drop(f);
    s.restart(&[]);
    let list = s.snapshots();
    let names: Vec<&str> = list.snapshots.iter().map(|x| x.name.as_str()).collect();
    assert_eq!(names, ["good"], "{list:?}");
    assert!(list.quarantined[0].starts_with("bad."), "{list:?}");
    let v = s.try_create_vm(&from_snapshot("bad")).unwrap_err();
    assert_eq!(v.status, 404, "{v}");
    let x = s.restore("good");
    assert_eq!(s.verify(&x, 0, 100, 1), 0);
}

fn disk_sum(s: &TestServer, vm: &str, count: u64) -> u64 {
    s.exec(vm, &op::disk_checksum(0, count))
}

#[test]
fn rollback_returns_memory_state_and_disk_while_a_fork_child_keeps_its_own() {
    let Some(s) = server_on_xfs(&[]) else { return };
    s.create_volume("rb-disk", 1);
    let a = s.create_vm(&CreateVm {
        volume: Some("rb-disk".into()),
        ..new_vm(MIB)
    });
    s.fill(&a, 0, 2000, 1);
    s.exec(&a, &op::disk_fill(0, 100, 1));
    let mem_at_snap = all_ram_digest(&s, &a);
    let disk_at_snap = disk_sum(&s, &a, 2048);
    let snap = s.snapshot(&a, "rb", SnapshotMode::Full);
    assert_eq!(
        s.snapshot_info("rb").volume_snapshot.as_deref(),
        Some("rb.disk"),
        "{snap:?}"
    );

    // A child forked after the snapshot reads its pages from the parent.
    let child = s.fork_one(&a);
    // (Not read yet: the child still reads most of its pages from the
    // parent at the rollbacks.)
    let child_mem = mem_at_snap;

    // The parent moves on: memory and disk.
    s.fill(&a, 0, 500, 2);
    s.fill(&a, 3000, 500, 3);
    s.exec(&a, &op::disk_fill(0, 50, 2));
    assert_ne!(all_ram_digest(&s, &a), mem_at_snap);
    assert_ne!(disk_sum(&s, &a, 2048), disk_at_snap);

    let r = s.rollback(&a, "rb");
    eprintln!("rollback: {r:?}");
    // Back to its last snapshot: only the pages written since are reset
    // (the child already holds its own copies of those).
    assert_eq!(r.pages_handed_over, 0, "{r:?}");
    // On 4 KiB memory the VMM discards them (hugetlb memory is punched).
    let discarded = r.pages_discarded;
    if s.unit_pages(&a) == 1 {
        assert!(discarded >= 1000, "{r:?}");
    } else {
        assert_eq!(discarded, 0, "{r:?}");
    }
    assert_eq!(s.vm(&a).state, RunState::Running);
    assert_eq!(all_ram_digest(&s, &a), mem_at_snap, "memory after rollback");
    assert_eq!(disk_sum(&s, &a, 2048), disk_at_snap, "disk after rollback");
    assert_eq!(s.identity(&a), vm_num(&a));
    assert_eq!(s.verify(&a, 0, 2000, 1), 0);
    // The scrub punched whatever the guest did not touch.
    assert_no_stale_pages(&s, &a);
    // The child still has the memory it was forked with.
    assert_eq!(all_ram_digest(&s, &child), child_mem, "the child changed");
    let inv = s.invariant();
    assert!(inv.ok, "{inv:?}");
    // The rolled-back VM carries on; tracking went on from the snapshot,
    // so a dirty snapshot saves exactly what it wrote since the rollback.
    s.fill(&a, 10, 5, 9);
    assert_eq!(s.verify(&a, 10, 5, 9), 0);
    let d = s.snapshot(&a, "rb-after", SnapshotMode::Dirty);
    assert_eq!(d.mode_used, SnapshotMode::Dirty, "{d:?}");
    assert_eq!(
        d.pages_written,
        pages_in_units(&[(10, 5)], s.unit_pages(&a)),
        "{d:?}"
    );
    let after = all_ram_digest(&s, &a);
    let x = s.restore("rb-after");
    assert_eq!(all_ram_digest(&s, &x), after);
    // Back to the older snapshot (not the last one: all memory is reset).
    s.fill(&a, 0, 3000, 11);
    let before = all_ram_digest(&s, &a);
    let child2 = s.fork_one(&a);
    let r = s.rollback(&a, "rb");
    // Every page the new child still read from the parent was handed over.
    assert_eq!(r.pages_handed_over, pages_of(MIB), "{r:?}");
    assert_eq!(all_ram_digest(&s, &child2), before, "the 2nd child changed");
    assert_eq!(
        all_ram_digest(&s, &a),
        mem_at_snap,
        "memory after 2nd rollback"
    );
    assert_eq!(disk_sum(&s, &a, 2048), disk_at_snap);
    assert_eq!(
        all_ram_digest(&s, &x),
        after,
        "a VM restored before is unaffected"
    );
    let inv = s.invariant();
    assert!(inv.ok, "{inv:?}");
}

/// A rollback that discards every page of a VM, on a server that leaves
/// them stale (no background scrub for a minute): the guest reads all of
/// them after the resume and must see the snapshot's bytes in every one,
/// each stale run found by a MINOR fault and punched before its install.
/// (The other rollback test runs the scrub.)
#[test]
fn a_rollback_s_discarded_pages_read_as_the_snapshot_while_they_are_punched() {
    let Some(s) = server_on_xfs(&["--rollback-scrub-delay-ms", "60000"]) else {
        return;
    };
    let a = s.create_vm(&new_vm(MIB));
    let pages = pages_of(MIB);
    s.fill(&a, 0, pages, 21);
    let at_snap = all_ram_digest(&s, &a);
    s.snapshot(&a, "disc", SnapshotMode::Full);
    let mut minor = 0;
    for round in 0..3u64 {
        s.fill(&a, 0, pages, 30 + round);
        assert_ne!(all_ram_digest(&s, &a), at_snap);
        let r = s.rollback(&a, "disc");
        eprintln!("rollback {round}: {r:?}");
        if s.unit_pages(&a) == 1 {
            assert_eq!(r.pages_discarded, pages, "{r:?}");
        }
        // Every page is stale: the guest's reads fault MINOR, and each
        // fault punches and installs its whole run.
        assert_eq!(s.verify(&a, 0, pages, 21), 0, "round {round}");
        assert_eq!(all_ram_digest(&s, &a), at_snap, "round {round}");
        let vm = s.vm(&a);
        eprintln!("faults: {:?}", vm.faults);
        if s.unit_pages(&a) == 1 {
            let now = vm.faults.minor;
            assert!(now > minor, "round {round}: no MINOR fault: {vm:?}");
            minor = now;
        }
        let inv = s.invariant();
        assert!(inv.ok, "{inv:?}");
    }
    // Writes after the rollback stay, and a restore of a later snapshot
    // has them.
    s.fill(&a, 100, 50, 99);
    let now = all_ram_digest(&s, &a);
    s.snapshot(&a, "disc-after", SnapshotMode::Dirty);
    let x = s.restore("disc-after");
    assert_eq!(all_ram_digest(&s, &x), now);
    // Every page was read, so every stale one was punched on the way:
    // the memfd holds exactly the pages the table says are the VM's own.
    assert_no_stale_pages(&s, &a);
}

/// Wait (up to 10 s) until `vm`'s memfd holds exactly the pages its table
/// says are its own: no stale page of a rollback is left.
fn assert_no_stale_pages(s: &TestServer, vm: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let inv = s.invariant();
        assert!(inv.ok, "{inv:?}");
        let v = s.vm(vm);
        let own = pagefork_tests::pages_by(&v, "vm");
        if v.resident_pages == own {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "stale pages left in the memfd: {v:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn clone_makes_n_running_copies() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let a = s.create_vm(&new_vm(16));
    s.fill(&a, 0, 1000, 5);
    let c = s.clone_vm(&a, 5, 2);
    eprintln!("clone: {c:?}");
    let clones = c.clones;
    assert_eq!(clones.len(), 5);
    assert_eq!(s.snapshot_info(&c.snapshot).readers.len(), 5);
    for x in &clones {
        assert_eq!(s.verify(x, 0, 1000, 5), 0, "{x}");
        assert_eq!(s.identity(x), vm_num(x));
    }
}

/// The server's VM memfds. RAM made ahead for pooled VMMs (named
/// `pagefork-pool-N` until a VM takes it) comes and goes with the pool and
/// is not counted; these VMs are smaller than it and never take one.
fn memfds_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|l| {
                let l = l.to_string_lossy();
                l.contains("memfd:pagefork-") && !l.contains("memfd:pagefork-pool-")
            })
        })
        .count()
}

#[test]
fn clone_failing_at_the_kth_create_leaves_nothing_behind() {
    // Room for the VM and three clones: the fourth create is refused.
    let Some(s) = server_on_xfs(&["--memory-budget-mib", "64"]) else {
        return;
    };
    let a = s.create_vm(&new_vm(16));
    s.fill(&a, 0, 100, 5);
    let before = memfds_of(s.pid());
    let c = s
        .try_clone_vm(
            &a,
            &CloneVm {
                count: 6,
                concurrency: 2,
            },
        )
        .unwrap_err();
    assert_eq!(c.status, 507, "{c}");
    assert!(c.error().contains("of 6"), "the error names the clone: {c}");
    assert_eq!(s.vm_ids(), vec![a.clone()]);
    let list = s.snapshots();
    assert!(list.snapshots.is_empty(), "{list:?}");
    assert_eq!(memfds_of(s.pid()), before, "memfds left behind");
    let names: Vec<String> = std::fs::read_dir(s.state_dir().join("snapshots"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().into_string().unwrap())
        .collect();
    assert!(names.is_empty(), "{names:?}");
    // The source VM is unharmed.
    assert_eq!(s.verify(&a, 0, 100, 5), 0);
}

#[test]
fn uffdctl_snapshot_restore_rollback_and_clone() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let a = s.create_vm(&new_vm(16));
    s.fill(&a, 0, 50, 1);
    let c: SnapshotCreated = uffdctl_json(&s, &["snapshot", "create", &a, "cli-1"]);
    assert_eq!(c.mode_used, SnapshotMode::Full, "{c:?}");
    let d: SnapshotCreated =
        uffdctl_json(&s, &["snapshot", "create", &a, "cli-2", "--mode", "dirty"]);
    assert_eq!(d.mode_used, SnapshotMode::Dirty, "{d:?}");
    let list: SnapshotList = uffdctl_json(&s, &["snapshot", "list"]);
    assert_eq!(list.snapshots.len(), 2, "{list:?}");
    let show: SnapshotInfo = uffdctl_json(&s, &["snapshot", "show", "cli-2"]);
    assert_eq!(show.parent.as_deref(), Some("cli-1"), "{show:?}");
    let r: VmInfo = uffdctl_json(&s, &["snapshot", "restore", "cli-1"]);
    let restored = r.id;
    assert_eq!(s.verify(&restored, 0, 50, 1), 0);
    s.fill(&a, 0, 50, 2);
    let rb: VmRolledBack = uffdctl_json(&s, &["vm", "rollback", &a, "cli-1"]);
    assert_eq!(rb.snapshot, "cli-1", "{rb:?}");
    assert_eq!(s.verify(&a, 0, 50, 1), 0);
    let cl: ClonedVms = uffdctl_json(&s, &["vm", "clone", &a, "--count", "2"]);
    assert_eq!(cl.clones.len(), 2, "{cl:?}");
    let del: SnapshotDeleted = uffdctl_json(&s, &["snapshot", "delete", "cli-2"]);
    assert!(del.deleted, "{del:?}");
}

#[test]
fn snapshots_of_forked_and_restored_vms_survive_their_parents() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let a = s.create_vm(&new_vm(MIB));
    s.fill(&a, 0, 4000, 1);
    s.snapshot(&a, "origin", SnapshotMode::Full);
    // A VM restored from a snapshot is forked; the child reads pages from
    // its parent and from the snapshot's image.
    let r = s.restore("origin");
    s.fill(&r, 100, 50, 2);
    let c = s.fork_one(&r);
    s.fill(&c, 3000, 20, 3);
    s.fill(&r, 0, 200, 4); // the parent moves on after the fork
    let want = all_ram_digest(&s, &c);
    let full = s.snapshot(&c, "child-full", SnapshotMode::Full);
    assert_eq!(full.mode_used, SnapshotMode::Full, "{full:?}");
    s.fill(&c, 5000, 7, 5);
    let want2 = all_ram_digest(&s, &c);
    let d = s.snapshot(&c, "child-dirty", SnapshotMode::Dirty);
    assert_eq!(d.mode_used, SnapshotMode::Dirty, "{d:?}");
    assert_eq!(
        d.pages_written,
        pages_in_units(&[(5000, 7)], s.unit_pages(&c)),
        "{d:?}"
    );
    // The parents go; the snapshots and the child keep their memory.
    for id in [&r, &a] {
        s.delete_vm(id);
    }
    assert_eq!(all_ram_digest(&s, &c), want2);
    let x = s.restore("child-full");
    assert_eq!(all_ram_digest(&s, &x), want);
    let y = s.restore("child-dirty");
    assert_eq!(all_ram_digest(&s, &y), want2);
    // A fork of a restored VM, snapshotted again.
    let z = s.fork_one(&y);
    let zs = s.snapshot(&z, "grandchild", SnapshotMode::Incremental);
    assert_eq!(
        zs.mode_used,
        SnapshotMode::Full,
        "a fork child has no base: {zs:?}"
    );
    let w = s.restore("grandchild");
    assert_eq!(all_ram_digest(&s, &w), want2);
    let inv = s.invariant();
    assert!(inv.ok, "{inv:?}");
}

/// While a snapshot saves its pages (the guest running again), the VM
/// shows how far it got: what `uffdctl snapshot create` draws its progress
/// bar from.
#[test]
fn a_snapshot_saving_shows_its_progress_on_the_vm() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let mib = 256;
    let vm = s.create_vm(&new_vm(mib));
    s.fill(&vm, 0, pages_of(mib), 5);
    let seen = std::thread::scope(|sc| {
        let post = sc.spawn(|| s.try_snapshot(&vm, &full("progress")));
        let mut seen = Vec::new();
        while !post.is_finished() {
            if let Some(p) = s.vm(&vm).snapshot_saving {
                seen.push(p);
            }
        }
        if let Err(r) = post.join().expect("POST thread") {
            panic!("{r}");
        }
        seen
    });
    eprintln!("{} progress samples while saving", seen.len());
    let first = seen
        .first()
        .expect("no progress was shown while the snapshot saved");
    assert_eq!(first.name, "progress", "{first:?}");
    assert_eq!(first.pages_total, pages_of(mib), "{first:?}");
    let saved: Vec<u64> = seen.iter().map(|p| p.pages_saved).collect();
    assert!(saved.windows(2).all(|w| w[0] <= w[1]), "{saved:?}");
    assert!(saved.iter().all(|n| *n <= pages_of(mib)), "{saved:?}");
    assert!(
        s.vm(&vm).snapshot_saving.is_none(),
        "progress stays after the snapshot committed"
    );
}

/// A dirty snapshot written in many small runs over its parent's reflinked
/// image is fragmented; past `--snapshot-rewrite-extents` the server
/// rewrites it sequentially in the background: far fewer extents, the same
/// bytes, and the snapshot restores exactly throughout.
#[test]
fn a_fragmented_image_is_rewritten_in_the_background() {
    if counts_4k_pages_only("200 one-page writes fragment an image; on 2 MiB blocks they do not") {
        return;
    }
    let Some(s) = server_on_xfs(&["--snapshot-rewrite-extents", "64"]) else {
        return;
    };
    let vm = s.create_vm(&new_vm(MIB));
    s.fill(&vm, 0, 4000, 1);
    s.snapshot(&vm, "frag-base", SnapshotMode::Full);
    for i in 0..200 {
        s.fill(&vm, i * 20, 1, 2);
    }
    let want = all_ram_digest(&s, &vm);
    let r = s.snapshot(&vm, "frag", SnapshotMode::Dirty);
    assert_eq!(r.mode_used, SnapshotMode::Dirty, "{r:?}");
    let written = r.image_extents;
    assert!(written > 64, "the dirty image is not fragmented: {r:?}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let now = loop {
        let info = s.snapshot_info("frag");
        let n = info.image_extents;
        if n < written / 4 {
            break n;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still {n} extents (written with {written}): {info:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    eprintln!("dirty image: {written} extents written, {now} after the rewrite");
    let restored = s.restore("frag");
    assert_eq!(
        all_ram_digest(&s, &restored),
        want,
        "rewritten image differs"
    );
    // The rewrite keeps the checksums: a restarted server verifies it.
    let mut s = s;
    s.restart(&["--snapshot-rewrite-extents", "64"]);
    let list = s.snapshots();
    assert!(list.quarantined.is_empty(), "{list:?}");
    let again = s.restore("frag");
    assert_eq!(all_ram_digest(&s, &again), want);
}

/// A crash after a VM snapshot's volume snapshot (`<name>.disk`, taken in
/// the pause) but before the snapshot committed leaves `.tmp-<name>/` and
/// the volume snapshot: the restarted server removes both, and nothing
/// else.
#[test]
fn an_unfinished_snapshots_volume_snapshot_is_removed_at_start() {
    let Some(mut s) = server_on_xfs(&[]) else {
        return;
    };
    s.create_volume("v1", 16);
    for name in ["orph.disk", "keep.disk", "keep"] {
        s.snapshot_volume("v1", name);
    }
    // What the crash leaves: the unfinished snapshot's directory.
    let tmp = s.state_dir().join("snapshots/.tmp-orph");
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("memory.img"), b"partial").unwrap();
    s.restart(&[]);
    assert!(!tmp.exists(), "the unfinished directory stays");
    let v = s.try_volume_snapshot("orph.disk");
    assert_eq!(
        v.as_ref().map_err(|r| r.status),
        Err(404),
        "the orphan volume snapshot stays: {v:?}"
    );
    for name in ["keep.disk", "keep"] {
        if let Err(v) = s.try_volume_snapshot(name) {
            panic!("{name} was removed: {v}");
        }
    }
}

/// What each page of `img` holds of a fill with `new` over one with
/// `old`: 0 the new fill, 1 the old one, 2 a page the new fill was
/// writing at that moment (its first word new, its second old); panics on
/// any other page (torn, foreign).
fn fill_state_of_pages(img: &std::path::Path, pages: u64, new: u64, old: u64) -> Vec<u8> {
    use shared::pattern::{fill_page, pattern_word, sample_offset};
    let bytes = std::fs::read(img).expect("read the image");
    let size = usize::try_from(shared::PAGE_SIZE).unwrap();
    assert_eq!(bytes.len(), size * idx(pages));
    let mut want = vec![0u8; size];
    bytes
        .chunks_exact(size)
        .zip(0..)
        .map(|(got, p)| {
            for (class, seed) in [(0, new), (1, old)] {
                want.fill(0);
                fill_page(&mut want, p, seed);
                if got == want.as_slice() {
                    return class;
                }
            }
            // Half written: word 0 of the new fill, the sampled word of
            // the old.
            want.fill(0);
            fill_page(&mut want, p, old);
            want[..8].copy_from_slice(&pattern_word(new, p).to_le_bytes());
            if sample_offset(p) != 0 && got == want.as_slice() {
                return 2;
            }
            panic!(
                "page {p} of {} holds neither fill {new} nor {old}",
                img.display()
            )
        })
        .collect()
}

/// A snapshot taken while the guest fills its memory, page after page,
/// holds one moment: pages below some k of the new fill, the rest of the
/// old one, none torn. Protection is armed before the pause while the
/// guest still writes, and the pause re-protects what it wrote meanwhile:
/// the dirty log of the next snapshot still sees every later write.
#[test]
fn a_snapshot_taken_mid_fill_holds_one_moment_and_tracks_every_later_write() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let mib = 256;
    let pages = pages_of(mib);
    let a = s.create_vm(&new_vm(mib));
    s.fill(&a, 0, pages, 1);
    s.snapshot(&a, "mid-base", SnapshotMode::Full);
    let mut old = 1;
    let mut delay = std::time::Duration::from_millis(120);
    for attempt in 0..6u64 {
        let seed = 10 + attempt;
        let name = format!("mid-{attempt}");
        let r = std::thread::scope(|sc| {
            let filler = sc.spawn(|| s.fill(&a, 0, pages, seed));
            std::thread::sleep(delay);
            let r = s.snapshot(&a, &name, SnapshotMode::Dirty);
            filler.join().expect("fill thread");
            r
        });
        assert_eq!(r.mode_used, SnapshotMode::Dirty, "{r:?}");
        let held = fill_state_of_pages(&image(&s, &name), pages, seed, old);
        let k = held.iter().take_while(|&&i| i == 0).count() as u64;
        // At most the page being written at the pause is half written.
        let half = u64::from(held.get(idx(k)) == Some(&2));
        assert!(
            held[idx(k + half)..].iter().all(|&i| i == 1),
            "{name}: pages below {k} of seed {seed}, but not all above it of seed {old}: {r:?}"
        );
        let k = k + half;
        eprintln!(
            "attempt {attempt}: delay {delay:?}, snapshot at page {k} of {pages}: {:?}",
            (&r.before_pause_us, &r.phases_us, r.pause_us)
        );
        old = seed;
        if k == 0 || k == pages {
            delay = if k == 0 {
                delay + std::time::Duration::from_millis(100)
            } else {
                delay / 2
            };
            continue;
        }
        // Exactly the pages the fill wrote before the pause.
        assert_eq!(
            r.pages_written,
            pages_in_units(&[(0, k)], s.unit_pages(&a)),
            "{r:?}"
        );
        assert!(r.before_pause_us.contains_key("armed_ahead"), "{r:?}");
        // Every page is written again: each write after the pause, in the
        // window between arming and pausing or not, is in the next log.
        s.fill(&a, 0, pages, 99);
        let d = s.snapshot(&a, "mid-after", SnapshotMode::Dirty);
        assert_eq!(d.mode_used, SnapshotMode::Dirty, "{d:?}");
        assert_eq!(d.pages_written, pages, "{d:?}");
        let x = s.restore("mid-after");
        assert_eq!(s.digest(&x, 0, pages), s.digest(&a, 0, pages));
        assert_eq!(s.verify(&x, 0, pages, 99), 0);
        return;
    }
    panic!("no snapshot landed in the middle of the fill in 6 attempts");
}

fn idx(n: u64) -> usize {
    usize::try_from(n).expect("fits")
}
