//! The warm VMM pool (`--vmm-pool N`) through the real server, real `vmm`
//! processes and KVM: pooled VMMs are the ones new VMs run on, the pool
//! refills, a pooled VMM that dies is replaced, a broken `vmm` binary does
//! not make the server spawn in a loop, and forks of a paused template
//! (which skip the write-protect pass after the first) keep every child's
//! memory exact once the template runs and writes again.

use std::time::{Duration, Instant};

use pagefork_tests::{
    child_pids, new_vm, op, pages_of, process_exists, require_kvm_uffd, signal, vm_num, TestServer,
};
use proto::api::{CreateVm, RunState};

/// `vmm` processes the server started.
fn vmm_children(server: &TestServer) -> Vec<u32> {
    child_pids(server.pid())
        .into_iter()
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "vmm")
        })
        .collect()
}

#[test]
fn new_vms_run_on_pooled_vmms_and_the_pool_refills() {
    if !require_kvm_uffd() {
        return;
    }
    let server = TestServer::start_with_args(&["--vmm-pool", "2"]);
    server.wait_pool_ready(2, Duration::from_secs(30));
    let pooled = vmm_children(&server);
    assert_eq!(pooled.len(), 2, "two pooled vmm processes: {pooled:?}");

    let a = server.create_vm(&new_vm(64));
    let b = server.create_vm(&CreateVm {
        vcpus: 2,
        ..new_vm(64)
    });
    for id in [&a, &b] {
        let pid = server.vmm_pid(id);
        assert!(
            pooled.contains(&pid),
            "{id} runs on pid {pid}, not a pooled vmm {pooled:?}"
        );
        assert_eq!(
            server.exec(id, &op::identity()),
            vm_num(id),
            "{id} knows who it is"
        );
        let log = server.state_dir().join("logs").join(format!("{id}.log"));
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            text.contains("welcomed by the server"),
            "{id}'s log follows its VMM: {text}"
        );
    }
    // Memory is the VM's own: what it writes it reads back.
    server.fill(&b, 0, pages_of(64), 5);
    assert_eq!(server.verify(&b, 0, pages_of(64), 5), 0);
    assert_eq!(
        server.metric("pagefork_vmm_pool_taken_total").unwrap_or(0),
        2
    );

    server.wait_pool_ready(2, Duration::from_secs(30));
    let now = vmm_children(&server);
    assert_eq!(now.len(), 4, "two VMs and two fresh pooled VMMs: {now:?}");
    let logs: Vec<String> = std::fs::read_dir(server.state_dir().join("logs"))
        .expect("logs dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        logs.iter().filter(|l| l.starts_with("pool-")).count(),
        2,
        "one log per waiting pooled VMM: {logs:?}"
    );
    server.assert_healthy();
}

