//! Fork of a VM on a shared base: the layer.
//!
//! A VM on a shared base (restored from a snapshot, or the child of a
//! paused template) maps the base MAP_PRIVATE, so the pages its guest
//! writes are private pages of its VMM. A fork of it copies those pages
//! into a memfd the server owns (a layer), in the background after the
//! fork answers, while the children run (a page one reads first is copied
//! first), so no child depends on the parent's process. A VM on its own memfd needs no layer: its children read its
//! memfd. Side by side in one run, for parents of 256 MiB and 1 GiB
//! (quick: 64 MiB) restored from a full snapshot that wrote a quarter of
//! their memory, each forked into one child:
//!
//! 1. The parent's pause (`pause_us`), against the same fork of a VM on
//!    its own memfd (created on zeroes) that wrote the same quarter.
//! 2. Fork request → the child answers `exec identity`, against the same
//!    baseline; the layer's pages (`phases.layer_pages`), when it is
//!    whole (the server's memfds grown by all of it, from the fork
//!    request), and that fill's throughput against an in-process copy of
//!    as many bytes from anonymous memory into a fresh memfd (its floor).
//! 3. Memory added per fork right after the fork returns (host `Shmem`,
//!    the server's RSS), against the written quarter: a fork of a running
//!    parent on a base costs a copy of what the parent wrote.
//! 4. After the parent is deleted, its child reads all its memory
//!    (`touch`): the memory its VMM gains (exact), against what it read.
//!    The base's pages are mapped shared; the layer's pages are copied
//!    into the child (and the layer goes once no VM reads it).
//! 5. A paused template on the base (a restore that wrote a quarter, then
//!    paused; the first size) forked 10 times, one child each: the layer
//!    pages its first fork copies, and its later forks (none: the template
//!    keeps its layer while it stays paused).
//! 6. A running restore that wrote a quarter (the first size) forked 10
//!    times with nothing written in between, its children alive: the
//!    memory the first, second and tenth fork add (the later ones share
//!    the first one's layer).
//!
//! Before every fork of 1–3 the parent rewrites its quarter (untimed), so
//! each fork captures, and on a base copies, a quarter written since the
//! last one. The two parents alternate, so load on the machine hits both
//! alike. Every child checks what it read (`verify`).
//!
//! The server's state directory is on the XFS (reflink=1) given as the
//! first argument or `$PAGEFORK_XFS_DIR` (VM snapshots need it).
//!
//! Usage: `lineage [XFS_DIR] [--quick]`. Prints JSON rows.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pagefork_benches::mapping::Mapping;
use pagefork_benches::sys::{held, meminfo_kib, proc_status_kib};
use pagefork_benches::{Plan, Row, Stats};
use pagefork_tests::{child_pids, new_vm, pages_of, TestServer};
use proto::api::SnapshotMode;
use shared::PAGE_SIZE;

const BENCH: &str = "lineage";
const T_FORK: &str = "Fork of a VM on a shared base: the layer";
const T_MEM: &str = "Fork of a VM on a shared base: memory";
const T_TEMPLATE: &str = "Fork of a paused template on a shared base: the kept layer";
/// Forks of each paused template.
const TEMPLATE_FORKS: usize = 10;
/// The pattern the snapshot's VM wrote over the second quarter (the
/// base's data).
const GOLD_SEED: u64 = 11;

/// Pages read back wrong by a child (a bench over wrong memory is no
/// bench).
static WRONG: AtomicU64 = AtomicU64::new(0);

/// What holds the parent's guest RAM.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// A restore of the snapshot: MAP_PRIVATE over the snapshot's base.
    Based,
    /// A VM created on zeroes: a memfd of its own.
    Own,
}

/// One size of the bench.
struct Size {
    mib: u64,
    pages: u64,
    /// Pages the parent writes (a quarter).
    quarter: u64,
    /// The snapshot the parents on a base are restored from.
    snapshot: String,
}

impl Size {
    fn label(&self) -> String {
        size_label(self.mib)
    }

    fn written(&self) -> String {
        size_label(self.mib / 4)
    }

    fn quarter_kib(&self) -> f64 {
        (self.quarter * PAGE_SIZE / 1024) as f64
    }
}

