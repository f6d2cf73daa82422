//! Live fork (issue 3), for VMs of 256 MiB, 1 GiB and 4 GiB (quick: 256 MiB
//! and 1 GiB) with a quarter of memory materialized, side by side with its
//! baselines in one run:
//!
//! 1. Table work: `PageTable::fork()` in-process (a quarter of the table set
//!    to another source) and the server's `fork_us`, against (a) cloning an
//!    8-byte-per-page pointer table (`Vec<u64>`) and (b) memcpy of the
//!    materialized quarter (source and destination pre-touched: the
//!    cheapest possible copy fork).
//! 2. The parent's pause (`pause_us`) against a bare UFFDIO_WRITEPROTECT of
//!    the same amount of populated shmem ([`pagefork_benches::wp_floor`]).
//! 3. End to end: from the fork request to every child answering
//!    `exec identity`, for 1 and 10 children, against cold-starting as many
//!    empty VMs of the same size until they answer.
//! 4. Memory added per child right after the fork returns: host `Shmem`
//!    and the server's RSS, against the materialized size (what a copy fork
//!    adds).
//!
//! Before every fork the parent rewrites its quarter (untimed), so each
//! pause write-protects writable pages, as the first fork does.
//!
//! Usage: `fork [--quick]`. Prints JSON rows.

use std::hint::black_box;
use std::process::ExitCode;
use std::time::Instant;

use pagefork_benches::plan::FORK_COUNTS;
use pagefork_benches::sys::{meminfo_kib, proc_status_kib};
use pagefork_benches::wp_floor::WpFloor;
use pagefork_benches::{Plan, Row};
use pagefork_tests::{new_vm, op, pages_of, TestServer};
use proto::api::CreateVm;
use uffd_server::pages::{PageTable, CHUNK_PAGES};

const BENCH: &str = "fork";
const T_TABLE: &str = "Live fork: table work (issue 3)";
const T_PAUSE: &str = "Live fork: parent pause (issue 3)";
const T_E2E: &str = "Live fork: end to end (issue 3)";
const T_MEM: &str = "Live fork: memory added per child (issue 3)";

/// Samples for in-process micro-measurements (cheap, so more of them).
fn micro_reps(plan: &Plan) -> usize {
    if plan.quick {
        3
    } else {
        11
    }
}

fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

/// Samples of the in-process baselines for one size.
struct InProcess {
    table_fork_us: Vec<f64>,
    ptr_copy_us: Vec<f64>,
    memcpy_us: Vec<f64>,
    wp_us: Vec<f64>,
    wp_huge_us: Vec<f64>,
}

fn in_process(plan: &Plan, mib: u64) -> InProcess {
    let pages = pages_of(mib);
    let quarter = pages / 4;
    let n = micro_reps(plan);

    let mut table = PageTable::new(pages, 0);
    table.set_range(0, quarter, 1);
    let table_fork_us = (0..n)
        .map(|_| {
            let t = Instant::now();
            let f = black_box(table.fork());
            let took = us(t);
            drop(f);
            took
        })
        .collect();

    let ptrs: Vec<u64> = (0..pages)
        .map(|p| p.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    let ptr_copy_us = (0..n)
        .map(|_| {
            let t = Instant::now();
            let c = black_box(ptrs.clone());
            let took = us(t);
            drop(c);
            took
        })
        .collect();
    drop(ptrs);

    let bytes = usize::try_from(quarter * shared::PAGE_SIZE).expect("size fits in usize");
    let src: Vec<u8> = (0..bytes).map(|i| i.to_le_bytes()[0] ^ 0x5a).collect();
    let mut dst = vec![1u8; bytes];
    let memcpy_us = (0..plan.reps)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
            us(t)
        })
        .collect();
    drop((src, dst));

    let len = usize::try_from(mib << 20).expect("size fits in usize");
    let floor = WpFloor::new(len, bytes)
        .unwrap_or_else(|e| panic!("write-protect floor: {}", shared::error_chain(&e)));
    let wp_us = (0..plan.reps.max(5))
        .map(|_| {
            floor
                .measure()
                .unwrap_or_else(|e| panic!("write-protect floor: {}", shared::error_chain(&e)))
                .as_secs_f64()
                * 1e6
        })
        .collect();
    // The same write-protect on 2 MiB hugetlb pages: the floor of a fork's
    // pause with hugepage guest RAM.
    let huge_pages = (bytes as u64).div_ceil(2 << 20);
    let wp_huge_us = if pagefork_benches::wp_floor::reserve_hugepages(huge_pages) {
        let floor = WpFloor::new_hugetlb(len, bytes)
            .unwrap_or_else(|e| panic!("hugetlb write-protect floor: {}", shared::error_chain(&e)));
        (0..plan.reps.max(5))
            .map(|_| {
                floor
                    .measure()
                    .unwrap_or_else(|e| {
                        panic!("hugetlb write-protect floor: {}", shared::error_chain(&e))
                    })
                    .as_secs_f64()
                    * 1e6
            })
            .collect()
    } else {
        eprintln!("{BENCH}: cannot reserve {huge_pages} hugepages; no hugetlb row");
        Vec::new()
    };
    InProcess {
        table_fork_us,
        ptr_copy_us,
        memcpy_us,
        wp_us,
        wp_huge_us,
    }
}

