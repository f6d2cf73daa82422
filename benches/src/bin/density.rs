//! Density with shared bases: host memory per VM and start latency of VMs
//! that map their clean pages from one shared base, side by side in one
//! run with the same on a server started `--shared-bases=false` (the
//! baseline: every VM copies every page it reads).
//!
//! Host memory is what holds guest RAM and VMMs: the pages of the memfds
//! (guest RAM, bases) and the anonymous pages (what VMs wrote over a base,
//! the VMMs' heaps) of the bench's two servers and their VMMs, read from
//! /proc (each memfd counted once). These are the host's `Shmem` +
//! `AnonPages` restricted to the processes under test: builds on the
//! machine move the host-wide counters by hundreds of MiB, which no count
//! of VMs divides away. The notes give the host-wide figure
//! (`/proc/meminfo`) too. Readings are taken once the figure stopped
//! moving.
//!
//! 1. Children of a paused template (64 MiB guest RAM that wrote
//!    W = 16 MiB; quick: 32 MiB and 8 MiB), forked N at a time (N = 1,
//!    100, 1000; quick: 1, 20, 100), each reading all of W (`verify`):
//!    per child, what the reads added ((after reads − after start) / N)
//!    and the fixed cost of its VMM ((after start − before) / N). The
//!    same with each child writing its own half of W and reading the
//!    other half. A count the server refuses (VM limit, fds) or that would
//!    not fit in memory without bases is measured at the largest count
//!    that works, and the row says so.
//! 2. M VMs (16; quick: 4) restored from one full snapshot (on XFS), each
//!    reading its 16 MiB working set: time until all have read it, and
//!    host memory per VM (a base is filled by the VMs' reads, so its one
//!    copy is in the figure).
//! 3. Fork of the template → the child answers, and create from the
//!    snapshot → it answers: p50 over many samples.
//!
//! Both servers run for the whole bench with their own templates and
//! snapshots; measurements alternate between them so load on the machine
//! hits both alike. The server's state directories are on the XFS
//! (reflink=1) given as the first argument or `$PAGEFORK_XFS_DIR`.
//!
//! Usage: `density [XFS_DIR] [--quick] [--counts 1,5]` (`--counts`
//! overrides the children counts of part 1 for a quick look; the report
//! then lacks rows). Prints JSON rows.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pagefork_benches::sys::{held, meminfo_kib, proc_status_kib};
use pagefork_benches::{Plan, Row, Stats};
use pagefork_tests::{child_pids, from_snapshot, new_vm, TestServer};
use proto::api::{ForkRequest, SnapshotMode};

const BENCH: &str = "density";
const T_FORK: &str = "Shared bases: host memory per forked child (density)";
const T_RESTORE: &str = "Shared bases: lazy restores of one snapshot (density)";
const T_START: &str = "Shared bases: start latency (density)";
/// The pattern the template and the snapshot's VM write.
const SEED: u64 = 7;
/// zeroboot's published host memory per fork, KB.
const ZEROBOOT_KB: f64 = 265.0;
/// Client threads driving the children's guest ops at once (the server's
/// API takes 256 connections; the machine has 2 cores).
const THREADS: usize = 8;
/// Share of MemAvailable the copying baseline may fill at most.
const MEM_SHARE: f64 = 0.6;

/// Sizes of one run.
struct Sizes {
    /// Template guest RAM, MiB, and the pages it wrote (W).
    tpl_mib: u64,
    ws_pages: u64,
    /// Children counts of part 1.
    counts: Vec<u32>,
    /// Children of the write-half variant.
    write_n: u32,
    /// Restores of part 2, and the pages each reads.
    restores: u32,
    restore_ws_pages: u64,
    /// Samples of each latency of part 3.
    start_samples: usize,
}

