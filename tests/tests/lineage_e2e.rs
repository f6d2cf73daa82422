//! End-to-end: a fork child keeps exactly what its parent held at the
//! fork once the parent is gone, deleted or its VMM killed, whatever holds
//! the parent's memory. A VM on a shared base (a restore of a snapshot, a
//! VM made from a compressed image, the child of a paused template) keeps
//! the pages it writes as private pages of its VMM process, and its
//! children read those pages from there; a VM on zeroes keeps them in a
//! memfd of its own (the control case).
//!
//! Each test has the parent write a quarter of its RAM, takes the
//! parent's digest of all RAM right before the fork, makes the parent go,
//! and then compares the child's digest of all RAM with it (every byte)
//! and `verify`s the ranges the parent had filled. Variants: the parent
//! writes more after the fork; the template's grandchild loses its
//! parent; the child, once its parent is gone, is snapshotted (full,
//! incremental, dirty), rolled back and cloned, each result compared
//! whole. Real server, VMMs, KVM and userfaultfd; snapshots on the XFS
//! mount (PAGEFORK_XFS_DIR).

use std::time::Duration;

use nix::sys::signal::Signal;
use pagefork_tests::{
    counts_4k_pages_only, new_vm, op, pages_of, realistic_memory, require_memcg_v1, server_on_xfs,
    set_oom_score_adj, signal, wait_until, zstd_source, Memcg, TestServer,
};
use proto::api::{CreateSnapshot, CreateVm, RunState, SnapshotCreated, SnapshotMode};
use shared::PAGE_SIZE;

const MIB: u64 = 64;

/// `fill` of `pages` pages from `start` with `seed`'s pattern.
#[derive(Debug, Clone, Copy)]
struct Fill {
    start: u64,
    pages: u64,
    seed: u64,
}

/// What every parent writes before the fork: a quarter of its RAM.
const QUARTER: Fill = Fill {
    start: 2048,
    pages: (MIB << 20) / PAGE_SIZE / 4,
    seed: 21,
};

/// What the VM whose snapshot a restore starts from wrote; the quarter
/// overwrites its upper part.
const GOLD: Fill = Fill {
    start: 0,
    pages: 4000,
    seed: 11,
};

/// What a template writes before it is paused and forked.
const TEMPLATE: Fill = Fill {
    start: 9000,
    pages: 2000,
    seed: 31,
};

/// What a parent writes after the fork: half of the quarter again, and
/// pages it never wrote.
const MORE: [Fill; 2] = [
    Fill {
        start: QUARTER.start + QUARTER.pages / 2,
        pages: QUARTER.pages / 2,
        seed: 91,
    },
    Fill {
        start: 13000,
        pages: 500,
        seed: 92,
    },
];

/// What holds the parent's memory.
#[derive(Debug, Clone, Copy)]
enum Lineage {
    /// A VM created on zeroes: its pages are in a memfd of its own.
    Plain,
    /// A restore of a full snapshot of a VM with pages written.
    Restore,
    /// A VM created from a compressed image (`memory.zst`).
    Zstd,
    /// The child of a paused template: the child under test is the
    /// template's grandchild.
    TemplateChild,
}

impl Lineage {
    /// The VM under test, for messages.
    fn child(self) -> &'static str {
        match self {
            Lineage::Plain => "a plain VM's child",
            Lineage::Restore => "a restore's child",
            Lineage::Zstd => "a zstd VM's child",
            Lineage::TemplateChild => "a template's grandchild",
        }
    }
}

/// How the parent goes.
#[derive(Debug, Clone, Copy)]
enum Gone {
    /// `DELETE /v1/vms/{parent}`.
    Deleted,
    /// SIGKILL to its VMM process.
    Killed,
}

impl Gone {
    /// What happened to the parent, for messages.
    fn what(self) -> &'static str {
        match self {
            Gone::Deleted => "its parent was deleted",
            Gone::Killed => "its parent's VMM was killed",
        }
    }
}

/// A parent ready to fork, and the fills it holds.
struct Parent {
    id: String,
    holds: Vec<Fill>,
}

fn fill(s: &TestServer, id: &str, f: Fill) {
    s.fill(id, f.start, f.pages, f.seed);
}

/// What `id` is now, for a failure's message.
fn state_of(s: &TestServer, id: &str) -> String {
    match s.try_vm(id) {
        Ok(v) => format!(
            "{id} is {}, failure {:?}, exit {:?}",
            v.state, v.failure, v.exit_reason
        ),
        Err(r) => format!("GET {id} answers {r}"),
    }
}

