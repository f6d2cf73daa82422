//! Live fork end to end (issue 3): a real `uffd-server`, real `vmm`
//! processes, real KVM and userfaultfd. A fork write-protects the parent's
//! pages, gives the child the parent's page-source table, and copies a page
//! only when one side writes it (`uffd-server/src/core/fork.rs`).
//!
//! Every test keeps a host-side [`Model`] of what each VM's guest RAM must
//! hold (the seed last written to each page, or zero) and compares the
//! guest's `checksum`/`verify` and the VMM's `digest` with it exactly. Every
//! test ends (and the tricky ones also pause) on `GET /v1/debug/invariant`:
//! `table_X[p] == Vm(X)` iff p is present in X's memfd, checked against the
//! kernel's view.
//!
//! Run: `cargo build --workspace && cargo test -p pagefork-tests --test
//! fork_e2e -- --test-threads=2`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread;
use std::time::{Duration, Instant};

use pagefork_tests::{
    counts_4k_pages_only, new_vm, pages_of, require_kvm_uffd, vm_num, TestServer,
};
use proto::api::RunState;
use shared::pattern::{digest_page, fill_page, fold, pattern_word};
use shared::PAGE_SIZE;

/// Tests that measure host-wide memory (Shmem) take this for writing; all
/// others for reading, so nothing else in this binary allocates meanwhile.
static HOST_MEMORY: RwLock<()> = RwLock::new(());

fn shared_host() -> RwLockReadGuard<'static, ()> {
    HOST_MEMORY
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn exclusive_host() -> RwLockWriteGuard<'static, ()> {
    HOST_MEMORY
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

// ---------------------------------------------------------------- model --

/// What one VM's guest RAM must hold: per page, the seed of the last
/// `fill`, or `None` for a page never written (all zeroes).
#[derive(Clone)]
struct Model {
    seeds: Vec<Option<u64>>,
}

impl Model {
    fn new(pages: u64) -> Self {
        Model {
            seeds: vec![None; idx(pages)],
        }
    }

    fn fill(&mut self, start: u64, pages: u64, seed: u64) {
        for p in start..start + pages {
            self.seeds[idx(p)] = Some(seed);
        }
    }

    /// The guest `checksum` of `[start, start+pages)`.
    fn checksum(&self, start: u64, pages: u64) -> u64 {
        (start..start + pages).fold(0, |h, p| {
            fold(h, self.seeds[idx(p)].map_or(0, |s| pattern_word(s, p)))
        })
    }

    /// The VMM `digest` of `[start, start+pages)`.
    fn digest(&self, start: u64, pages: u64) -> u64 {
        let mut page = vec![0u8; idx(PAGE_SIZE)];
        (start..start + pages).fold(0, |h, p| {
            page.fill(0);
            if let Some(s) = self.seeds[idx(p)] {
                fill_page(&mut page, p, s);
            }
            digest_page(h, &page)
        })
    }
}

fn idx(n: u64) -> usize {
    usize::try_from(n).expect("fits in usize")
}

// -------------------------------------------------------------- helpers --

fn create(s: &TestServer, mib: u64) -> String {
    let id = s.create_vm(&new_vm(mib));
    s.wait_state(&id, RunState::Running, Duration::from_secs(30));
    id
}

/// Assert page `p` of `id` comes from `source` and whether it is present
/// in `id`'s memfd (by the kernel and by the table alike).
fn assert_page(s: &TestServer, id: &str, p: u64, source: &str, present: bool) {
    let v = s.page(id, p);
    assert_eq!(
        v.source.as_deref(),
        Some(source),
        "source of page {p} of {id}: {v:?}"
    );
    assert_eq!(
        v.present, present,
        "page {p} of {id} present in its memfd: {v:?}"
    );
    assert_eq!(
        v.table_says_present, present,
        "page {p} of {id} table_says_present: {v:?}"
    );
}

/// Assert `id` answers the model exactly over all `pages`.
fn assert_matches_model(s: &TestServer, id: &str, model: &Model, pages: u64) {
    assert_eq!(
        s.checksum(id, 0, pages),
        model.checksum(0, pages),
        "guest checksum of {id}"
    );
    assert_eq!(
        s.digest(id, 0, pages),
        model.digest(0, pages),
        "VMM digest of {id}"
    );
}

/// The host's Shmem in KiB (/proc/meminfo).
/// Host memory holding guest RAM, in KiB: Shmem (4 KiB memfds) plus the
/// huge pages in use (hugetlb memfds, which Shmem does not count).
fn shmem_kib() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").expect("cannot read /proc/meminfo");
    let field = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|r| r.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} line in /proc/meminfo"))
    };
    let huge_in_use = field("HugePages_Total:") - field("HugePages_Free:");
    field("Shmem:") + huge_in_use * field("Hugepagesize:")
}

