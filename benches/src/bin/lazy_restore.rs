//! Lazy restore (issue 2): a guest touching all of its RAM, served from a
//! raw image of random content, against the same guest on memory the
//! server pre-populated (`prefetch`: no faults at all — the floor).
//!
//! Per repetition, in one server and interleaved so noise hits every
//! configuration alike: for each fault-around size (0, 16, 64, 256 KiB) and
//! for prefetch, create a VM from the image, `exec touch` every page (the
//! guest time is the VMM's `elapsed_us`), read `faults.missing`, delete it.
//! The prefetched guest touches everything a second time too: pages already
//! mapped in the VMM and KVM, i.e. memory speed.
//!
//! Observability's cost: the fault-heaviest configuration (no fault-around,
//! one fault per page) also runs with a live fault-trace listener reading
//! every event and `/metrics` scraped every 100 ms, twice per repetition,
//! next to two plain runs (row 1's and one more, in alternating order);
//! the ratio is that cost on the fault path. (The fault-time histogram and
//! the page log are always on: they are in both.)
//! Issue 13: the server defaults install a readahead window in 64 KiB
//! pieces, the faulting page's first (its thread runs while the rest goes
//! in); a second server in the same run installs each window whole before
//! the wake (`--readahead-piece-kib 0`, the fault path before), measured
//! interleaved with the defaults. The server's time by phase goes in the
//! notes.
//! Prints JSON rows (see `pagefork_benches::Row`).
//!
//! Usage: `lazy_restore [--quick]`.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pagefork_benches::plan::FAULT_AROUND_KIB;
use pagefork_benches::{Plan, Row};
use pagefork_tests::{new_vm, op, pages_of, Api, RandomImage, TestServer};
use proto::api::CreateVm;

const BENCH: &str = "lazy_restore";
const TABLE: &str = "Lazy restore from a raw image (issue 2)";

/// Samples of one configuration.
#[derive(Default)]
struct Samples {
    guest_us: Vec<f64>,
    wall_ms: Vec<f64>,
    missing: Vec<f64>,
}

fn run_once(
    server: &TestServer,
    body: CreateVm,
    pages: u64,
    s: &mut Samples,
    warm: Option<&mut Vec<f64>>,
) -> String {
    let t = Instant::now();
    let id = server.create_vm(&body);
    let v = server
        .try_exec(&id, &op::touch(0, pages, false))
        .unwrap_or_else(|v| panic!("touch on {id} failed: {v}"));
    let wall = t.elapsed();
    let guest = v.elapsed_us as f64;
    let vm = server.vm(&id);
    if let Some(warm) = warm {
        let v = server
            .try_exec(&id, &op::touch(0, pages, false))
            .unwrap_or_else(|v| panic!("second touch on {id} failed: {v}"));
        warm.push(v.elapsed_us as f64);
    }
    s.guest_us.push(guest);
    s.wall_ms.push(wall.as_secs_f64() * 1e3);
    s.missing.push(vm.faults.missing as f64);
    server.delete_vm(&id);
    pagefork_benches::phases::describe(&vm)
}

/// What the observers of one observed run saw.
#[derive(Default)]
struct Observed {
    events: Vec<f64>,
    dropped: Vec<f64>,
    scrapes: Vec<f64>,
}