/// The VMM's digest of all of `id`'s RAM; panics with why if `id` cannot
/// answer (`what` says which VM of the test it is).
fn all_ram(s: &TestServer, id: &str, what: &str) -> u64 {
    match s.try_exec(id, &op::digest(0, pages_of(MIB))) {
        Ok(r) => r.result,
        Err(r) => panic!("{what}: digest of {id} failed: {r}; {}", state_of(s, id)),
    }
}

/// Assert `id` holds `want` (digest of all RAM) and every fill of `holds`.
fn assert_holds(s: &TestServer, id: &str, want: u64, holds: &[Fill], what: &str) {
    assert_eq!(
        all_ram(s, id, what),
        want,
        "{what}: {id} does not read what its parent held at the fork"
    );
    for f in holds {
        let bad = match s.try_exec(id, &op::verify(f.start, f.pages, f.seed)) {
            Ok(r) => r.result,
            Err(r) => panic!(
                "{what}: verify {f:?} on {id} failed: {r}; {}",
                state_of(s, id)
            ),
        };
        assert_eq!(bad, 0, "{what}: {bad} pages of {f:?} differ on {id}");
    }
}

fn snap(s: &TestServer, vm: &str, name: &str, mode: SnapshotMode) -> SnapshotCreated {
    let req = CreateSnapshot {
        name: name.to_owned(),
        mode,
        compress: false,
    };
    s.try_snapshot(vm, &req).unwrap_or_else(|r| {
        panic!(
            "snapshot {name} ({mode}) of {vm} failed: {r}; {}",
            state_of(s, vm)
        )
    })
}

/// Assert a restore of snapshot `name` holds `want`, then delete it.
fn assert_restores(s: &TestServer, name: &str, want: u64, holds: &[Fill]) {
    let back = s.restore(name);
    assert_holds(s, &back, want, holds, &format!("restore of {name}"));
    s.delete_vm(&back);
}

/// A VM created from a compressed image of realistic memory, made next to
/// the server's state directory.
fn zstd_vm(s: &TestServer) -> String {
    let dir = s.state_dir().join("..");
    let (raw, zst) = (dir.join("lineage.raw"), dir.join("lineage.zst"));
    std::fs::write(&raw, realistic_memory(MIB)).expect("write the raw image");
    pagefork_tests::compress_image(&raw, &zst, None);
    std::fs::remove_file(&raw).expect("remove the raw image");
    s.create_vm(&CreateVm {
        memory_source: Some(zstd_source(&zst)),
        ..new_vm(MIB)
    })
}

/// A running parent of `lineage` that has written [`QUARTER`].
fn parent(s: &TestServer, lineage: Lineage) -> Parent {
    let (id, mut holds) = match lineage {
        Lineage::Plain => (s.create_vm(&new_vm(MIB)), Vec::new()),
        Lineage::Restore => {
            let g = s.create_vm(&new_vm(MIB));
            fill(s, &g, GOLD);
            snap(s, &g, "gold", SnapshotMode::Full);
            s.delete_vm(&g);
            let below_quarter = Fill {
                pages: QUARTER.start - GOLD.start,
                ..GOLD
            };
            (s.restore("gold"), vec![below_quarter])
        }
        Lineage::Zstd => (zstd_vm(s), Vec::new()),
        Lineage::TemplateChild => {
            let t = s.create_vm(&new_vm(MIB));
            fill(s, &t, TEMPLATE);
            s.pause(&t);
            (s.fork_one(&t), vec![TEMPLATE])
        }
    };
    let memory = s.vm(&id).memory;
    assert_eq!(
        memory.base.is_some(),
        !matches!(lineage, Lineage::Plain),
        "{lineage:?}: whether the parent {id} maps a shared base: {memory:?}"
    );
    fill(s, &id, QUARTER);
    holds.push(QUARTER);
    Parent { id, holds }
}