/// Shmem once it has stopped moving (VMMs of an earlier test may still be
/// exiting and freeing their memory): two readings 500 ms apart within
/// 1 MiB, or the last reading after 10 s.
fn settled_shmem_kib() -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = shmem_kib();
    loop {
        thread::sleep(Duration::from_millis(500));
        let now = shmem_kib();
        if now.abs_diff(last) <= 1024 || Instant::now() >= deadline {
            return now;
        }
        last = now;
    }
}

/// Whether the server process still holds `id`'s memfd (as an fd or a
/// mapping).
/// The name of `id`'s guest RAM memfd, as the API gives it.
fn memfd_of(s: &TestServer, id: &str) -> String {
    s.vm(id)
        .memfd
        .unwrap_or_else(|| panic!("{id} names no memfd"))
}

/// Whether the server has the memfd named `memfd` open or mapped.
fn server_holds_memfd(s: &TestServer, memfd: &str) -> bool {
    let name = format!("/memfd:{memfd} (deleted)");
    let pid = s.pid();
    let in_fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("cannot list the server's fds")
        .flatten()
        .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy() == name));
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .expect("cannot read the server's maps");
    in_fds || maps.lines().any(|l| l.ends_with(&name))
}

/// Pages of `[start, start+pages)` that `verify(seed)` rejects, found by
/// bisection, each with whether it still holds `old` (a lost write) or
/// neither seed (a torn page). Reads materialize pages: diagnosis only.
fn bad_pages(s: &TestServer, id: &str, start: u64, pages: u64, seed: u64, old: u64) -> Vec<String> {
    if pages == 0 || s.verify(id, start, pages, seed) == 0 {
        return Vec::new();
    }
    if pages == 1 {
        let what = if s.verify(id, start, 1, old) == 0 {
            "lost write (old seed)"
        } else {
            "torn"
        };
        return vec![format!("page {start}: {what}")];
    }
    let half = pages / 2;
    let mut out = bad_pages(s, id, start, half, seed, old);
    out.extend(bad_pages(s, id, start + half, pages - half, seed, old));
    out
}

const MIB_64: u64 = 64;

// ---------------------------------------------------------------- tests --

#[test]
fn fork_children_see_parent_memory_as_at_fork_time() {
    if !require_kvm_uffd() {
        return;
    }
    let _host = shared_host();
    let s = TestServer::start();
    let total = pages_of(MIB_64);
    let a = create(&s, MIB_64);
    s.fill(&a, 0, total, 1);
    let mut model = Model::new(total);
    model.fill(0, total, 1);
    let (sum, dig) = (s.checksum(&a, 0, total), s.digest(&a, 0, total));
    assert_eq!(sum, model.checksum(0, total), "parent checksum before fork");
    assert_eq!(dig, model.digest(0, total), "parent digest before fork");

    let kids = s.fork(&a, 2).children;
    for k in &kids {
        assert_eq!(s.checksum(k, 0, total), sum, "checksum of child {k}");
        assert_eq!(s.digest(k, 0, total), dig, "digest of child {k}");
        assert_eq!(s.verify(k, 0, total, 1), 0, "verify(seed 1) of child {k}");
    }
    assert_eq!(s.checksum(&a, 0, total), sum, "parent checksum after fork");
    s.assert_invariant("after the children read all memory");
}

/// A fork write-protects a large materialized set from several threads
/// (`uffd_abi::write_protect_runs` gives each thread 64 MiB of 4 KiB pages
/// or more):
/// every share must be protected, so parent writes anywhere in 256 MiB,
/// on either side of any cut, stay out of the child.
#[test]
fn fork_of_a_large_vm_protects_every_part_of_its_memory() {
    if !require_kvm_uffd() {
        return;
    }
    let _host = shared_host();
    let s = TestServer::start();
    let mib = 256;
    let total = pages_of(mib);
    let a = create(&s, mib);
    s.fill(&a, 0, total, 1);
    let mut child_model = Model::new(total);
    child_model.fill(0, total, 1);
    let kids = s.fork(&a, 1).children;
    let kid = &kids[0];
    // The parent rewrites 64 pages in each sixteenth, and the last ones.
    let mut parent_model = child_model.clone();
    let chunk = 64;
    let starts: Vec<u64> = (0..16)
        .map(|i| i * total / 16 + total / 32)
        .chain([total - chunk])
        .collect();
    for &start in &starts {
        s.fill(&a, start, chunk, 2);
        parent_model.fill(start, chunk, 2);
    }
    assert_eq!(
        s.verify(kid, 0, total, 1),
        0,
        "the child still holds seed 1"
    );
    assert_eq!(
        s.digest(kid, 0, total),
        child_model.digest(0, total),
        "child digest"
    );
    assert_eq!(
        s.digest(&a, 0, total),
        parent_model.digest(0, total),
        "parent digest"
    );
    s.assert_invariant("after parent writes across a large fork");
}

