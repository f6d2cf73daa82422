//! End-to-end snapshots at the edges of a VM's life and of the disk: a
//! paused VM is snapshotted as it is (and stays paused), and a snapshot
//! that finds the state directory's filesystem full is refused with 507
//! and leaves nothing behind. Real server, VMMs, KVM, userfaultfd and XFS.

use std::os::fd::AsRawFd;
use std::path::Path;

use pagefork_tests::{
    pages_of, require_kvm_uffd, require_root, server_on_xfs, ScratchXfs, ServerOptions, TestServer,
};
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

/// Bytes free for an unprivileged file on the filesystem of `dir`.
fn free_bytes(dir: &Path) -> u64 {
    let st = nix::sys::statvfs::statvfs(dir).expect("statvfs");
    st.blocks_available() * st.fragment_size()
}

/// Take all but `leave` bytes of the free space of `dir`'s filesystem
/// with one allocated file, `hog`.
fn fill_disk(dir: &Path, hog: &Path, leave: u64) {
    let take = free_bytes(dir).saturating_sub(leave);
    let f = std::fs::File::create(hog).expect("create the hog file");
    nix::fcntl::fallocate(
        f.as_raw_fd(),
        nix::fcntl::FallocateFlags::empty(),
        0,
        i64::try_from(take).expect("size fits"),
    )
    .expect("fallocate the hog file");
    f.sync_all().expect("fsync the hog file");
}

fn snapshot_names(s: &TestServer) -> Vec<String> {
    let (st, list) = s.api("GET", "/v1/snapshots", None);
    assert_eq!(st, 200, "{list}");
    list["snapshots"]
        .as_array()
        .expect("snapshots")
        .iter()
        .map(|x| x["name"].as_str().unwrap_or_default().to_owned())
        .collect()
}

fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn snapshot_on_a_full_disk_answers_507_and_leaves_nothing_behind() {
    if !require_kvm_uffd() || !require_root("a loop XFS to fill") {
        return;
    }
    let xfs = ScratchXfs::new();
    let s = TestServer::start_with_options(
        &[],
        &ServerOptions {
            parent: Some(xfs.path().to_owned()),
            ..ServerOptions::default()
        },
    );
    let mib = 32;
    let vm = s.create_vm(json!({ "memory_mib": mib }));
    s.fill(&vm, 0, pages_of(mib), 21);
    let want = s.digest(&vm, 0, pages_of(mib));

    // Room for a few MiB, not for the 32 MiB of memory to save.
    let hog = xfs.path().join("hog");
    fill_disk(xfs.path(), &hog, 4 << 20);
    let (st, e) = snapshot(&s, &vm, "full-disk");
    assert_eq!(st, 507, "a snapshot on a full disk: {e}");
    let msg = e["error"].as_str().unwrap_or_default();
    assert!(
        msg.contains("full") && msg.contains("DELETE /v1/snapshots"),
        "the error does not say what to do: {msg}"
    );

    // Nothing is left: no snapshot listed, no directory (not even a
    // `.tmp-` one), and the VM runs on with its memory.
    assert_eq!(snapshot_names(&s), Vec::<String>::new());
    let dir = s.state_dir().join("snapshots");
    assert_eq!(entries(&dir), Vec::<String>::new(), "in {}", dir.display());
    assert_eq!(state(&s, &vm), "running");
    assert_eq!(s.digest(&vm, 0, pages_of(mib)), want);

    // Once there is room again, the next snapshot works and is exact.
    std::fs::remove_file(&hog).expect("remove the hog file");
    let (st, r) = snapshot(&s, &vm, "after-room");
    assert_eq!(st, 201, "a snapshot after space was freed: {r}");
    assert_eq!(snapshot_names(&s), vec!["after-room".to_owned()]);
    let restored = s.create_vm(json!({ "from_snapshot": "after-room" }));
    assert_eq!(s.digest(&restored, 0, pages_of(mib)), want);
    s.assert_healthy();
}