/// Make VM `id`, the parent of `child`, go as `gone` says. A delete
/// says what it keeps of the parent and for whom: its memfd (a parent on
/// its own memfd, kept frozen) or the layer its pages were copied into
/// when it forked (a parent on a base, not kept itself).
fn go(s: &TestServer, id: &str, gone: Gone, lineage: Lineage, child: &str) {
    match gone {
        Gone::Deleted => {
            let d = s.delete_vm(id);
            let own_memfd = matches!(lineage, Lineage::Plain);
            assert_eq!(d.frozen, own_memfd, "DELETE of {id}: {d:?}");
            let kind = if own_memfd { "memfd" } else { "layer" };
            let kept = d
                .kept
                .iter()
                .find(|k| k.kind == kind)
                .unwrap_or_else(|| panic!("DELETE of {id} keeps no {kind}: {d:?}"));
            assert!(
                kept.bytes >= QUARTER.pages * PAGE_SIZE
                    && kept.readers.iter().any(|r| r.vm == child && r.pages > 0),
                "DELETE of {id} keeps its {kind} for {child}: {d:?}"
            );
        }
        Gone::Killed => {
            signal(s.vmm_pid(id), Signal::SIGKILL);
            wait_until(
                &format!("the server to see {id}'s VMM gone"),
                Duration::from_secs(10),
                || {
                    s.try_vm(id)
                        .map_or(true, |v| {
                            matches!(v.state, RunState::Exited | RunState::Failed)
                        })
                        .then_some(())
                },
            );
            // The views of a VM whose VMM is gone still answer.
            if let Err(e) = s.try_sources(id) {
                panic!("GET /v1/vms/{id}/sources after its VMM was killed: {e}");
            }
            s.explain(id, QUARTER.start);
        }
    }
}

/// `GET /v1/vms/{child}` and explain say where the pages the child reads
/// from its gone parent live: in the parent's memfd or in its layer,
/// both the server's, never in a VMM.
fn assert_lives_with_the_server(s: &TestServer, child: &str, lineage: Lineage) {
    let want = if matches!(lineage, Lineage::Plain) {
        "memfd pagefork-vm-"
    } else {
        "-layer (server, a layer of"
    };
    let info = s.vm(child);
    let from = info
        .reads_from
        .iter()
        .find(|r| r.lives_in.contains(want))
        .unwrap_or_else(|| panic!("{child} reads nothing from {want:?}: {:?}", info.reads_from));
    assert!(from.pages >= QUARTER.pages, "{child}: {from:?}");
    assert!(
        info.reads_from
            .iter()
            .all(|r| !r.lives_in.starts_with("private memory")),
        "{child} reads pages from a VMM: {:?}",
        info.reads_from
    );
    let explained = s.explain(child, QUARTER.start);
    let chain = explained.explain.expect("explain asked for").chain;
    assert!(
        chain
            .iter()
            .any(|step| step.lives_in.as_deref().is_some_and(|l| l.contains(want))),
        "explain of page {} of {child}: {chain:?}",
        QUARTER.start
    );
}

/// Fork a parent of `lineage`, let it write `more` after the fork, make
/// it go as `gone` says, and check the child holds the parent's memory
/// at the fork.
fn child_keeps_the_fork(lineage: Lineage, gone: Gone, more: &[Fill]) {
    let Some(s) = server_on_xfs(&[]) else { return };
    let p = parent(&s, lineage);
    let at_fork = all_ram(&s, &p.id, "the parent right before the fork");
    let child = s.fork_one(&p.id);
    for f in more {
        fill(&s, &p.id, *f);
    }
    if !more.is_empty() {
        assert_ne!(
            all_ram(&s, &p.id, "the parent after its writes"),
            at_fork,
            "the parent's writes after the fork change its memory"
        );
    }
    go(&s, &p.id, gone, lineage, &child);
    assert_lives_with_the_server(&s, &child, lineage);
    let what = format!("{} after {}", lineage.child(), gone.what());
    assert_holds(&s, &child, at_fork, &p.holds, &what);
    s.assert_invariant(&format!("after {what}"));
}