#[test]
fn writes_after_fork_are_isolated_between_parent_and_children() {
    if !require_kvm_uffd() {
        return;
    }
    let _host = shared_host();
    let s = TestServer::start();
    let total = pages_of(MIB_64); // 16384
    let part = total / 8; // 2048
    let a = create(&s, MIB_64);
    s.fill(&a, 0, total, 1);
    let kids = s.fork(&a, 2).children;

    // Writers: the parent (seed 2) and each child (seed 100 + its
    // identity), each on its own part; and all of them on a common part.
    let mut writers: Vec<(String, u64)> = vec![(a.clone(), 2)];
    for k in &kids {
        let me = s.identity(k);
        assert_eq!(me, vm_num(k), "identity of {k}");
        writers.push((k.clone(), 100 + me));
    }
    let own_part = |i: usize| (u64::try_from(i).expect("small") + 1) * part; // parts 1..=3
    let common = 6 * part; // part 6 is written by everybody
    for (i, (id, seed)) in writers.iter().enumerate() {
        s.fill(id, own_part(i), part, *seed);
        s.fill(id, common, part, *seed);
    }
    s.assert_invariant("after the isolated writes");

    for (i, (id, seed)) in writers.iter().enumerate() {
        // Own writes, exactly.
        assert_eq!(
            s.verify(id, own_part(i), part, *seed),
            0,
            "{id} own part, own seed"
        );
        assert_eq!(
            s.verify(id, own_part(i), part, 1),
            part,
            "{id} own part is no longer seed 1"
        );
        assert_eq!(
            s.verify(id, common, part, *seed),
            0,
            "{id} common part holds its own seed"
        );
        // Nobody else's writes.
        for (j, (other, other_seed)) in writers.iter().enumerate() {
            if i == j {
                continue;
            }
            assert_eq!(
                s.verify(id, own_part(j), part, 1),
                0,
                "{id} sees {other}'s part as seed 1"
            );
            assert_eq!(
                s.verify(id, own_part(j), part, *other_seed),
                part,
                "{id} sees none of {other}'s writes"
            );
            assert_eq!(
                s.verify(id, common, part, *other_seed),
                part,
                "{id}'s common part has none of {other}'s"
            );
        }
        // Pages nobody wrote: part 0, parts 4..=5, part 7.
        for (start, pages) in [(0, part), (4 * part, 2 * part), (7 * part, part)] {
            assert_eq!(
                s.verify(id, start, pages, 1),
                0,
                "{id} untouched pages {start}+{pages} are seed 1"
            );
        }
        let mut model = Model::new(total);
        model.fill(0, total, 1);
        model.fill(own_part(i), part, *seed);
        model.fill(common, part, *seed);
        assert_matches_model(&s, id, &model, total);
    }
    s.assert_invariant("at the end");
}

#[test]
fn fork_keeps_parent_vmm_process_and_guest_running() {
    if !require_kvm_uffd() {
        return;
    }
    let _host = shared_host();
    let s = TestServer::start();
    let total = pages_of(MIB_64);
    let a = create(&s, MIB_64);
    let pid = s.vm(&a).pid.expect("parent pid");
    s.fill(&a, 0, total, 1);

    let kids = s.fork(&a, 1).children;
    let info = s.vm(&a);
    assert_eq!(info.pid, Some(pid), "parent pid after fork: {info:?}");
    assert_eq!(
        info.state,
        RunState::Running,
        "parent state after fork: {info:?}"
    );
    assert!(
        pagefork_tests::process_exists(pid),
        "parent vmm {pid} is gone"
    );
    let child = s.vm(&kids[0]);
    assert_ne!(child.pid, Some(pid), "child runs in its own vmm: {child:?}");
    assert_eq!(child.parent.as_ref(), Some(&a), "child's parent: {child:?}");

    // The parent's guest keeps working: identity, writes and reads.
    assert_eq!(s.identity(&a), vm_num(&a));
    s.fill(&a, 100, 1000, 3);
    assert_eq!(s.verify(&a, 100, 1000, 3), 0);
    assert_eq!(s.verify(&a, 0, 100, 1), 0);
    assert_eq!(s.verify(&a, 1100, total - 1100, 1), 0);
    // A second fork of the same parent works too.
    let more = s.fork(&a, 1).children;
    assert_eq!(s.vm(&a).pid, Some(pid), "parent pid after a second fork");
    assert_eq!(
        s.verify(&more[0], 100, 1000, 3),
        0,
        "second child sees the parent's post-fork writes"
    );
    assert_eq!(s.verify(&kids[0], 100, 1000, 1), 0, "first child does not");
    s.assert_invariant("at the end");
}

