//! End-to-end tests of the page server core: a real `uffd-server`, real
//! `vmm` processes, real KVM and userfaultfd.
//!
//! Every expected value is computed on the host with the reference
//! implementations in `shared::pattern`, so a wrong page served anywhere on
//! the fault path changes a checksum or digest.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use pagefork_tests::{
    apply_fill, expected_checksum, expected_digest, filled_zero_memory, new_vm, op, pages_by,
    pages_of, pages_total, process_exists, require_kvm_uffd, signal, RandomImage, Reply,
    TestServer,
};
use proto::api::{CreateVm, RunState, VmInfo};
use serde_json::{json, Value};

#[test]
fn image_backed_vm_checksum_and_digest_match_the_image_file() {
    if !require_kvm_uffd() {
        return;
    }
    // Arrange: a 256 MiB image of random content.
    let mib = 256;
    let pages = pages_of(mib);
    let image = RandomImage::new(mib, 0x5eed_0001);
    // Pages copied into the VM's own memfd (what a VM not on a shared
    // base does; `based_e2e` and `density_e2e` cover the base).
    let s = TestServer::start_with_args(&["--shared-bases=false"]);

    // Act: create the VM from it.
    let id = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        ..new_vm(mib)
    });

    // Assert: every page starts out served from the file.
    let vm = s.vm(&id);
    assert_eq!(vm.state, RunState::Running, "{vm:?}");
    assert_eq!(vm.memory_mib, mib, "{vm:?}");
    assert_eq!(pages_by(&vm, "file"), pages, "fresh image VM: {vm:?}");
    assert_eq!(pages_total(&vm), pages, "{vm:?}");

    // Touching pages moves them from the file to the VM's own memory.
    s.touch(&id, 0, 1024, false);
    let vm = s.vm(&id);
    assert!(
        pages_by(&vm, "file") <= pages - 1024,
        "after touching 1024 pages: {vm:?}"
    );
    assert!(
        pages_by(&vm, "vm") >= 1024,
        "after touching 1024 pages: {vm:?}"
    );
    assert_eq!(pages_total(&vm), pages, "{vm:?}");
    assert_eq!(
        pages_by(&vm, "vm"),
        vm.resident_pages,
        "table and memfd agree: {vm:?}"
    );

    // The guest's checksum (one word per page) and the VMM's digest (every
    // word) equal what the host computes from the file.
    let want_sum = expected_checksum(&image.bytes, 0, pages);
    assert_ne!(want_sum, 0);
    assert_eq!(
        s.checksum(&id, 0, pages),
        want_sum,
        "guest checksum of all RAM"
    );
    assert_eq!(
        s.checksum(&id, 40_000, 777),
        expected_checksum(&image.bytes, 40_000, 777),
        "guest checksum of a sub-range"
    );
    assert_eq!(
        s.digest(&id, 0, pages),
        expected_digest(&image.bytes, 0, pages),
        "VMM digest of all RAM"
    );

    // Every page has been read: all are now the VM's own.
    let vm = s.vm(&id);
    assert_eq!(pages_by(&vm, "file"), 0, "after reading all RAM: {vm:?}");
    assert_eq!(pages_by(&vm, "vm"), pages, "after reading all RAM: {vm:?}");
    assert_eq!(vm.resident_pages, pages, "{vm:?}");
}

#[test]
fn untouched_pages_of_a_vm_without_image_read_as_zero() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 64;
    let pages = pages_of(mib);
    let s = TestServer::start();
    let id = s.create_vm(&new_vm(mib));
    let vm = s.vm(&id);
    assert_eq!(pages_by(&vm, "uninitialized"), pages, "fresh VM: {vm:?}");

    let sum = s.checksum(&id, 0, pages);
    let dig = s.digest(&id, 0, pages);

    assert_eq!(sum, 0, "checksum of untouched memory");
    assert_eq!(dig, 0, "digest of untouched memory");
    let vm = s.vm(&id);
    assert!(
        vm.faults.missing > 0,
        "reads were served through missing faults: {vm:?}"
    );
    assert_eq!(pages_total(&vm), pages, "{vm:?}");
}

