//! End-to-end disk tests: a VM's reflinked volume through the guest block
//! device, forked with the VM, and rolled back to a snapshot. The server's
//! state directory lives on the loop-mounted XFS (reflink=1) named by
//! PAGEFORK_XFS_DIR, which `scripts/test.sh` sets up.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pagefork_tests::{new_vm, op, server_on_xfs, RandomImage, TestServer};
use proto::api::{CreateVm, ExecRequest, RollbackVolume};
use shared::pattern::{disk_checksum, disk_word, SECTOR_SIZE};

/// What `disk_fill` leaves in sectors [s, s+n) of `disk`.
fn apply_disk_fill(disk: &mut [u8], s: u64, n: u64, seed: u64) {
    for sec in s..s + n {
        let b = usize::try_from(sec * SECTOR_SIZE).unwrap();
        disk[b..b + 512].fill(0);
        disk[b..b + 8].copy_from_slice(&disk_word(seed, sec).to_le_bytes());
    }
}

/// Roll a volume back to `snapshot`, keeping newer snapshots.
fn rollback_to(snapshot: &str) -> RollbackVolume {
    RollbackVolume {
        snapshot: snapshot.to_owned(),
        delete_newer: false,
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
    server.create_volume("d1", 4);
    let sectors = 4 * 2048;
    let parent = server.create_vm(&CreateVm {
        volume: Some("d1".into()),
        ..new_vm(64)
    });

    // The parent fills the whole disk with seed 1.
    server.exec(&parent, &op::disk_fill(0, sectors, 1));
    let mut want_parent = vec![0u8; 4 << 20];
    apply_disk_fill(&mut want_parent, 0, sectors, 1);
    let sum = server.exec(&parent, &op::disk_checksum(0, sectors));
    assert_eq!(sum, disk_checksum(&want_parent, 0, sectors));
    assert_eq!(
        disk_checksum(&volume_file(&server, "d1"), 0, sectors),
        sum,
        "guest view and volume file differ"
    );

    // Fork: the child gets a reflink of the disk taken while paused.
    let child = server.fork_one(&parent);
    let child_vol = server.vm(&child).volume.expect("child has a volume");
    assert_ne!(child_vol, "d1");

    // Parent and child write different halves.
    let half = sectors / 2;
    server.exec(&parent, &op::disk_fill(0, half, 2));
    server.exec(&child, &op::disk_fill(half, half, 3));
    let mut want_child = want_parent.clone();
    apply_disk_fill(&mut want_parent, 0, half, 2);
    apply_disk_fill(&mut want_child, half, half, 3);

    let p = server.exec(&parent, &op::disk_checksum(0, sectors));
    let c = server.exec(&child, &op::disk_checksum(0, sectors));
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
    server.create_volume("r1", 2);
    let sectors = 2 * 2048;
    let vm = server.create_vm(&CreateVm {
        volume: Some("r1".into()),
        ..new_vm(64)
    });
    server.exec(&vm, &op::disk_fill(0, sectors, 10));
    let at_snapshot = server.exec(&vm, &op::disk_checksum(0, sectors));
    server.snapshot_volume("r1", "r1-s1");
    server.exec(&vm, &op::disk_fill(0, sectors / 4, 11));
    let changed = server.exec(&vm, &op::disk_checksum(0, sectors));
    assert_ne!(changed, at_snapshot);
    server.delete_vm(&vm);

    if let Err(v) = server.try_rollback_volume("r1", &rollback_to("r1-s1")) {
        panic!("{v}");
    }
    let vm2 = server.create_vm(&CreateVm {
        volume: Some("r1".into()),
        ..new_vm(64)
    });
    let after = server.exec(&vm2, &op::disk_checksum(0, sectors));
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
    let v = server
        .try_create_vm(&CreateVm {
            volume: Some("nope".into()),
            ..new_vm(64)
        })
        .unwrap_err();
    assert_eq!(v.status, 400, "{v}");
    assert!(v.error().contains("nope"), "{v}");
}

#[test]
fn a_volume_in_use_cannot_be_rolled_back_or_deleted_until_its_vm_is_gone() {
    let Some(server) = server_on_xfs(&[]) else {
        return;
    };
    server.create_volume("busy", 1);
    server.snapshot_volume("busy", "busy-s");
    let vm = server.create_vm(&CreateVm {
        volume: Some("busy".into()),
        ..new_vm(64)
    });
    let v = server
        .try_rollback_volume("busy", &rollback_to("busy-s"))
        .unwrap_err();
    assert_eq!(v.status, 409, "{v}");
    assert!(v.error().contains(&vm), "{v}");
    let v = server.try_delete_volume("busy").unwrap_err();
    assert_eq!(v.status, 409, "{v}");
    server.delete_vm(&vm);
    if let Err(v) = server.try_rollback_volume("busy", &rollback_to("busy-s")) {
        panic!("{v}");
    }
    if let Err(v) = server.try_delete_volume("busy") {
        panic!("{v}");
    }
}

#[test]
fn multi_sector_requests_fill_and_fold_exactly_what_the_volume_file_holds() {
    let Some(server) = server_on_xfs(&[]) else {
        return;
    };
    server.create_volume("m1", 8);
    let sectors = 8 * 2048;
    let vm = server.create_vm(&CreateVm {
        volume: Some("m1".into()),
        ..new_vm(64)
    });
    let mut want = vec![0u8; 8 << 20];
    // Requests of the default 2048 sectors, starting off a boundary and
    // ending in a short one; an even size that is no multiple of the
    // agent's unrolling; an odd size; one sector per request.
    for (sector, count, seed, per_io) in [
        (1000u64, 5000u64, 7u64, None),
        (6100, 1234, 8, Some(100u32)),
        (9000, 333, 9, Some(7)),
        (12000, 10, 10, Some(1)),
        (16383, 1, 11, None),
    ] {
        let op = ExecRequest::DiskFill {
            sector,
            count,
            seed,
            sectors_per_io: per_io,
        };
        server.exec(&vm, &op);
        apply_disk_fill(&mut want, sector, count, seed);
    }
    assert_eq!(volume_file(&server, "m1"), want, "volume file");
    for (sector, count, per_io) in [
        (0u64, sectors, None),
        (0, sectors, Some(1u32)),
        (999, 5003, Some(2048)),
        (5, 16000, Some(17)),
        (6099, 1300, Some(64)),
    ] {
        let op = ExecRequest::DiskChecksum {
            sector,
            count,
            sectors_per_io: per_io,
        };
        assert_eq!(
            server.exec(&vm, &op),
            disk_checksum(&want, sector, count),
            "{op:?}"
        );
    }
    for bad in [0, 2049] {
        let v = server.try_exec(
            &vm,
            &ExecRequest::DiskFill {
                sector: 0,
                count: 1,
                seed: 1,
                sectors_per_io: Some(bad),
            },
        );
        let v = v.unwrap_err();
        assert_eq!(v.status, 400, "sectors_per_io {bad}: {v}");
    }
}

/// Fork while the parent's guest is in the middle of a long `disk_fill`.
/// The child (a new VMM whose buffers start zeroed) resumes after the last
/// request its parent completed, with the words of the request in progress
/// from the device state, and finishes the fill on its own volume.
#[test]
fn fork_during_a_long_disk_fill_gives_the_child_the_whole_fill() {
    let Some(server) = server_on_xfs(&[]) else {
        return;
    };
    // Long enough that a fork (whose volume reflink first flushes what the
    // fill wrote) can land inside it.
    let mib = 256u64;
    server.create_volume("f1", mib);
    let sectors = mib * 2048;
    let parent = server.create_vm(&CreateVm {
        volume: Some("f1".into()),
        ..new_vm(64)
    });
    server.exec(&parent, &op::disk_fill(0, sectors, 1));
    let mut delay = Duration::from_millis(40);
    for attempt in 0..12u64 {
        let seed = 20 + attempt;
        let done = AtomicBool::new(false);
        let (fork, fill_done_first) = std::thread::scope(|sc| {
            let filler = sc.spawn(|| {
                server.exec(&parent, &op::disk_fill(0, sectors, seed));
                done.store(true, Ordering::SeqCst);
            });
            std::thread::sleep(delay);
            // The fill cannot end while the fork holds the parent paused,
            // so whether it ended is judged before the fork is asked for.
            let first = done.load(Ordering::SeqCst);
            let f = server.fork(&parent, 1);
            filler.join().expect("fill thread panicked");
            (f, first)
        });
        let child = fork.children[0].clone();
        let child_vol = server.vm(&child).volume.unwrap();
        // An op on the child runs after the fill it inherited, if any.
        let sum = server.exec(&child, &op::disk_checksum(0, sectors));
        let mut want = vec![0u8; usize::try_from(mib << 20).unwrap()];
        apply_disk_fill(&mut want, 0, sectors, seed);
        let child_disk = volume_file(&server, &child_vol);
        let before_start = child_disk[..8] == disk_word(seed - 1, 0).to_le_bytes()
            || child_disk[..8] == disk_word(1, 0).to_le_bytes();
        eprintln!(
            "attempt {attempt}: delay {delay:?}, fill done before the fork was asked for: \
             {fill_done_first}, child disk starts with the old seed: {before_start}"
        );
        assert_eq!(volume_file(&server, "f1"), want, "parent volume");
        server.delete_vm(&child);
        if fill_done_first {
            delay /= 2;
            continue;
        }
        if before_start {
            delay += Duration::from_millis(60);
            continue;
        }
        // The fork fell inside the fill: the child finished it.
        assert_eq!(sum, disk_checksum(&want, 0, sectors), "child checksum");
        assert!(child_disk == want, "child volume after a mid-fill fork");
        return;
    }
    panic!("no fork landed in the middle of the disk fill in 12 attempts");
}

/// `disk_write_pages`: the device writes guest pages to the volume straight
/// from guest RAM. The VM's memory comes lazily from an image file of
/// arbitrary bytes, so the VMM's `pwrite` itself faults pages in through
/// the server's userfaultfd; pages the guest filled go out as it left
/// them. The volume must then hold exactly those bytes, request sizes and
/// offsets notwithstanding, and requests outside memory or the disk are
/// refused with nothing written.
#[test]
fn pages_written_from_guest_ram_reach_the_volume_byte_for_byte() {
    let Some(server) = server_on_xfs(&[]) else {
        return;
    };
    server.create_volume("p1", 8);
    let mib = 16u64;
    let image = RandomImage::new(mib, 0x9e37_79b9_7f4a_7c15);
    let vm = server.create_vm(&CreateVm {
        volume: Some("p1".into()),
        memory_source: Some(image.source()),
        fault_around_kib: Some(0),
        readahead_kib: Some(0),
        ..new_vm(mib)
    });
    // The guest rewrites two words of pages 300..310.
    server.exec(&vm, &op::fill(300, 10, 4));
    let mut ram = image.bytes.clone();
    for p in 300..310u64 {
        let b = usize::try_from(p * 4096).unwrap();
        shared::pattern::fill_page(&mut ram[b..b + 4096], p, 4);
    }
    let mut want = vec![0u8; 8 << 20];
    // (start_page, pages, sector, sectors_per_io): the default 1 MiB
    // requests over 1,000 pages from an odd sector; requests that split
    // pages; one sector per request.
    for (start, pages, sector, per_io) in [
        (5u64, 1000u64, 3u64, None),
        (295, 20, 9000, Some(12u32)),
        (2000, 3, 12000, Some(1)),
        (4095, 1, 16376, None),
    ] {
        let op = ExecRequest::DiskWritePages {
            start_page: Some(start),
            pages: Some(pages),
            sector,
            sectors_per_io: per_io,
        };
        assert_eq!(server.exec(&vm, &op), 0);
        let (from, to) = (
            usize::try_from(start * 4096).unwrap(),
            usize::try_from(sector * SECTOR_SIZE).unwrap(),
        );
        let len = usize::try_from(pages * 4096).unwrap();
        want[to..to + len].copy_from_slice(&ram[from..from + len]);
    }
    assert!(
        volume_file(&server, "p1") == want,
        "the volume differs from the guest pages written to it"
    );
    // The guest reads back what the device wrote from its RAM.
    assert_eq!(
        server.exec(&vm, &op::disk_checksum(0, 16384)),
        disk_checksum(&want, 0, 16384)
    );
    // Past the end of memory, past the end of the disk: refused, nothing
    // written.
    for bad in [
        op::disk_write_pages(4090, 7, 0),
        op::disk_write_pages(0, 2, 16380),
    ] {
        let v = server.try_exec(&vm, &bad).unwrap_err();
        assert_eq!(v.status, 400, "{bad:?}: {v}");
    }
    assert!(
        volume_file(&server, "p1") == want,
        "a refused request wrote"
    );
    // Memory still answers exactly: writing pages out changed none.
    assert_eq!(
        server.exec(
            &vm,
            &ExecRequest::Digest {
                start_page: None,
                pages: None
            }
        ),
        shared::pattern::digest(&ram, 0, 0, mib << 8)
    );
}