/// A forks B, B forks C. B reads p (materializing it from A), then A
/// writes p: C still reads A's page as it was at B's fork. Then B writes
/// p: C is unaffected. Checked with verify, digest and page sources.
#[test]
fn grandchild_keeps_pre_write_page_when_parent_reads_then_grandparent_writes() {
    if !require_kvm_uffd() {
        return;
    }
    let _host = shared_host();
    let s = TestServer::start();
    let total = pages_of(MIB_64);
    let a = create(&s, MIB_64);
    s.fill(&a, 0, total, 1);
    let b = s.fork(&a, 1).children.remove(0);
    // s_: B materializes it before forking C (so it is Vm(B), protected).
    let (p, q, r, s_) = (1000, 2000, 3000, 4000);
    s.touch(&b, s_, 1, false);
    assert_page(&s, &b, s_, &b, true);
    let c = s.fork(&b, 1).children.remove(0);
    assert_eq!(s.vm(&c).parent, Some(b.clone()));
    assert_page(&s, &c, p, &a, false);
    assert_page(&s, &b, p, &a, false);
    assert_page(&s, &a, p, &a, true);
    assert_page(&s, &c, s_, &b, false);

    // B reads p: B's copy comes from A; C still reads from A.
    s.touch(&b, p, 1, false);
    assert_page(&s, &b, p, &b, true);
    assert_page(&s, &c, p, &a, false);
    assert_page(&s, &a, p, &a, true);
    s.assert_invariant("after B read p");

    // A writes p (seed 9): C gets A's pre-write page, B keeps its copy.
    s.fill(&a, p, 1, 9);
    assert_page(&s, &c, p, &c, true);
    assert_page(&s, &b, p, &b, true);
    assert_eq!(s.verify(&a, p, 1, 9), 0, "A sees its new data on p");
    assert_eq!(s.verify(&b, p, 1, 1), 0, "B sees p as at its fork");
    assert_eq!(s.verify(&c, p, 1, 1), 0, "C sees p as at B's fork");
    s.assert_invariant("after A wrote p");

    // B writes p (seed 11): C is unaffected.
    s.fill(&b, p, 1, 11);
    assert_eq!(s.verify(&b, p, 1, 11), 0, "B sees its write");
    assert_eq!(s.verify(&c, p, 1, 1), 0, "C unaffected by B's write");
    assert_eq!(s.verify(&a, p, 1, 9), 0, "A unaffected by B's write");
    assert_page(&s, &c, p, &c, true);

    // q: nobody reads it first; A writes it: B and C both get the old page.
    s.fill(&a, q, 1, 9);
    assert_page(&s, &b, q, &b, true);
    assert_page(&s, &c, q, &c, true);
    assert_eq!(s.verify(&b, q, 1, 1), 0);
    assert_eq!(s.verify(&c, q, 1, 1), 0);

    // r: B writes it without reading first (MISSING with write); C still
    // reads it from A.
    s.fill(&b, r, 1, 12);
    assert_page(&s, &b, r, &b, true);
    assert_page(&s, &c, r, &a, false);
    assert_eq!(s.verify(&c, r, 1, 1), 0);
    assert_eq!(s.verify(&b, r, 1, 12), 0);

    // s_: materialized in B before C's fork; B's write (WP) gives C the
    // pre-write page.
    s.fill(&b, s_, 1, 13);
    assert_page(&s, &c, s_, &c, true);
    assert_eq!(s.verify(&c, s_, 1, 1), 0);
    assert_eq!(s.verify(&b, s_, 1, 13), 0);
    s.assert_invariant("after all the writes");

    // Whole-memory check of each VM against its model.
    let mut ma = Model::new(total);
    ma.fill(0, total, 1);
    let mc = ma.clone();
    let mut mb = ma.clone();
    ma.fill(p, 1, 9);
    ma.fill(q, 1, 9);
    mb.fill(p, 1, 11);
    mb.fill(r, 1, 12);
    mb.fill(s_, 1, 13);
    for (id, m) in [(&a, &ma), (&b, &mb), (&c, &mc)] {
        assert_matches_model(&s, id, m, total);
    }
    s.assert_invariant("at the end");
}