#[test]
fn verify_after_fill_reports_no_mismatches_and_checksum_matches_host_model() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 64;
    let pages = pages_of(mib);
    let s = TestServer::start();
    let id = s.create_vm(&new_vm(mib));

    s.fill(&id, 0, pages, 42);

    assert_eq!(
        s.verify(&id, 0, pages, 42),
        0,
        "verify with the fill's seed"
    );
    assert_eq!(
        s.verify(&id, 0, pages, 43),
        pages,
        "verify with another seed"
    );
    assert_eq!(
        s.verify(&id, 100, 50, 7),
        50,
        "verify of a sub-range with another seed"
    );
    let want = filled_zero_memory(mib, 42);
    assert_eq!(
        s.checksum(&id, 0, pages),
        expected_checksum(&want, 0, pages),
        "checksum after fill"
    );
    assert_eq!(
        s.digest(&id, 0, pages),
        expected_digest(&want, 0, pages),
        "digest after fill"
    );

    // A partial refill: only its pages change.
    s.fill(&id, 1000, 24, 9);
    assert_eq!(
        s.verify(&id, 0, pages, 42),
        24,
        "pages refilled with seed 9"
    );
    assert_eq!(
        s.verify(&id, 990, 40, 9),
        16,
        "pages not refilled with seed 9"
    );
}

#[test]
fn fill_over_an_image_changes_only_the_pattern_words() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 32;
    let pages = pages_of(mib);
    let image = RandomImage::new(mib, 0x5eed_0002);
    let s = TestServer::start();
    let id = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        ..new_vm(mib)
    });

    s.fill(&id, 2000, 3000, 5);

    let mut want = image.bytes.clone();
    apply_fill(&mut want, 2000, 3000, 5);
    assert_eq!(s.verify(&id, 2000, 3000, 5), 0);
    assert_eq!(
        s.verify(&id, 0, pages, 5),
        pages - 3000,
        "pages outside the fill keep the image"
    );
    assert_eq!(
        s.checksum(&id, 0, pages),
        expected_checksum(&want, 0, pages)
    );
    assert_eq!(s.digest(&id, 0, pages), expected_digest(&want, 0, pages));
}

#[test]
fn touch_read_and_write_leave_image_contents_unchanged() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 32;
    let pages = pages_of(mib);
    let image = RandomImage::new(mib, 0x5eed_0003);
    // Pages copied into the VM's own memfd (what a VM not on a shared
    // base does; `based_e2e` and `density_e2e` cover the base).
    let s = TestServer::start_with_args(&["--shared-bases=false"]);
    let id = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        fault_around_kib: Some(0),
        ..new_vm(mib)
    });

    s.touch(&id, 0, 256, false);
    let after_read = s.vm(&id);
    s.touch(&id, 256, 256, true);
    let after_write = s.vm(&id);

    assert_eq!(
        pages_by(&after_read, "vm"),
        256,
        "read touch installs the touched pages: {after_read:?}"
    );
    assert_eq!(
        pages_by(&after_write, "vm"),
        512,
        "write touch installs the touched pages: {after_write:?}"
    );
    assert_eq!(
        s.checksum(&id, 0, pages),
        expected_checksum(&image.bytes, 0, pages)
    );
    assert_eq!(
        s.digest(&id, 0, pages),
        expected_digest(&image.bytes, 0, pages)
    );
}

