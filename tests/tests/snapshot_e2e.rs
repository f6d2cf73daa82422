//! End-to-end VM snapshots: real server, VMMs, KVM, userfaultfd and a
//! loop-mounted XFS (reflink=1, PAGEFORK_XFS_DIR) for the state directory.
//! Memory is compared whole with the VMM's `digest` of all RAM.

use std::path::PathBuf;

use pagefork_tests::{counts_4k_pages_only, pages_in_units, pages_of, server_on_xfs, TestServer};
use serde_json::{json, Value};

const MIB: u64 = 64;

fn all_ram_digest(s: &TestServer, id: &str) -> u64 {
    s.digest(id, 0, pages_of(MIB))
}

fn snapshot(s: &TestServer, vm: &str, name: &str, mode: &str) -> Value {
    let (st, v) = s.api(
        "POST",
        &format!("/v1/vms/{vm}/snapshots"),
        Some(json!({"name": name, "mode": mode})),
    );
    assert_eq!(st, 201, "snapshot {name} of {vm}: {v}");
    v
}

fn restore(s: &TestServer, name: &str) -> String {
    s.create_vm(json!({ "from_snapshot": name }))
}

fn image(s: &TestServer, name: &str) -> PathBuf {
    s.state_dir()
        .join("snapshots")
        .join(name)
        .join("memory.img")
}

fn num(id: &str) -> u64 {
    id.trim_start_matches("vm-").parse().expect("vm-N")
}

#[test]
fn full_snapshot_restores_exact_memory_and_guest_state() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let vm = s.create_vm(json!({ "memory_mib": MIB }));
    // Part of memory written, part only read, the rest never touched.
    s.fill(&vm, 0, 3000, 1);
    s.touch(&vm, 5000, 500, false);
    s.fill(&vm, 9000, 100, 7);
    let want = all_ram_digest(&s, &vm);

    let r = snapshot(&s, &vm, "full-1", "full");
    assert_eq!(r["mode_used"], "full", "{r}");
    assert_eq!(r["mode_requested"], "full", "{r}");
    assert!(r.get("fallback_reason").is_none(), "{r}");
    // `digest` read every page into the VM: all are saved, but only the
    // written ones hold data; zero pages stay holes.
    assert_eq!(r["pages_written"], pages_of(MIB), "{r}");
    assert_eq!(r["bytes_written"], 3100 * 4096, "{r}");
    assert!(r["image_extents"].as_u64().unwrap() >= 1, "{r}");

    // The original moves on; the snapshot keeps the moment.
    s.fill(&vm, 0, 200, 2);
    assert_ne!(all_ram_digest(&s, &vm), want);

    let (st, list) = s.api("GET", "/v1/snapshots", None);
    assert_eq!(st, 200, "{list}");
    assert_eq!(list["snapshots"][0]["name"], "full-1", "{list}");
    let (st, info) = s.api("GET", "/v1/snapshots/full-1", None);
    assert_eq!(st, 200, "{info}");
    assert_eq!(info["memory_mib"], MIB, "{info}");
    assert_eq!(info["vm"], vm.as_str(), "{info}");
    assert_eq!(
        info["pages"]["data"].as_u64().unwrap() + info["pages"]["zero_hole"].as_u64().unwrap(),
        pages_of(MIB),
        "{info}"
    );
    let meta = std::fs::metadata(image(&s, "full-1")).unwrap();
    assert_eq!(meta.len(), MIB << 20);
    assert!(
        std::os::unix::fs::MetadataExt::blocks(&meta) * 512 < (MIB << 20) / 2,
        "memory.img is not sparse"
    );

    let restored = restore(&s, "full-1");
    let info = s.vm(&restored);
    assert_eq!(info["memory_mib"], MIB, "{info}");
    assert!(pagefork_tests::pages_by(&info, "image") > 0, "{info}");
    // Deleting a snapshot a VM reads from is refused, naming the VM.
    let (st, v) = s.api("DELETE", "/v1/snapshots/full-1", None);
    assert_eq!(st, 409, "{v}");
    assert!(v["error"].as_str().unwrap().contains(&restored), "{v}");
    let (_, src) = s.api("GET", &format!("/v1/vms/{restored}/sources"), None);
    assert!(
        src["by_source"].get("snapshot:full-1").is_some(),
        "sources name the snapshot: {src}"
    );
    let (_, tree) = s.api("GET", "/v1/tree", None);
    let node = tree["vms"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == restored.as_str())
        .cloned()
        .unwrap();
    assert!(
        node["reads_from"]["snapshot:full-1"].as_u64().unwrap() > 0,
        "the tree names the snapshot: {node}"
    );
    assert_eq!(
        all_ram_digest(&s, &restored),
        want,
        "restored memory differs"
    );
    assert_eq!(s.verify(&restored, 0, 3000, 1), 0);
    assert_eq!(s.verify(&restored, 9000, 100, 7), 0);
    // The guest agent carries on as itself and keeps working.
    assert_eq!(s.exec(&restored, json!({"op": "identity"})), num(&restored));
    s.fill(&restored, 100, 10, 3);
    assert_eq!(s.verify(&restored, 100, 10, 3), 0);
    assert_eq!(s.verify(&vm, 0, 200, 2), 0, "the original is unaffected");

    let (st, v) = s.api("DELETE", &format!("/v1/vms/{restored}"), None);
    assert_eq!(st, 200, "{v}");
    let (st, v) = s.api("DELETE", "/v1/snapshots/full-1", None);
    assert_eq!(st, 200, "{v}");
    assert!(!image(&s, "full-1").exists());
    let (st, _) = s.api("GET", "/v1/snapshots/full-1", None);
    assert_eq!(st, 404);
}