/// Fork a parent of `lineage`, snapshot the child while the parent
/// lives, delete the parent; then the child's full, incremental and dirty
/// snapshots restore exact, its rollback to the snapshot taken while the
/// parent lived is exact, and so are its clones.
fn orphan_snapshots_rolls_back_and_clones_exactly(lineage: Lineage) {
    let Some(s) = server_on_xfs(&[]) else { return };
    let p = parent(&s, lineage);
    let at_fork = all_ram(&s, &p.id, "the parent right before the fork");
    let c = s.fork_one(&p.id);
    snap(&s, &c, "before", SnapshotMode::Full);
    go(&s, &p.id, Gone::Deleted, lineage, &c);

    // The first read of the parent's pages since it went is the
    // server's own, for the image.
    let full = snap(&s, &c, "orphan-full", SnapshotMode::Full);
    assert_eq!(full.mode_used, SnapshotMode::Full, "{full:?}");
    assert_restores(&s, "orphan-full", at_fork, &p.holds);
    assert_holds(&s, &c, at_fork, &p.holds, "the child after its parent went");

    // A fork child did not start from a snapshot: the server may take
    // it full; exact either way.
    let inc = snap(&s, &c, "orphan-inc", SnapshotMode::Incremental);
    eprintln!(
        "incremental snapshot of {c}: {} ({:?})",
        inc.mode_used, inc.fallback_reason
    );
    assert_restores(&s, "orphan-inc", at_fork, &p.holds);

    let later = Fill {
        start: 12000,
        pages: 300,
        seed: 61,
    };
    fill(&s, &c, later);
    let now = all_ram(&s, &c, "the child after its own writes");
    let dirty = snap(&s, &c, "orphan-dirty", SnapshotMode::Dirty);
    assert_eq!(dirty.mode_used, SnapshotMode::Dirty, "{dirty:?}");
    let mut holds_now = p.holds.clone();
    holds_now.push(later);
    assert_restores(&s, "orphan-dirty", now, &holds_now);

    s.rollback(&c, "before");
    assert_holds(&s, &c, at_fork, &p.holds, "the child rolled back");

    for k in s.clone_vm(&c, 2, 2).clones {
        assert_holds(&s, &k, at_fork, &p.holds, "a clone of the child");
    }
    s.assert_invariant("after snapshots, a rollback and clones of an orphan");
}

#[test]
fn a_plain_vms_child_keeps_its_pages_when_the_parent_is_deleted() {
    child_keeps_the_fork(Lineage::Plain, Gone::Deleted, &[]);
}

#[test]
fn a_plain_vms_child_keeps_its_pages_when_the_parents_vmm_is_killed() {
    child_keeps_the_fork(Lineage::Plain, Gone::Killed, &[]);
}

#[test]
fn a_restores_child_keeps_its_pages_when_the_parent_is_deleted() {
    child_keeps_the_fork(Lineage::Restore, Gone::Deleted, &[]);
}

#[test]
fn a_restores_child_keeps_its_pages_when_the_parents_vmm_is_killed() {
    child_keeps_the_fork(Lineage::Restore, Gone::Killed, &[]);
}

#[test]
fn a_zstd_vms_child_keeps_its_pages_when_the_parent_is_deleted() {
    child_keeps_the_fork(Lineage::Zstd, Gone::Deleted, &[]);
}

#[test]
fn a_zstd_vms_child_keeps_its_pages_when_the_parents_vmm_is_killed() {
    child_keeps_the_fork(Lineage::Zstd, Gone::Killed, &[]);
}

#[test]
fn a_templates_grandchild_keeps_its_pages_when_its_parent_is_deleted() {
    child_keeps_the_fork(Lineage::TemplateChild, Gone::Deleted, &[]);
}

#[test]
fn a_templates_grandchild_keeps_its_pages_when_its_parents_vmm_is_killed() {
    child_keeps_the_fork(Lineage::TemplateChild, Gone::Killed, &[]);
}

#[test]
fn a_restores_child_keeps_the_fork_when_the_parent_writes_more_and_is_deleted() {
    child_keeps_the_fork(Lineage::Restore, Gone::Deleted, &MORE);
}

#[test]
fn a_templates_grandchild_keeps_the_fork_when_its_parent_writes_more_and_is_killed() {
    child_keeps_the_fork(Lineage::TemplateChild, Gone::Killed, &MORE);
}

#[test]
fn a_plain_vms_orphan_snapshots_rolls_back_and_clones_exactly() {
    orphan_snapshots_rolls_back_and_clones_exactly(Lineage::Plain);
}

#[test]
fn a_restores_orphan_snapshots_rolls_back_and_clones_exactly() {
    orphan_snapshots_rolls_back_and_clones_exactly(Lineage::Restore);
}