#[test]
fn fault_around_installs_whole_aligned_blocks_per_fault() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 32;
    let image = RandomImage::new(mib, 0x5eed_0004);
    let s = TestServer::start();
    let off = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        fault_around_kib: Some(0),
        ..new_vm(mib)
    });
    // Readahead off: this test is about the fault-around block alone.
    let on = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        fault_around_kib: Some(64),
        readahead_kib: Some(0),
        ..new_vm(mib)
    });
    let before_off = s.vm(&off);
    let before_on = s.vm(&on);
    assert_eq!(before_on.faults.fault_around_kib, 64, "{before_on:?}");

    // 256 pages from an aligned start, then 20 pages from an unaligned one.
    s.touch(&off, 1024, 256, false);
    s.touch(&on, 1024, 256, false);
    let mid_off = s.vm(&off);
    let mid_on = s.vm(&on);
    s.touch(&off, 3000 + 6, 20, false);
    s.touch(&on, 3000 + 6, 20, false);
    let end_off = s.vm(&off);
    let end_on = s.vm(&on);

    // Pages made present: copied, or mapped from the image's shared base.
    let installed = |a: &VmInfo, b: &VmInfo| {
        b.faults.pages_installed + b.faults.pages_shared
            - a.faults.pages_installed
            - a.faults.pages_shared
    };
    let missing = |a: &VmInfo, b: &VmInfo| b.faults.missing - a.faults.missing;
    // Without fault-around: one fault and one page per touched page.
    assert_eq!(installed(&before_off, &mid_off), 256, "{mid_off:?}");
    assert_eq!(missing(&before_off, &mid_off), 256, "{mid_off:?}");
    assert_eq!(installed(&mid_off, &end_off), 20, "{end_off:?}");
    assert_eq!(missing(&mid_off, &end_off), 20, "{end_off:?}");
    // With 64 KiB (16 pages): one fault per aligned block touched.
    assert_eq!(installed(&before_on, &mid_on), 256, "{mid_on:?}");
    assert_eq!(missing(&before_on, &mid_on), 16, "{mid_on:?}");
    // Pages 3006..3026 lie in the blocks 2992..3008, 3008..3024, 3024..3040.
    assert_eq!(installed(&mid_on, &end_on), 48, "{end_on:?}");
    assert_eq!(missing(&mid_on, &end_on), 3, "{end_on:?}");
    // And the pages installed around the fault carry the image's bytes.
    assert_eq!(
        s.checksum(&on, 2992, 48),
        expected_checksum(&image.bytes, 2992, 48)
    );
    assert_eq!(
        s.digest(&on, 1024, 256),
        expected_digest(&image.bytes, 1024, 256)
    );
}