#[test]
fn snapshot_names_are_checked_and_unique() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let vm = s.create_vm(json!({ "memory_mib": 16 }));
    snapshot(&s, &vm, "one", "full");
    for (body, want) in [
        (json!({"name": "one"}), 409),
        (json!({"name": "../x"}), 400),
        (json!({"name": ".hidden"}), 400),
        (json!({"name": "a", "mode": "soft"}), 400),
    ] {
        let (st, v) = s.api(
            "POST",
            &format!("/v1/vms/{vm}/snapshots"),
            Some(body.clone()),
        );
        assert_eq!(st, want, "{body}: {v}");
    }
    let (st, v) = s.api(
        "POST",
        "/v1/vms/vm-999/snapshots",
        Some(json!({"name": "two"})),
    );
    assert_eq!(st, 404, "{v}");
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

fn info(s: &TestServer, name: &str) -> Value {
    let (st, v) = s.api("GET", &format!("/v1/snapshots/{name}"), None);
    assert_eq!(st, 200, "{v}");
    v
}

#[test]
fn incremental_and_dirty_images_equal_full_images_of_the_same_moment() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let a = s.create_vm(json!({ "memory_mib": MIB }));
    s.fill(&a, 0, 4000, 1);
    snapshot(&s, &a, "base", "full");

    // A VM restored from `base` writes some pages.
    let r = restore(&s, "base");
    s.fill(&r, 100, 200, 2);
    s.fill(&r, 8000, 50, 3);
    let inc = snapshot(&s, &r, "inc", "incremental");
    assert_eq!(inc["mode_used"], "incremental", "{inc}");
    assert_eq!(info(&s, "inc")["parent"], "base");
    // Pages the VM has not written or read since its start are not saved.
    assert!(inc["pages_written"].as_u64().unwrap() < 4000, "{inc}");
    let full = snapshot(&s, &r, "inc-full", "full");
    assert_eq!(full["mode_used"], "full");
    assert!(
        same_file(&image(&s, "inc"), &image(&s, "inc-full")),
        "incremental and full images of one moment differ"
    );
    let at_inc = all_ram_digest(&s, &r);

    // k page writes after a snapshot: a dirty snapshot writes exactly k.
    // (On hugepage guest RAM, the k pages' whole blocks.)
    let k = 37;
    s.fill(&r, 1000, k, 4);
    let before = info(&s, "inc-full")["exclusive_bytes"].as_u64().unwrap();
    let d = snapshot(&s, &r, "d1", "dirty");
    assert_eq!(d["mode_used"], "dirty", "{d}");
    let dirty = pages_in_units(&[(1000, k)], s.unit_pages(&r));
    assert_eq!(d["pages_written"], dirty, "{d}");
    assert_eq!(d["bytes_written"], dirty * 4096, "{d}");
    assert_eq!(info(&s, "d1")["parent"], "inc-full");
    let excl = info(&s, "d1")["exclusive_bytes"].as_u64().unwrap();
    assert!(
        (dirty * 4096..=dirty * 4096 + (64 << 10)).contains(&excl),
        "d1 holds {excl} bytes of its own for {k} pages (its parent {before})"
    );
    let d_full = snapshot(&s, &r, "d1-full", "full");
    assert_eq!(d_full["mode_used"], "full");
    assert!(same_file(&image(&s, "d1"), &image(&s, "d1-full")));
    let at_d1 = all_ram_digest(&s, &r);

    // A second dirty snapshot with nothing written saves nothing.
    let d2 = snapshot(&s, &r, "d2", "dirty");
    assert_eq!(d2["mode_used"], "dirty", "{d2}");
    assert_eq!(d2["pages_written"], 0, "{d2}");

    // Every image restores to the memory of its moment.
    for (name, want) in [("inc", at_inc), ("d1", at_d1), ("d2", at_d1)] {
        let x = restore(&s, name);
        assert_eq!(all_ram_digest(&s, &x), want, "restore of {name}");
        assert_eq!(s.verify(&x, 1000, k, 4), u64::from(name == "inc") * k);
        s.api("DELETE", &format!("/v1/vms/{x}"), None);
    }
}