#[test]
fn a_pooled_vmm_that_dies_is_replaced() {
    if !require_kvm_uffd() {
        return;
    }
    let server = TestServer::start_with_args(&["--vmm-pool", "1"]);
    server.wait_pool_ready(1, Duration::from_secs(30));
    let victim = vmm_children(&server)[0];
    signal(victim, nix::sys::signal::Signal::SIGKILL);
    let t = Instant::now();
    loop {
        let now = vmm_children(&server);
        if server.pool_ready() == 1 && !now.contains(&victim) && now.len() == 1 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "no replacement for the killed pooled vmm: {now:?}\n{}",
            server.server_log_tail(20)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let id = server.create_vm(&new_vm(32));
    assert!(server.exec(&id, &op::identity()) > 0);
    assert!(server.server_log_text().contains("went away unused"));
}

#[test]
fn a_broken_vmm_binary_does_not_make_the_pool_spawn_in_a_loop() {
    if !require_kvm_uffd() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let broken = dir.path().join("vmm");
    std::fs::write(
        &broken,
        "#!/bin/sh\necho 'this vmm is broken' >&2\nexit 3\n",
    )
    .expect("script");
    std::fs::set_permissions(&broken, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let broken = broken.to_string_lossy().into_owned();
    let server = TestServer::start_with_args(&["--vmm-pool", "2", "--vmm-bin", &broken]);
    let t = Instant::now();
    while !server
        .server_log_text()
        .contains("the vmm pool stops refilling")
    {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the pool never gave up: {}",
            server.server_log_tail(30)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Quiet now: no further launches while nothing asks for a VM.
    let launched = |s: &TestServer| s.server_log_text().matches("went away unused").count();
    let before = launched(&server);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(launched(&server), before, "the pool kept launching");
    // A create still says clearly why it cannot start.
    let v = server.try_create_vm(&new_vm(16)).unwrap_err();
    assert_eq!(v.status, 502, "{v}");
    assert!(
        v.error().contains("broken"),
        "the error quotes the vmm's log: {v}"
    );
    server.assert_healthy();
}

#[test]
fn forks_of_a_paused_template_stay_exact_when_it_runs_again() {
    if !require_kvm_uffd() {
        return;
    }
    let server = TestServer::start_with_args(&["--vmm-pool", "2"]);
    let mib = 64;
    let pages = pages_of(mib);
    let tpl = server.create_vm(&new_vm(mib));
    server.fill(&tpl, 0, pages / 2, 11);
    let before = server.digest(&tpl, 0, pages);
    server.pause(&tpl);

    // Two forks of the paused template.
    let mut children = Vec::new();
    for round in 0..2 {
        let v = server.fork(&tpl, 2);
        // Its memfd becomes the children's shared base, frozen: nothing
        // of it needs protecting, at the first fork or any later one.
        assert_eq!(
            v.phases.write_protected_pages,
            Some(0),
            "round {round}: a fork of a paused template protects nothing: {v:?}"
        );
        children.extend(v.children);
        assert_eq!(
            server.vm(&tpl).state,
            RunState::Paused,
            "the template stays paused"
        );
    }
    for c in &children {
        assert_eq!(
            server.digest(c, 0, pages),
            before,
            "{c} starts with the template's memory"
        );
    }
    // The template runs and overwrites everything; children keep theirs.
    server.resume(&tpl);
    server.fill(&tpl, 0, pages, 12);
    for c in &children {
        assert_eq!(
            server.digest(c, 0, pages),
            before,
            "{c} kept the template's old memory"
        );
        server.fill(c, 0, 8, 13);
    }
    assert_eq!(
        server.verify(&tpl, 0, pages, 12),
        0,
        "the template kept its writes"
    );

    // Paused again after running: the next fork protects again.
    let now = server.digest(&tpl, 0, pages);
    server.pause(&tpl);
    let v = server.fork(&tpl, 1);
    assert!(
        v.phases.write_protected_pages.is_some_and(|n| n > 0),
        "a template that ran is protected again: {v:?}"
    );
    let late = v.children[0].clone();
    server.resume(&tpl);
    server.fill(&tpl, 0, pages, 14);
    assert_eq!(
        server.digest(&late, 0, pages),
        now,
        "{late} kept the memory of its fork"
    );
    server.assert_invariant("at the end");
    for c in children.iter().chain([&late]) {
        assert!(process_exists(server.vmm_pid(c)));
    }
}

/// A fork of more children than the VMM socket's hello allowance (64)
/// starts every one of them, with a pool smaller than the fork and without
/// one; each child knows who it is and holds the template's memory.
#[test]
fn a_fork_of_a_hundred_children_starts_them_all() {
    if !require_kvm_uffd() {
        return;
    }
    for pool in ["0", "8"] {
        let server = TestServer::start_with_args(&["--vmm-pool", pool]);
        let tpl = server.create_vm(&new_vm(16));
        server.fill(&tpl, 0, pages_of(16), 3);
        let want = server.digest(&tpl, 0, pages_of(16));
        server.pause(&tpl);
        let children = server.fork(&tpl, 100).children;
        assert_eq!(children.len(), 100);
        for c in &children {
            assert_eq!(
                server.exec(c, &op::identity()),
                vm_num(c),
                "pool {pool}: {c}"
            );
        }
        for c in children.iter().step_by(17) {
            assert_eq!(server.digest(c, 0, pages_of(16)), want, "pool {pool}: {c}");
        }
        server.assert_healthy();
    }
}

/// The text of `id`'s VMM log.
fn vmm_log(server: &TestServer, id: &str) -> String {
    std::fs::read_to_string(server.state_dir().join("logs").join(format!("{id}.log")))
        .unwrap_or_default()
}

#[test]
fn pooled_vmms_map_guest_ram_of_the_prepared_size_into_their_ready_kvm_slot() {
    if !require_kvm_uffd() {
        return;
    }
    let server = TestServer::start_with_args(&["--vmm-pool", "2", "--vmm-pool-memory-mib", "32"]);
    server.wait_pool_ready(2, Duration::from_secs(30));
    let unused = "the KVM slot prepared for 32 MiB of guest RAM is not used";
    // The prepared size: the VM's guest RAM is the memfd the server made
    // for the pooled VMM, mapped under its ready slot before the Welcome;
    // another size: the slot is replaced at start. Both must run exactly.
    for (mib, prepared) in [(32, true), (16, false), (32, true)] {
        let pages = pages_of(mib);
        let pooled = vmm_children(&server);
        let a = server.create_vm(&new_vm(mib));
        server.fill(&a, 0, pages, mib);
        let want = server.digest(&a, 0, pages);
        let child = server.fork_one(&a);
        assert_eq!(server.digest(&child, 0, pages), want, "{mib} MiB child");
        server.fill(&child, pages / 2, 1, 99);
        assert_ne!(server.digest(&child, 0, pages), want, "the child writes");
        assert_eq!(
            server.digest(&a, 0, pages),
            want,
            "the parent keeps its own"
        );
        for id in [&a, &child] {
            let pid = server.vmm_pid(id);
            assert!(
                pooled.contains(&pid),
                "{id} runs on a pooled vmm: {pid}, {pooled:?}"
            );
            let log = vmm_log(&server, id);
            assert_eq!(!log.contains(unused), prepared, "{id}, {mib} MiB: {log}");
            assert_eq!(
                log.contains("ram=Ahead"),
                prepared,
                "{id}, {mib} MiB: guest RAM mapped ahead: {log}"
            );
            let memfd = server.vm(id).memfd.unwrap_or_default();
            assert_eq!(
                memfd.starts_with("pagefork-pool-"),
                prepared,
                "{id}, {mib} MiB: its RAM is the pooled VMM's memfd: {memfd}"
            );
            server.delete_vm(id);
        }
        server.wait_pool_ready(2, Duration::from_secs(30));
    }
    // Every VM is gone: the server holds the RAM of the two pooled VMMs
    // and nothing else (a VM's RAM taken from the pool went with the VM).
    let memfds: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", server.pid()))
        .expect("the server's fds")
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|l| l.to_string_lossy().into_owned())
        .filter(|l| l.contains("memfd:pagefork-"))
        .collect();
    assert_eq!(memfds.len(), 2, "{memfds:?}");
    assert!(
        memfds.iter().all(|l| l.contains("memfd:pagefork-pool-")),
        "{memfds:?}"
    );
    server.assert_healthy();
}
