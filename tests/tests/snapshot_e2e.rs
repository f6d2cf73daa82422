//! End-to-end VM snapshots: real server, VMMs, KVM, userfaultfd and a
//! loop-mounted XFS (reflink=1, PAGEFORK_XFS_DIR) for the state directory.
//! Memory is compared whole with the VMM's `digest` of all RAM.

use std::path::PathBuf;

use pagefork_tests::{pages_of, require_kvm_uffd, TestServer};
use serde_json::{json, Value};

/// The XFS mount, or None (skip) outside CI; in CI a missing mount fails.
fn xfs_dir() -> Option<PathBuf> {
    match std::env::var_os("PAGEFORK_XFS_DIR") {
        Some(d) => Some(PathBuf::from(d)),
        None if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("CI=true but PAGEFORK_XFS_DIR is not set: run the tests through scripts/test.sh")
        }
        None => {
            eprintln!("skipping: PAGEFORK_XFS_DIR is not set (scripts/test.sh sets up a loop-mounted XFS)");
            None
        }
    }
}

/// A server whose state directory is on the XFS mount.
fn server_on_xfs() -> Option<TestServer> {
    let dir = xfs_dir()?;
    if !require_kvm_uffd() {
        return None;
    }
    std::env::set_var("TMPDIR", &dir);
    Some(TestServer::start())
}

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
    let Some(s) = server_on_xfs() else { return };
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
    let Some(s) = server_on_xfs() else { return };
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
