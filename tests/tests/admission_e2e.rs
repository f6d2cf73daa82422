//! Admission control: the server refuses a create or fork that would pass
//! its memory budget or VM limit with a clear 507, before allocating
//! anything, and keeps serving the VMs it has.

use pagefork_tests::{require_kvm_uffd, TestServer};
use serde_json::json;

#[test]
fn create_and_fork_beyond_the_memory_budget_answer_507() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start_with_args(&["--memory-budget-mib", "64"]);
    let a = s.create_vm(json!({"memory_mib": 32}));
    s.fill(&a, 0, 64, 7);

    let (status, body) = s.api("POST", "/v1/vms", Some(json!({"memory_mib": 48})));
    assert_eq!(status, 507, "{body}");
    let msg = body["error"].as_str().unwrap_or_default();
    assert!(msg.contains("--memory-budget-mib"), "{msg}");

    let (status, body) = s.api(
        "POST",
        &format!("/v1/vms/{a}/fork"),
        Some(json!({"count": 2})),
    );
    assert_eq!(status, 507, "{body}");
    assert_eq!(s.vm_ids(), vec![a.clone()], "a refused fork made no child");

    // What fits still works, and the first VM is untouched.
    let b = s.create_vm(json!({"memory_mib": 16}));
    let (status, body) = s.api(
        "POST",
        &format!("/v1/vms/{a}/fork"),
        Some(json!({"count": 1})),
    );
    assert_eq!(status, 507, "{body}");
    assert_eq!(s.verify(&a, 0, 64, 7), 0);
    s.api("DELETE", &format!("/v1/vms/{b}"), None);
    let (status, body) = s.api(
        "POST",
        &format!("/v1/vms/{a}/fork"),
        Some(json!({"count": 1})),
    );
    assert_eq!(status, 201, "{body}");
}

#[test]
fn vms_beyond_max_vms_answer_507() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start_with_args(&["--max-vms", "2"]);
    s.create_vm(json!({"memory_mib": 4}));
    s.create_vm(json!({"memory_mib": 4}));
    let (status, body) = s.api("POST", "/v1/vms", Some(json!({"memory_mib": 4})));
    assert_eq!(status, 507, "{body}");
    assert!(body["error"]
        .as_str()
        .unwrap_or_default()
        .contains("--max-vms"));
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
    let (status, _) = s.api_raw("POST", "/v1/vms", big.as_bytes());
    assert_eq!(status, 413);
    s.assert_healthy();
}