impl Sizes {
    fn new(plan: &Plan) -> Sizes {
        let counts = std::env::args()
            .skip_while(|a| a != "--counts")
            .nth(1)
            .map(|v| v.split(',').filter_map(|n| n.parse().ok()).collect())
            .unwrap_or_else(|| plan.density_children.clone());
        let write_n = plan.density_children.get(1).copied().unwrap_or(1);
        Sizes {
            tpl_mib: plan.density_mib,
            ws_pages: plan.density_ws_mib * 256,
            counts,
            write_n,
            restores: if plan.quick { 4 } else { 16 },
            restore_ws_pages: 16 * 256,
            start_samples: if plan.quick { 6 } else { 21 },
        }
    }

    fn ws_kib(&self) -> f64 {
        self.ws_pages as f64 * 4.0
    }
}

/// One server of the comparison.
struct Side {
    on: bool,
    server: TestServer,
    template: String,
    snapshot: String,
}

impl Side {
    fn name(&self) -> &'static str {
        if self.on {
            "bases on"
        } else {
            "bases off"
        }
    }
}

fn start_side(on: bool, sz: &Sizes) -> Side {
    let flag = format!("--shared-bases={on}");
    let server = TestServer::start_with_args(&[
        &flag,
        "--memory-budget-mib",
        "100000000",
        "--max-vms",
        "4096",
    ]);
    // The snapshot's VM: its working set written, saved whole, gone.
    let mib = sz.tpl_mib.max(sz.restore_ws_pages / 256);
    let vm = server.create_vm(&new_vm(mib));
    server.fill(&vm, 0, sz.restore_ws_pages, SEED);
    let snapshot = "density".to_owned();
    server.snapshot(&vm, &snapshot, SnapshotMode::Full);
    server.delete_vm(&vm);
    // The template: W written, paused (only a paused VM's memory can be
    // its children's base).
    let template = server.create_vm(&new_vm(sz.tpl_mib));
    server.fill(&template, 0, sz.ws_pages, SEED);
    server.pause(&template);
    Side {
        on,
        server,
        template,
        snapshot,
    }
}

/// Host-wide memory holding guest RAM and VMMs, KiB: Shmem + AnonPages +
/// huge pages in use.
fn host_kib() -> f64 {
    let f = |k: &str| meminfo_kib(k).unwrap_or(0);
    let huge = f("HugePages_Total").saturating_sub(f("HugePages_Free"));
    (f("Shmem") + f("AnonPages") + huge * f("Hugepagesize")) as f64
}

/// The same counters restricted to the bench's servers and their VMMs,
/// KiB (see [`held`]): what VMs wrote over a base is in their VMMs'
/// anonymous pages.
fn own_kib(servers: &[u32]) -> f64 {
    let mut pids = servers.to_vec();
    for &s in servers {
        pids.extend(child_pids(s));
    }
    held(&pids).total_kib()
}

/// Both measures of memory at one moment.
#[derive(Clone, Copy)]
struct Reading {
    own: f64,
    host: f64,
}

/// A [`Reading`] once the bench's own memory stopped moving (VMMs that
/// just started or exited), within a few seconds.
fn settled(servers: &[u32]) -> Reading {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut last = own_kib(servers);
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = own_kib(servers);
        if (now - last).abs() < 64.0 || Instant::now() > deadline {
            return Reading {
                own: now,
                host: host_kib(),
            };
        }
        last = now;
    }
}

/// Run `f` on every id, from up to [`THREADS`] client threads.
fn on_all(ids: &[String], f: impl Fn(usize, &str) + Sync) {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..THREADS.min(ids.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(id) = ids.get(i) else { break };
                f(i, id);
            });
        }
    });
}

fn delete_all(server: &TestServer, ids: &[String]) {
    on_all(ids, |_, id| {
        server.delete_vm(id);
    });
}