#[test]
fn four_vms_run_at_once_without_interference() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 64;
    let pages = pages_of(mib);
    let seeds = [11u64, 22, 33, 44];
    let s = TestServer::start();

    // Create and drive the four VMs concurrently.
    let ids: Vec<String> = std::thread::scope(|sc| {
        let handles: Vec<_> = seeds
            .iter()
            .map(|&seed| {
                let s = &s;
                sc.spawn(move || {
                    let id = s.create_vm(&new_vm(mib));
                    for round in 0..3 {
                        s.fill(&id, 0, pages, seed + round);
                        assert_eq!(
                            s.verify(&id, 0, pages, seed + round),
                            0,
                            "{id} round {round}"
                        );
                    }
                    s.fill(&id, 0, pages, seed);
                    id
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("VM driver thread panicked"))
            .collect()
    });

    for (i, id) in ids.iter().enumerate() {
        let want = filled_zero_memory(mib, seeds[i]);
        assert_eq!(
            s.checksum(id, 0, pages),
            expected_checksum(&want, 0, pages),
            "{id}"
        );
        for (j, &other) in seeds.iter().enumerate() {
            let mismatches = s.verify(id, 0, pages, other);
            if i == j {
                assert_eq!(mismatches, 0, "{id} with its own seed {other}");
            } else {
                assert_eq!(mismatches, pages, "{id} with {}'s seed {other}", ids[j]);
            }
        }
    }
    let pids: Vec<u32> = ids.iter().map(|id| s.vmm_pid(id)).collect();
    let mut distinct = pids.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 4, "one vmm process per VM: {pids:?}");
}

#[test]
fn sigkill_of_one_vmm_mid_work_leaves_the_others_answering() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 256;
    let pages = pages_of(mib);
    let image = RandomImage::new(mib, 0x5eed_0005);
    let s = TestServer::start();
    // The victim reads its image one page per fault, so the kill lands
    // while faults are in flight.
    let victim = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        fault_around_kib: Some(0),
        ..new_vm(mib)
    });
    let a = s.create_vm(&new_vm(64));
    let b = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        ..new_vm(mib)
    });
    let victim_pid = s.vmm_pid(&victim);
    assert!(process_exists(victim_pid));

    std::thread::scope(|sc| {
        let s = &s;
        let dying = sc.spawn(|| {
            // Keeps working until the kill makes exec fail.
            let started = Instant::now();
            loop {
                if let Err(r) = s.try_exec(&victim, &op::checksum(0, pages)) {
                    return r;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "victim never failed"
                );
            }
        });
        let worker_a = sc.spawn(|| {
            for round in 0..6u64 {
                s.fill(&a, 0, pages_of(64), round);
                assert_eq!(s.verify(&a, 0, pages_of(64), round), 0, "{a} round {round}");
            }
        });
        // Let the victim get going, then kill it.
        std::thread::sleep(Duration::from_millis(300));
        let faults_before_kill = s.vm(&victim).faults.missing;
        signal(victim_pid, Signal::SIGKILL);

        let r = dying.join().expect("victim thread panicked");
        assert!(r.status >= 400, "exec on the killed VM fails: {r}");
        assert!(r.body["error"].is_string(), "with an error message: {r}");
        worker_a.join().expect("worker thread panicked");
        assert!(
            faults_before_kill > 0 && faults_before_kill < pages,
            "the kill must land while the victim is still faulting its pages in: {faults_before_kill} of {pages}"
        );
    });

    // The dead VM is reported as exited, soon.
    let dead = s.wait_state(&victim, RunState::Exited, Duration::from_secs(10));
    assert!(dead.exit_reason.is_some(), "exited VM says why: {dead:?}");
    assert!(
        !process_exists(victim_pid) || is_zombie(victim_pid),
        "victim pid {victim_pid} is gone"
    );
    let r = s.try_exec(&victim, &op::identity()).unwrap_err();
    assert!(
        (400..500).contains(&r.status),
        "exec on an exited VM is a client error: {r}"
    );

    // The others answer correctly, after the kill too.
    assert_eq!(
        s.checksum(&b, 0, pages),
        expected_checksum(&image.bytes, 0, pages),
        "{b}"
    );
    s.fill(&a, 0, pages_of(64), 77);
    assert_eq!(s.verify(&a, 0, pages_of(64), 77), 0, "{a}");
    assert_eq!(s.vm(&a).state, RunState::Running);
    assert_eq!(s.vm(&b).state, RunState::Running);
    // And the server still starts new VMs.
    let c = s.create_vm(&new_vm(16));
    assert_eq!(s.checksum(&c, 0, pages_of(16)), 0);
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

#[test]
fn exec_on_a_paused_vm_conflicts_until_resumed() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let id = s.create_vm(&new_vm(16));
    s.fill(&id, 0, 100, 3);

    let v = s.pause(&id);
    assert_eq!(v.state, RunState::Paused, "{v:?}");
    assert_eq!(s.vm(&id).state, RunState::Paused);

    s.try_exec(&id, &op::verify(0, 100, 3))
        .unwrap_err()
        .assert_error(409, "paused", "exec on a paused VM");
    s.try_pause(&id)
        .unwrap_err()
        .assert_error(409, "paused", "pause of a paused VM");

    let v = s.resume(&id);
    assert_eq!(v.state, RunState::Running, "{v:?}");
    s.try_resume(&id)
        .unwrap_err()
        .assert_error(409, "running", "resume of a running VM");

    assert_eq!(
        s.verify(&id, 0, 100, 3),
        0,
        "memory kept across pause/resume"
    );
    s.fill(&id, 100, 100, 4);
    assert_eq!(s.verify(&id, 100, 100, 4), 0);
}