fn median(v: &[f64]) -> f64 {
    pagefork_benches::Stats::of(v).map_or(f64::NAN, |s| s.median)
}

/// Samples of real forks through the API for one size and child count.
#[derive(Default)]
struct Forks {
    fork_us: Vec<f64>,
    pause_us: Vec<f64>,
    /// The UFFDIO_WRITEPROTECT inside the pause, as the server timed it.
    server_wp_us: Vec<f64>,
    server_ahead_us: Vec<f64>,
    e2e_ms: Vec<f64>,
    shmem_kib_per_child: Vec<f64>,
    /// Pages in each child's own memfd right after the fork (exact).
    resident_pages_per_child: Vec<f64>,
    rss_kib_per_child: Vec<f64>,
    /// Guest time of the parent rewriting its written pages before the
    /// fork and after the children answer (only when asked for).
    rewrite_free_us: Vec<f64>,
    rewrite_forked_us: Vec<f64>,
}

fn delete(server: &TestServer, id: &str) {
    server.delete_vm(id);
}

/// Every VM in `ids` answers `exec identity` (in parallel).
fn all_answer(server: &TestServer, ids: &[String]) {
    std::thread::scope(|s| {
        for id in ids {
            s.spawn(move || server.exec(id, &op::identity()));
        }
    });
}

fn kib_delta(after: Option<u64>, before: Option<u64>) -> f64 {
    match (after, before) {
        (Some(a), Some(b)) => a as f64 - b as f64,
        _ => f64::NAN,
    }
}

/// Guest time of rewriting (first byte, unchanged) each of `pages`.
fn rewrite_us(server: &TestServer, vm: &str, pages: u64) -> f64 {
    let v = server
        .try_exec(vm, &op::touch(0, pages, true))
        .unwrap_or_else(|v| panic!("rewrite on {vm} failed: {v}"));
    v.elapsed_us as f64
}

