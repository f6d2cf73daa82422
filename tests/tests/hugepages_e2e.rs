//! Hugepage guest RAM end to end: VMs whose memory is a 2 MiB hugetlb memfd
//! are served lazily from zero, an image file and a snapshot, forked with
//! copy-on-write of whole blocks, snapshotted, restored and rolled back,
//! through the real server, VMMs, KVM and userfaultfd. Every check of
//! memory is a `digest` over every byte, compared with a model.

use pagefork_tests::{
    apply_fill, expected_digest, file_source, from_snapshot, new_vm, op, pages_of,
    realistic_memory, require_hugepages, server_on_xfs, TestServer,
};
use proto::api::{CreateVm, MemorySource, SnapshotMode};

/// Guest RAM of most VMs here: 8 blocks of 2 MiB.
const MIB: u64 = 16;
/// 4 KiB pages per block.
const BLOCK: u64 = 512;

fn all(s: &TestServer, id: &str) -> u64 {
    s.digest(id, 0, pages_of(MIB))
}

fn assert_exact(s: &TestServer, id: &str, model: &[u8], what: &str) {
    assert_eq!(
        all(s, id),
        expected_digest(model, 0, pages_of(MIB)),
        "{id}: memory differs from its model {what}"
    );
}

/// A VM of `MIB` on hugepages, its memory from `memory_source`.
fn huge_vm(s: &TestServer, memory_source: Option<MemorySource>) -> String {
    let id = s.create_vm(&CreateVm {
        hugepages: Some(true),
        memory_source,
        ..new_vm(MIB)
    });
    assert!(s.vm(&id).hugepages, "{:?}", s.vm(&id));
    id
}

fn resident(s: &TestServer, id: &str) -> u64 {
    s.vm(id).resident_pages
}

#[test]
fn hugepage_memory_is_served_whole_blocks_at_a_time_and_exactly() {
    if !require_hugepages(64) {
        return;
    }
    let s = TestServer::start();
    let id = huge_vm(&s, None);
    let mut model = vec![0u8; usize::try_from(MIB << 20).unwrap()];
    // Writes that start mid-block and cross a block boundary.
    s.fill(&id, 300, 400, 1);
    apply_fill(&mut model, 300, 400, 1);
    assert_eq!(s.verify(&id, 300, 400, 1), 0);
    // Two blocks were touched by the fill; the agent's own pages are in
    // others. Every install is a whole block.
    let r = resident(&s, &id);
    assert_eq!(r % BLOCK, 0, "resident pages {r} are not whole blocks");
    assert!(r >= 2 * BLOCK, "{r}");
    assert_exact(&s, &id, &model, "after a fill across a block boundary");
    assert_eq!(resident(&s, &id), pages_of(MIB), "digest read every block");
    s.assert_invariant("after reading every block");
    // A size that is no whole number of huge pages is refused clearly.
    let v = s
        .try_create_vm(&CreateVm {
            hugepages: Some(true),
            ..new_vm(3)
        })
        .unwrap_err();
    assert_eq!(v.status, 400, "{v}");
    assert!(v.error().contains("multiple of 2"), "{v}");
}

#[test]
fn hugepage_vm_reads_an_image_file_exactly() {
    if !require_hugepages(32) {
        return;
    }
    let s = TestServer::start();
    let mut model = realistic_memory(MIB);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("memory.img");
    // Half a block of zeros at the end, as a hole.
    let end = model.len() - (1 << 20);
    model[end..].fill(0);
    std::fs::write(&path, &model[..end]).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&path)
        .and_then(|f| f.set_len(MIB << 20))
        .unwrap();
    let id = huge_vm(&s, Some(file_source(&path)));
    assert_exact(&s, &id, &model, "read from the image");
    s.fill(&id, 1000, 30, 4);
    apply_fill(&mut model, 1000, 30, 4);
    assert_exact(&s, &id, &model, "after a write over image pages");
    s.assert_invariant("after image reads");
}

#[test]
fn hugepage_fork_copies_whole_blocks_on_write_and_keeps_everyone_exact() {
    if !require_hugepages(128) {
        return;
    }
    let s = TestServer::start();
    let a = huge_vm(&s, None);
    let mut pa = vec![0u8; usize::try_from(MIB << 20).unwrap()];
    // Blocks 0-3 written, 4-7 never touched before the fork.
    s.fill(&a, 0, 4 * BLOCK, 1);
    apply_fill(&mut pa, 0, 4 * BLOCK, 1);
    let kids = s.fork(&a, 2).children;
    for k in &kids {
        assert!(s.vm(k).hugepages, "{:?}", s.vm(k));
    }
    let (mut k0, mut k1) = (pa.clone(), pa.clone());
    // The parent writes a few pages of block 1: the children get the
    // block's pre-write copy, whole.
    s.fill(&a, BLOCK + 7, 3, 2);
    apply_fill(&mut pa, BLOCK + 7, 3, 2);
    assert!(s.vm(&a).faults.wp_copies >= 1, "{:?}", s.vm(&a));
    // A child writes into a block it reads from the parent and into one
    // nobody touched.
    s.fill(&kids[0], 2 * BLOCK + 100, 50, 3);
    apply_fill(&mut k0, 2 * BLOCK + 100, 50, 3);
    s.fill(&kids[0], 6 * BLOCK + 1, 1, 5);
    apply_fill(&mut k0, 6 * BLOCK + 1, 1, 5);
    // A grandchild of a child, then the child writes the block again.
    let g = s.fork_one(&kids[1]);
    let pg = k1.clone();
    s.fill(&kids[1], BLOCK, BLOCK, 6);
    apply_fill(&mut k1, BLOCK, BLOCK, 6);
    s.assert_invariant("after the writes");
    assert_exact(&s, &a, &pa, "(parent)");
    assert_exact(&s, &kids[0], &k0, "(child 0)");
    assert_exact(&s, &kids[1], &k1, "(child 1)");
    assert_exact(&s, &g, &pg, "(grandchild)");
    // The parent goes; its children keep reading its blocks.
    s.delete_vm(&a);
    assert_exact(&s, &kids[0], &k0, "after the parent was deleted");
    assert_exact(&s, &g, &pg, "(grandchild) after the parent was deleted");
    s.assert_invariant("after the parent was deleted");
}