/// Fork `want` children of the side's template, or as many as the server
/// accepts (halving on a refusal). Returns them and why fewer, if so.
fn fork_children(side: &Side, want: u32) -> (Vec<String>, Option<String>) {
    let mut n = want;
    let mut why = None;
    loop {
        match side
            .server
            .try_fork(&side.template, &ForkRequest { count: n })
        {
            Ok(f) => return (f.children, why),
            Err(r) => {
                eprintln!("  {}: a fork of {n} children refused: {r}", side.name());
                if why.is_none() {
                    why = Some(format!("the server refused {n} children ({r})"));
                }
                assert!(n > 1, "{}: even one child refused: {r}", side.name());
                n /= 2;
            }
        }
    }
}

/// The count the copying baseline can hold: `want`, or what fits in
/// [`MEM_SHARE`] of MemAvailable when each child copies `per_child_kib`.
fn fits(want: u32, per_child_kib: f64) -> (u32, Option<String>) {
    let avail = meminfo_kib("MemAvailable").unwrap_or(0) as f64;
    let cap = (avail * MEM_SHARE / (per_child_kib + 4096.0)).floor();
    if f64::from(want) <= cap {
        return (want, None);
    }
    // Clamped to [1, want] first: the cast cannot truncate.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let n = cap.clamp(1.0, f64::from(want)) as u32;
    (
        n,
        Some(format!(
            "{want} children copying {:.0} MiB each need {:.1} GiB, more than {:.0} % of \
             MemAvailable ({:.1} GiB)",
            per_child_kib / 1024.0,
            f64::from(want) * per_child_kib / (1 << 20) as f64,
            MEM_SHARE * 100.0,
            avail / (1 << 20) as f64
        )),
    )
}

/// One measurement of a batch of children.
#[derive(Default, Clone)]
struct Batch {
    /// Children measured.
    n: u32,
    /// Per child: the VMM's start, the reads (and writes), both, KiB.
    start_kib: f64,
    read_kib: f64,
    total_kib: f64,
    /// The reads per child by the host-wide counters, KiB.
    host_read_kib: f64,
    /// Median RssAnon of the children's VMMs after the reads, KiB (exact:
    /// the pages they own).
    vmm_anon_kib: f64,
    /// Why fewer children than asked for, if so.
    why: Option<String>,
}

/// Pages a child found wrong (a bench over wrong memory is no bench).
static WRONG: AtomicU64 = AtomicU64::new(0);

/// Fork `want` children; each reads all of W, or with `write_half` writes
/// its own first half and reads the second. Measures host memory around
/// both steps.
fn batch(side: &Side, pids: &[u32], sz: &Sizes, want: u32, write_half: bool) -> Batch {
    let s = &side.server;
    let per_child = if side.on { 0.0 } else { sz.ws_kib() };
    let (want, mut why) = fits(want, per_child);
    let before = settled(pids);
    let (kids, refused) = fork_children(side, want);
    why = why.or(refused);
    let started = settled(pids);
    let half = sz.ws_pages / 2;
    on_all(&kids, |i, id| {
        let wrong = if write_half {
            s.fill(id, 0, half, 100 + i as u64);
            s.verify(id, half, sz.ws_pages - half, SEED)
        } else {
            s.verify(id, 0, sz.ws_pages, SEED)
        };
        WRONG.fetch_add(wrong, Ordering::Relaxed);
    });
    let after = settled(pids);
    let anon: Vec<f64> = kids
        .iter()
        .filter_map(|id| s.vm(id).pid)
        .filter_map(|pid| proc_status_kib(pid, "RssAnon"))
        .map(|k| k as f64)
        .collect();
    delete_all(s, &kids);
    let n = kids.len() as f64;
    Batch {
        n: u32::try_from(kids.len()).unwrap_or(u32::MAX),
        start_kib: (started.own - before.own) / n,
        read_kib: (after.own - started.own) / n,
        total_kib: (after.own - before.own) / n,
        host_read_kib: (after.host - started.host) / n,
        vmm_anon_kib: median(&anon),
        why,
    }
}

fn median(v: &[f64]) -> f64 {
    Stats::of(v).map_or(f64::NAN, |s| s.median)
}