/// Whether `vm` has a trace listener, read from `/metrics`.
fn has_listener(server: &TestServer, vm: &str) -> bool {
    let text = server.metrics_text();
    let name = format!("pagefork_vm_trace_listeners{{vm=\"{vm}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&name))
        .is_some_and(|v| v.trim() != "0")
}

/// [`run_once`] with a fault-trace listener on the VM and `/metrics`
/// scraped every 100 ms while the guest touches its memory.
fn run_observed(
    server: &TestServer,
    body: CreateVm,
    pages: u64,
    s: &mut Samples,
    o: &mut Observed,
) {
    let id = server.create_vm(&body);
    let client = Api::clone(server);
    let (events, dropped) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let listener = {
        let (events, dropped) = (events.clone(), dropped.clone());
        let path = format!("/v1/vms/{id}/faults?follow=true");
        std::thread::spawn(move || {
            let r = client.trace(&path, |line| {
                match line.strip_prefix("{\"dropped\":") {
                    Some(n) => {
                        let n = n.trim_end_matches('}').parse().unwrap_or(0);
                        dropped.fetch_add(n, Ordering::Relaxed);
                    }
                    None => {
                        events.fetch_add(1, Ordering::Relaxed);
                    }
                }
                true
            });
            assert!(r.is_none(), "trace stream: {r:?}");
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !has_listener(server, &id) {
        assert!(Instant::now() < deadline, "the trace listener never came");
        std::thread::sleep(Duration::from_millis(10));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let scraper = {
        let (stop, sock) = (stop.clone(), server.api_sock());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let r = pagefork_tests::request_within(
                    &sock,
                    "GET",
                    "/metrics",
                    None,
                    Duration::from_secs(10),
                );
                assert!(matches!(r, Some((200, _))), "scrape failed: {r:?}");
                n += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            n
        })
    };
    let t = Instant::now();
    let v = server.try_exec(&id, &op::touch(0, pages, false));
    let wall = t.elapsed();
    let v = v.unwrap_or_else(|v| panic!("touch on {id} failed: {v}"));
    stop.store(true, Ordering::Relaxed);
    let scrapes = scraper.join().expect("scraper");
    let vm = server.vm(&id);
    s.guest_us.push(v.elapsed_us as f64);
    s.wall_ms.push(wall.as_secs_f64() * 1e3);
    s.missing.push(vm.faults.missing as f64);
    server.delete_vm(&id);
    // The stream ends with the VM.
    listener.join().expect("listener");
    o.events.push(events.load(Ordering::Relaxed) as f64);
    o.dropped.push(dropped.load(Ordering::Relaxed) as f64);
    o.scrapes.push(scrapes as f64);
}

fn median(v: &[f64]) -> f64 {
    pagefork_benches::Stats::of(v).map_or(f64::NAN, |s| s.median)
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    if !pagefork_tests::require_kvm_uffd() {
        eprintln!("{BENCH}: needs /dev/kvm and /dev/userfaultfd");
        return ExitCode::FAILURE;
    }
    let mib = plan.lazy_mib;
    let pages = pages_of(mib);
    eprintln!("{BENCH}: {mib} MiB image, {} reps", plan.reps);
    let image = RandomImage::new(mib, 0x5eed);
    let server = TestServer::start();
    let whole = TestServer::start_with_args(&["--readahead-piece-kib", "0"]);

    let mut lazy: BTreeMap<u64, Samples> = BTreeMap::new();
    let mut readahead = Samples::default();
    let mut readahead_whole = Samples::default();
    let (mut phases, mut phases_whole, mut phases_fa0) =
        (String::new(), String::new(), String::new());
    let mut floor = Samples::default();
    let mut warm = Vec::new();
    let mut observed = Samples::default();
    let mut unobserved = Samples::default();
    let mut seen = Observed::default();
    // Issue 13: the same guest on 2 MiB hugetlb guest RAM, lazy with the
    // defaults and prefetched.
    let huge = pagefork_benches::wp_floor::reserve_hugepages(mib.div_ceil(2) + 64);
    if !huge {
        eprintln!(
            "{BENCH}: cannot reserve {} huge pages: no hugepage row",
            mib.div_ceil(2)
        );
    }
    let (mut lazy_huge, mut floor_huge) = (Samples::default(), Samples::default());
    let mut phases_huge = String::new();
    for rep in 0..plan.reps {
        for fa in FAULT_AROUND_KIB {
            // Pure fault-around: readahead off.
            let body = CreateVm {
                memory_source: Some(image.source()),
                fault_around_kib: Some(fa),
                readahead_kib: Some(0),
                ..new_vm(mib)
            };
            let served = run_once(
                &server,
                body.clone(),
                pages,
                lazy.entry(fa).or_default(),
                None,
            );
            if fa == 0 {
                phases_fa0 = served;
            }
            if fa == 0 {
                let plain = lazy[&0].guest_us.last().copied().unwrap_or(f64::NAN);
                unobserved.guest_us.push(plain);
                run_observed(&server, body.clone(), pages, &mut observed, &mut seen);
                run_observed(&server, body.clone(), pages, &mut observed, &mut seen);
                let _ = run_once(&server, body, pages, &mut unobserved, None);
            }
        }
        // The server's defaults: fault-around 64 KiB and sequential
        // readahead up to 2 MiB.
        let body = CreateVm {
            memory_source: Some(image.source()),
            ..new_vm(mib)
        };
        phases = run_once(&server, body.clone(), pages, &mut readahead, None);
        phases_whole = run_once(&whole, body, pages, &mut readahead_whole, None);
        let body = CreateVm {
            memory_source: Some(image.source()),
            prefetch: true,
            ..new_vm(mib)
        };
        let _ = run_once(&server, body, pages, &mut floor, Some(&mut warm));
        if huge {
            let body = CreateVm {
                memory_source: Some(image.source()),
                hugepages: Some(true),
                ..new_vm(mib)
            };
            phases_huge = run_once(&server, body, pages, &mut lazy_huge, None);
            let body = CreateVm {
                memory_source: Some(image.source()),
                hugepages: Some(true),
                prefetch: true,
                ..new_vm(mib)
            };
            let _ = run_once(&server, body, pages, &mut floor_huge, None);
        }
        eprintln!(
            "  rep {rep}: floor {:.0} us, fa64 {:.0} us",
            floor.guest_us[rep], lazy[&64].guest_us[rep]
        );
    }

    let floor_name = "prefetched by the server (no faults)";
    for (fa, s) in &lazy {
        let label = if *fa == 0 {
            "no fault-around (1 page per fault)".to_owned()
        } else {
            format!("fault-around {fa} KiB")
        };
        Row::new(
            BENCH,
            &format!("lazy.touch.fa{fa}"),
            TABLE,
            &format!("guest touches {mib} MiB ({pages} pages): lazy, {label}"),
            "µs",
            &s.guest_us,
            floor_name,
            &floor.guest_us,
        )
        .goal("close to 1 (report; issue 2)")
        .note(format!(
            "guest time (exec elapsed_us); faults.missing median {:.0} (prefetch: {:.0}){}",
            median(&s.missing),
            median(&floor.missing),
            if *fa == 0 {
                format!("; last run, {phases_fa0}")
            } else {
                String::new()
            }
        ))
        .emit();
    }
    Row::new(
        BENCH,
        "lazy.touch.readahead",
        TABLE,
        &format!("guest touches {mib} MiB ({pages} pages): lazy, server defaults (fault-around 64 KiB + readahead up to 2 MiB)"),
        "µs",
        &readahead.guest_us,
        floor_name,
        &floor.guest_us,
    )
    .goal("close to 1 (report; issue 2)")
    .note(format!(
        "guest time (exec elapsed_us); faults.missing median {:.0}; last run, {phases}",
        median(&readahead.missing)
    ))
    .emit();
    Row::new(
        BENCH,
        "lazy.touch.readahead_whole",
        TABLE,
        &format!("guest touches {mib} MiB: lazy, server defaults but each readahead window installed whole before the wake (--readahead-piece-kib 0: before issue 13)"),
        "µs",
        &readahead_whole.guest_us,
        floor_name,
        &floor.guest_us,
    )
    .goal("report (before issue 13)")
    .note(format!(
        "a second server, interleaved with row 5; faults.missing median {:.0}; last run, {phases_whole}",
        median(&readahead_whole.missing)
    ))
    .emit();
    Row::new(
        BENCH,
        "lazy.touch.piece_gain",
        TABLE,
        &format!("guest touches {mib} MiB, lazy, server defaults: readahead installed in 64 KiB pieces, the faulting one first"),
        "µs",
        &readahead.guest_us,
        "each window installed whole before the wake",
        &readahead_whole.guest_us,
    )
    .goal("< 1 (issue 13)")
    .note("same samples as the two rows above")
    .emit();
    Row::new(
        BENCH,
        "lazy.touch.warm",
        TABLE,
        &format!("guest touches {mib} MiB: prefetched by the server, first touch"),
        "µs",
        &floor.guest_us,
        "same guest, second touch (every page already mapped)",
        &warm,
    )
    .goal("≈ 1 (prefetch reaches memory speed)")
    .note("no uffd faults in either; the first touch still maps each page into the VMM and KVM")
    .emit();
    Row::new(
        BENCH,
        "lazy.touch.observed",
        TABLE,
        &format!(
            "guest touches {mib} MiB, lazy, no fault-around: a fault-trace listener + /metrics every 100 ms"
        ),
        "µs",
        &observed.guest_us,
        "the same, nobody listening (interleaved)",
        &unobserved.guest_us,
    )
    .goal("≤ 1.03 (issue 12)")
    .note(format!(
        "guest time; the listener read a median {:.0} events and was told of {:.0} dropped, \
         {:.0} scrapes per run; faults.missing median {:.0}; histogram and page log on in both",
        median(&seen.events),
        median(&seen.dropped),
        median(&seen.scrapes),
        median(&observed.missing)
    ))
    .emit();
    if huge {
        Row::new(
            BENCH,
            "lazy.touch.huge",
            TABLE,
            &format!("guest touches {mib} MiB on 2 MiB hugetlb pages: lazy, server defaults"),
            "µs",
            &lazy_huge.guest_us,
            "the same hugepage guest, prefetched by the server",
            &floor_huge.guest_us,
        )
        .goal("≤ 1.1 (issue 13)")
        .note(format!(
            "guest time; faults.missing median {:.0} (a fault installs its 2 MiB block; a sequential one up to 4 blocks after it too); 4 KiB pages in the same run: \
             lazy {:.0} µs, prefetched {:.0} µs; last run, {phases_huge}",
            median(&lazy_huge.missing),
            median(&readahead.guest_us),
            median(&floor.guest_us),
        ))
        .emit();
    }
    let s = &readahead;
    Row::new(
        BENCH,
        "lazy.wall.fa64",
        TABLE,
        &format!("create VM + guest touches {mib} MiB (wall, client side): lazy, server defaults"),
        "ms",
        &s.wall_ms,
        "create with prefetch + touch",
        &floor.wall_ms,
    )
    .goal("≤ 1 (lazy start must not cost more in total)")
    .note("includes VMM start; prefetch pays its copy before the guest runs")
    .emit();
    ExitCode::SUCCESS
}