#[test]
fn dirty_and_incremental_without_a_base_degrade_to_full_and_say_why() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let a = s.create_vm(json!({ "memory_mib": 16 }));
    s.fill(&a, 0, 10, 1);
    let d = snapshot(&s, &a, "first", "dirty");
    assert_eq!(d["mode_requested"], "dirty");
    assert_eq!(d["mode_used"], "full", "{d}");
    let why = d["fallback_reason"].as_str().unwrap_or_default();
    assert!(why.contains("no snapshot"), "{d}");
    let i = snapshot(&s, &a, "second", "incremental");
    assert_eq!(i["mode_used"], "full", "{i}");
    assert!(
        i["fallback_reason"]
            .as_str()
            .unwrap_or_default()
            .contains("did not start from a snapshot"),
        "{i}"
    );
    // Once it has a snapshot, dirty works; if that one is deleted, it
    // degrades again.
    let d = snapshot(&s, &a, "third", "dirty");
    assert_eq!(d["mode_used"], "dirty", "{d}");
    let (st, v) = s.api("DELETE", "/v1/snapshots/third", None);
    assert_eq!(st, 200, "{v}");
    let d = snapshot(&s, &a, "fourth", "dirty");
    assert_eq!(d["mode_used"], "full", "{d}");
    assert!(
        d["fallback_reason"]
            .as_str()
            .unwrap_or_default()
            .contains("third"),
        "{d}"
    );
}

#[test]
fn guest_writes_during_the_save_keep_the_snapshot_at_its_moment() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let mib = 256;
    let pages = pages_of(mib);
    let a = s.create_vm(json!({ "memory_mib": mib }));
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
                    && s.vm(&a).get("snapshot_saving").is_none()
                {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                s.fill(&a, start, tail, seed);
            });
            let r = snapshot(&s, &a, &name, "full");
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            eprintln!("snapshot while the guest writes: {r}");
            assert!(r["pause_us"].as_u64().unwrap() < 200_000, "{r}");
            overlapped |= r["pages_saved_ahead"].as_u64().unwrap() > 0;
            writer.join().unwrap();
        });
        assert_eq!(s.verify(&a, start, tail, seed), 0);
        let x = restore(&s, &name);
        assert_eq!(s.digest(&x, 0, pages), want, "{name} is not of its moment");
        s.api("DELETE", &format!("/v1/vms/{x}"), None);
        want = s.digest(&a, 0, pages);
        if overlapped {
            break;
        }
    }
    assert!(overlapped, "the guest's writes never overlapped the save");
    // Dirty tracking saw every page the guest wrote after the last pause.
    let d = snapshot(&s, &a, "after", "dirty");
    assert_eq!(d["mode_used"], "dirty", "{d}");
    assert_eq!(d["pages_written"], tail, "{d}");
    let y = restore(&s, "after");
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
    let a = s.create_vm(json!({ "memory_mib": mib, "hugepages": false }));
    s.fill(&a, 0, pages, 1);
    let want = s.digest(&a, 0, pages);
    let n = 64;
    let r = std::thread::scope(|sc| {
        let writer = sc.spawn(|| {
            while s.vm(&a).get("snapshot_saving").is_none() {
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
            s.fill(&a, 0, n, 9);
        });
        let r = snapshot(&s, &a, "held", "full");
        writer.join().unwrap();
        r
    });
    eprintln!("snapshot with its copies held: {r}");
    assert_eq!(s.verify(&a, 0, n, 9), 0);
    let x = restore(&s, "held");
    assert_eq!(
        s.digest(&x, 0, pages),
        want,
        "the snapshot took later bytes"
    );
    assert_eq!(r["pages_saved_ahead"], n, "{r}");
}