/// The parent is deleted right after forking; its memory stays as a frozen
/// source while a child reads from it and goes when the last reference
/// does.
#[test]
fn children_read_every_page_of_a_parent_deleted_right_after_fork() {
    if !require_kvm_uffd() {
        return;
    }
    let _host = shared_host();
    let s = TestServer::start();
    let total = pages_of(MIB_64);
    let a = create(&s, MIB_64);
    let a_memfd = memfd_of(&s, &a);
    s.fill(&a, 0, total, 1);
    let dig = s.digest(&a, 0, total);
    let kids = s.fork(&a, 2).children;
    let d = s.delete_vm(&a);
    assert!(d.frozen, "parent with readers must be kept frozen: {d:?}");
    assert!(
        !s.vm_ids().contains(&a),
        "a deleted parent is not listed in /v1/vms"
    );
    let node = s.tree_node(&a).expect("frozen parent stays in /v1/tree");
    assert_eq!(
        node.state,
        RunState::Deleted,
        "frozen parent in the tree: {node:?}"
    );
    for k in &kids {
        let n = s.tree_node(k).expect("child in tree");
        assert_eq!(
            n.reads_from.clone(),
            BTreeMap::from([(a.clone(), total)]),
            "child {k} reads all from {a}: {n:?}"
        );
    }
    assert!(
        server_holds_memfd(&s, &a_memfd),
        "frozen parent's memfd must stay open"
    );

    // First child reads everything; the second still depends on the parent.
    assert_eq!(
        s.verify(&kids[0], 0, total, 1),
        0,
        "child {} verify after parent delete",
        kids[0]
    );
    assert_eq!(
        s.digest(&kids[0], 0, total),
        dig,
        "child {} digest",
        kids[0]
    );
    let n = s
        .tree_node(&a)
        .expect("parent still frozen while the second child reads from it");
    assert_eq!(n.state, RunState::Deleted);
    s.assert_invariant("with a frozen parent");

    // The second child reads everything: the last reference goes.
    assert_eq!(
        s.verify(&kids[1], 0, total, 1),
        0,
        "child {} verify after parent delete",
        kids[1]
    );
    assert_eq!(
        s.digest(&kids[1], 0, total),
        dig,
        "child {} digest",
        kids[1]
    );
    assert!(
        s.tree_node(&a).is_none(),
        "parent released once no table reads from it"
    );
    assert!(
        !server_holds_memfd(&s, &a_memfd),
        "released parent's memfd must be closed and unmapped"
    );
    for k in &kids {
        let n = s.tree_node(k).expect("child in tree");
        assert_eq!(n.own_pages, total, "child {k} owns every page: {n:?}");
        assert!(
            n.reads_from.clone().is_empty(),
            "child {k} reads from nobody: {n:?}"
        );
    }
    s.assert_invariant("at the end");
}

/// A forks B, B writes page x and forks C, then A and B are deleted (both
/// frozen). Once C has its own copy of every page it read from A, A must
/// go even though the frozen B still exists: a deleted VM's table is no
/// reader (grandchildren read directly from the holder). B goes when C
/// has read x.
#[test]
fn frozen_grandparent_is_released_once_no_live_vm_reads_from_it() {
    if !require_kvm_uffd() {
        return;
    }
    let _host = shared_host();
    let s = TestServer::start();
    let total = pages_of(MIB_64);
    let x = 0;
    let a = create(&s, MIB_64);
    let a_memfd = memfd_of(&s, &a);
    s.fill(&a, 0, total, 1);
    let b = s.fork(&a, 1).children.remove(0);
    let b_memfd = memfd_of(&s, &b);
    s.fill(&b, x, 1, 7);
    let c = s.fork(&b, 1).children.remove(0);
    // B's one-page write made its unit (a 2 MiB block on hugepages) its own.
    let unit = s.unit_pages(&b);
    assert_eq!(
        s.by_source(&c),
        BTreeMap::from([(a.clone(), total - unit), (b.clone(), unit)])
    );
    assert!(s.delete_vm(&a).frozen);
    assert!(s.delete_vm(&b).frozen);
    assert_eq!(s.tree_node(&b).expect("frozen B").state, RunState::Deleted);
    if unit > 1 && counts_4k_pages_only("C reading page 1 takes B's page x with its block") {
        return;
    }

    // C reads every page it holds from A.
    assert_eq!(s.verify(&c, 1, total - 1, 1), 0);
    assert_eq!(
        s.by_source(&c),
        BTreeMap::from([(c.clone(), total - 1), (b.clone(), 1)])
    );
    assert!(
        s.tree_node(&a).is_none(),
        "no live VM reads from {a} any more, yet it is kept: {:?}",
        s.tree_node(&a)
    );
    assert!(!server_holds_memfd(&s, &a_memfd));
    assert!(s.tree_node(&b).is_some(), "C still reads x from {b}");
    s.assert_invariant("with only B frozen");

    // C reads x from B: B goes too.
    assert_eq!(
        s.verify(&c, x, 1, 7),
        0,
        "C sees B's write made before C's fork"
    );
    assert!(
        s.tree_node(&b).is_none(),
        "{b} released with its last reader"
    );
    assert!(!server_holds_memfd(&s, &b_memfd));
    let mut model = Model::new(total);
    model.fill(0, total, 1);
    model.fill(x, 1, 7);
    assert_matches_model(&s, &c, &model, total);
    s.assert_invariant("at the end");
}