/// Repetitions of a batch of `n` children: fewer for the large counts
/// (host-wide noise divides by `n`).
fn reps_for(plan: &Plan, n: u32) -> usize {
    match n {
        0..=10 => plan.reps.max(3),
        11..=200 => 2,
        _ => 1,
    }
}

fn counts_label(b: &[Batch], want: u32) -> String {
    let got = b.iter().map(|b| b.n).min().unwrap_or(0);
    match b.iter().find_map(|b| b.why.clone()) {
        Some(why) if got < want => format!("{got} children (not {want}: {why})"),
        _ if want == 1 => "1 child".to_owned(),
        _ => format!("{want} children"),
    }
}

fn pick(b: &[Batch], f: impl Fn(&Batch) -> f64) -> Vec<f64> {
    b.iter().map(f).collect()
}

fn fork_rows(plan: &Plan, sz: &Sizes, sides: &[Side; 2], pids: &[u32]) {
    let ws = sz.ws_kib();
    let w = format!("{} MiB", sz.ws_pages / 256);
    let tpl = format!("{} MiB template", sz.tpl_mib);
    for (ci, &want) in sz.counts.iter().enumerate() {
        let reps = reps_for(plan, want);
        let (mut on, mut off) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            for side in sides {
                let t = Instant::now();
                let b = batch(side, pids, sz, want, false);
                eprintln!(
                    "  {}: {} children: start {:.0} KiB, reads {:.0} KiB per child ({:.1} s)",
                    side.name(),
                    b.n,
                    b.start_kib,
                    b.read_kib,
                    t.elapsed().as_secs_f64()
                );
                if side.on { &mut on } else { &mut off }.push(b);
            }
        }
        let (lon, loff) = (counts_label(&on, want), counts_label(&off, want));
        let read_on = median(&pick(&on, |b| b.read_kib));
        Row::new(
            BENCH,
            &format!("density.read.{want}"),
            T_FORK,
            &format!(
                "{lon} of a paused {tpl} that wrote {w}, each reading all {w}: host memory the reads add per child, bases on"
            ),
            "KiB",
            &pick(&on, |b| b.read_kib),
            &format!("the same on --shared-bases=false ({loff}): each child copies what it reads"),
            &pick(&off, |b| b.read_kib),
        )
        .goal(format!("≤ 5 % of W ({:.0} KiB), near 0", ws * 0.05))
        .note(format!(
            "reads per child / W: {:.4} bases on, {:.3} off (page tables, ~2.3 KiB per MiB a VMM maps, \
             are in neither); host-wide (Shmem + AnonPages, other work \
             on the machine included): {:.0} KiB on, {:.0} KiB off; the children's VMMs own (RssAnon, \
             median) {:.0} KiB on, {:.0} KiB off",
            read_on / ws,
            median(&pick(&off, |b| b.read_kib)) / ws,
            median(&pick(&on, |b| b.host_read_kib)),
            median(&pick(&off, |b| b.host_read_kib)),
            median(&pick(&on, |b| b.vmm_anon_kib)),
            median(&pick(&off, |b| b.vmm_anon_kib)),
        ))
        .emit();
        Row::new(
            BENCH,
            &format!("density.start.{want}"),
            T_FORK,
            &format!("{lon}: fixed cost per child's VMM (host memory added by the fork, before any read), bases on"),
            "KiB",
            &pick(&on, |b| b.start_kib),
            &format!("the same on --shared-bases=false ({loff})"),
            &pick(&off, |b| b.start_kib),
        )
        .goal(format!("report (zeroboot: {ZEROBOOT_KB:.0} KB per fork)"))
        .note("a VMM process, its KVM VM and the server's state for it")
        .emit();
        if ci + 1 == sz.counts.len() {
            Row::new(
                BENCH,
                "density.child",
                T_FORK,
                &format!(
                    "{lon}, each reading all {w}: host memory per child, start and reads, bases on"
                ),
                "KiB",
                &pick(&on, |b| b.total_kib),
                &format!("the same on --shared-bases=false ({loff})"),
                &pick(&off, |b| b.total_kib),
            )
            .goal(format!(
                "report, next to zeroboot's {ZEROBOOT_KB:.0} KB per fork ({:.0} KiB)",
                ZEROBOOT_KB * 1000.0 / 1024.0
            ))
            .note(format!(
                "zeroboot's figure is for forks that read little; here each child reads {w}"
            ))
            .emit();
        }
    }

    let want = sz.write_n;
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for _ in 0..reps_for(plan, want) {
        for side in sides {
            let b = batch(side, pids, sz, want, true);
            eprintln!(
                "  {}: {} children writing half: start {:.0} KiB, reads+writes {:.0} KiB per child",
                side.name(),
                b.n,
                b.start_kib,
                b.read_kib
            );
            if side.on { &mut on } else { &mut off }.push(b);
        }
    }
    let (lon, loff) = (counts_label(&on, want), counts_label(&off, want));
    let mine = ws / 2.0;
    Row::new(
        BENCH,
        "density.write_half",
        T_FORK,
        &format!("{lon} of the {tpl}, each writing its own half of W and reading the other half: host memory added per child after it started, bases on"),
        "KiB",
        &pick(&on, |b| b.read_kib),
        &format!("the same on --shared-bases=false ({loff})"),
        &pick(&off, |b| b.read_kib),
    )
    .goal(format!("≤ 1.05 × its own writes ({:.0} KiB)", mine * 1.05))
    .note(format!(
        "own writes W/2 = {mine:.0} KiB; per child / own writes: {:.3} on, {:.3} off; plus the VMM's fixed cost \
         (median {:.0} KiB on, {:.0} KiB off)",
        median(&pick(&on, |b| b.read_kib)) / mine,
        median(&pick(&off, |b| b.read_kib)) / mine,
        median(&pick(&on, |b| b.start_kib)),
        median(&pick(&off, |b| b.start_kib)),
    ))
    .emit();
}