/// Start a VM for a crash round: from an earlier snapshot when there is
/// one (so incremental snapshots have a base), else empty.
fn crash_round_vm(s: &TestServer, from: Option<&str>) -> String {
    match from {
        Some(name) => restore(s, name),
        None => s.create_vm(json!({ "memory_mib": CRASH_MIB })),
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
        let mode = ["full", "incremental", "dirty"][round % 3];
        if mode == "dirty" {
            let name = format!("r{round:02}-pre");
            s.fill(&vm, 0, pages, 100 + round as u64);
            snapshot(&s, &vm, &name, "full");
            want.insert(name, s.digest(&vm, 0, pages));
        }
        let start = rng.gen_range(0..pages / 2);
        s.fill(&vm, start, pages / 2, round as u64);
        let digest = s.digest(&vm, 0, pages);
        let name = format!("r{round:02}-{mode}");
        let delay = rng.gen_range(0..120);
        let sock = s.api_sock();
        let body = json!({"name": name, "mode": mode});
        let path = format!("/v1/vms/{vm}/snapshots");
        let request = std::thread::spawn(move || {
            let c = uffdctl::client::Client::new(sock);
            c.request("POST", &path, Some(&body)).ok().map(|r| r.status)
        });
        std::thread::sleep(std::time::Duration::from_millis(delay));
        s.kill_hard();
        let answered = request.join().unwrap();
        s.restart(&[]);

        let (st, list) = s.api("GET", "/v1/snapshots", None);
        assert_eq!(st, 200, "{list}");
        assert_eq!(list["quarantined"], json!([]), "round {round}: {list}");
        let listed: Vec<String> = list["snapshots"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["name"].as_str().unwrap().to_owned())
            .collect();
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
            let x = restore(&s, &name);
            assert_eq!(s.digest(&x, 0, pages), digest, "round {round}: {name}");
            s.api("DELETE", &format!("/v1/vms/{x}"), None);
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
        let x = restore(&s, name);
        assert_eq!(s.digest(&x, 0, pages), *digest, "{name}");
        s.api("DELETE", &format!("/v1/vms/{x}"), None);
    }
}