/// Memory accounting of a frozen parent: released only when its last child
/// is deleted, visible in the host's Shmem.
#[test]
fn deleted_parent_memory_is_released_when_its_last_child_is_deleted() {
    if !require_kvm_uffd() {
        return;
    }
    let _host = exclusive_host();
    let s = TestServer::start();
    let mib = 256;
    let total = pages_of(mib);
    let slack_kib = 32 * 1024;
    let baseline = settled_shmem_kib();
    let a = create(&s, mib);
    let a_memfd = memfd_of(&s, &a);
    s.fill(&a, 0, total, 1);
    let filled = shmem_kib();
    assert!(
        filled + slack_kib >= baseline + mib * 1024,
        "a filled {mib} MiB VM should add ~{mib} MiB of Shmem: {baseline} -> {filled} KiB"
    );
    let kids = s.fork(&a, 2).children;
    assert!(s.delete_vm(&a).frozen);
    // Each child reads a little (correctly) and keeps reading the rest from
    // the frozen parent.
    let k = 1024;
    for (i, kid) in kids.iter().enumerate() {
        let start = u64::try_from(i).expect("small") * k;
        assert_eq!(s.verify(kid, start, k, 1), 0);
        assert_eq!(
            s.by_source(kid),
            BTreeMap::from([(kid.clone(), k), (a.clone(), total - k)])
        );
    }
    let d = s.delete_vm(&kids[0]);
    assert!(!d.frozen, "nobody reads from {}: {d:?}", kids[0]);
    let node = s
        .tree_node(&a)
        .expect("parent still frozen for the second child");
    assert_eq!(node.state, RunState::Deleted);
    assert!(server_holds_memfd(&s, &a_memfd));
    s.assert_invariant("with one child left");

    let before = shmem_kib();
    s.delete_vm(&kids[1]);
    assert!(
        s.tree_node(&a).is_none(),
        "parent must be released with its last child"
    );
    assert!(
        !server_holds_memfd(&s, &a_memfd),
        "released parent's memfd must be closed and unmapped"
    );
    // The VMM process of the last child exits asynchronously: poll.
    let want_drop = mib * 1024 - slack_kib;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut after = shmem_kib();
    while before.saturating_sub(after) < want_drop && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
        after = shmem_kib();
    }
    assert!(
        before.saturating_sub(after) >= want_drop,
        "Shmem should drop by ~{mib} MiB when the parent is released: {before} -> {after} KiB"
    );
    // Not asserted: other processes on the host may allocate meanwhile.
    eprintln!("Shmem: baseline {baseline}, filled {filled}, before the last delete {before}, after {after} KiB");
    s.assert_invariant("at the end");
}

