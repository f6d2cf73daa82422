//! A fork child whose pre-write copy of a page cannot be made (its VMM's
//! memory cgroup is full, so UFFDIO_COPY into its memory fails with
//! ENOMEM) is failed, with the reason, and can no longer read what its
//! parent writes; the parent and every other VM go on.
//!
//! Needs the cgroup v1 memory controller (`/sys/fs/cgroup/memory`, as on
//! the hosts this runs on), whose `memory.oom_control` makes a charge over
//! the limit fail with ENOMEM instead of calling the OOM killer.

use pagefork_tests::{new_vm, op, require_memcg_v1, Memcg, TestServer};
use proto::api::RunState;

#[test]
fn a_child_that_cannot_get_a_pre_write_copy_fails_and_reads_nothing_new() {
    if !require_memcg_v1() {
        return;
    }
    let s = TestServer::start();
    let other = s.create_vm(&new_vm(4));
    let parent = s.create_vm(&new_vm(64));
    s.fill(&parent, 0, 4096, 1);
    let child = s.fork_one(&parent);
    let sibling = s.fork_one(&parent);
    let pid = s.vm(&child).pid.expect("the child's vmm pid");

    // The child's VMM may be charged 64 pages more than it has now; a
    // charge past that fails with ENOMEM (no OOM kill).
    let cg = Memcg::new(&format!("pagefork-test-{}", std::process::id()));
    cg.limit(64 << 20);
    cg.take(pid);
    let usage = cg.usage();
    cg.limit(usage + (256 << 10));
    cg.set("memory.oom_control", "1");

    // The parent rewrites every page both children still read from it:
    // each gets the pre-write copies, the child only until its group is
    // full.
    s.fill(&parent, 0, 4096, 2);
    let failcnt = cg.failcnt();
    assert!(failcnt > 0, "the child's cgroup never refused a charge");
    let v = s.vm(&child);
    assert_eq!(
        v.state,
        RunState::Failed,
        "{child} still runs although it lost a page its parent rewrote: {v:?}"
    );
    let failure = v.failure.as_deref().unwrap_or_default();
    assert!(
        failure.contains("could not be kept") && failure.contains("ENOMEM"),
        "the child's failure does not say why: {v:?}"
    );
    let r = s.try_exec(&child, &op::checksum(0, 1)).unwrap_err();
    assert_eq!(r.status, 409, "a failed child still runs ops: {r}");

    // Nobody else lost anything: the parent has its new bytes, the
    // sibling the bytes of the fork, and an unrelated VM works.
    assert_eq!(s.verify(&parent, 0, 4096, 2), 0);
    assert_eq!(s.verify(&sibling, 0, 4096, 1), 0);
    s.fill(&other, 0, 1024, 3);
    assert_eq!(s.verify(&other, 0, 1024, 3), 0);

    cg.release();
    for id in [&child, &sibling, &parent, &other] {
        s.delete_vm(id);
    }
    s.assert_healthy();
}
