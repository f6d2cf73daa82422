//! Firecracker backend (issue 6): a Firecracker-like client touching all
//! of its anonymous guest memory (sequential and random page order), served
//! by pagefork's Firecracker listener — one page per fault, fault-around
//! 64 KiB, and a recorded working set — next to the baseline handler that
//! does what Firecracker's example on-demand handler does (one UFFDIO_COPY
//! of one 4 KiB page per fault from a MAP_PRIVATE mapping of the image).
//!
//! pagefork's client is `fc_client` (tests/src/bin), a separate process that
//! speaks Firecracker's handshake; it times its own touch loop, as the
//! baseline's in-process client does.
//!
//! Usage: `fc_restore [--quick]`. Prints JSON rows.

use std::process::ExitCode;

use pagefork_benches::fc_handler::BaselineVm;
use pagefork_benches::mapping::{Mapping, PAGE};
use pagefork_benches::{Plan, Row, Stats};
use pagefork_tests::{bin, pages_of, RandomImage, TestServer};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::json;

const BENCH: &str = "fc_restore";
const TABLE: &str = "Firecracker backend: restore touch (issue 6)";

/// Touch `order` on memory that already holds the image (no faults).
fn floor_us(image: &[u8], order: &[usize]) -> f64 {
    let m = Mapping::anonymous(image.len()).unwrap_or_else(|e| panic!("map floor memory: {e}"));
    // SAFETY: m is a fresh read-write mapping of image.len() bytes.
    unsafe { std::ptr::copy_nonoverlapping(image.as_ptr(), m.ptr(), image.len()) };
    let t = std::time::Instant::now();
    let mut sum = 0u64;
    for &p in order {
        // SAFETY: p * PAGE < image.len() == m.len().
        sum += u64::from(unsafe { m.ptr().add(p * PAGE).read_volatile() });
    }
    std::hint::black_box(sum);
    t.elapsed().as_secs_f64() * 1e6
}

/// pagefork's modes: (key suffix, label, fault_around_kib, readahead_kib,
/// working_set).
const MODES: [(&str, &str, u64, u64, bool); 4] = [
    ("single", "one page per fault", 0, 0, false),
    ("around", "fault-around 64 KiB", 64, 0, false),
    (
        "readahead",
        "fault-around 64 KiB + readahead up to 2 MiB (defaults)",
        64,
        2048,
        false,
    ),
    (
        "ws",
        "recorded working set + fault-around 64 KiB",
        64,
        0,
        true,
    ),
];

/// Run `fc_client` against `socket` with one touch command; returns the
/// client's touch time (µs) and the sum of the first byte of every page.
fn client_touch(
    socket: &std::path::Path,
    mib: u64,
    cmd: &str,
) -> Result<(f64, u64), Box<dyn std::error::Error>> {
    let out = std::process::Command::new(bin("fc_client"))
        .arg("--socket")
        .arg(socket)
        .arg("--mib")
        .arg(mib.to_string())
        .arg(cmd)
        .output()
        .map_err(|e| format!("cannot run fc_client: {e}"))?;
    if !out.status.success() {
        return Err(format!("fc_client failed: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(line.lines().next().unwrap_or_default())
        .map_err(|e| format!("fc_client printed no JSON: {e}"))?;
    let us = v["elapsed_us"].as_f64().ok_or("no elapsed_us")?;
    let sum = v["sum"].as_u64().ok_or("no sum")?;
    Ok((us, sum))
}

/// Touch times (µs) of pagefork in each mode, `reps` clients each.
fn pagefork_samples(
    server: &TestServer,
    image: &std::path::Path,
    mib: u64,
    cmd: &str,
    tag: &str,
    reps: usize,
    expected: u64,
) -> Result<Vec<Vec<f64>>, Box<dyn std::error::Error>> {
    let mut out = Vec::new();
    for (key, _, fa, ra, ws) in MODES {
        let socket = server.state_dir().join(format!("fc-{tag}-{key}.sock"));
        let (st, v) = server.api(
            "POST",
            "/v1/firecracker/listeners",
            Some(json!({
                "socket": socket,
                "memory_source": {"kind": "file", "path": image},
                "fault_around_kib": fa,
                "readahead_kib": ra,
                "working_set": ws,
            })),
        );
        if st != 201 {
            return Err(format!("cannot create listener: {v}").into());
        }
        if ws {
            // The first client records the working set; it is not measured.
            client_touch(&socket, mib, cmd)?;
            // The recording is taken when that client's hang-up is handled.
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        let mut times = Vec::new();
        for _ in 0..reps {
            let (us, sum) = client_touch(&socket, mib, cmd)?;
            if sum != expected {
                return Err(format!(
                    "fc_client read wrong bytes in mode {key} (sum {sum}, expected {expected})"
                )
                .into());
            }
            times.push(us);
        }
        out.push(times);
    }
    Ok(out)
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    let mib = plan.fc_mib;
    let pages = usize::try_from(pages_of(mib)).expect("pages fit in usize");
    let len = pages * PAGE;
    eprintln!("{BENCH}: {mib} MiB, {} reps", plan.reps);
    let image = RandomImage::new(mib, 0xf1c);
    let expected: u64 = (0..pages).map(|p| u64::from(image.bytes[p * PAGE])).sum();

    let sequential: Vec<usize> = (0..pages).collect();
    let mut random = sequential.clone();
    random.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));

    let server = TestServer::start();
    for (key, label, order, cmd) in [
        ("fc.seq", "sequential", &sequential, "touch-seq"),
        ("fc.rand", "random", &random, "touch-random:7"),
    ] {
        let pagefork = match pagefork_samples(
            &server,
            image.file.path(),
            mib,
            cmd,
            label,
            plan.reps,
            expected,
        ) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("{BENCH}: pagefork {label}: {e}");
                return ExitCode::FAILURE;
            }
        };
        let mut times = Vec::new();
        let mut copies = 0;
        for _ in 0..plan.reps {
            let vm = match BaselineVm::start(image.file.path(), len) {
                Ok(vm) => vm,
                Err(e) => {
                    eprintln!("{BENCH}: cannot start the baseline handler: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let (took, sum) = vm.touch(order);
            let stats = match vm.finish() {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("{BENCH}: baseline handler failed: {e}");
                    return ExitCode::FAILURE;
                }
            };
            if sum != expected {
                eprintln!("{BENCH}: client read wrong bytes (sum {sum}, expected {expected})");
                return ExitCode::FAILURE;
            }
            copies = stats.copies;
            times.push(took.as_secs_f64() * 1e6);
        }
        let floor = Stats::of(
            &(0..plan.reps)
                .map(|_| floor_us(&image.bytes, order))
                .collect::<Vec<_>>(),
        )
        .map_or(f64::NAN, |s| s.median);
        for ((suffix, mode, _, _, _), samples) in MODES.iter().zip(&pagefork) {
            Row::new(
                BENCH,
                &format!("{key}.{suffix}"),
                TABLE,
                &format!("client touches {mib} MiB of anonymous memory ({pages} pages, {label} order): pagefork {mode}"),
                "µs",
                samples,
                "one UFFDIO_COPY of one 4 KiB page per fault (Firecracker's example handler)",
                &times,
            )
            .goal("faster than the baseline (ratio < 1)")
            .note(format!(
                "baseline did {copies} UFFDIO_COPYs; same touch on pre-populated memory: {floor:.0} µs"
            ))
            .emit();
        }
    }
    ExitCode::SUCCESS
}