#[test]
fn bad_create_requests_get_4xx_that_say_what_to_fix() {
    // Validation happens before any VMM starts: no KVM needed.
    let s = TestServer::start();
    let small = RandomImage::from_bytes(vec![7u8; 1 << 20]);
    let missing = s.state_dir().join("no-such-image.raw");
    let cases: Vec<(&str, &str, Option<Value>, u16, &str)> = vec![
        ("unknown VM", "GET /v1/vms/vm-9999", None, 404, "vm-9999"),
        ("malformed VM id", "GET /v1/vms/banana", None, 404, "banana"),
        (
            "exec on unknown VM",
            "POST /v1/vms/vm-9999/exec",
            Some(json!({"op": "identity"})),
            404,
            "vm-9999",
        ),
        (
            "delete unknown VM",
            "DELETE /v1/vms/vm-9999",
            None,
            404,
            "vm-9999",
        ),
        (
            "pause unknown VM",
            "POST /v1/vms/vm-9999/pause",
            None,
            404,
            "vm-9999",
        ),
        ("unknown route", "GET /v1/nothing", None, 404, "route"),
        (
            "memory_mib 0",
            "POST /v1/vms",
            Some(json!({"memory_mib": 0})),
            400,
            "memory_mib",
        ),
        (
            "memory_mib beyond host RAM",
            "POST /v1/vms",
            Some(json!({"memory_mib": 1u64 << 30})),
            400,
            "RAM",
        ),
        (
            "vcpus 0",
            "POST /v1/vms",
            Some(json!({"memory_mib": 16, "vcpus": 0})),
            400,
            "vcpus",
        ),
        (
            "missing image file",
            "POST /v1/vms",
            Some(json!({"memory_mib": 16, "memory_source": {"kind": "file", "path": missing}})),
            400,
            "no-such-image.raw",
        ),
        (
            "image smaller than memory",
            "POST /v1/vms",
            Some(json!({"memory_mib": 16, "memory_source": small.source()})),
            400,
            "smaller",
        ),
        (
            "unknown memory source kind",
            "POST /v1/vms",
            Some(json!({"memory_mib": 16, "memory_source": {"kind": "floppy"}})),
            400,
            "floppy",
        ),
        (
            "unknown field",
            "POST /v1/vms",
            Some(json!({"memory_mib": 16, "memroy": 1})),
            400,
            "memroy",
        ),
        (
            "bad fault-around size",
            "POST /v1/vms",
            Some(json!({"memory_mib": 16, "fault_around_kib": 12})),
            400,
            "fault_around_kib",
        ),
    ];
    for (what, route, body, want, needle) in cases {
        let (method, path) = route.split_once(' ').unwrap();
        s.raw(method, path, body).assert_error(want, needle, what);
    }

    // Bodies that are not JSON at all.
    for (what, body) in [
        ("invalid JSON", &b"{\"memory_mib\": 16,"[..]),
        ("empty body", b""),
    ] {
        let (status, text) = s.raw_bytes("POST", "/v1/vms", body);
        let body: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{what}: body {text:?} not JSON: {e}"));
        Reply { status, body }.assert_error(400, "body", what);
    }

    assert!(s.vm_ids().is_empty(), "no VM was created by a bad request");

    // An array where the schema says object: serde would read `[]` as a
    // struct whose fields all default, so an upgrade would hand the server
    // over. It is refused, and the same process goes on serving.
    let pid = s.health().pid;
    for (method, path) in [("POST", "/v1/server/upgrade"), ("POST", "/v1/vms")] {
        let (status, text) = s.raw_bytes(method, path, b" []");
        let body: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{path}: body {text:?} not JSON: {e}"));
        Reply { status, body }.assert_error(400, "expected a JSON object", path);
    }
    assert_eq!(s.health().pid, pid, "an array body handed the server over");
    s.assert_healthy();
}

#[test]
fn bad_exec_requests_get_4xx_and_leave_the_vm_working() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let pages = pages_of(16);
    let id = s.create_vm(&new_vm(16));
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "unknown op",
            json!({"op": "explode"}),
            "unknown variant `explode`",
        ),
        (
            "range past the end",
            json!({"op": "checksum", "start_page": pages - 10, "pages": 11}),
            "outside",
        ),
        (
            "start past the end",
            json!({"op": "touch", "start_page": pages, "pages": 1}),
            "outside",
        ),
        (
            "overflowing range",
            json!({"op": "checksum", "start_page": u64::MAX, "pages": 2}),
            "outside",
        ),
        (
            "fill without seed",
            json!({"op": "fill", "start_page": 0, "pages": 1}),
            "seed",
        ),
        (
            "wrong field type",
            json!({"op": "checksum", "pages": "many"}),
            "invalid type",
        ),
    ];
    for (what, body, needle) in cases {
        s.raw("POST", &format!("/v1/vms/{id}/exec"), Some(body))
            .assert_error(400, needle, what);
    }
    let (status, text) = s.raw_bytes("POST", &format!("/v1/vms/{id}/exec"), b"op=fill");
    let body: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("body {text:?} not JSON: {e}"));
    Reply { status, body }.assert_error(400, "body", "non-JSON exec body");

    // The whole of memory is a valid range, and the VM still works.
    assert_eq!(s.checksum(&id, 0, pages), 0);
    s.fill(&id, pages - 1, 1, 8);
    assert_eq!(s.verify(&id, pages - 1, 1, 8), 0);
}

