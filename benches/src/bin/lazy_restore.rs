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
//! Prints JSON rows (see `pagefork_benches::Row`).
//!
//! Usage: `lazy_restore [--quick]`.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

use pagefork_benches::plan::FAULT_AROUND_KIB;
use pagefork_benches::{Plan, Row};
use pagefork_tests::{fault_counter, pages_of, RandomImage, TestServer};
use serde_json::{json, Value};

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
    body: Value,
    pages: u64,
    s: &mut Samples,
    warm: Option<&mut Vec<f64>>,
) {
    let t = Instant::now();
    let id = server.create_vm(body);
    let (status, v) = server.try_exec(
        &id,
        json!({"op": "touch", "start_page": 0, "pages": pages, "write": false}),
    );
    let wall = t.elapsed();
    assert_eq!(status, 200, "touch on {id} failed: {v}");
    let guest = v["elapsed_us"]
        .as_f64()
        .unwrap_or_else(|| panic!("no elapsed_us in {v}"));
    let vm = server.vm(&id);
    if let Some(warm) = warm {
        let (status, v) = server.try_exec(
            &id,
            json!({"op": "touch", "start_page": 0, "pages": pages, "write": false}),
        );
        assert_eq!(status, 200, "second touch on {id} failed: {v}");
        warm.push(
            v["elapsed_us"]
                .as_f64()
                .unwrap_or_else(|| panic!("no elapsed_us in {v}")),
        );
    }
    s.guest_us.push(guest);
    s.wall_ms.push(wall.as_secs_f64() * 1e3);
    s.missing.push(fault_counter(&vm, "missing") as f64);
    let (status, v) = server.api("DELETE", &format!("/v1/vms/{id}"), None);
    assert!(status < 300, "DELETE {id} failed: {v}");
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

    let mut lazy: BTreeMap<u64, Samples> = BTreeMap::new();
    let mut readahead = Samples::default();
    let mut floor = Samples::default();
    let mut warm = Vec::new();
    for rep in 0..plan.reps {
        for fa in FAULT_AROUND_KIB {
            // Pure fault-around: readahead off.
            let body = json!({"memory_mib": mib, "memory_source": image.source(),
                              "fault_around_kib": fa, "readahead_kib": 0});
            run_once(&server, body, pages, lazy.entry(fa).or_default(), None);
        }
        // The server's defaults: fault-around 64 KiB and sequential
        // readahead up to 2 MiB.
        let body = json!({"memory_mib": mib, "memory_source": image.source()});
        run_once(&server, body, pages, &mut readahead, None);
        let body = json!({"memory_mib": mib, "memory_source": image.source(), "prefetch": true});
        run_once(&server, body, pages, &mut floor, Some(&mut warm));
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
            "guest time (exec elapsed_us); faults.missing median {:.0} (prefetch: {:.0})",
            median(&s.missing),
            median(&floor.missing)
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
        "guest time (exec elapsed_us); faults.missing median {:.0}",
        median(&readahead.missing)
    ))
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
