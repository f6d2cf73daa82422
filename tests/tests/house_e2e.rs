//! End-to-end snapshots at the edges of a VM's life: a paused VM is
//! snapshotted as it is (and stays paused). Real server, VMMs, KVM,
//! userfaultfd and XFS.

use pagefork_tests::{pages_of, server_on_xfs, TestServer};
use serde_json::{json, Value};

fn snapshot(s: &TestServer, vm: &str, name: &str) -> (u16, Value) {
    s.api(
        "POST",
        &format!("/v1/vms/{vm}/snapshots"),
        Some(json!({"name": name, "mode": "full"})),
    )
}

fn state(s: &TestServer, vm: &str) -> String {
    s.vm(vm)["state"].as_str().unwrap_or_default().to_owned()
}

#[test]
fn snapshot_of_a_paused_vm_keeps_it_paused_and_restores_exactly() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let mib = 16;
    let vm = s.create_vm(json!({ "memory_mib": mib }));
    s.fill(&vm, 0, 1500, 11);
    s.fill(&vm, 3000, 200, 12);
    let want = s.digest(&vm, 0, pages_of(mib));

    let (st, v) = s.api("POST", &format!("/v1/vms/{vm}/pause"), None);
    assert_eq!(st, 200, "pause: {v}");
    let (st, r) = snapshot(&s, &vm, "paused-1");
    assert_eq!(st, 201, "a snapshot of a paused VM: {r}");
    assert_eq!(r["mode_used"], "full", "{r}");

    // Still paused: the guest did not run.
    assert_eq!(state(&s, &vm), "paused");
    let (st, e) = s.try_exec(&vm, json!({"op": "touch", "start_page": 0, "pages": 1}));
    assert_eq!(st, 409, "an exec on the paused VM: {e}");

    // The image is the paused VM's memory, exactly.
    let restored = s.create_vm(json!({ "from_snapshot": "paused-1" }));
    assert_eq!(s.digest(&restored, 0, pages_of(mib)), want);

    // Resumed, the original goes on from where it paused.
    let (st, v) = s.api("POST", &format!("/v1/vms/{vm}/resume"), None);
    assert_eq!(st, 200, "resume: {v}");
    assert_eq!(s.digest(&vm, 0, pages_of(mib)), want);
    // A dirty snapshot after it sees what the guest writes from now on.
    s.fill(&vm, 100, 50, 13);
    let want2 = s.digest(&vm, 0, pages_of(mib));
    let (st, r) = s.api(
        "POST",
        &format!("/v1/vms/{vm}/snapshots"),
        Some(json!({"name": "paused-2", "mode": "dirty"})),
    );
    assert_eq!(st, 201, "{r}");
    let restored2 = s.create_vm(json!({ "from_snapshot": "paused-2" }));
    assert_eq!(s.digest(&restored2, 0, pages_of(mib)), want2);
    s.assert_healthy();
}