fn size_label(mib: u64) -> String {
    if mib >= 1024 {
        format!("{} GiB", mib / 1024)
    } else {
        format!("{mib} MiB")
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn median(v: &[f64]) -> f64 {
    Stats::of(v).map_or(f64::NAN, |s| s.median)
}

/// `a / b` of two medians, in whole units.
fn pair(a: &[f64], b: &[f64]) -> String {
    format!("{:.0} / {:.0}", median(a), median(b))
}

fn kib_delta(after: Option<u64>, before: Option<u64>) -> f64 {
    match (after, before) {
        (Some(a), Some(b)) => a as f64 - b as f64,
        _ => f64::NAN,
    }
}

/// MiB/s of `pages` copied in `us` microseconds.
fn mib_per_s(pages: f64, us: f64) -> f64 {
    pages * PAGE_SIZE as f64 / f64::from(1u32 << 20) / (us / 1e6)
}

fn check(wrong: u64) {
    WRONG.fetch_add(wrong, Ordering::Relaxed);
}

/// A full snapshot of a VM of `mib` that wrote its second quarter.
fn make_snapshot(s: &TestServer, mib: u64) -> Size {
    let pages = pages_of(mib);
    let quarter = pages / 4;
    let vm = s.create_vm(&new_vm(mib));
    s.fill(&vm, quarter, quarter, GOLD_SEED);
    let snapshot = format!("lineage-{mib}");
    s.snapshot(&vm, &snapshot, SnapshotMode::Full);
    s.delete_vm(&vm);
    Size {
        mib,
        pages,
        quarter,
        snapshot,
    }
}

/// A running parent of `kind`; panics unless it is on a base exactly
/// when it should be.
fn parent(s: &TestServer, sz: &Size, kind: Kind) -> String {
    let id = match kind {
        Kind::Based => s.restore(&sz.snapshot),
        Kind::Own => s.create_vm(&new_vm(sz.mib)),
    };
    let memory = s.vm(&id).memory;
    assert_eq!(
        memory.base.is_some(),
        kind == Kind::Based,
        "{kind:?} parent {id}: whether it maps a shared base ({memory:?}); \
         a restore maps one only where the server runs with shared bases"
    );
    id
}

/// Samples of forks of one parent.
#[derive(Default)]
struct Forks {
    pause_us: Vec<f64>,
    armed_ahead_us: Vec<f64>,
    /// Phases of the pause: stop and capture, the re-protect, the table
    /// fork, the resume.
    capture_us: Vec<f64>,
    protect_us: Vec<f64>,
    table_us: Vec<f64>,
    resume_us: Vec<f64>,
    /// After the capture: the late re-protect (of pages a late fault
    /// lifted), and the layer's set-up.
    late_protect_us: Vec<f64>,
    layer_begin_us: Vec<f64>,
    /// The pause less its timed phases.
    rest_us: Vec<f64>,
    e2e_ms: Vec<f64>,
    layer_pages: Vec<f64>,
    layer_us: Vec<f64>,
    /// Host Shmem and the server's VmRSS added by the fork, read right
    /// after it returns, KiB.
    shmem_kib: Vec<f64>,
    rss_kib: Vec<f64>,
    /// The server's memfds, grown from before the fork to once the child
    /// answered and the layer was whole, KiB (exact).
    memfd_kib: Vec<f64>,
}

/// The parent rewrites its quarter (untimed), forks into one child, and
/// the child answers `identity`, then reads the quarter back.
fn fork_once(s: &TestServer, sz: &Size, parent: &str, seed: u64, f: &mut Forks) {
    s.fill(parent, 0, sz.quarter, seed);
    let spid = s.pid();
    let memfd0 = held(&[spid]).memfd_kib;
    let (shmem0, rss0) = (meminfo_kib("Shmem"), proc_status_kib(spid, "VmRSS"));
    let t = Instant::now();
    let v = s.fork(parent, 1);
    let (shmem1, rss1) = (meminfo_kib("Shmem"), proc_status_kib(spid, "VmRSS"));
    let child = &v.children[0];
    s.identity(child);
    f.e2e_ms.push(ms(t));
    // The layer fills in the background, after the answer: its end is
    // when the server's memfds have grown by all of it (every page is
    // written, zero or not), timed from the fork request.
    let want_kib = v.phases.layer_pages * PAGE_SIZE / 1024;
    let filled = if want_kib > 0 {
        let deadline = Instant::now() + Duration::from_secs(60);
        while held(&[spid]).memfd_kib.saturating_sub(memfd0) < want_kib {
            assert!(
                Instant::now() < deadline,
                "the layer did not fill within 60 s"
            );
            std::thread::sleep(Duration::from_micros(500));
        }
        t.elapsed().as_secs_f64() * 1e6
    } else {
        0.0
    };
    let memfd1 = held(&[spid]).memfd_kib;
    f.pause_us.push(v.pause_us as f64);
    f.armed_ahead_us.push(v.phases.armed_ahead_us as f64);
    f.capture_us.push(v.phases.pause_and_capture_us as f64);
    f.protect_us.push(v.phases.write_protect_us as f64);
    f.table_us.push(v.phases.table_fork_us as f64);
    f.resume_us.push(v.phases.resume_us as f64);
    f.late_protect_us.push(v.phases.late_protect_us as f64);
    f.layer_begin_us.push(v.phases.layer_begin_us as f64);
    let timed = v.phases.pause_and_capture_us
        + v.phases.late_protect_us
        + v.phases.table_fork_us
        + v.phases.volumes_us
        + v.phases.layer_begin_us
        + v.phases.resume_us;
    f.rest_us.push(v.pause_us as f64 - timed as f64);
    f.layer_pages.push(v.phases.layer_pages as f64);
    f.layer_us.push(filled);
    f.shmem_kib.push(kib_delta(shmem1, shmem0));
    f.rss_kib.push(kib_delta(rss1, rss0));
    f.memfd_kib.push(memfd1 as f64 - memfd0 as f64);
    check(s.verify(child, 0, sz.quarter, seed));
    s.delete_vm(child);
}

/// Throughput of copying `bytes` in-process from populated anonymous
/// memory into a fresh memfd, MiB/s: the floor of a layer's copy.
fn copy_floor(bytes: usize, reps: usize) -> Vec<f64> {
    let src = Mapping::anonymous(bytes).unwrap_or_else(|e| panic!("anonymous source: {e}"));
    src.populate(bytes);
    (0..reps)
        .map(|_| {
            let dst =
                Mapping::shared_memfd(bytes).unwrap_or_else(|e| panic!("memfd destination: {e}"));
            let t = Instant::now();
            // SAFETY: both mappings are at least `bytes` long, distinct,
            // read-write and alive for the copy.
            unsafe { std::ptr::copy_nonoverlapping(src.ptr(), dst.ptr(), bytes) };
            let us = t.elapsed().as_secs_f64() * 1e6;
            std::hint::black_box(&dst);
            mib_per_s((bytes as u64 / PAGE_SIZE) as f64, us)
        })
        .collect()
}

/// Memory of the server and its VMMs (exact, KiB) and the host-wide
/// Shmem + AnonPages (KiB), once the former stopped moving (a VMM that
/// just exited), within a few seconds.
fn settled(s: &TestServer) -> (f64, f64) {
    let own = || {
        let mut pids = vec![s.pid()];
        pids.extend(child_pids(s.pid()));
        held(&pids).total_kib()
    };
    let host = || {
        let f = |k: &str| meminfo_kib(k).unwrap_or(0);
        (f("Shmem") + f("AnonPages")) as f64
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut last = own();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = own();
        if (now - last).abs() < 64.0 || Instant::now() > deadline {
            return (now, host());
        }
        last = now;
    }
}

/// Samples of a child reading all its memory after its parent went.
#[derive(Default)]
struct Orphans {
    /// Memory the child's VMM gained by its reads (its memfds and
    /// RssAnon), KiB: the pages copied into it.
    child_kib: Vec<f64>,
    /// Net change of the memory of the server and its VMMs, KiB (exact).
    net_kib: Vec<f64>,
    /// The same, host-wide Shmem + AnonPages, KiB.
    host_kib: Vec<f64>,
    /// The child's `memory.own_bytes` after its reads, KiB.
    own_kib: Vec<f64>,
}

/// A fresh parent of `kind` writes its quarter and forks; the parent is
/// deleted; then the child reads all its memory.
fn orphan_read(s: &TestServer, sz: &Size, kind: Kind, seed: u64, o: &mut Orphans) {
    let p = parent(s, sz, kind);
    s.fill(&p, 0, sz.quarter, seed);
    let child = s.fork_one(&p);
    s.delete_vm(&p);
    let cpid = s.vmm_pid(&child);
    let before = settled(s);
    let child0 = held(&[cpid]).total_kib();
    s.touch(&child, 0, sz.pages, false);
    let after = settled(s);
    o.child_kib.push(held(&[cpid]).total_kib() - child0);
    o.net_kib.push(after.0 - before.0);
    o.host_kib.push(after.1 - before.1);
    o.own_kib
        .push(s.vm(&child).memory.own_bytes as f64 / 1024.0);
    check(s.verify(&child, 0, sz.quarter, seed));
    if kind == Kind::Based {
        check(s.verify(&child, sz.quarter, sz.quarter, GOLD_SEED));
    }
    s.delete_vm(&child);
}

fn bench_size(s: &TestServer, plan: &Plan, mib: u64, seed: &mut u64) -> Size {
    let sz = make_snapshot(s, mib);
    let (label, written) = (sz.label(), sz.written());
    eprintln!("{BENCH}: {label} parents, {written} written");
    let based = parent(s, &sz, Kind::Based);
    // Its whole memory read once: the base holds every page, so the
    // orphans' reads below copy nothing into it.
    s.touch(&based, 0, sz.pages, false);
    let own = parent(s, &sz, Kind::Own);
    let t = Instant::now();
    let (mut on_base, mut on_own) = (Forks::default(), Forks::default());
    for _ in 0..plan.reps {
        *seed += 1;
        fork_once(s, &sz, &based, *seed, &mut on_base);
        fork_once(s, &sz, &own, *seed, &mut on_own);
    }
    eprintln!(
        "  {} forks of each: {:.1} s; layer {:.0} pages in {:.1} ms",
        plan.reps,
        t.elapsed().as_secs_f64(),
        median(&on_base.layer_pages),
        median(&on_base.layer_us) / 1e3
    );
    let t = Instant::now();
    let (mut orphan_base, mut orphan_own) = (Orphans::default(), Orphans::default());
    for _ in 0..plan.reps {
        *seed += 1;
        orphan_read(s, &sz, Kind::Based, *seed, &mut orphan_base);
        orphan_read(s, &sz, Kind::Own, *seed, &mut orphan_own);
    }
    eprintln!(
        "  {} orphans of each read all: {:.1} s",
        plan.reps,
        t.elapsed().as_secs_f64()
    );
    s.delete_vm(&based);
    s.delete_vm(&own);
    let bytes = usize::try_from(sz.quarter * PAGE_SIZE).expect("a quarter fits in usize");
    let floor = copy_floor(bytes, plan.reps);
    fork_rows(&sz, &on_base, &on_own, &floor);
    memory_rows(&sz, &on_base, &on_own);
    orphan_rows(&sz, &orphan_base, &orphan_own);
    sz
}

fn fork_rows(sz: &Size, on_base: &Forks, on_own: &Forks, floor: &[f64]) {
    let (mib, label, written) = (sz.mib, sz.label(), sz.written());
    let baseline = format!(
        "the same fork of a {label} VM on its own memfd (created on zeroes) with {written} written"
    );
    Row::new(
        BENCH,
        &format!("lineage.pause.{mib}"),
        T_FORK,
        &format!(
            "{label} VM restored from a snapshot (on a base), {written} written: parent pause (pause_us), 1 child"
        ),
        "µs",
        &on_base.pause_us,
        &baseline,
        &on_own.pause_us,
    )
    .goal("≤ 1.1: the layer is filled after the resume, not in the pause")
    .note(format!(
        "medians on a base / on its own memfd: the pause's stop and capture {}, re-protect {}, late \
         re-protect (pages a late fault lifted) {}, table fork {}, the \
         layer's set-up (an empty memfd, the pages frozen over it) {}, resume {}, the rest (not timed by \
         phase) {}; the write-protect armed before it, the parent running, {} µs",
        pair(&on_base.capture_us, &on_own.capture_us),
        pair(&on_base.protect_us, &on_own.protect_us),
        pair(&on_base.late_protect_us, &on_own.late_protect_us),
        pair(&on_base.table_us, &on_own.table_us),
        pair(&on_base.layer_begin_us, &on_own.layer_begin_us),
        pair(&on_base.resume_us, &on_own.resume_us),
        pair(&on_base.rest_us, &on_own.rest_us),
        pair(&on_base.armed_ahead_us, &on_own.armed_ahead_us),
    ))
    .emit();
    let layer_ms = median(&on_base.layer_us) / 1e3;
    let e2e_base = median(&on_base.e2e_ms);
    Row::new(
        BENCH,
        &format!("lineage.e2e.{mib}"),
        T_FORK,
        &format!(
            "{label} VM on a base, {written} written: fork request → the child answers exec identity"
        ),
        "ms",
        &on_base.e2e_ms,
        &baseline,
        &on_own.e2e_ms,
    )
    .goal("≤ 1.2: the children start at once, the layer fills after the answer")
    .note(format!(
        "the layer (layer_pages median {:.0}; pages written: {}) is whole {layer_ms:.1} ms (median) after \
         the fork request, {:.1} ms after the child answered; a page the child reads before is copied \
         into the layer first",
        median(&on_base.layer_pages),
        sz.quarter,
        layer_ms - e2e_base
    ))
    .emit();
    let copy: Vec<f64> = on_base
        .layer_pages
        .iter()
        .zip(&on_base.layer_us)
        .map(|(&p, &us)| mib_per_s(p, us))
        .collect();
    Row::new(
        BENCH,
        &format!("lineage.copy.{mib}"),
        T_FORK,
        &format!("{label} VM on a base, {written} written: the layer's fill, in the background (layer_pages × 4 KiB / time from the fork request until the layer is whole)"),
        "MiB/s",
        &copy,
        &format!("in-process copy of {written} from anonymous memory into a fresh memfd (its floor)"),
        floor,
    )
    .goal("report (1 = the floor)")
    .note(
        "the server reads the parent's VMM with process_vm_readv into a buffer and writes the layer with \
         pwrite, 256 KiB a step, serving its other work every 200 µs, once the children run",
    )
    .emit();
}

fn memory_rows(sz: &Size, on_base: &Forks, on_own: &Forks) {
    let (mib, label, written) = (sz.mib, sz.label(), sz.written());
    let quarter = [sz.quarter_kib()];
    let exact = format!(
        "exact: the server's memfds grew by {:.0} KiB on a base, {:.0} KiB on its own memfd, from before the \
         fork to once the child answered",
        median(&on_base.memfd_kib),
        median(&on_own.memfd_kib)
    );
    Row::new(
        BENCH,
        &format!("lineage.shmem.{mib}"),
        T_MEM,
        &format!(
            "{label} VM on a base, {written} written: host Shmem added per fork (1 child), right after it returns"
        ),
        "KiB",
        &on_base.shmem_kib,
        &format!("the {written} written"),
        &quarter,
    )
    .goal("≈ 1: a copy of the written bytes per fork of a running parent")
    .note(format!(
        "/proc/meminfo, host-wide (other processes add noise); the same fork of a VM on its own memfd: median \
         {:.0} KiB; {exact}",
        median(&on_own.shmem_kib)
    ))
    .emit();
    Row::new(
        BENCH,
        &format!("lineage.rss.{mib}"),
        T_MEM,
        &format!(
            "{label} VM on a base, {written} written: uffd-server VmRSS added per fork (1 child)"
        ),
        "KiB",
        &on_base.rss_kib,
        &format!("the {written} written"),
        &quarter,
    )
    .goal("report: the server writes the layer (pwrite) without mapping it")
    .note(format!(
        "right after the fork returns; the same fork of a VM on its own memfd: median {:.0} KiB",
        median(&on_own.rss_kib)
    ))
    .emit();
}

fn orphan_rows(sz: &Size, base: &Orphans, own: &Orphans) {
    let (mib, label, written) = (sz.mib, sz.label(), sz.written());
    let read_kib = (sz.pages * PAGE_SIZE / 1024) as f64;
    let own_child = median(&own.child_kib);
    Row::new(
        BENCH,
        &format!("lineage.orphan_read.{mib}"),
        T_MEM,
        &format!(
            "child of a {label} VM on a base that wrote {written}, its parent deleted: memory its VMM gains \
             reading all {label} (touch)"
        ),
        "KiB",
        &base.child_kib,
        &format!("what it read ({label})"),
        &[read_kib],
    )
    .goal(format!(
        "≈ {:.2}: the layer's pages ({written}) are copied into the child, the base's are shared",
        sz.quarter as f64 / sz.pages as f64
    ))
    .note(format!(
        "the child VMM's memfds and RssAnon (exact), once settled; its own_bytes after: {:.0} KiB. The base \
         was read whole beforehand, so these reads fill none of it. Net change of the memory of the server and \
         its VMMs (exact): {:.0} KiB, as the layer goes once its only reader holds all its pages (host-wide \
         Shmem + AnonPages: {:.0} KiB). The same child of a VM on its own memfd gains {own_child:.0} KiB \
         ({:.2} of what it read; net {:.0} KiB): it copies every page it reads",
        median(&base.own_kib),
        median(&base.net_kib),
        median(&base.host_kib),
        own_child / read_kib,
        median(&own.net_kib)
    ))
    .emit();
}

/// Forks of paused templates on a base: samples of the first fork of
/// each and of the later ones.
#[derive(Default)]
struct TemplateForks {
    first_pages: Vec<f64>,
    later_pages: Vec<f64>,
    first_layer_us: Vec<f64>,
    later_layer_us: Vec<f64>,
    first_e2e_ms: Vec<f64>,
    later_e2e_ms: Vec<f64>,
}

/// A restore writes its quarter, pauses and is forked
/// [`TEMPLATE_FORKS`] times, one child each (each answers, reads the
/// quarter back and is deleted).
fn template_forks(s: &TestServer, sz: &Size, seed: u64, f: &mut TemplateForks) {
    let tpl = parent(s, sz, Kind::Based);
    s.fill(&tpl, 0, sz.quarter, seed);
    s.pause(&tpl);
    for i in 0..TEMPLATE_FORKS {
        let t = Instant::now();
        let v = s.fork(&tpl, 1);
        let child = &v.children[0];
        s.identity(child);
        let e2e = ms(t);
        let (pages, us) = (v.phases.layer_pages as f64, v.phases.layer_us as f64);
        let (p, u, e) = if i == 0 {
            (
                &mut f.first_pages,
                &mut f.first_layer_us,
                &mut f.first_e2e_ms,
            )
        } else {
            (
                &mut f.later_pages,
                &mut f.later_layer_us,
                &mut f.later_e2e_ms,
            )
        };
        p.push(pages);
        u.push(us);
        e.push(e2e);
        check(s.verify(child, 0, sz.quarter, seed));
        s.delete_vm(child);
    }
    s.delete_vm(&tpl);
}

fn template_rows(s: &TestServer, plan: &Plan, sz: &Size, seed: &mut u64) {
    let (label, written) = (sz.label(), sz.written());
    let t = Instant::now();
    let mut f = TemplateForks::default();
    for _ in 0..plan.reps {
        *seed += 1;
        template_forks(s, sz, *seed, &mut f);
    }
    eprintln!(
        "{BENCH}: {} templates of {label}, {TEMPLATE_FORKS} forks each: {:.1} s",
        plan.reps,
        t.elapsed().as_secs_f64()
    );
    Row::new(
        BENCH,
        "lineage.template_first",
        T_TEMPLATE,
        &format!(
            "paused {label} template on a base (a restore that wrote {written}): layer pages its first fork copies"
        ),
        "pages",
        &f.first_pages,
        &format!("the pages written ({written})"),
        &[sz.quarter as f64],
    )
    .goal("≈ 1: what it wrote, once")
    .note(format!(
        "layer_us median {:.1} ms; fork request → the child answers: median {:.1} ms",
        median(&f.first_layer_us) / 1e3,
        median(&f.first_e2e_ms)
    ))
    .emit();
    let later_max = f.later_pages.iter().copied().fold(0.0, f64::max);
    Row::new(
        BENCH,
        "lineage.template_later",
        T_TEMPLATE,
        &format!(
            "the same template's forks 2–{TEMPLATE_FORKS}: layer pages each copies (the template stays paused)"
        ),
        "pages",
        &f.later_pages,
        "its first fork",
        &f.first_pages,
    )
    .goal("0: the layer is kept while the template stays paused")
    .note(format!(
        "most copied by a later fork: {later_max:.0} pages; layer_us median {:.0} µs; fork request → the child \
         answers: median {:.1} ms (first fork: {:.1} ms)",
        median(&f.later_layer_us),
        median(&f.later_e2e_ms),
        median(&f.first_e2e_ms)
    ))
    .emit();
}

/// Memory each of [`TEMPLATE_FORKS`] forks of one running parent on a
/// base adds, nothing written between them, every child kept alive.
#[derive(Default)]
struct AgainForks {
    /// Per fork, in order: the server's memfds grown by it (exact, KiB).
    memfd_kib: Vec<Vec<f64>>,
    /// Per fork: the layer pages it copied.
    pages: Vec<Vec<f64>>,
}

/// A restore writes its quarter and is forked [`TEMPLATE_FORKS`] times
/// while it runs, one child each, nothing written in between; every child
/// reads the quarter back, and all stay until the last fork.
fn forks_again(s: &TestServer, sz: &Size, seed: u64, f: &mut AgainForks) {
    let p = parent(s, sz, Kind::Based);
    s.fill(&p, 0, sz.quarter, seed);
    let spid = s.pid();
    f.memfd_kib.resize(TEMPLATE_FORKS, Vec::new());
    f.pages.resize(TEMPLATE_FORKS, Vec::new());
    let mut children = Vec::new();
    for i in 0..TEMPLATE_FORKS {
        let memfd0 = held(&[spid]).memfd_kib;
        let v = s.fork(&p, 1);
        let child = v.children[0].clone();
        s.identity(&child);
        f.memfd_kib[i].push(held(&[spid]).memfd_kib as f64 - memfd0 as f64);
        f.pages[i].push(v.phases.layer_pages as f64);
        check(s.verify(&child, 0, sz.quarter, seed));
        children.push(child);
    }
    for c in &children {
        s.delete_vm(c);
    }
    s.delete_vm(&p);
}

fn again_rows(s: &TestServer, plan: &Plan, sz: &Size, seed: &mut u64) {
    let (label, written) = (sz.label(), sz.written());
    let t = Instant::now();
    let mut f = AgainForks::default();
    for _ in 0..plan.reps {
        *seed += 1;
        forks_again(s, sz, *seed, &mut f);
    }
    eprintln!(
        "{BENCH}: {} running parents of {label}, {TEMPLATE_FORKS} forks each: {:.1} s",
        plan.reps,
        t.elapsed().as_secs_f64()
    );
    let quarter = [sz.quarter_kib()];
    for (i, name) in [(0, "first"), (1, "second"), (TEMPLATE_FORKS - 1, "tenth")] {
        let goal = if i == 0 {
            "≤ 1.0: one copy of what it wrote"
        } else {
            "≤ 0.05: it shares what the earlier forks keep"
        };
        Row::new(
            BENCH,
            &format!("lineage.again.{}.{}", i + 1, sz.mib),
            T_MEM,
            &format!(
                "running {label} VM on a base, {written} written, forked {TEMPLATE_FORKS} times with nothing                  written between (its children alive): the server's memfds the {name} fork adds"
            ),
            "KiB",
            &f.memfd_kib[i],
            &format!("the {written} written"),
            &quarter,
        )
        .goal(goal)
        .note(format!(
            "exact (the server's memfds, before the fork and once its child answered); layer pages it copied:              median {:.0}",
            median(&f.pages[i])
        ))
        .emit();
    }
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    if let Err(code) = pagefork_benches::sys::start_on_xfs(BENCH) {
        return code;
    }
    let server = TestServer::start();
    let mut seed = 100;
    let mut sizes: Vec<Size> = plan
        .lineage_mib
        .iter()
        .map(|&mib| bench_size(&server, &plan, mib, &mut seed))
        .collect();
    if sizes.is_empty() {
        eprintln!("{BENCH}: no sizes to measure");
        return ExitCode::FAILURE;
    }
    let first = sizes.remove(0);
    template_rows(&server, &plan, &first, &mut seed);
    again_rows(&server, &plan, &first, &mut seed);
    server.assert_healthy();
    let wrong = WRONG.load(Ordering::Relaxed);
    if wrong > 0 {
        eprintln!("{BENCH}: {wrong} pages read back wrong");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
