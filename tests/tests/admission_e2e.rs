//! Admission control: the server refuses a create or fork that would pass
//! its memory budget or VM limit with a clear 507, before allocating
//! anything, and keeps serving the VMs it has.

use pagefork_tests::{from_snapshot, new_vm, require_kvm_uffd, TestServer};
use proto::api::{ForkRequest, RunState, SnapshotMode};

#[test]
fn create_and_fork_beyond_the_memory_budget_answer_507() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start_with_args(&["--memory-budget-mib", "64"]);
    let a = s.create_vm(&new_vm(32));
    s.fill(&a, 0, 64, 7);

    let r = s.try_create_vm(&new_vm(48)).unwrap_err();
    assert_eq!(r.status, 507, "{r}");
    let msg = r.error();
    assert!(msg.contains("--memory-budget-mib"), "{msg}");

    let r = s.try_fork(&a, &ForkRequest { count: 2 }).unwrap_err();
    assert_eq!(r.status, 507, "{r}");
    assert_eq!(s.vm_ids(), vec![a.clone()], "a refused fork made no child");

    // What fits still works, and the first VM is untouched.
    let b = s.create_vm(&new_vm(16));
    let r = s.try_fork(&a, &ForkRequest { count: 1 }).unwrap_err();
    assert_eq!(r.status, 507, "{r}");
    assert_eq!(s.verify(&a, 0, 64, 7), 0);
    s.delete_vm(&b);
    s.fork(&a, 1);
}

#[test]
fn vms_beyond_max_vms_answer_507() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start_with_args(&["--max-vms", "2"]);
    s.create_vm(&new_vm(4));
    s.create_vm(&new_vm(4));
    let r = s.try_create_vm(&new_vm(4)).unwrap_err();
    assert_eq!(r.status, 507, "{r}");
    assert!(r.error().contains("--max-vms"));
}

#[test]
fn oversized_request_bodies_are_refused() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let big = format!(
        "{{\"memory_mib\": 4, \"volume\": \"{}\"}}",
        "x".repeat(1 << 20)
    );
    let (status, _) = s.raw_bytes("POST", "/v1/vms", big.as_bytes());
    assert_eq!(status, 413);
    s.assert_healthy();
}

#[test]
fn restore_beyond_the_memory_budget_answers_507_and_what_fits_restores() {
    let Some(s) = pagefork_tests::server_on_xfs(&["--memory-budget-mib", "80"]) else {
        return;
    };
    let a = s.create_vm(&new_vm(32));
    s.fill(&a, 0, 256, 11);
    s.snapshot(&a, "budget", SnapshotMode::Full);
    let b = s.create_vm(&new_vm(32));

    // 32 + 32 + 32 MiB would pass the 80 MiB budget.
    let r = s.try_create_vm(&from_snapshot("budget")).unwrap_err();
    assert_eq!(r.status, 507, "{r}");
    let msg = r.error();
    assert!(msg.contains("--memory-budget-mib"), "{msg}");
    assert_eq!(s.vm_ids().len(), 2, "a refused restore made no VM");

    // With room again, the same restore works and is exact.
    s.delete_vm(&b);
    let r = s.create_vm(&from_snapshot("budget"));
    assert_eq!(s.verify(&r, 0, 256, 11), 0);
    assert_eq!(s.verify(&a, 0, 256, 11), 0);
}

#[test]
fn fork_counts_outside_1_to_1024_are_refused_before_anything_is_made() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let a = s.create_vm(&new_vm(4));
    for count in [0, 1025, 100_000] {
        let r = s.try_fork(&a, &ForkRequest { count }).unwrap_err();
        assert_eq!(r.status, 400, "count {count}: {r}");
        let msg = r.error();
        assert!(msg.contains("between 1 and 1024"), "count {count}: {msg}");
    }
    assert_eq!(s.vm_ids(), vec![a.clone()]);
    assert_eq!(s.vm(&a).state, RunState::Running);
}

/// Whether this process may lower an oom_score_adj (CAP_SYS_RESOURCE,
/// capability 24, in its effective set): containers often drop it.
fn has_cap_sys_resource() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").expect("status");
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .expect("CapEff");
    u64::from_str_radix(eff.trim(), 16).expect("hex") & (1 << 24) != 0
}

/// The server makes itself a late choice for the kernel's OOM killer
/// (it holds every VM's memory); the VMMs it launches keep the default.
/// Where the server may not lower its score (no CAP_SYS_RESOURCE), it says
/// so in its log, raises its VMMs' scores instead (no privilege needed),
/// and runs on: either way the killer picks a VMM first.
#[test]
fn the_oom_killer_picks_a_vmm_before_the_server() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let score = |pid: u64| {
        std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
            .unwrap_or_else(|e| panic!("oom_score_adj of {pid}: {e}"))
            .trim()
            .parse::<i32>()
            .expect("a number")
    };
    let privileged = has_cap_sys_resource();
    if privileged {
        assert_eq!(score(u64::from(s.pid())), -500, "the server's");
    } else {
        eprintln!("no CAP_SYS_RESOURCE here: the server must say it cannot lower its score");
        assert!(
            s.server_log_text()
                .contains("cannot lower the server's oom_score_adj"),
            "no warning in the log"
        );
    }
    let id = s.create_vm(&new_vm(4));
    let vmm = u64::from(s.vm(&id).pid.expect("the VM's vmm pid"));
    let server = score(u64::from(s.pid()));
    if privileged {
        assert_eq!(score(vmm), 0, "the vmm's");
    } else {
        assert_eq!(score(vmm), 500, "the vmm's, raised");
    }
    assert!(
        score(vmm) > server,
        "the vmm's score is not above the server's"
    );
}