/// `count` real forks of `parent`, `plan.reps` times. With `rewrite`, the
/// parent also rewrites its written quarter before the fork (nothing
/// protected) and after its children answer (every first write to a unit
/// hands its pre-image to the child): the difference per unit is the cost
/// of one first write after a fork.
fn real_forks(
    server: &TestServer,
    plan: &Plan,
    parent: &str,
    quarter: u64,
    count: u32,
    seed: &mut u64,
    rewrite: bool,
) -> Forks {
    let mut f = Forks::default();
    for _ in 0..plan.reps {
        *seed += 1;
        server.exec(parent, &op::fill(0, quarter, *seed));
        let free = rewrite.then(|| rewrite_us(server, parent, quarter));
        let (shmem0, rss0) = (meminfo_kib("Shmem"), proc_status_kib(server.pid(), "VmRSS"));
        let t = Instant::now();
        let v = server.fork(parent, count);
        let (shmem1, rss1) = (meminfo_kib("Shmem"), proc_status_kib(server.pid(), "VmRSS"));
        let children = v.children.clone();
        let resident: u64 = children.iter().map(|c| server.vm(c).resident_pages).sum();
        f.resident_pages_per_child
            .push(resident as f64 / f64::from(count));
        all_answer(server, &children);
        f.e2e_ms.push(t.elapsed().as_secs_f64() * 1e3);
        if let Some(free) = free {
            let after = rewrite_us(server, parent, quarter);
            f.rewrite_free_us.push(free);
            f.rewrite_forked_us.push(after);
        }
        f.fork_us.push(v.fork_us as f64);
        f.pause_us.push(v.pause_us as f64);
        f.server_wp_us.push(v.phases.write_protect_us as f64);
        f.server_ahead_us.push(v.phases.armed_ahead_us as f64);
        f.shmem_kib_per_child
            .push(kib_delta(shmem1, shmem0) / f64::from(count));
        f.rss_kib_per_child
            .push(kib_delta(rss1, rss0) / f64::from(count));
        for c in &children {
            delete(server, c);
        }
    }
    f
}

/// Cold start of `count` empty VMs of `mib` until each answers identity.
fn cold_starts(server: &TestServer, plan: &Plan, mib: u64, count: u32) -> Vec<f64> {
    (0..plan.reps)
        .map(|_| {
            let t = Instant::now();
            let ids: Vec<String> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..count)
                    .map(|_| {
                        s.spawn(move || {
                            let id = server.create_vm(&new_vm(mib));
                            server.exec(&id, &op::identity());
                            id
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().expect("cold start thread panicked"))
                    .collect()
            });
            let took = t.elapsed().as_secs_f64() * 1e3;
            for id in &ids {
                delete(server, id);
            }
            took
        })
        .collect()
}

fn children(n: u32) -> String {
    if n == 1 {
        "1 child".into()
    } else {
        format!("all {n} children")
    }
}

fn size_label(mib: u64) -> String {
    if mib >= 1024 {
        format!("{} GiB", mib / 1024)
    } else {
        format!("{mib} MiB")
    }
}

