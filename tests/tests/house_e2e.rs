//! End-to-end snapshots at the edges of a VM's life and of the disk: a
//! paused VM is snapshotted as it is (and stays paused), and a snapshot
//! that finds the state directory's filesystem full is refused with 507
//! and leaves nothing behind. Real server, VMMs, KVM, userfaultfd and XFS.

use std::os::fd::AsRawFd;
use std::path::Path;

use pagefork_tests::{
    new_vm, op, pages_of, require_kvm_uffd, require_root, server_on_xfs, Answer, ScratchXfs,
    ServerOptions, TestServer,
};
use proto::api::{CreateSnapshot, RunState, SnapshotCreated, SnapshotMode};

fn try_full_snapshot(s: &TestServer, vm: &str, name: &str) -> Answer<SnapshotCreated> {
    s.try_snapshot(
        vm,
        &CreateSnapshot {
            name: name.to_owned(),
            mode: SnapshotMode::Full,
            compress: false,
        },
    )
}

#[test]
fn snapshot_of_a_paused_vm_keeps_it_paused_and_restores_exactly() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let mib = 16;
    let vm = s.create_vm(&new_vm(mib));
    s.fill(&vm, 0, 1500, 11);
    s.fill(&vm, 3000, 200, 12);
    let want = s.digest(&vm, 0, pages_of(mib));

    s.pause(&vm);
    let r = try_full_snapshot(&s, &vm, "paused-1")
        .unwrap_or_else(|e| panic!("a snapshot of a paused VM: {e}"));
    assert_eq!(r.mode_used, SnapshotMode::Full, "{r:?}");

    // Still paused: the guest did not run.
    assert_eq!(s.vm(&vm).state, RunState::Paused);
    let e = s
        .try_exec(&vm, &op::touch(0, 1, false))
        .expect_err("an exec on the paused VM");
    assert_eq!(e.status, 409, "an exec on the paused VM: {e}");

    // The image is the paused VM's memory, exactly.
    let restored = s.restore("paused-1");
    assert_eq!(s.digest(&restored, 0, pages_of(mib)), want);

    // Resumed, the original goes on from where it paused.
    s.resume(&vm);
    assert_eq!(s.digest(&vm, 0, pages_of(mib)), want);
    // A dirty snapshot after it sees what the guest writes from now on.
    s.fill(&vm, 100, 50, 13);
    let want2 = s.digest(&vm, 0, pages_of(mib));
    s.snapshot(&vm, "paused-2", SnapshotMode::Dirty);
    let restored2 = s.restore("paused-2");
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
    s.snapshots()
        .snapshots
        .into_iter()
        .map(|x| x.name)
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
    let vm = s.create_vm(&new_vm(mib));
    s.fill(&vm, 0, pages_of(mib), 21);
    let want = s.digest(&vm, 0, pages_of(mib));

    // Room for a few MiB, not for the 32 MiB of memory to save.
    let hog = xfs.path().join("hog");
    fill_disk(xfs.path(), &hog, 4 << 20);
    let e = try_full_snapshot(&s, &vm, "full-disk").expect_err("a snapshot on a full disk");
    assert_eq!(e.status, 507, "a snapshot on a full disk: {e}");
    let msg = e.error();
    assert!(
        msg.contains("full") && msg.contains("DELETE /v1/snapshots"),
        "the error does not say what to do: {msg}"
    );

    // Nothing is left: no snapshot listed, no directory (not even a
    // `.tmp-` one), and the VM runs on with its memory.
    assert_eq!(snapshot_names(&s), Vec::<String>::new());
    let dir = s.state_dir().join("snapshots");
    assert_eq!(entries(&dir), Vec::<String>::new(), "in {}", dir.display());
    assert_eq!(s.vm(&vm).state, RunState::Running);
    assert_eq!(s.digest(&vm, 0, pages_of(mib)), want);

    // Once there is room again, the next snapshot works and is exact.
    std::fs::remove_file(&hog).expect("remove the hog file");
    try_full_snapshot(&s, &vm, "after-room")
        .unwrap_or_else(|e| panic!("a snapshot after space was freed: {e}"));
    assert_eq!(snapshot_names(&s), vec!["after-room".to_owned()]);
    let restored = s.restore("after-room");
    assert_eq!(s.digest(&restored, 0, pages_of(mib)), want);
    s.assert_healthy();
}
