//! A fork child whose pre-write copy of a page cannot be made (its VMM's
//! memory cgroup is full, so UFFDIO_COPY into its memory fails with
//! ENOMEM) is failed, with the reason, and can no longer read what its
//! parent writes; the parent and every other VM go on.
//!
//! Needs the cgroup v1 memory controller (`/sys/fs/cgroup/memory`, as on
//! the hosts this runs on), whose `memory.oom_control` makes a charge over
//! the limit fail with ENOMEM instead of calling the OOM killer.

use std::path::{Path, PathBuf};

use pagefork_tests::{new_vm, op, require_kvm_uffd, TestServer};
use proto::api::RunState;

const MEMCG_ROOT: &str = "/sys/fs/cgroup/memory";

/// Whether the cgroup v1 memory controller is there to use. Otherwise:
/// panics if `CI=true` (CI must not skip), else prints `skipping: ...`.
fn require_memcg_v1() -> bool {
    if !require_kvm_uffd() {
        return false;
    }
    let control = Path::new(MEMCG_ROOT).join("memory.oom_control");
    if control.exists() {
        return true;
    }
    let why = format!(
        "no cgroup v1 memory controller ({} is missing)",
        control.display()
    );
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but a prerequisite of the memory cgroup test is missing: {why}");
    }
    eprintln!("skipping: {why}");
    false
}

/// A memory cgroup of this test, removed (its tasks moved back to the
/// root first) when dropped, whatever the test did.
struct Memcg(PathBuf);

impl Memcg {
    fn new(name: &str) -> Self {
        let dir = Path::new(MEMCG_ROOT).join(name);
        if dir.exists() {
            Memcg(dir.clone()).release();
            let _ = std::fs::remove_dir(&dir);
        }
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        Memcg(dir)
    }

    fn set(&self, file: &str, value: &str) {
        let path = self.0.join(file);
        std::fs::write(&path, value)
            .unwrap_or_else(|e| panic!("{value} > {}: {e}", path.display()));
    }

    fn get(&self, file: &str) -> String {
        std::fs::read_to_string(self.0.join(file)).unwrap_or_default()
    }

    /// Move every thread of `pid` into this group.
    fn take(&self, pid: u64) {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the vmm's threads");
        for t in tasks.flatten() {
            self.set("tasks", &t.file_name().to_string_lossy());
        }
    }

    /// No limit, and tasks back to the root group.
    fn release(&self) {
        let _ = std::fs::write(self.0.join("memory.oom_control"), "0");
        let _ = std::fs::write(self.0.join("memory.limit_in_bytes"), "-1");
        for t in self.get("tasks").split_whitespace() {
            let _ = std::fs::write(Path::new(MEMCG_ROOT).join("tasks"), t);
        }
    }
}

impl Drop for Memcg {
    fn drop(&mut self) {
        self.release();
        let _ = std::fs::remove_dir(&self.0);
    }
}

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
    let pid = u64::from(s.vm(&child).pid.expect("the child's vmm pid"));

    // The child's VMM may be charged 64 pages more than it has now; a
    // charge past that fails with ENOMEM (no OOM kill).
    let cg = Memcg::new(&format!("pagefork-test-{}", std::process::id()));
    cg.set("memory.limit_in_bytes", &(64u64 << 20).to_string());
    cg.take(pid);
    let usage: u64 = cg
        .get("memory.usage_in_bytes")
        .trim()
        .parse()
        .expect("usage");
    cg.set("memory.limit_in_bytes", &(usage + (256 << 10)).to_string());
    cg.set("memory.oom_control", "1");

    // The parent rewrites every page both children still read from it:
    // each gets the pre-write copies, the child only until its group is
    // full.
    s.fill(&parent, 0, 4096, 2);
    let failcnt: u64 = cg.get("memory.failcnt").trim().parse().unwrap_or(0);
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