fn bench_size(server: &TestServer, plan: &Plan, mib: u64) {
    let pages = pages_of(mib);
    let quarter = pages / 4;
    let sz = size_label(mib);
    let mat = size_label(mib / 4);
    eprintln!("{BENCH}: {sz} VM, {quarter} pages materialized");

    let ip = in_process(plan, mib);

    let parent = server.create_vm(&new_vm(mib));
    let mut seed = 0;
    let t = Instant::now();
    server.exec(&parent, &op::fill(0, quarter, 1));
    eprintln!("  first fill of {mat}: {:.1} s", t.elapsed().as_secs_f64());
    let mut forks = Vec::new();
    for count in FORK_COUNTS {
        let t = Instant::now();
        forks.push((
            count,
            real_forks(server, plan, &parent, quarter, count, &mut seed, count == 1),
        ));
        eprintln!(
            "  {} forks of {count}: {:.1} s",
            plan.reps,
            t.elapsed().as_secs_f64()
        );
    }
    delete(server, &parent);
    let one = &forks[0].1;

    // The same parent on hugepage guest RAM: the pause's write-protect
    // pass covers 2 MiB blocks.
    let blocks = quarter.div_ceil(512);
    let huge = pagefork_benches::wp_floor::reserve_hugepages(blocks + 64).then(|| {
        let hp = server.create_vm(&CreateVm {
            hugepages: Some(true),
            ..new_vm(mib)
        });
        let f = real_forks(server, plan, &hp, quarter, 1, &mut seed, true);
        delete(server, &hp);
        f
    });
    if let Some(h) = &huge {
        Row::new(
            BENCH,
            &format!("fork.pause_huge.{mib}"),
            T_PAUSE,
            &format!("{sz} VM on 2 MiB hugetlb pages, {mat} written: parent pause (pause_us), 1 child"),
            "µs",
            &h.pause_us,
            "the same fork of the same VM on 4 KiB pages",
            &one.pause_us,
        )
        .goal("≤ 1 ms at 4 GiB with 1 GiB written")
        .note(format!(
            "the UFFDIO_WRITEPROTECT armed before it, the parent running: median {:.0} µs, and the re-protect \
             inside it: {:.0} µs; fork request → child answering: median {:.1} ms (4 KiB: {:.1} ms)",
            median(&h.server_ahead_us),
            median(&h.server_wp_us),
            median(&h.e2e_ms),
            median(&one.e2e_ms)
        ))
        .emit();
        // One first write after the fork: the rewrite's extra guest time
        // per unit (2 MiB block / 4 KiB page), per repetition.
        let per_unit = |f: &Forks, units: u64| -> Vec<f64> {
            f.rewrite_forked_us
                .iter()
                .zip(&f.rewrite_free_us)
                .map(|(after, free)| (after - free) / units as f64)
                .collect()
        };
        let (huge_unit, small_unit) = (per_unit(h, blocks), per_unit(one, quarter));
        Row::new(
            BENCH,
            &format!("fork.first_write_huge.{mib}"),
            T_PAUSE,
            &format!(
                "{sz} VM on 2 MiB hugetlb pages: one first write after a fork (the 2 MiB block's pre-image to the child)"
            ),
            "µs",
            &huge_unit,
            "one first write after the same fork on 4 KiB pages (a 4 KiB page's pre-image)",
            &small_unit,
        )
        .goal("report (issue 13): ratio < 512 means fewer, larger copies win per byte")
        .note(format!(
            "the parent rewrites its {mat} after the child answers, minus the same rewrite before the fork, \
             per unit; the whole rewrite after the fork: median {:.0} ms on hugepages ({blocks} faults), \
             {:.0} ms on 4 KiB pages ({quarter} faults); before it: {:.0} / {:.0} ms",
            median(&h.rewrite_forked_us) / 1e3,
            median(&one.rewrite_forked_us) / 1e3,
            median(&h.rewrite_free_us) / 1e3,
            median(&one.rewrite_free_us) / 1e3,
        ))
        .emit();
    } else {
        eprintln!("{BENCH}: {blocks} free huge pages could not be reserved: no hugepage fork row");
    }

    let chunks = pages.div_ceil(CHUNK_PAGES as u64);
    Row::new(
        BENCH,
        &format!("fork.table.{mib}"),
        T_TABLE,
        &format!("{sz} VM: PageTable::fork() ({chunks} shared chunks), in-process"),
        "µs",
        &ip.table_fork_us,
        &format!("copy an 8-byte-per-page pointer table ({pages} × u64)"),
        &ip.ptr_copy_us,
    )
    .goal("< 100 µs at every size, flat")
    .note("a quarter of the table points at another source")
    .emit();
    Row::new(
        BENCH,
        &format!("fork.table_vs_memcpy.{mib}"),
        T_TABLE,
        &format!("{sz} VM: PageTable::fork(), in-process"),
        "µs",
        &ip.table_fork_us,
        &format!("memcpy of the materialized {mat}"),
        &ip.memcpy_us,
    )
    .goal("< 100 µs at every size, flat")
    .note("memcpy between pre-touched buffers: the cheapest copy fork")
    .emit();
    Row::new(
        BENCH,
        &format!("fork.server_fork_us.{mib}"),
        T_TABLE,
        &format!("{sz} VM: server-side memory fork (fork_us), 1 child"),
        "µs",
        &one.fork_us,
        &format!("copy an 8-byte-per-page pointer table ({pages} × u64)"),
        &ip.ptr_copy_us,
    )
    .goal("< 100 µs at every size, flat")
    .note("fork_us as reported by POST /v1/vms/{id}/fork (child registration included)")
    .emit();
    let pause10 = pagefork_benches::Stats::of(&forks[1].1.pause_us).map_or(f64::NAN, |s| s.median);
    Row::new(
        BENCH,
        &format!("fork.pause.{mib}"),
        T_PAUSE,
        &format!("{sz} VM: parent pause (pause_us), 1 child"),
        "µs",
        &one.pause_us,
        &format!("bare UFFDIO_WRITEPROTECT of {mat} populated shmem"),
        &ip.wp_us,
    )
    .goal("≤ 1.2")
    .note(format!(
        "pause with 10 children: median {pause10:.0} µs; the UFFDIO_WRITEPROTECT on the VMM's KVM-mapped \
         memory, armed before the pause while the parent runs: median {:.0} µs (pause / that = {:.2}), and the \
         re-protect of what the parent wrote meanwhile, inside the pause: {:.0} µs",
        median(&one.server_ahead_us),
        median(&one.pause_us) / median(&one.server_ahead_us),
        median(&one.server_wp_us)
    ))
    .emit();
    Row::new(
        BENCH,
        &format!("fork.wp_huge.{mib}"),
        T_PAUSE,
        &format!("{sz} VM: bare UFFDIO_WRITEPROTECT of {mat} populated as 2 MiB hugetlb pages"),
        "µs",
        &ip.wp_huge_us,
        "the same on 4 KiB shmem pages (today's guest RAM)",
        &ip.wp_us,
    )
    .goal("≤ 1 ms at 4 GiB with 1 GiB written (what hugepage guest RAM would give a fork's pause)")
    .note(
        "kernel floor, in-process; fork.pause_huge is the server's real fork of hugepage guest RAM",
    )
    .emit();
    for (count, f) in &forks {
        Row::new(
            BENCH,
            &format!("fork.e2e{count}.{mib}"),
            T_E2E,
            &format!(
                "{sz} VM: fork request → {} answer exec identity",
                children(*count)
            ),
            "ms",
            &f.e2e_ms,
            &format!(
                "cold start of {count} empty {sz} VM{} until they answer",
                if *count == 1 { "" } else { "s" }
            ),
            &cold_starts(server, plan, mib, *count),
        )
        .goal("milliseconds; ≤ cold start")
        .note("children carry the parent's memory and vCPU state; cold-started VMs carry none")
        .emit();
    }
    let ten = &forks[1].1;
    let mat_kib = [(quarter * shared::PAGE_SIZE / 1024) as f64];
    let table_bytes = chunks * 8;
    Row::new(
        BENCH,
        &format!("fork.shmem_per_child.{mib}"),
        T_MEM,
        &format!("{sz} VM: host Shmem added per child, 10 children"),
        "KiB",
        &ten.shmem_kib_per_child,
        &format!("the materialized {mat} (what a copy fork adds)"),
        &mat_kib,
    )
    .goal(format!(
        "table chunks only ({chunks} chunk pointers = {table_bytes} B)"
    ))
    .note(
        format!(
            "/proc/meminfo Shmem right after the fork returns; host-wide, so other processes add noise. \
             Exact: each child's memfd holds {:.1} pages (median; resident_pages of GET /v1/vms/{{id}})",
            pagefork_benches::Stats::of(&ten.resident_pages_per_child).map_or(f64::NAN, |s| s.median)
        ),
    )
    .emit();
    Row::new(
        BENCH,
        &format!("fork.rss_per_child.{mib}"),
        T_MEM,
        &format!("{sz} VM: server RSS added per child, 10 children"),
        "KiB",
        &ten.rss_kib_per_child,
        &format!("the materialized {mat} (what a copy fork adds)"),
        &mat_kib,
    )
    .goal(format!(
        "table chunks only ({chunks} chunk pointers = {table_bytes} B)"
    ))
    .note("VmRSS of uffd-server right after the fork returns (4 KiB granularity)")
    .emit();
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    if !pagefork_tests::require_kvm_uffd() {
        eprintln!("{BENCH}: needs /dev/kvm and /dev/userfaultfd");
        return ExitCode::FAILURE;
    }
    let server = TestServer::start();
    for &mib in &plan.fork_mib {
        bench_size(&server, &plan, mib);
    }
    ExitCode::SUCCESS
}
