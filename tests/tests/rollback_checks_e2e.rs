//! End-to-end rollbacks in place to a snapshot of another VM whose shape
//! differs: more vCPUs, another memory size, a volume where the VM has
//! none or one of another size. Each is refused with 409 and a message
//! naming the mismatch before the VM is paused, and the VM runs on with
//! its memory (and disk) exactly as they were. A snapshot that differs
//! only in what backed its memory (2 MiB hugetlb pages or 4 KiB pages)
//! fits, and the rollback gives its bytes exactly. Real server, VMMs,
//! KVM and userfaultfd; snapshots on the XFS mount (PAGEFORK_XFS_DIR).
//! Memory is compared whole with the VMM's `digest` of all RAM.

use pagefork_tests::{new_vm, op, pages_of, require_hugepages, server_on_xfs, TestServer};
use proto::api::{CreateVm, RunState, SnapshotMode};

const MIB: u64 = 32;

fn all_ram(s: &TestServer, id: &str, mib: u64) -> u64 {
    s.digest(id, 0, pages_of(mib))
}

/// Roll `vm` back to `snapshot` and expect a 409 whose message names
/// the VM, the snapshot and `mismatch`; then check that `vm` still runs
/// with the memory it had (`digest` of its `mib` MiB, and pages
/// `[0, filled)` still hold the fill of `seed`).
fn assert_refused_untouched(
    s: &TestServer,
    vm: &str,
    mib: u64,
    (filled, seed): (u64, u64),
    snapshot: &str,
    mismatch: &str,
) -> String {
    let before = all_ram(s, vm, mib);
    let reply = s
        .try_rollback(vm, snapshot)
        .expect_err("a rollback to a snapshot that does not fit went through");
    let what = format!("rollback of {vm} to {snapshot}");
    let msg = reply.assert_error(409, mismatch, &what);
    eprintln!("{what}: {} {msg}", reply.status);
    assert!(
        msg.contains(vm) && msg.contains(snapshot),
        "{what}: {msg:?} names neither the VM nor the snapshot"
    );
    let info = s.vm(vm);
    assert_eq!(info.state, RunState::Running, "{what}: {info:?}");
    assert!(info.failure.is_none(), "{what}: {info:?}");
    assert_eq!(all_ram(s, vm, mib), before, "{what}: memory changed");
    assert_eq!(s.verify(vm, 0, filled, seed), 0, "{what}: fill changed");
    msg
}

/// The VM still works after a refusal: it writes, and a rollback to its
/// own snapshot `own` (taken when its memory digested to `at_own`) brings
/// that memory back.
fn assert_rolls_back_to_its_own(s: &TestServer, vm: &str, mib: u64, own: &str, at_own: u64) {
    s.fill(vm, 0, 100, 77);
    assert_ne!(all_ram(s, vm, mib), at_own);
    s.rollback(vm, own);
    assert_eq!(s.vm(vm).state, RunState::Running);
    assert_eq!(
        all_ram(s, vm, mib),
        at_own,
        "{vm} after rolling back to {own}"
    );
}

#[test]
fn rollback_to_a_snapshot_with_other_vcpus_is_refused_and_leaves_the_vm_running() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let a = s.create_vm(&CreateVm {
        vcpus: 2,
        ..new_vm(MIB)
    });
    let b = s.create_vm(&new_vm(MIB));
    assert_eq!((s.vm(&a).vcpus, s.vm(&b).vcpus), (2, 1));
    s.fill(&a, 0, 3000, 1);
    let a_at_snap = all_ram(&s, &a, MIB);
    s.snapshot(&a, "a-2cpu", SnapshotMode::Full);
    s.fill(&b, 0, 2000, 2);
    let b_at_snap = all_ram(&s, &b, MIB);
    s.snapshot(&b, "b-1cpu", SnapshotMode::Full);
    s.fill(&b, 0, 1000, 3);

    let msg = assert_refused_untouched(&s, &b, MIB, (1000, 3), "a-2cpu", "2 vCPUs");
    assert!(msg.contains(&format!("{b} has 1")), "{msg:?}");
    assert!(msg.contains("restore it as a new VM"), "{msg:?}");
    // The other way round too.
    s.fill(&a, 0, 500, 4);
    assert_refused_untouched(&s, &a, MIB, (500, 4), "b-1cpu", "1 vCPU");
    s.assert_invariant("after the refused rollbacks");

    // Both still roll back to their own snapshots.
    assert_rolls_back_to_its_own(&s, &a, MIB, "a-2cpu", a_at_snap);
    assert_rolls_back_to_its_own(&s, &b, MIB, "b-1cpu", b_at_snap);
    assert_eq!(s.verify(&a, 0, 3000, 1), 0);
    // A snapshot of A still restores as a new VM with its 2 vCPUs.
    let r = s.restore("a-2cpu");
    assert_eq!(s.vm(&r).vcpus, 2);
    assert_eq!(all_ram(&s, &r, MIB), a_at_snap);
    s.assert_invariant("after the rollbacks");
}