#[test]
fn ten_children_forked_in_one_request_all_answer() {
    if !require_kvm_uffd() {
        return;
    }
    let _host = shared_host();
    let s = TestServer::start();
    let total = pages_of(MIB_64);
    let a = create(&s, MIB_64);
    s.fill(&a, 0, total, 1);
    let sum = s.checksum(&a, 0, total);
    let mut model = Model::new(total);
    model.fill(0, total, 1);
    assert_eq!(sum, model.checksum(0, total));

    let answer = s.fork(&a, 10);
    let kids = answer.children.clone();
    eprintln!(
        "fork of 10: pause {} us, table fork {} us",
        answer.pause_us, answer.fork_us
    );
    let distinct: BTreeSet<&String> = kids.iter().collect();
    assert_eq!(distinct.len(), 10, "distinct child ids: {kids:?}");
    let mut ids = BTreeSet::new();
    for k in &kids {
        let me = s.identity(k);
        assert_eq!(me, vm_num(k), "identity of {k}");
        ids.insert(me);
        assert_eq!(s.checksum(k, 0, total), sum, "checksum of child {k}");
    }
    assert_eq!(ids.len(), 10, "identities distinct: {ids:?}");
    assert!(!ids.contains(&vm_num(&a)));
    let node = s.tree_node(&a).expect("parent in tree");
    let listed: BTreeSet<String> = node.children.iter().cloned().collect();
    assert_eq!(
        listed,
        kids.iter().cloned().collect::<BTreeSet<_>>(),
        "tree children of {a}"
    );
    s.assert_invariant("at the end");
}

/// Fork while the parent's guest is in the middle of a 256 MiB fill. The
/// child resumes mid-fill from the captured vCPU state and finishes the
/// fill itself: no page is lost or torn in either VM. Where the fork fell
/// is read back from the child's table: pages the parent had filled
/// before the fork still come from the parent, the rest the child wrote.
#[test]
fn fork_during_a_long_fill_loses_and_tears_no_page() {
    if !require_kvm_uffd() {
        return;
    }
    let _host = shared_host();
    let s = TestServer::start();
    let mib = 256;
    let total = pages_of(mib);
    let a = create(&s, mib);
    s.fill(&a, 0, total, 1);
    let mut old = 1;
    let mut delay = Duration::from_millis(120);
    for attempt in 0..6u64 {
        let seed = 5 + attempt;
        let (answer, fill_us) = thread::scope(|sc| {
            let filler = sc.spawn(|| {
                let t = Instant::now();
                s.fill(&a, 0, total, seed);
                t.elapsed().as_micros()
            });
            thread::sleep(delay);
            let answer = s.fork(&a, 2);
            (answer, filler.join().expect("fill thread panicked"))
        });
        let kids = answer.children.clone();
        // Before any read by the test: where does each child's memory come from?
        let ext = s.extents(&kids[0]);
        let k = match ext.first() {
            Some((0, n, src)) if *src == a => *n,
            _ => 0,
        };
        eprintln!(
            "attempt {attempt}: delay {delay:?}, fill {fill_us} us, pause {} us ({:?}), child {} extents {ext:?}",
            answer.pause_us, answer.phases, kids[0]
        );
        if k == 0 || k == total {
            // The fork fell before the fill started or after it ended.
            let started = s.verify(&kids[0], 0, 1, seed) == 0;
            for kid in &kids {
                s.delete_vm(kid);
            }
            delay = if started {
                delay / 2
            } else {
                delay + Duration::from_millis(100)
            };
            old = seed;
            continue;
        }
        // Mid-fill: exactly [0, k) from the parent, the rest written by the
        // child itself after the fork.
        for kid in &kids {
            assert_eq!(
                s.extents(kid),
                vec![(0, k, a.clone()), (k, total - k, kid.clone())],
                "child {kid} after a fork at page {k} (previous seed {old})"
            );
        }
        s.assert_invariant("right after the mid-fill fork");
        let mut model = Model::new(total);
        model.fill(0, total, seed);
        assert_eq!(s.verify(&a, 0, total, seed), 0, "parent finished its fill");
        assert_eq!(
            s.digest(&a, 0, total),
            model.digest(0, total),
            "parent digest (no torn page)"
        );
        // The parent writes every page again before the children read
        // any: the pages it wrote while its protection was armed ahead of
        // the pause were protected again in it, so the children keep them.
        s.fill(&a, 0, total, seed + 100);
        for kid in &kids {
            let bad = s.verify(kid, 0, total, seed);
            if bad != 0 {
                let pages = bad_pages(&s, kid, 0, total, seed, old);
                panic!(
                    "child {kid} (fork at page {k}): {bad} pages are not seed {seed}: {pages:?}"
                );
            }
            assert_eq!(
                s.digest(kid, 0, total),
                model.digest(0, total),
                "child {kid} digest (no torn page)"
            );
            assert_eq!(s.by_source(kid), BTreeMap::from([(kid.clone(), total)]));
        }
        assert_eq!(s.by_source(&a), BTreeMap::from([(a.clone(), total)]));
        assert_eq!(s.verify(&a, 0, total, seed + 100), 0, "parent's rewrite");
        s.assert_invariant("at the end");
        return;
    }
    panic!("no fork landed in the middle of the fill in 6 attempts");
}