/// A running parent of `lineage` forked again and again: a fork with
/// nothing written since the one before copies nothing (its children
/// share the earlier layer), one after more writes copies only those, and
/// every child holds exactly what the parent held at its fork after the
/// parent's VMM is killed.
fn forks_again_share_what_earlier_forks_keep(lineage: Lineage) {
    let Some(s) = server_on_xfs(&[]) else { return };
    let p = parent(&s, lineage);
    let mut children: Vec<(String, u64, Vec<Fill>)> = Vec::new();
    let mut holds = p.holds.clone();
    let mut fork = |s: &TestServer, holds: &[Fill], what: &str| {
        let at_fork = all_ram(s, &p.id, what);
        let f = s.fork(&p.id, 1);
        children.push((f.children[0].clone(), at_fork, holds.to_vec()));
        f.phases.layer_pages
    };
    let first = fork(&s, &holds, "the parent before its first fork");
    assert!(
        first >= QUARTER.pages,
        "the first fork copies what the parent wrote ({} pages): {first}",
        QUARTER.pages
    );
    for i in 2..=4 {
        let again = fork(&s, &holds, "the parent before a fork again");
        assert_eq!(
            again, 0,
            "fork {i}, nothing written since the one before, copies nothing"
        );
    }
    // MORE overwrites the quarter's upper half: what is left of it is
    // its lower half.
    holds.retain(|f| f.seed != QUARTER.seed);
    holds.push(Fill {
        pages: QUARTER.pages / 2,
        ..QUARTER
    });
    for f in MORE {
        fill(&s, &p.id, f);
        holds.push(f);
    }
    let more: u64 = MORE.iter().map(|f| f.pages).sum();
    let after = fork(&s, &holds, "the parent after more writes");
    assert!(
        after >= more && after < QUARTER.pages + more,
        "a fork after {more} pages more copies those alone, not the quarter again: {after}"
    );
    s.assert_invariant("after forks again of a running parent");
    go(&s, &p.id, Gone::Killed, lineage, &children[0].0);
    for (i, (child, at_fork, holds)) in children.iter().enumerate() {
        let what = format!(
            "child {} of {} forks after its parent's VMM was killed",
            i + 1,
            children.len()
        );
        assert_holds(&s, child, *at_fork, holds, &what);
    }
    s.assert_invariant("after the children of forks again read their pages");
}

#[test]
fn a_running_restore_forked_again_copies_only_what_it_wrote_since() {
    forks_again_share_what_earlier_forks_keep(Lineage::Restore);
}

#[test]
fn a_running_templates_child_forked_again_copies_only_what_it_wrote_since() {
    forks_again_share_what_earlier_forks_keep(Lineage::TemplateChild);
}

/// A parent on a base writes all of its RAM and forks into two; its VMM
/// is SIGKILLed the moment the fork answers, while the layer its children
/// read is still being filled (the children start at once and the fill
/// runs after the answer). With `crash_server`, the serving process is
/// SIGKILLed first, between the fork and the parent's death, and its
/// successor goes on filling from the journal. The children read exactly
/// what the parent held at the fork: the pages not copied yet come
/// through the VMM's anchor, a process that shares its address space.
fn children_exact_when_the_parent_dies_as_its_layer_fills(crash_server: bool) {
    if crash_server
        && counts_4k_pages_only(
            "a restarted server cannot tell which blocks of a hugepage layer were copied; \
             it fails their readers instead (docs/architecture.md, Layers)",
        )
    {
        return;
    }
    let Some(s) = server_on_xfs(&[]) else { return };
    let p = parent(&s, Lineage::Restore);
    let all = Fill {
        start: 0,
        pages: pages_of(MIB),
        seed: 77,
    };
    fill(&s, &p.id, all);
    let at_fork = all_ram(&s, &p.id, "the parent right before the fork");
    let vmm = s.vmm_pid(&p.id);
    let serving = s.pid();
    let f = s.fork(&p.id, 2);
    if crash_server {
        signal(serving, Signal::SIGKILL);
    }
    signal(vmm, Signal::SIGKILL);
    assert!(
        f.phases.layer_pages >= all.pages,
        "the fork freezes every page the parent wrote into its layer: {:?}",
        f.phases
    );
    if crash_server {
        wait_until("a new serving process", Duration::from_secs(30), || {
            s.health_now()
                .filter(|h| h.pid != serving && h.pid != 0)
                .map(|_| ())
        });
    }
    let what = if crash_server {
        "after the server and then the parent's VMM were SIGKILLed as the layer filled"
    } else {
        "after the parent's VMM was SIGKILLed as the layer filled"
    };
    for child in &f.children {
        assert_holds(&s, child, at_fork, &[all], what);
    }
    s.assert_invariant(what);
}

#[test]
fn a_restores_children_are_exact_when_its_vmm_is_killed_as_the_layer_fills() {
    children_exact_when_the_parent_dies_as_its_layer_fills(false);
}