#[test]
fn rollback_to_a_snapshot_of_another_memory_size_is_refused_and_leaves_the_vm_running() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let a = s.create_vm(&new_vm(2 * MIB));
    let b = s.create_vm(&new_vm(MIB));
    s.fill(&a, 0, 3000, 5);
    let a_at_snap = all_ram(&s, &a, 2 * MIB);
    s.snapshot(&a, "a-big", SnapshotMode::Full);
    s.fill(&b, 0, 2000, 6);
    let b_at_snap = all_ram(&s, &b, MIB);
    s.snapshot(&b, "b-small", SnapshotMode::Full);
    s.fill(&b, 0, 1000, 7);

    let msg = assert_refused_untouched(&s, &b, MIB, (1000, 7), "a-big", "64 MiB of memory");
    assert!(msg.contains(&format!("{b} has 32 MiB")), "{msg:?}");
    s.fill(&a, 0, 500, 8);
    assert_refused_untouched(&s, &a, 2 * MIB, (500, 8), "b-small", "32 MiB of memory");
    s.assert_invariant("after the refused rollbacks");

    assert_rolls_back_to_its_own(&s, &a, 2 * MIB, "a-big", a_at_snap);
    assert_rolls_back_to_its_own(&s, &b, MIB, "b-small", b_at_snap);
    s.assert_invariant("after the rollbacks");
}

#[test]
fn rollback_to_a_snapshot_with_another_volume_is_refused_and_leaves_the_disk_as_it_was() {
    let Some(s) = server_on_xfs(&[]) else { return };
    s.create_volume("checks-a", 1);
    s.create_volume("checks-c", 2);
    let a = s.create_vm(&CreateVm {
        volume: Some("checks-a".into()),
        ..new_vm(MIB)
    });
    let b = s.create_vm(&new_vm(MIB));
    let c = s.create_vm(&CreateVm {
        volume: Some("checks-c".into()),
        ..new_vm(MIB)
    });
    s.fill(&a, 0, 1000, 9);
    s.exec(&a, &op::disk_fill(0, 100, 9));
    s.snapshot(&a, "a-disk", SnapshotMode::Full);
    s.fill(&b, 0, 1000, 10);
    s.snapshot(&b, "b-nodisk", SnapshotMode::Full);
    s.fill(&c, 0, 1000, 11);
    s.exec(&c, &op::disk_fill(0, 200, 11));
    let c_disk = s.exec(&c, &op::disk_checksum(0, 4096));
    let c_at_snap = all_ram(&s, &c, MIB);
    s.snapshot(&c, "c-disk", SnapshotMode::Full);

    // A snapshot with a volume, a VM without one.
    assert_refused_untouched(&s, &b, MIB, (1000, 10), "a-disk", "has a volume");
    // A snapshot without a volume, a VM with one.
    assert_refused_untouched(&s, &c, MIB, (1000, 11), "b-nodisk", "no volume");
    // Volumes of 1 and 2 MiB: the VMM's disk keeps the size it started with.
    let msg = assert_refused_untouched(&s, &c, MIB, (1000, 11), "a-disk", "1048576 bytes");
    assert!(msg.contains("2097152"), "{msg:?}");
    assert_eq!(s.exec(&c, &op::disk_checksum(0, 4096)), c_disk, "c's disk");
    s.assert_invariant("after the refused rollbacks");

    assert_rolls_back_to_its_own(&s, &c, MIB, "c-disk", c_at_snap);
    assert_eq!(s.exec(&c, &op::disk_checksum(0, 4096)), c_disk);

    // A snapshot whose volume snapshot was deleted since: refused too,
    // before the VM's memory is dropped.
    let vs = s
        .snapshot_info("a-disk")
        .volume_snapshot
        .expect("a-disk has a volume snapshot");
    let r = s.raw("DELETE", &format!("/v1/volume-snapshots/{vs}"), None);
    assert_eq!(r.status, 200, "{r}");
    s.fill(&a, 0, 300, 14);
    let a_disk = s.exec(&a, &op::disk_checksum(0, 2048));
    assert_refused_untouched(&s, &a, MIB, (300, 14), "a-disk", &format!("{vs} is gone"));
    assert_eq!(s.exec(&a, &op::disk_checksum(0, 2048)), a_disk, "a's disk");
    s.assert_invariant("after the refused rollback to a-disk");
}

#[test]
fn rollback_between_hugepage_and_4k_memory_gives_the_snapshot_exactly() {
    if !require_hugepages(MIB / 2) {
        return;
    }
    let Some(s) = server_on_xfs(&[]) else { return };
    let huge = s.create_vm(&CreateVm {
        hugepages: Some(true),
        ..new_vm(MIB)
    });
    let small = s.create_vm(&CreateVm {
        hugepages: Some(false),
        ..new_vm(MIB)
    });
    assert!(s.vm(&huge).hugepages && !s.vm(&small).hugepages);
    s.fill(&huge, 100, 3000, 12);
    let huge_at_snap = all_ram(&s, &huge, MIB);
    s.snapshot(&huge, "on-huge", SnapshotMode::Full);
    s.fill(&small, 2000, 3000, 13);
    let small_at_snap = all_ram(&s, &small, MIB);
    s.snapshot(&small, "on-4k", SnapshotMode::Full);

    // Each goes to the other's snapshot: the bytes are the snapshot's,
    // the backing stays the VM's own.
    s.rollback(&small, "on-huge");
    assert_eq!(all_ram(&s, &small, MIB), huge_at_snap, "4 KiB VM");
    assert_eq!(s.verify(&small, 100, 3000, 12), 0);
    s.rollback(&huge, "on-4k");
    assert_eq!(all_ram(&s, &huge, MIB), small_at_snap, "hugepage VM");
    assert_eq!(s.verify(&huge, 2000, 3000, 13), 0);
    assert!(s.vm(&huge).hugepages && !s.vm(&small).hugepages);
    s.assert_invariant("after the rollbacks across page sizes");
    // And back to their own.
    s.rollback(&small, "on-4k");
    assert_eq!(all_ram(&s, &small, MIB), small_at_snap);
    s.rollback(&huge, "on-huge");
    assert_eq!(all_ram(&s, &huge, MIB), huge_at_snap);
    s.assert_invariant("after the rollbacks to their own snapshots");
}