/// `restores` VMs from the side's snapshot, each reading its working set:
/// ms until all have, and host memory per VM.
fn restores(side: &Side, pids: &[u32], sz: &Sizes) -> (f64, f64) {
    let s = &side.server;
    let before = settled(pids).own;
    let ids: Vec<String> = (0..sz.restores).map(|i| format!("{i}")).collect();
    let made = std::sync::Mutex::new(Vec::new());
    let t = Instant::now();
    on_all(&ids, |_, _| {
        let id = s.restore(&side.snapshot);
        let wrong = s.verify(&id, 0, sz.restore_ws_pages, SEED);
        WRONG.fetch_add(wrong, Ordering::Relaxed);
        made.lock().unwrap_or_else(|p| p.into_inner()).push(id);
    });
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let after = settled(pids).own;
    let made = made.into_inner().unwrap_or_else(|p| p.into_inner());
    delete_all(s, &made);
    (ms, (after - before) / f64::from(sz.restores))
}

fn restore_rows(plan: &Plan, sz: &Sizes, sides: &[Side; 2], pids: &[u32]) {
    let (mut ms, mut kib) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    for _ in 0..plan.reps {
        for (i, side) in sides.iter().enumerate() {
            let (t, k) = restores(side, pids, sz);
            eprintln!(
                "  {}: {} restores read in {t:.0} ms, {k:.0} KiB each",
                side.name(),
                sz.restores
            );
            ms[i].push(t);
            kib[i].push(k);
        }
    }
    let m = sz.restores;
    let ws = format!("{} MiB", sz.restore_ws_pages / 256);
    Row::new(
        BENCH,
        "density.restore_time",
        T_RESTORE,
        &format!("{m} VMs restored at once from one full snapshot, each reading its {ws} working set: until all have read it, bases on"),
        "ms",
        &ms[0],
        "the same on --shared-bases=false: each VM copies what it reads",
        &ms[1],
    )
    .goal("≤ 1.05 (not slower)")
    .note(format!("{} client threads; the VMs' reads go through the server's fault path", THREADS.min(m as usize)))
    .emit();
    let ws_kib = sz.restore_ws_pages as f64 * 4.0;
    Row::new(
        BENCH,
        "density.restore_mem",
        T_RESTORE,
        &format!("the same: host memory per VM once all have read {ws}, bases on"),
        "KiB",
        &kib[0],
        "the same on --shared-bases=false",
        &kib[1],
    )
    .goal(format!("report (the base's one copy / {m} + a VMM's cost)"))
    .note(format!(
        "the snapshot's base is filled by the VMs' reads and freed with the last VM, so its one copy ({ws_kib:.0} KiB, \
         {:.0} KiB per VM) is in the figure",
        ws_kib / f64::from(m)
    ))
    .emit();
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn start_rows(sz: &Sizes, sides: &[Side; 2]) {
    // One VM of each snapshot stays up, so its base lives across the
    // samples (the steady state of many restores).
    let anchors: Vec<String> = sides
        .iter()
        .map(|d| d.server.restore(&d.snapshot))
        .collect();
    let (mut fork, mut restore) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    for _ in 0..sz.start_samples {
        for (i, d) in sides.iter().enumerate() {
            let s = &d.server;
            let t = Instant::now();
            let child = s.fork_one(&d.template);
            s.identity(&child);
            fork[i].push(ms_since(t));
            s.delete_vm(&child);
            let t = Instant::now();
            let vm = s.create_vm(&from_snapshot(&d.snapshot));
            s.identity(&vm);
            restore[i].push(ms_since(t));
            s.delete_vm(&vm);
        }
    }
    for (d, a) in sides.iter().zip(&anchors) {
        d.server.delete_vm(a);
    }
    Row::new(
        BENCH,
        "density.fork_p50",
        T_START,
        &format!(
            "fork of the paused {} MiB template → the child answers (p50), bases on",
            sz.tpl_mib
        ),
        "ms",
        &fork[0],
        "the same on --shared-bases=false",
        &fork[1],
    )
    .goal("≤ 1.05 (not slower)")
    .note("no VMM pool: a vmm process is started per VM")
    .emit();
    Row::new(
        BENCH,
        "density.restore_p50",
        T_START,
        "create from the full snapshot → the VM answers (p50), bases on",
        "ms",
        &restore[0],
        "the same on --shared-bases=false",
        &restore[1],
    )
    .goal("≤ 1.05 (not slower)")
    .note("one VM of the snapshot stays up meanwhile, so its base lives across the samples")
    .emit();
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    if let Err(code) = pagefork_benches::sys::start_on_xfs(BENCH) {
        return code;
    }
    let sz = Sizes::new(&plan);
    eprintln!(
        "{BENCH}: {} MiB template, W = {} pages, children {:?}, {} restores",
        sz.tpl_mib, sz.ws_pages, sz.counts, sz.restores
    );
    let t = Instant::now();
    let sides = [start_side(true, &sz), start_side(false, &sz)];
    eprintln!(
        "{BENCH}: servers ready in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let pids: Vec<u32> = sides.iter().map(|d| d.server.pid()).collect();
    fork_rows(&plan, &sz, &sides, &pids);
    eprintln!("{BENCH}: children in {:.1} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    restore_rows(&plan, &sz, &sides, &pids);
    eprintln!("{BENCH}: restores in {:.1} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    start_rows(&sz, &sides);
    eprintln!("{BENCH}: latencies in {:.1} s", t.elapsed().as_secs_f64());
    for side in &sides {
        side.server.assert_healthy();
    }
    let wrong = WRONG.load(Ordering::Relaxed);
    if wrong > 0 {
        eprintln!("{BENCH}: {wrong} pages read back wrong");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
