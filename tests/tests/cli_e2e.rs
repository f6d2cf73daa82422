//! `uffdctl` end to end: the CLI's commands against a real server, and the
//! demo (the README's main job) from start to finish.

use std::process::Command;
use std::sync::{Mutex, MutexGuard};

use pagefork_tests::{
    bin, ok_stdout, require_kvm_uffd, uffdctl, uffdctl_json, uffdctl_ok, TestServer,
};
use proto::api::{ExecResponse, ForkResponse, VmInfo};

#[test]
fn uffdctl_drives_a_vm_through_create_exec_fork_and_inspection() {
    if !require_kvm_uffd() {
        return;
    }
    let _one = one_demo();
    let s = TestServer::start();
    let vm: VmInfo = uffdctl_json(&s, &["vm", "create", "--memory-mib", "64"]);
    let id = vm.id;
    uffdctl_ok(
        &s,
        &["vm", "exec", &id, "fill", "--seed", "3", "--pages", "100"],
    );
    let v: ExecResponse = uffdctl_json(
        &s,
        &["vm", "exec", &id, "verify", "--seed", "3", "--pages", "100"],
    );
    assert_eq!(v.result, 0, "{v:?}");

    let list = uffdctl_ok(&s, &["vm", "list"]);
    assert!(list.starts_with("ID"), "{list}");
    assert!(list.contains(&id) && list.contains("running"), "{list}");

    let fork: ForkResponse = uffdctl_json(&s, &["vm", "fork", &id, "--count", "1"]);
    let child = fork.children[0].clone();
    let sources = uffdctl_ok(&s, &["sources", &child]);
    assert!(
        sources.contains(&format!("{id}  ")) || sources.contains(&id),
        "{sources}"
    );
    let page = uffdctl_ok(&s, &["page", &child, "0"]);
    assert!(page.contains(&format!("source {id}")), "{page}");
    let tree = uffdctl_ok(&s, &["tree"]);
    assert!(
        tree.contains(&format!("  {child}")),
        "child not indented under its parent: {tree}"
    );

    let listeners = uffdctl_ok(&s, &["firecracker", "list"]);
    assert!(listeners.starts_with("ID"), "{listeners}");

    // Errors: a clear message and a failing exit status.
    let bad = uffdctl(&s, &["vm", "exec", "vm-999", "checksum"]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("no VM vm-999") && err.contains("404"), "{err}");

    uffdctl_ok(&s, &["vm", "delete", &child]);
    uffdctl_ok(&s, &["vm", "delete", &id]);
}

#[test]
fn uffdctl_without_a_server_says_how_to_fix_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(bin("uffdctl"))
        .arg("--state-dir")
        .arg(dir.path())
        .args(["vm", "list"])
        .output()
        .expect("cannot run uffdctl");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is uffd-server running"), "{err}");
}

/// One test with VMs at a time: the demo measures the host memory its
/// restores add, which the VMs of another test would add to.
static ONE_DEMO: Mutex<()> = Mutex::new(());

fn one_demo() -> MutexGuard<'static, ()> {
    ONE_DEMO
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn the_demo_runs_a_vm_a_fork_and_a_snapshot_end_to_end() {
    if !require_kvm_uffd() {
        return;
    }
    let _one = one_demo();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(bin("uffdctl"))
        .args(["demo", "--memory-mib", "64", "--state-dir"])
        .arg(dir.path().join("state"))
        .arg("--server-bin")
        .arg(bin("uffd-server"))
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .output()
        .expect("cannot run uffdctl demo");
    let text = ok_stdout(&out, "uffdctl demo");
    for want in [
        "[1] create",
        "[3] fork",
        "same as parent",
        "0 mismatches",
        "[6] snapshot",
        "[8] 8 restores of one snapshot",
        "host memory added: ",
        "[9] fork a running restore",
        "VMM (pid ",
        "[10] kill -9 the serving process",
        "started: crash",
        "recovery   ",
        "VMs: every byte as before the kill",
        "[11] ",
        "figures:",
        "host memory added by the restores",
        "demo done",
    ] {
        assert!(text.contains(want), "demo output lacks {want:?}:\n{text}");
    }
    assert!(!text.contains("DIFFERENT"), "{text}");
    // The cgroup step runs where a memory cgroup controller is, and says
    // why not elsewhere.
    assert!(
        text.contains("OOM kills 0") || text.contains("    skipped: "),
        "{text}"
    );
}

#[test]
fn the_demo_fails_when_restores_do_not_share_a_base() {
    if !require_kvm_uffd() {
        return;
    }
    let _one = one_demo();
    // Without shared bases each restore reads into memory of its own: the
    // shared-base step's figure is wrong and must fail the demo.
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(bin("uffdctl"))
        .args(["demo", "--memory-mib", "64", "--state-dir"])
        .arg(dir.path().join("state"))
        .arg("--server-bin")
        .arg(bin("uffd-server"))
        .env("PAGEFORK_SHARED_BASES", "false")
        .output()
        .expect("cannot run uffdctl demo");
    let err = String::from_utf8_lossy(&out.stderr);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "the demo passed:\n{text}");
    assert!(
        err.contains("demo check failed") && err.contains("do not share one base"),
        "{err}\n{text}"
    );
    assert!(!text.contains("demo done"), "{text}");
}
