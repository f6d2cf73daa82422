//! End-to-end disk tests: a VM's reflinked volume through the guest block
//! device, forked with the VM, and rolled back to a snapshot. The server's
//! state directory lives on the loop-mounted XFS (reflink=1) named by
//! PAGEFORK_XFS_DIR, which `scripts/test.sh` sets up.

use pagefork_tests::{server_on_xfs, TestServer};
use serde_json::json;
use shared::pattern::{disk_checksum, disk_word, SECTOR_SIZE};

/// What `disk_fill` leaves in sectors [s, s+n) of `disk`.
fn apply_disk_fill(disk: &mut [u8], s: u64, n: u64, seed: u64) {
    for sec in s..s + n {
        let b = usize::try_from(sec * SECTOR_SIZE).unwrap();
        disk[b..b + 512].fill(0);
        disk[b..b + 8].copy_from_slice(&disk_word(seed, sec).to_le_bytes());
    }
}

fn volume_file(server: &TestServer, name: &str) -> Vec<u8> {
    let path = server.state_dir().join("volumes").join(name).join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

#[test]
fn forked_vm_disks_are_isolated_and_match_the_volume_files() {
    let Some(server) = server_on_xfs(&[]) else {
        return;
    };
    let (st, v) = server.api(
        "POST",
        "/v1/volumes",
        Some(json!({"name": "d1", "size_mib": 4})),
    );
    assert_eq!(st, 201, "{v}");
    let sectors = 4 * 2048;
    let parent = server.create_vm(json!({"memory_mib": 64, "volume": "d1"}));

    // The parent fills the whole disk with seed 1.
    server.exec(
        &parent,
        json!({"op": "disk_fill", "sector": 0, "count": sectors, "seed": 1}),
    );
    let mut want_parent = vec![0u8; 4 << 20];
    apply_disk_fill(&mut want_parent, 0, sectors, 1);
    let sum = server.exec(
        &parent,
        json!({"op": "disk_checksum", "sector": 0, "count": sectors}),
    );
    assert_eq!(sum, disk_checksum(&want_parent, 0, sectors));
    assert_eq!(
        disk_checksum(&volume_file(&server, "d1"), 0, sectors),
        sum,
        "guest view and volume file differ"
    );

    // Fork: the child gets a reflink of the disk taken while paused.
    let (st, f) = server.api(
        "POST",
        &format!("/v1/vms/{parent}/fork"),
        Some(json!({"count": 1})),
    );
    assert_eq!(st, 201, "{f}");
    let child = f["children"][0].as_str().unwrap().to_owned();
    let child_vol = server.vm(&child)["volume"]
        .as_str()
        .expect("child has a volume")
        .to_owned();
    assert_ne!(child_vol, "d1");

    // Parent and child write different halves.
    let half = sectors / 2;
    server.exec(
        &parent,
        json!({"op": "disk_fill", "sector": 0, "count": half, "seed": 2}),
    );
    server.exec(
        &child,
        json!({"op": "disk_fill", "sector": half, "count": half, "seed": 3}),
    );
    let mut want_child = want_parent.clone();
    apply_disk_fill(&mut want_parent, 0, half, 2);
    apply_disk_fill(&mut want_child, half, half, 3);

    let p = server.exec(
        &parent,
        json!({"op": "disk_checksum", "sector": 0, "count": sectors}),
    );
    let c = server.exec(
        &child,
        json!({"op": "disk_checksum", "sector": 0, "count": sectors}),
    );
    assert_eq!(
        p,
        disk_checksum(&want_parent, 0, sectors),
        "parent sees a write it did not make"
    );
    assert_eq!(
        c,
        disk_checksum(&want_child, 0, sectors),
        "child sees a write it did not make"
    );
    assert_ne!(p, c);
    assert_eq!(
        volume_file(&server, "d1"),
        want_parent,
        "parent volume file"
    );
    assert_eq!(
        volume_file(&server, &child_vol),
        want_child,
        "child volume file"
    );
}

#[test]
fn volume_rolled_back_to_a_snapshot_reads_back_the_snapshot() {
    let Some(server) = server_on_xfs(&[]) else {
        return;
    };
    let (st, v) = server.api(
        "POST",
        "/v1/volumes",
        Some(json!({"name": "r1", "size_mib": 2})),
    );
    assert_eq!(st, 201, "{v}");
    let sectors = 2 * 2048;
    let vm = server.create_vm(json!({"memory_mib": 64, "volume": "r1"}));
    server.exec(
        &vm,
        json!({"op": "disk_fill", "sector": 0, "count": sectors, "seed": 10}),
    );
    let at_snapshot = server.exec(
        &vm,
        json!({"op": "disk_checksum", "sector": 0, "count": sectors}),
    );
    let (st, v) = server.api(
        "POST",
        "/v1/volumes/r1/snapshots",
        Some(json!({"name": "r1-s1"})),
    );
    assert_eq!(st, 201, "{v}");
    server.exec(
        &vm,
        json!({"op": "disk_fill", "sector": 0, "count": sectors / 4, "seed": 11}),
    );
    let changed = server.exec(
        &vm,
        json!({"op": "disk_checksum", "sector": 0, "count": sectors}),
    );
    assert_ne!(changed, at_snapshot);
    let (st, _) = server.api("DELETE", &format!("/v1/vms/{vm}"), None);
    assert_eq!(st, 200);

    let (st, v) = server.api(
        "POST",
        "/v1/volumes/r1/rollback",
        Some(json!({"snapshot": "r1-s1", "delete_newer": false})),
    );
    assert_eq!(st, 200, "{v}");
    let vm2 = server.create_vm(json!({"memory_mib": 64, "volume": "r1"}));
    let after = server.exec(
        &vm2,
        json!({"op": "disk_checksum", "sector": 0, "count": sectors}),
    );
    assert_eq!(
        after, at_snapshot,
        "rolled-back volume does not read back the snapshot"
    );
    let mut want = vec![0u8; 2 << 20];
    apply_disk_fill(&mut want, 0, sectors, 10);
    assert_eq!(volume_file(&server, "r1"), want);
}

#[test]
fn vm_with_unknown_volume_is_refused_with_a_clear_error() {
    let Some(server) = server_on_xfs(&[]) else {
        return;
    };
    let (st, v) = server.api(
        "POST",
        "/v1/vms",
        Some(json!({"memory_mib": 64, "volume": "nope"})),
    );
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"].as_str().unwrap_or_default().contains("nope"),
        "{v}"
    );
}