#[test]
fn a_snapshot_that_does_not_verify_is_quarantined_at_start() {
    use std::os::unix::fs::FileExt;
    let Some(mut s) = server_on_xfs(&[]) else {
        return;
    };
    let vm = s.create_vm(json!({ "memory_mib": 16 }));
    s.fill(&vm, 0, 100, 1);
    snapshot(&s, &vm, "good", "full");
    snapshot(&s, &vm, "bad", "full");
    s.stop(std::time::Duration::from_secs(20));
    // One flipped byte in a data page.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(image(&s, "bad"))
        .unwrap();
    f.write_all_at(&[0x5a], 4096 * 10 + 17).unwrap();
    drop(f);
    s.restart(&[]);
    let (st, list) = s.api("GET", "/v1/snapshots", None);
    assert_eq!(st, 200, "{list}");
    let names: Vec<&str> = list["snapshots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["good"], "{list}");
    assert!(
        list["quarantined"][0].as_str().unwrap().starts_with("bad."),
        "{list}"
    );
    let (st, v) = s.api("POST", "/v1/vms", Some(json!({"from_snapshot": "bad"})));
    assert_eq!(st, 404, "{v}");
    let x = restore(&s, "good");
    assert_eq!(s.verify(&x, 0, 100, 1), 0);
}

fn disk_sum(s: &TestServer, vm: &str, count: u64) -> u64 {
    s.exec(
        vm,
        json!({"op": "disk_checksum", "sector": 0, "count": count}),
    )
}

#[test]
fn rollback_returns_memory_state_and_disk_while_a_fork_child_keeps_its_own() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let (st, v) = s.api(
        "POST",
        "/v1/volumes",
        Some(json!({"name": "rb-disk", "size_mib": 1})),
    );
    assert_eq!(st, 201, "{v}");
    let a = s.create_vm(json!({ "memory_mib": MIB, "volume": "rb-disk" }));
    s.fill(&a, 0, 2000, 1);
    s.exec(
        &a,
        json!({"op": "disk_fill", "sector": 0, "count": 100, "seed": 1}),
    );
    let mem_at_snap = all_ram_digest(&s, &a);
    let disk_at_snap = disk_sum(&s, &a, 2048);
    let snap = snapshot(&s, &a, "rb", "full");
    assert_eq!(info(&s, "rb")["volume_snapshot"], "rb.disk", "{snap}");

    // A child forked after the snapshot reads its pages from the parent.
    let (st, f) = s.api("POST", &format!("/v1/vms/{a}/fork"), Some(json!({})));
    assert_eq!(st, 201, "{f}");
    let child = f["children"][0].as_str().unwrap().to_owned();
    // (Not read yet: the child still reads most of its pages from the
    // parent at the rollbacks.)
    let child_mem = mem_at_snap;

    // The parent moves on: memory and disk.
    s.fill(&a, 0, 500, 2);
    s.fill(&a, 3000, 500, 3);
    s.exec(
        &a,
        json!({"op": "disk_fill", "sector": 0, "count": 50, "seed": 2}),
    );
    assert_ne!(all_ram_digest(&s, &a), mem_at_snap);
    assert_ne!(disk_sum(&s, &a, 2048), disk_at_snap);

    let (st, r) = s.api(
        "POST",
        &format!("/v1/vms/{a}/rollback"),
        Some(json!({"snapshot": "rb"})),
    );
    assert_eq!(st, 200, "{r}");
    eprintln!("rollback: {r}");
    // Back to its last snapshot: only the pages written since are reset
    // (the child already holds its own copies of those).
    assert_eq!(r["pages_handed_over"], 0, "{r}");
    // On 4 KiB memory the VMM discards them (hugetlb memory is punched).
    let discarded = r["pages_discarded"].as_u64().unwrap_or(0);
    if s.unit_pages(&a) == 1 {
        assert!(discarded >= 1000, "{r}");
    } else {
        assert_eq!(discarded, 0, "{r}");
    }
    assert_eq!(s.vm(&a)["state"], "running");
    assert_eq!(all_ram_digest(&s, &a), mem_at_snap, "memory after rollback");
    assert_eq!(disk_sum(&s, &a, 2048), disk_at_snap, "disk after rollback");
    assert_eq!(s.exec(&a, json!({"op": "identity"})), num(&a));
    assert_eq!(s.verify(&a, 0, 2000, 1), 0);
    // The scrub punched whatever the guest did not touch.
    assert_no_stale_pages(&s, &a);
    // The child still has the memory it was forked with.
    assert_eq!(all_ram_digest(&s, &child), child_mem, "the child changed");
    let (st, inv) = s.api("GET", "/v1/debug/invariant", None);
    assert_eq!(st, 200);
    assert_eq!(inv["ok"], true, "{inv}");
    // The rolled-back VM carries on; tracking went on from the snapshot,
    // so a dirty snapshot saves exactly what it wrote since the rollback.
    s.fill(&a, 10, 5, 9);
    assert_eq!(s.verify(&a, 10, 5, 9), 0);
    let d = snapshot(&s, &a, "rb-after", "dirty");
    assert_eq!(d["mode_used"], "dirty", "{d}");
    assert_eq!(
        d["pages_written"],
        pages_in_units(&[(10, 5)], s.unit_pages(&a)),
        "{d}"
    );
    let after = all_ram_digest(&s, &a);
    let x = restore(&s, "rb-after");
    assert_eq!(all_ram_digest(&s, &x), after);
    // Back to the older snapshot (not the last one: all memory is reset).
    s.fill(&a, 0, 3000, 11);
    let before = all_ram_digest(&s, &a);
    let (st, f) = s.api("POST", &format!("/v1/vms/{a}/fork"), Some(json!({})));
    assert_eq!(st, 201, "{f}");
    let child2 = f["children"][0].as_str().unwrap().to_owned();
    let (st, r) = s.api(
        "POST",
        &format!("/v1/vms/{a}/rollback"),
        Some(json!({"snapshot": "rb"})),
    );
    assert_eq!(st, 200, "{r}");
    // Every page the new child still read from the parent was handed over.
    assert_eq!(r["pages_handed_over"], pages_of(MIB), "{r}");
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
    let (_, inv) = s.api("GET", "/v1/debug/invariant", None);
    assert_eq!(inv["ok"], true, "{inv}");
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
    let a = s.create_vm(json!({ "memory_mib": MIB }));
    let pages = pages_of(MIB);
    s.fill(&a, 0, pages, 21);
    let at_snap = all_ram_digest(&s, &a);
    snapshot(&s, &a, "disc", "full");
    let mut minor = 0;
    for round in 0..3u64 {
        s.fill(&a, 0, pages, 30 + round);
        assert_ne!(all_ram_digest(&s, &a), at_snap);
        let (st, r) = s.api(
            "POST",
            &format!("/v1/vms/{a}/rollback"),
            Some(json!({"snapshot": "disc"})),
        );
        assert_eq!(st, 200, "{r}");
        eprintln!("rollback {round}: {r}");
        if s.unit_pages(&a) == 1 {
            assert_eq!(r["pages_discarded"], pages, "{r}");
        }
        // Every page is stale: the guest's reads fault MINOR, and each
        // fault punches and installs its whole run.
        assert_eq!(s.verify(&a, 0, pages, 21), 0, "round {round}");
        assert_eq!(all_ram_digest(&s, &a), at_snap, "round {round}");
        let vm = s.vm(&a);
        eprintln!("faults: {}", vm["faults"]);
        if s.unit_pages(&a) == 1 {
            let now = vm["faults"]["minor"].as_u64().unwrap_or(0);
            assert!(now > minor, "round {round}: no MINOR fault: {vm}");
            minor = now;
        }
        let (_, inv) = s.api("GET", "/v1/debug/invariant", None);
        assert_eq!(inv["ok"], true, "{inv}");
    }
    // Writes after the rollback stay, and a restore of a later snapshot
    // has them.
    s.fill(&a, 100, 50, 99);
    let now = all_ram_digest(&s, &a);
    snapshot(&s, &a, "disc-after", "dirty");
    let x = restore(&s, "disc-after");
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
        let (_, inv) = s.api("GET", "/v1/debug/invariant", None);
        assert_eq!(inv["ok"], true, "{inv}");
        let v = s.vm(vm);
        let own = v["pages"]["vm"].as_u64().unwrap_or(0);
        if v["resident_pages"].as_u64() == Some(own) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "stale pages left in the memfd: {v}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn clone_makes_n_running_copies() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let a = s.create_vm(json!({ "memory_mib": 16 }));
    s.fill(&a, 0, 1000, 5);
    let (st, c) = s.api(
        "POST",
        &format!("/v1/vms/{a}/clone"),
        Some(json!({"count": 5, "concurrency": 2})),
    );
    assert_eq!(st, 201, "{c}");
    eprintln!("clone: {c}");
    let clones: Vec<String> = c["clones"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(clones.len(), 5);
    let name = c["snapshot"].as_str().unwrap();
    assert_eq!(info(&s, name)["readers"].as_array().unwrap().len(), 5);
    for x in &clones {
        assert_eq!(s.verify(x, 0, 1000, 5), 0, "{x}");
        assert_eq!(s.exec(x, json!({"op": "identity"})), num(x));
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
    let a = s.create_vm(json!({ "memory_mib": 16 }));
    s.fill(&a, 0, 100, 5);
    let before = memfds_of(s.pid());
    let (st, c) = s.api(
        "POST",
        &format!("/v1/vms/{a}/clone"),
        Some(json!({"count": 6, "concurrency": 2})),
    );
    assert_eq!(st, 507, "{c}");
    assert!(
        c["error"].as_str().unwrap().contains("of 6"),
        "the error names the clone: {c}"
    );
    assert_eq!(s.vm_ids(), vec![a.clone()]);
    let (_, list) = s.api("GET", "/v1/snapshots", None);
    assert_eq!(list["snapshots"], json!([]), "{list}");
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

fn uffdctl_json(s: &TestServer, args: &[&str]) -> Value {
    let out = std::process::Command::new(pagefork_tests::bin("uffdctl"))
        .arg("--socket")
        .arg(s.api_sock())
        .arg("--json")
        .args(args)
        .output()
        .expect("cannot run uffdctl");
    assert!(
        out.status.success(),
        "uffdctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("uffdctl printed no JSON")
}

#[test]
fn uffdctl_snapshot_restore_rollback_and_clone() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let a = s.create_vm(json!({ "memory_mib": 16 }));
    s.fill(&a, 0, 50, 1);
    let c = uffdctl_json(&s, &["snapshot", "create", &a, "cli-1"]);
    assert_eq!(c["mode_used"], "full", "{c}");
    let d = uffdctl_json(&s, &["snapshot", "create", &a, "cli-2", "--mode", "dirty"]);
    assert_eq!(d["mode_used"], "dirty", "{d}");
    let list = uffdctl_json(&s, &["snapshot", "list"]);
    assert_eq!(list["snapshots"].as_array().unwrap().len(), 2, "{list}");
    let show = uffdctl_json(&s, &["snapshot", "show", "cli-2"]);
    assert_eq!(show["parent"], "cli-1", "{show}");
    let r = uffdctl_json(&s, &["snapshot", "restore", "cli-1"]);
    let restored = r["id"].as_str().unwrap().to_owned();
    assert_eq!(s.verify(&restored, 0, 50, 1), 0);
    s.fill(&a, 0, 50, 2);
    let rb = uffdctl_json(&s, &["vm", "rollback", &a, "cli-1"]);
    assert_eq!(rb["snapshot"], "cli-1", "{rb}");
    assert_eq!(s.verify(&a, 0, 50, 1), 0);
    let cl = uffdctl_json(&s, &["vm", "clone", &a, "--count", "2"]);
    assert_eq!(cl["clones"].as_array().unwrap().len(), 2, "{cl}");
    let del = uffdctl_json(&s, &["snapshot", "delete", "cli-2"]);
    assert_eq!(del["deleted"], true, "{del}");
}

#[test]
fn snapshots_of_forked_and_restored_vms_survive_their_parents() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let a = s.create_vm(json!({ "memory_mib": MIB }));
    s.fill(&a, 0, 4000, 1);
    snapshot(&s, &a, "origin", "full");
    // A VM restored from a snapshot is forked; the child reads pages from
    // its parent and from the snapshot's image.
    let r = restore(&s, "origin");
    s.fill(&r, 100, 50, 2);
    let (st, f) = s.api("POST", &format!("/v1/vms/{r}/fork"), Some(json!({})));
    assert_eq!(st, 201, "{f}");
    let c = f["children"][0].as_str().unwrap().to_owned();
    s.fill(&c, 3000, 20, 3);
    s.fill(&r, 0, 200, 4); // the parent moves on after the fork
    let want = all_ram_digest(&s, &c);
    let full = snapshot(&s, &c, "child-full", "full");
    assert_eq!(full["mode_used"], "full", "{full}");
    s.fill(&c, 5000, 7, 5);
    let want2 = all_ram_digest(&s, &c);
    let d = snapshot(&s, &c, "child-dirty", "dirty");
    assert_eq!(d["mode_used"], "dirty", "{d}");
    assert_eq!(
        d["pages_written"],
        pages_in_units(&[(5000, 7)], s.unit_pages(&c)),
        "{d}"
    );
    // The parents go; the snapshots and the child keep their memory.
    for id in [&r, &a] {
        let (st, v) = s.api("DELETE", &format!("/v1/vms/{id}"), None);
        assert_eq!(st, 200, "{v}");
    }
    assert_eq!(all_ram_digest(&s, &c), want2);
    let x = restore(&s, "child-full");
    assert_eq!(all_ram_digest(&s, &x), want);
    let y = restore(&s, "child-dirty");
    assert_eq!(all_ram_digest(&s, &y), want2);
    // A fork of a restored VM, snapshotted again.
    let (st, f) = s.api("POST", &format!("/v1/vms/{y}/fork"), Some(json!({})));
    assert_eq!(st, 201, "{f}");
    let z = f["children"][0].as_str().unwrap().to_owned();
    let zs = snapshot(&s, &z, "grandchild", "incremental");
    assert_eq!(zs["mode_used"], "full", "a fork child has no base: {zs}");
    let w = restore(&s, "grandchild");
    assert_eq!(all_ram_digest(&s, &w), want2);
    let (_, inv) = s.api("GET", "/v1/debug/invariant", None);
    assert_eq!(inv["ok"], true, "{inv}");
}

/// While a snapshot saves its pages (the guest running again), the VM
/// shows how far it got: what `uffdctl snapshot create` draws its progress
/// bar from.
#[test]
fn a_snapshot_saving_shows_its_progress_on_the_vm() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let mib = 256;
    let vm = s.create_vm(json!({ "memory_mib": mib }));
    s.fill(&vm, 0, pages_of(mib), 5);
    let seen = std::thread::scope(|sc| {
        let post = sc.spawn(|| {
            s.api(
                "POST",
                &format!("/v1/vms/{vm}/snapshots"),
                Some(json!({"name": "progress"})),
            )
        });
        let mut seen = Vec::new();
        while !post.is_finished() {
            if let Some(p) = s.vm(&vm).get("snapshot_saving").cloned() {
                seen.push(p);
            }
        }
        let (st, r) = post.join().expect("POST thread");
        assert_eq!(st, 201, "{r}");
        seen
    });
    eprintln!("{} progress samples while saving", seen.len());
    let first = seen
        .first()
        .expect("no progress was shown while the snapshot saved");
    assert_eq!(first["name"], "progress", "{first}");
    assert_eq!(first["pages_total"], pages_of(mib), "{first}");
    let saved: Vec<u64> = seen
        .iter()
        .map(|p| p["pages_saved"].as_u64().expect("pages_saved"))
        .collect();
    assert!(saved.windows(2).all(|w| w[0] <= w[1]), "{saved:?}");
    assert!(saved.iter().all(|n| *n <= pages_of(mib)), "{saved:?}");
    assert!(
        s.vm(&vm).get("snapshot_saving").is_none(),
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
    let vm = s.create_vm(json!({ "memory_mib": MIB }));
    s.fill(&vm, 0, 4000, 1);
    snapshot(&s, &vm, "frag-base", "full");
    for i in 0..200 {
        s.fill(&vm, i * 20, 1, 2);
    }
    let want = all_ram_digest(&s, &vm);
    let r = snapshot(&s, &vm, "frag", "dirty");
    assert_eq!(r["mode_used"], "dirty", "{r}");
    let written = r["image_extents"].as_u64().expect("image_extents");
    assert!(written > 64, "the dirty image is not fragmented: {r}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let now = loop {
        let (_, info) = s.api("GET", "/v1/snapshots/frag", None);
        let n = info["image_extents"].as_u64().expect("image_extents");
        if n < written / 4 {
            break n;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still {n} extents (written with {written}): {info}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    eprintln!("dirty image: {written} extents written, {now} after the rewrite");
    let restored = restore(&s, "frag");
    assert_eq!(
        all_ram_digest(&s, &restored),
        want,
        "rewritten image differs"
    );
    // The rewrite keeps the checksums: a restarted server verifies it.
    let mut s = s;
    s.restart(&["--snapshot-rewrite-extents", "64"]);
    let (_, list) = s.api("GET", "/v1/snapshots", None);
    assert!(
        list["quarantined"].as_array().is_none_or(|q| q.is_empty()),
        "{list}"
    );
    let again = restore(&s, "frag");
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
    let (st, v) = s.api(
        "POST",
        "/v1/volumes",
        Some(json!({"name": "v1", "size_mib": 16})),
    );
    assert_eq!(st, 201, "{v}");
    for name in ["orph.disk", "keep.disk", "keep"] {
        let (st, v) = s.api(
            "POST",
            "/v1/volumes/v1/snapshots",
            Some(json!({ "name": name })),
        );
        assert_eq!(st, 201, "{name}: {v}");
    }
    // What the crash leaves: the unfinished snapshot's directory.
    let tmp = s.state_dir().join("snapshots/.tmp-orph");
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("memory.img"), b"partial").unwrap();
    s.restart(&[]);
    assert!(!tmp.exists(), "the unfinished directory stays");
    let (st, v) = s.api("GET", "/v1/volume-snapshots/orph.disk", None);
    assert_eq!(st, 404, "the orphan volume snapshot stays: {v}");
    for name in ["keep.disk", "keep"] {
        let (st, v) = s.api("GET", &format!("/v1/volume-snapshots/{name}"), None);
        assert_eq!(st, 200, "{name} was removed: {v}");
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
    let a = s.create_vm(json!({ "memory_mib": mib }));
    s.fill(&a, 0, pages, 1);
    snapshot(&s, &a, "mid-base", "full");
    let mut old = 1;
    let mut delay = std::time::Duration::from_millis(120);
    for attempt in 0..6u64 {
        let seed = 10 + attempt;
        let name = format!("mid-{attempt}");
        let r = std::thread::scope(|sc| {
            let filler = sc.spawn(|| s.fill(&a, 0, pages, seed));
            std::thread::sleep(delay);
            let r = snapshot(&s, &a, &name, "dirty");
            filler.join().expect("fill thread");
            r
        });
        assert_eq!(r["mode_used"], "dirty", "{r}");
        let held = fill_state_of_pages(&image(&s, &name), pages, seed, old);
        let k = held.iter().take_while(|&&i| i == 0).count() as u64;
        // At most the page being written at the pause is half written.
        let half = u64::from(held.get(idx(k)) == Some(&2));
        assert!(
            held[idx(k + half)..].iter().all(|&i| i == 1),
            "{name}: pages below {k} of seed {seed}, but not all above it of seed {old}: {r}"
        );
        let k = k + half;
        eprintln!(
            "attempt {attempt}: delay {delay:?}, snapshot at page {k} of {pages}: {}",
            json!({"before_pause_us": r["before_pause_us"], "phases_us": r["phases_us"], "pause_us": r["pause_us"]})
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
            r["pages_written"],
            pages_in_units(&[(0, k)], s.unit_pages(&a)),
            "{r}"
        );
        assert!(r["before_pause_us"]["armed_ahead"].is_u64(), "{r}");
        // Every page is written again: each write after the pause, in the
        // window between arming and pausing or not, is in the next log.
        s.fill(&a, 0, pages, 99);
        let d = snapshot(&s, &a, "mid-after", "dirty");
        assert_eq!(d["mode_used"], "dirty", "{d}");
        assert_eq!(d["pages_written"], pages, "{d}");
        let x = restore(&s, "mid-after");
        assert_eq!(s.digest(&x, 0, pages), s.digest(&a, 0, pages));
        assert_eq!(s.verify(&x, 0, pages, 99), 0);
        return;
    }
    panic!("no snapshot landed in the middle of the fill in 6 attempts");
}

fn idx(n: u64) -> usize {
    usize::try_from(n).expect("fits")
}
