//! File descriptors are admitted like memory: a server whose fd limit
//! (`RLIMIT_NOFILE`) is nearly taken refuses a create, a restore, a fork
//! or a clone up front with a 503 that names the limit and what to do,
//! before it allocates anything (no child, no snapshot, the parent not
//! paused). What it already runs keeps working on the fds it keeps in
//! reserve: plain VMs, fork children on a paused template's base, VMs
//! restored from a snapshot, the template moving onto its children's base
//! when it runs again, the snapshot catalog, `/metrics`. Deleting VMs
//! makes room again.

use pagefork_tests::{
    from_snapshot, new_vm, require_kvm_uffd, xfs_dir, Holdings, ServerOptions, TestServer,
};
use proto::api::{CloneVm, ForkRequest, RunState, SnapshotMode};

/// The server's fd limit (soft and hard): a few dozen small VMs fill it.
const LIMIT: u64 = 256;
/// What the server keeps out of admission at that limit: a tenth of it.
const RESERVE: u64 = LIMIT / 10;

/// A server on the XFS mount (snapshots) under `LIMIT` fds, or None.
fn server_under_fd_limit() -> Option<TestServer> {
    let dir = xfs_dir()?;
    if !require_kvm_uffd() {
        return None;
    }
    Some(TestServer::start_with_options(
        &[],
        &ServerOptions {
            parent: Some(dir),
            nofile: Some((LIMIT, LIMIT)),
            ..ServerOptions::default()
        },
    ))
}

/// The VMs made while filling the fd table, by how they were made.
#[derive(Debug, Default)]
struct Made {
    /// Plain VMs, each filled with the seed of its index.
    plain: Vec<(String, u64)>,
    /// Children of the paused template (on its base).
    children: Vec<String>,
    /// VMs restored from the template's snapshot.
    restored: Vec<String>,
}

/// Create plain VMs, fork the paused template `t` and restore `snap` by
/// turns until one is refused; every request before it succeeds. Returns
/// what was made and the refusal.
fn fill_until_refused(s: &TestServer, t: &str, snap: &str) -> (Made, pagefork_tests::Reply) {
    let mut made = Made::default();
    for i in 0u64.. {
        assert!(
            i < 80,
            "{i} VMs and no refusal under a limit of {LIMIT} fds"
        );
        let answer = match i % 3 {
            0 => s.try_create_vm(&new_vm(4)).map(|v| {
                s.fill(&v.id, 0, 8, i);
                made.plain.push((v.id, i));
            }),
            1 => s
                .try_fork(t, &ForkRequest { count: 1 })
                .map(|f| made.children.extend(f.children)),
            _ => s
                .try_create_vm(&from_snapshot(snap))
                .map(|v| made.restored.push(v.id)),
        };
        if let Err(refusal) = answer {
            return (made, refusal);
        }
    }
    unreachable!("the loop ends with a refusal or a panic")
}

#[test]
fn past_the_fd_limit_requests_get_503_and_every_vm_keeps_working() {
    let Some(s) = server_under_fd_limit() else {
        return;
    };
    // Arrange: a template with a page range, a snapshot of it, and the
    // fd table filled with VMs of every kind until one is refused.
    let t = s.create_vm(&new_vm(4));
    s.fill(&t, 0, 16, 1);
    s.snapshot(&t, "gold", SnapshotMode::Full);
    s.pause(&t);
    let (made, refusal) = fill_until_refused(&s, &t, "gold");
    eprintln!(
        "refused after {} plain VMs, {} children, {} restores: {refusal}",
        made.plain.len(),
        made.children.len(),
        made.restored.len()
    );

    // The refusal: 503, naming the limit and what to do, with fds left.
    let msg = refusal.assert_error(503, "RLIMIT_NOFILE", "a request past the fd limit");
    assert!(
        msg.contains(&format!("of its {LIMIT} file descriptors")),
        "{msg}"
    );
    assert!(msg.contains("ulimit -n"), "{msg}");
    let held = Holdings::of(s.pid()).fds as u64;
    assert!(
        held + RESERVE / 2 <= LIMIT,
        "{held} fds held of {LIMIT}: admission left no reserve"
    );
    assert_eq!(s.metric("pagefork_fds_limit"), Some(LIMIT));
    assert_eq!(s.metric("pagefork_fds_reserve"), Some(RESERVE));
    assert!(s.metric("pagefork_fds_open").is_some_and(|n| n <= LIMIT));
    assert!(s
        .metric("pagefork_fd_refusals_total")
        .is_some_and(|n| n >= 1));

    // Every VM still answers: plain ones write and read back, children
    // on the template's base and restores read the template's pages and
    // write their own.
    for (id, seed) in &made.plain {
        assert_eq!(s.verify(id, 0, 8, *seed), 0, "plain VM {id}");
        s.fill(id, 8, 8, seed + 100);
        assert_eq!(s.verify(id, 8, 8, seed + 100), 0, "plain VM {id}");
    }
    for id in made.children.iter().chain(&made.restored) {
        assert_eq!(s.verify(id, 0, 16, 1), 0, "{id} reads the template's pages");
        s.fill(id, 16, 8, 5);
        assert_eq!(s.verify(id, 16, 8, 5), 0, "{id} keeps its own pages");
    }
    // The template runs again (it moves onto its children's base: a new
    // memfd and its VMM's pagemap, out of the reserve) and writes; its
    // children keep the pages of the fork's moment.
    s.resume(&t);
    s.fill(&t, 0, 16, 3);
    assert_eq!(s.verify(&t, 0, 16, 3), 0);
    for id in &made.children {
        assert_eq!(
            s.verify(id, 0, 16, 1),
            0,
            "child {id} after its parent wrote"
        );
    }
    // The snapshot catalog answers.
    let names: Vec<String> = s
        .snapshots()
        .snapshots
        .into_iter()
        .map(|i| i.name)
        .collect();
    assert_eq!(names, ["gold"]);
    assert_eq!(s.snapshot_info("gold").name, "gold");

    // A fork and a clone are refused before anything is made: no child,
    // no snapshot, the parent still running.
    let vms = s.vm_ids();
    let r = s.try_fork(&t, &ForkRequest { count: 4 }).unwrap_err();
    r.assert_error(503, "RLIMIT_NOFILE", "a fork of 4 at the fd limit");
    let r = s
        .try_clone_vm(
            &t,
            &CloneVm {
                count: 4,
                concurrency: 4,
            },
        )
        .unwrap_err();
    r.assert_error(503, "RLIMIT_NOFILE", "a clone of 4 at the fd limit");
    assert_eq!(s.vm_ids(), vms, "a refused fork or clone made no VM");
    assert_eq!(s.vm(&t).state, RunState::Running);
    assert_eq!(
        s.snapshots().snapshots.len(),
        1,
        "a refused clone took a snapshot"
    );

    // Act: delete some VMs. Assert: creates, restores and forks fit again.
    for (id, _) in made.plain.iter().take(6) {
        s.delete_vm(id);
    }
    let again = s.create_vm(&new_vm(4));
    s.fill(&again, 0, 8, 9);
    assert_eq!(s.verify(&again, 0, 8, 9), 0);
    let restored = s.restore("gold");
    assert_eq!(s.verify(&restored, 0, 16, 1), 0);
    let child = s.fork_one(&t);
    assert_eq!(s.verify(&child, 0, 16, 3), 0);
}