#[test]
fn hugepage_snapshots_restore_and_roll_back_exactly() {
    if !require_hugepages(128) {
        return;
    }
    let Some(s) = server_on_xfs(&[]) else { return };
    let id = huge_vm(&s, None);
    let mut model = vec![0u8; usize::try_from(MIB << 20).unwrap()];
    s.fill(&id, 0, 3 * BLOCK + 10, 1);
    apply_fill(&mut model, 0, 3 * BLOCK + 10, 1);
    let want = model.clone();
    s.snapshot(&id, "h-full", SnapshotMode::Full);
    // After the snapshot, writes are tracked per block: 5 pages in one
    // block make the whole block dirty.
    s.fill(&id, 5 * BLOCK + 3, 5, 2);
    apply_fill(&mut model, 5 * BLOCK + 3, 5, 2);
    let dirty = s.snapshot(&id, "h-dirty", SnapshotMode::Dirty);
    assert_eq!(dirty.mode_used, SnapshotMode::Dirty, "{dirty:?}");
    assert_eq!(dirty.pages_written, BLOCK, "{dirty:?}");

    // Restores are hugepage VMs like their original, and exact.
    let r1 = s.restore("h-full");
    assert!(s.vm(&r1).hugepages, "{:?}", s.vm(&r1));
    assert_exact(&s, &r1, &want, "restored from the full snapshot");
    let r2 = s.restore("h-dirty");
    assert_exact(&s, &r2, &model, "restored from the dirty snapshot");
    // A 4 KiB restore of the same snapshot reads the same bytes.
    let r3 = s.create_vm(&CreateVm {
        hugepages: Some(false),
        ..from_snapshot("h-dirty")
    });
    assert!(!s.vm(&r3).hugepages);
    assert_exact(&s, &r3, &model, "restored on 4 KiB pages");

    // A fork child of the VM keeps its memory through the rollback.
    let kid = s.fork_one(&id);
    s.fill(&id, 7 * BLOCK, 20, 3);
    s.rollback(&id, "h-full");
    assert_exact(&s, &id, &want, "after the rollback");
    assert_exact(&s, &kid, &model, "(fork child) after its parent's rollback");
    // The rolled-back VM runs on: its writes land.
    s.fill(&id, 100, 10, 9);
    let mut after = want.clone();
    apply_fill(&mut after, 100, 10, 9);
    assert_exact(&s, &id, &after, "after a write following the rollback");
    s.assert_invariant("after the rollback");
}

/// A guest reading an image in order on hugepages finds the blocks after
/// the one it faulted on installed while it works through it (one, then
/// two, then four): it faults on about one block in four, and with
/// readahead off on every block. Memory is exact both ways.
#[test]
fn hugepage_sequential_reader_faults_on_few_blocks_only() {
    const RA_MIB: u64 = 32;
    if !require_hugepages(2 * RA_MIB / 2 + 8) {
        return;
    }
    // Blocks copied into the VM's own memory: readahead of whole blocks
    // ahead is the copy path's (a VM on a shared base maps one block per
    // fault).
    let s = TestServer::start_with_args(&["--shared-bases=false"]);
    let model = realistic_memory(RA_MIB);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("memory.img");
    std::fs::write(&path, &model).unwrap();
    let pages = pages_of(RA_MIB);
    let mut missing = Vec::new();
    for readahead_kib in [None, Some(0)] {
        let id = s.create_vm(&CreateVm {
            hugepages: Some(true),
            memory_source: Some(file_source(&path)),
            readahead_kib,
            ..new_vm(RA_MIB)
        });
        s.exec(&id, &op::touch(0, pages, false));
        missing.push(s.vm(&id).faults.missing);
        assert_eq!(
            s.digest(&id, 0, pages),
            expected_digest(&model, 0, pages),
            "{id}: memory differs from the image (readahead {readahead_kib:?})"
        );
        assert_eq!(resident(&s, &id), pages, "{id}: every block present");
        s.delete_vm(&id);
    }
    let (ahead, off) = (missing[0], missing[1]);
    let blocks = pages / BLOCK;
    assert!(
        off > blocks / 2 && off <= blocks,
        "readahead off: {off} faults for {blocks} blocks"
    );
    // 16 blocks: faults on blocks 0, 1, 3, 6 and 11 (then 12..16 are in).
    assert!(
        ahead <= off / 3 + 1,
        "readahead on: {ahead} faults, off: {off} (expected about a quarter)"
    );
    s.assert_invariant("after sequential reads");
}