/// `sources`, `pages`, `tree` and `GET /v1/vms/{id}` count exactly what
/// the test did.
#[test]
fn sources_pages_and_tree_count_exactly_what_each_vm_touched() {
    if !require_kvm_uffd() || counts_4k_pages_only("exact per-page counts of reads and writes") {
        return;
    }
    let _host = shared_host();
    let s = TestServer::start();
    let total = pages_of(MIB_64); // 16384
    let half = total / 2;
    let a = create(&s, MIB_64);
    s.fill(&a, 0, half, 1);
    assert_eq!(
        s.by_source(&a),
        BTreeMap::from([(a.clone(), half), ("uninitialized".into(), half)])
    );

    let c = s.fork(&a, 1).children.remove(0);
    assert_eq!(
        s.by_source(&c),
        BTreeMap::from([(a.clone(), half), ("uninitialized".into(), half)])
    );
    let node = s.tree_node(&c).expect("child in tree");
    assert_eq!(node.parent, Some(a.clone()));
    assert_eq!(node.own_pages, 0);
    assert_eq!(node.reads_from.clone(), BTreeMap::from([(a.clone(), half)]));
    assert_eq!(s.tree_node(&a).expect("parent").children, vec![c.clone()]);

    // The child reads k pages the parent holds and z never-written pages.
    let (k_start, k) = (100, 1000);
    let (z_start, z) = (10_000, 500);
    s.touch(&c, k_start, k, false);
    s.touch(&c, z_start, z, false);
    assert_eq!(
        s.by_source(&c),
        BTreeMap::from([
            (c.clone(), k + z),
            (a.clone(), half - k),
            ("uninitialized".into(), half - z)
        ])
    );
    assert_eq!(
        s.extents(&c),
        vec![
            (0, k_start, a.clone()),
            (k_start, k, c.clone()),
            (k_start + k, half - k_start - k, a.clone()),
            (half, z_start - half, "uninitialized".into()),
            (z_start, z, c.clone()),
            (z_start + z, total - z_start - z, "uninitialized".into()),
        ]
    );
    let info = s.vm(&c);
    assert_eq!(
        info.pages,
        BTreeMap::from([
            ("vm".to_owned(), half - k + k + z),
            ("uninitialized".to_owned(), half - z)
        ]),
        "{info:?}"
    );
    assert_eq!(info.resident_pages, k + z, "{info:?}");
    assert_page(&s, &c, k_start, &c, true);
    assert_page(&s, &c, k_start + k, &a, false);
    assert_page(&s, &c, z_start, &c, true);
    assert_page(&s, &c, total - 1, "uninitialized", false);
    let node = s.tree_node(&c).expect("child in tree");
    assert_eq!(node.own_pages, k + z);
    assert_eq!(
        node.reads_from.clone(),
        BTreeMap::from([(a.clone(), half - k)])
    );
    // The parent is unaffected by its child's reads.
    assert_eq!(
        s.by_source(&a),
        BTreeMap::from([(a.clone(), half), ("uninitialized".into(), half)])
    );
    s.assert_invariant("after the child's reads");

    // The parent writes w pages its child still reads from it (WP faults:
    // each is copied to the child first) and u never-written pages (the
    // child reads those as zero still, no copy).
    let wp_before = s.vm(&a).faults.write_protect;
    let w = 50;
    let (u_start, u) = (12_000, 100);
    s.fill(&a, 0, w, 3);
    s.fill(&a, u_start, u, 3);
    assert_eq!(
        s.vm(&a).faults.write_protect - wp_before,
        w,
        "one WP fault per protected page the parent wrote"
    );
    assert_eq!(
        s.by_source(&c),
        BTreeMap::from([
            (c.clone(), k + z + w),
            (a.clone(), half - k - w),
            ("uninitialized".into(), half - z)
        ])
    );
    assert_eq!(
        s.by_source(&a),
        BTreeMap::from([(a.clone(), half + u), ("uninitialized".into(), half - u)])
    );
    assert_page(&s, &c, 0, &c, true);
    assert_page(&s, &c, u_start, "uninitialized", false);
    assert_eq!(
        s.tree_node(&c).expect("child").reads_from,
        BTreeMap::from([(a.clone(), half - k - w)])
    );
    assert_eq!(s.verify(&c, 0, w, 1), 0, "child kept the pre-write pages");
    assert_eq!(
        s.checksum(&c, u_start, u),
        0,
        "child still reads the parent's new pages as zero"
    );
    s.assert_invariant("at the end");
}