#[test]
fn a_restores_children_are_exact_when_the_server_then_its_vmm_are_killed_as_the_layer_fills() {
    children_exact_when_the_parent_dies_as_its_layer_fills(true);
}

/// Whether process `pid` is alive (a zombie is not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, r)| r.trim_start().to_owned()))
        .is_some_and(|r| !r.starts_with('Z') && !r.starts_with('X'))
}

/// A real OOM in a memory cgroup holding the server and its VMMs, in the
/// middle of a layer's fill: the group has room for all but 32 MiB of the
/// layer, so the fill runs it out of memory, and the kernel's OOM killer
/// chooses (nothing here sends a signal). While the layer fills, the
/// parent's VMM and its anchor have the lowest score and its children the
/// highest; a bystander on the same base that wrote 48 MiB is, as any VMM
/// may be, the OOM killer's first choice (score 1000). Whatever the
/// kernel kills, every VM whose VMM lives reads exactly what it held, and
/// the parent, whose pages the children need, is not the one it kills.
///
/// Not run by default: on these hosts the kernel, short of room, often
/// evicts and refaults the group's page cache (the binaries' text) for
/// minutes instead of killing (1 run in 4 here), which no limit chosen
/// from the group's counters avoided. Run it by hand with `--ignored`.
#[test]
#[ignore = "the kernel may thrash on page cache for minutes instead of OOM-killing"]
fn an_oom_as_the_layer_fills_spares_the_parent_and_every_survivor_is_exact() {
    if !require_memcg_v1()
        || counts_4k_pages_only("a memory cgroup does not charge hugetlb pages: no OOM to make")
    {
        return;
    }
    let cg = Memcg::new(&format!("pagefork-lineage-oom-{}", std::process::id()));
    let Some(s) = cg.spawn_inside(|| server_on_xfs(&[])) else {
        return;
    };
    let p = parent(&s, Lineage::Restore);
    let all = Fill {
        start: 0,
        pages: pages_of(MIB),
        seed: 78,
    };
    fill(&s, &p.id, all);
    let bystander = s.restore("gold");
    let theirs = Fill {
        start: 4096,
        pages: pages_of(48),
        seed: 79,
    };
    fill(&s, &bystander, theirs);
    set_oom_score_adj(s.vmm_pid(&bystander), 1000);
    let bystander_vmm = s.vmm_pid(&bystander);
    let at_fork = all_ram(&s, &p.id, "the parent right before the fork");
    let parent_vmm = s.vmm_pid(&p.id);
    let layer = all.pages * PAGE_SIZE;
    cg.limit(cg.usage() + layer - (32 << 20));
    let f = s.fork(&p.id, 2);
    wait_until("an OOM kill in the group", Duration::from_secs(60), || {
        (cg.oom_kills() > 0).then_some(())
    });
    // The fill is over once the parent's score is back.
    wait_until("the layer to fill", Duration::from_secs(60), || {
        std::fs::read_to_string(format!("/proc/{parent_vmm}/oom_score_adj"))
            .is_ok_and(|a| a.trim() != "0")
            .then_some(())
    });
    let kills = cg.oom_kills();
    cg.release();
    eprintln!(
        "OOM kills: {kills}; bystander's VMM alive {}, children's {:?}",
        alive(bystander_vmm),
        f.children
            .iter()
            .map(|c| (c, s.try_vm(c).ok().and_then(|v| v.pid).is_some_and(alive)))
            .collect::<Vec<_>>()
    );
    assert!(
        alive(parent_vmm),
        "the OOM killer took the parent's VMM, whose pages its children needed ({kills} kills)"
    );
    assert_holds(
        &s,
        &p.id,
        at_fork,
        &[all],
        "the parent after an OOM as its layer filled",
    );
    let mut survivors = 0;
    for child in &f.children {
        let pid = s.try_vm(child).ok().and_then(|v| v.pid);
        if pid.is_some_and(alive) {
            assert_holds(&s, child, at_fork, &[all], "a child that survived the OOM");
            survivors += 1;
        }
    }
    if alive(bystander_vmm) {
        assert_eq!(
            s.verify(&bystander, theirs.start, theirs.pages, theirs.seed),
            0,
            "the bystander survived the OOM and lost pages"
        );
    }
    eprintln!("{survivors} of {} children survived", f.children.len());
    s.assert_invariant("after an OOM as a layer filled");
    drop(s);
}