#[test]
fn deleted_vm_has_no_process_and_is_not_listed() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let keep = s.create_vm(&new_vm(16));
    let gone = s.create_vm(&new_vm(16));
    s.fill(&keep, 0, 64, 1);
    let pid = s.vmm_pid(&gone);
    assert!(process_exists(pid));

    s.delete_vm(&gone);

    assert!(
        !process_exists(pid),
        "vmm pid {pid} of {gone} still exists after DELETE returned"
    );
    assert_eq!(s.vm_ids(), vec![keep.clone()]);
    s.try_vm(&gone)
        .unwrap_err()
        .assert_error(404, &gone, "GET of a deleted VM");
    s.try_delete_vm(&gone)
        .unwrap_err()
        .assert_error(404, &gone, "second DELETE");
    assert_eq!(s.verify(&keep, 0, 64, 1), 0, "the other VM is untouched");
}

#[test]
fn sigterm_stops_the_server_and_its_vmms() {
    if !require_kvm_uffd() {
        return;
    }
    let mut s = TestServer::start();
    let a = s.create_vm(&new_vm(16));
    let b = s.create_vm(&new_vm(16));
    let pids = [s.vmm_pid(&a), s.vmm_pid(&b)];

    let status = s.stop(Duration::from_secs(15));

    assert!(
        status.success(),
        "uffd-server exit status after SIGTERM: {status}"
    );
    for pid in pids {
        assert!(!process_exists(pid), "vmm pid {pid} outlived its server");
    }
    assert!(!s.api_sock().exists(), "api.sock removed on exit");
    assert!(!s.vmm_sock().exists(), "vmm.sock removed on exit");
}

#[test]
fn sequential_faults_grow_the_readahead_window_up_to_its_limit() {
    if !require_kvm_uffd() {
        return;
    }
    let mib = 32;
    let image = RandomImage::new(mib, 0x5eed_0005);
    let s = TestServer::start();
    // Fault-around 64 KiB (16 pages), readahead up to 2 MiB (512 pages).
    let vm = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        fault_around_kib: Some(64),
        readahead_kib: Some(2048),
        ..new_vm(mib)
    });
    s.touch(&vm, 0, 4096, false);
    let v = s.vm(&vm);
    // Windows 16, 32, 64, 128, 256, 512, then 512 each: 0..16, 16..48,
    // 48..112, 112..240, 240..496, 496..1008, and seven more of 512 pages.
    // (Each window goes in 64 KiB pieces, the faulting one first; a
    // fault in a piece not yet installed is woken by that piece's copy.)
    assert_eq!(v.faults.missing, 13, "{v:?}");
    assert_eq!(
        v.faults.pages_installed + v.faults.pages_shared,
        4592,
        "{v:?}"
    );
    assert_eq!(v.faults.phases.service.count, 13, "{v:?}");
    assert_eq!(
        s.digest(&vm, 0, 4592),
        expected_digest(&image.bytes, 0, 4592)
    );
    // A jump elsewhere starts again from one aligned block.
    s.touch(&vm, 6000 + 3, 1, false);
    let w = s.vm(&vm);
    assert_eq!(w.faults.missing, 14, "{w:?}");
    assert_eq!(
        w.faults.pages_installed + w.faults.pages_shared,
        4592 + 16,
        "{w:?}"
    );
}
