//! End-to-end: everything a VM can do, done by VMs on a shared base (a
//! restore of a snapshot, the children of a paused template), exactly:
//! snapshots of every mode, rollbacks, clones, deletes, the debugging
//! views. Real server, VMMs, KVM and userfaultfd; snapshots on the XFS
//! mount (PAGEFORK_XFS_DIR). Memory is compared whole with the VMM's
//! `digest` of all RAM.

use pagefork_tests::{from_snapshot, new_vm, pages_of, server_on_xfs, TestServer};
use proto::api::{CreateSnapshot, SnapshotMode};

const MIB: u64 = 64;

fn all_ram(s: &TestServer, id: &str) -> u64 {
    s.digest(id, 0, pages_of(MIB))
}

fn snap(s: &TestServer, vm: &str, name: &str, mode: SnapshotMode, compress: bool) {
    let r = s
        .try_snapshot(
            vm,
            &CreateSnapshot {
                name: name.to_owned(),
                mode,
                compress,
            },
        )
        .unwrap_or_else(|e| panic!("snapshot {name} of {vm}: {e}"));
    assert_eq!(r.mode_used, mode, "{name}: {r:?}");
}

/// A VM of `MIB` MiB with three kinds of pages written, and a full
/// snapshot `name` of it: the image its restores share as their base.
fn gold(s: &TestServer, name: &str) -> String {
    let vm = s.create_vm(&new_vm(MIB));
    s.fill(&vm, 0, 4000, 11);
    s.fill(&vm, 9000, 300, 12);
    s.touch(&vm, 12000, 200, false);
    snap(s, &vm, name, SnapshotMode::Full, false);
    vm
}

#[test]
fn snapshots_of_a_restored_vm_restore_exact_in_every_mode() {
    let Some(s) = server_on_xfs(&[]) else { return };
    gold(&s, "gold");
    let r = s.restore("gold");
    // Some pages written over the base, some only read, some zero pages
    // written, the rest never touched.
    s.fill(&r, 100, 500, 21);
    s.touch(&r, 2000, 800, false);
    s.fill(&r, 14000, 64, 22);
    let at_full = all_ram(&s, &r);
    snap(&s, &r, "r-full", SnapshotMode::Full, false);
    snap(&s, &r, "r-inc", SnapshotMode::Incremental, false);
    s.fill(&r, 3000, 300, 23);
    s.fill(&r, 15000, 10, 24);
    let at_dirty = all_ram(&s, &r);
    snap(&s, &r, "r-dirty", SnapshotMode::Dirty, false);
    s.fill(&r, 150, 20, 25);
    let at_zst = all_ram(&s, &r);
    snap(&s, &r, "r-zst", SnapshotMode::Full, true);
    for (name, want) in [
        ("r-full", at_full),
        ("r-inc", at_full),
        ("r-dirty", at_dirty),
        ("r-zst", at_zst),
    ] {
        let back = s.restore(name);
        assert_eq!(all_ram(&s, &back), want, "{name} restores {r}'s memory");
        s.delete_vm(&back);
    }
    s.assert_invariant("after snapshots of a restored VM");
}

#[test]
fn snapshots_of_a_template_child_restore_exact() {
    let Some(s) = server_on_xfs(&[]) else { return };
    let t = s.create_vm(&new_vm(MIB));
    s.fill(&t, 0, 3000, 31);
    s.pause(&t);
    let kids = s.fork(&t, 2).children;
    let c = &kids[0];
    s.fill(c, 1000, 400, 32);
    s.touch(c, 5000, 100, false);
    let want = all_ram(&s, c);
    snap(&s, c, "c-full", SnapshotMode::Full, false);
    s.fill(c, 1200, 10, 33);
    let back = s.restore("c-full");
    assert_eq!(all_ram(&s, &back), want);
    // The template, moved onto its children's base, writes its own.
    s.resume(&t);
    s.fill(&t, 2000, 100, 34);
    let want_t = all_ram(&s, &t);
    snap(&s, &t, "t-full", SnapshotMode::Full, false);
    let back_t = s.restore("t-full");
    assert_eq!(all_ram(&s, &back_t), want_t);
    assert_eq!(s.verify(&kids[1], 0, 3000, 31), 0);
    s.assert_invariant("after snapshots of a template and its child");
}
