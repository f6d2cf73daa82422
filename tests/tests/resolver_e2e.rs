//! One page resolver for both kinds of VM: a pagefork VM (guest RAM in a
//! memfd, pages written through the server's mapping) and a Firecracker
//! client (anonymous memory, pages installed with UFFDIO_COPY) read the
//! same image with the same fault-around and readahead settings and the
//! same access pattern. They must be given the same pages, with the same
//! number of MISSING faults, and read the image's bytes exactly.
//!
//! Needs KVM and userfaultfd: without them it skips with a printed reason,
//! and fails under `CI=true`.

use std::time::Duration;

use pagefork_tests::{
    expected_digest, new_vm, pages_of, require_kvm_uffd, FcClient, RandomImage, TestServer,
};
use proto::api::{CreateListener, CreateVm, FaultCounters, VmInfo};

/// One of a VM's fault counters.
type Counter = fn(&FaultCounters) -> u64;

/// How long a client command or a state change may take.
const TIMEOUT: Duration = Duration::from_secs(120);

/// Page ranges `(start, pages)` read in this order by both VMs: a long
/// sequential read (readahead grows), an unaligned jump, a re-read of
/// installed pages running on into new ones, the end of memory, one lone
/// page.
const PATTERN: [(u64, u64); 5] = [(0, 600), (1005, 40), (590, 60), (4076, 20), (2051, 1)];

/// The Firecracker VM of client `pid` as `GET /v1/vms/{id}` shows it.
fn fc_vm(s: &TestServer, pid: u32) -> VmInfo {
    s.vm(&s.wait_firecracker_vm(pid, TIMEOUT).id)
}

/// The VM's table as `(start_page, pages, kind)` extents, where kind is
/// "installed" for the VM's own pages and the source kind otherwise.
fn installed_extents(s: &TestServer, vm: &VmInfo) -> Vec<(u64, u64, String)> {
    let id = &vm.id;
    s.sources(id)
        .extents
        .into_iter()
        .map(|e| {
            let kind = if &e.source == id {
                "installed".to_owned()
            } else {
                e.source.split(':').next().unwrap_or(&e.source).to_owned()
            };
            (e.start_page, e.pages, kind)
        })
        .collect()
}

#[test]
fn pagefork_and_firecracker_vms_install_the_same_pages_for_the_same_reads() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 16;
    let pages = pages_of(mib);
    let image = RandomImage::new(mib, 0x5e50_1e00);
    // Fault-around off; and 64 KiB blocks with readahead up to 512 KiB.
    for (fault_around_kib, readahead_kib) in [(0, 0), (64, 512)] {
        let what = format!("fault_around_kib {fault_around_kib}, readahead_kib {readahead_kib}");
        // Our VM copies what it reads, as Firecracker's anonymous memory
        // must (a VM on a shared base maps it instead: `based_e2e`).
        let s = TestServer::start_with_args(&["--shared-bases=false"]);

        // Arrange: a pagefork VM and a Firecracker client on one image.
        let ours = s.create_vm(&CreateVm {
            memory_source: Some(image.source()),
            fault_around_kib: Some(fault_around_kib),
            readahead_kib: Some(readahead_kib),
            ..new_vm(mib)
        });
        let listener = s.add_listener(&CreateListener {
            fault_around_kib: Some(fault_around_kib),
            readahead_kib: Some(readahead_kib),
            ..s.listener_request("fc", image.source())
        });
        let socket = std::path::PathBuf::from(listener.socket);
        let mut commands: Vec<String> = PATTERN
            .iter()
            .map(|(start, n)| format!("zero:{start}:{n}"))
            .collect();
        let last_read = commands.last().cloned().expect("a pattern");
        commands.push("hold".into());
        let check = format!("check:{}", image.path());
        commands.push(check.clone());

        // Act: the same reads on both, page by page in the same order.
        for (start, n) in PATTERN {
            s.touch(&ours, start, n, false);
        }
        let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
        let mut client = FcClient::spawn(&socket, &["--mib", &mib.to_string()], &commands);
        client.until(&last_read);

        // Assert: the same faults and the same pages installed.
        let ours_vm = s.vm(&ours);
        let fc = fc_vm(&s, client.pid());
        let counters: [(&str, Counter); 2] = [
            ("missing", |f| f.missing),
            ("pages_installed", |f| f.pages_installed),
        ];
        for (counter, get) in counters {
            assert_eq!(
                get(&ours_vm.faults),
                get(&fc.faults),
                "{what}: {counter} differs: pagefork {ours_vm:?} vs firecracker {fc:?}"
            );
        }
        let touched: u64 = PATTERN.iter().map(|(_, n)| n).sum();
        let missing = fc.faults.missing;
        assert!(missing > 0, "{what}: no faults at all: {fc:?}");
        if fault_around_kib > 0 {
            assert!(
                missing < touched / 4,
                "{what}: fault-around saves no faults: {fc:?}"
            );
        }
        assert_eq!(
            installed_extents(&s, &ours_vm),
            installed_extents(&s, &fc),
            "{what}: different pages installed"
        );

        // And both read the image's bytes exactly, every page.
        client.release();
        let checked = client.until(&check);
        assert_eq!(
            checked["mismatched_pages"], 0,
            "{what}: firecracker: {checked}"
        );
        client.finish();
        assert_eq!(
            s.digest(&ours, 0, pages),
            expected_digest(&image.bytes, 0, pages),
            "{what}: pagefork VM's memory differs from the image"
        );
        s.assert_healthy();
    }
}