#[test]
fn a_volume_in_use_cannot_be_rolled_back_or_deleted_until_its_vm_is_gone() {
    let Some(server) = server_on_xfs(&[]) else {
        return;
    };
    let (st, v) = server.api(
        "POST",
        "/v1/volumes",
        Some(json!({"name": "busy", "size_mib": 1})),
    );
    assert_eq!(st, 201, "{v}");
    let (st, v) = server.api(
        "POST",
        "/v1/volumes/busy/snapshots",
        Some(json!({"name": "busy-s"})),
    );
    assert_eq!(st, 201, "{v}");
    let vm = server.create_vm(json!({"memory_mib": 64, "volume": "busy"}));
    let (st, v) = server.api(
        "POST",
        "/v1/volumes/busy/rollback",
        Some(json!({"snapshot": "busy-s", "delete_newer": false})),
    );
    assert_eq!(st, 409, "{v}");
    assert!(v["error"].as_str().unwrap_or_default().contains(&vm), "{v}");
    let (st, v) = server.api("DELETE", "/v1/volumes/busy", None);
    assert_eq!(st, 409, "{v}");
    let (st, _) = server.api("DELETE", &format!("/v1/vms/{vm}"), None);
    assert_eq!(st, 200);
    let (st, v) = server.api(
        "POST",
        "/v1/volumes/busy/rollback",
        Some(json!({"snapshot": "busy-s", "delete_newer": false})),
    );
    assert_eq!(st, 200, "{v}");
    let (st, v) = server.api("DELETE", "/v1/volumes/busy", None);
    assert!(st < 300, "{v}");
}
