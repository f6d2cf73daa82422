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
//! Issue 13 (the fault path): the one-page-per-fault client also runs
//! against a second server that polls a uffd for 50 µs after serving it
//! (`--fault-poll-us 50`; off by default, these rows say why), and once
//! more per repetition
//! timing every read (`touch-seq-latency`), next to the baseline timed the
//! same way: the p50/p99 of one fault's round trip as the faulting thread
//! sees it, with the server's own time by phase in the notes.
//!
//! Usage: `fc_restore [--quick]`. Prints JSON rows.

use std::process::ExitCode;

use pagefork_benches::fc_handler::BaselineVm;
use pagefork_benches::mapping::{Mapping, PAGE};
use pagefork_benches::{Plan, Row, Stats};
use pagefork_tests::{bin, file_source, pages_of, RandomImage, TestServer};
use proto::api::{CreateListener, RunState, VmInfo, VmKind};
use rand::seq::SliceRandom;
use rand::SeedableRng;

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

/// Create a Firecracker listener on `server` serving `image` one page per
/// fault; returns its socket.
fn single_listener(
    server: &TestServer,
    image: &std::path::Path,
    tag: &str,
) -> Result<std::path::PathBuf, Box<dyn std::error::Error>> {
    let l = server
        .try_add_listener(&CreateListener {
            fault_around_kib: Some(0),
            readahead_kib: Some(0),
            ..server.listener_request(&format!("fc-{tag}"), file_source(image))
        })
        .map_err(|v| format!("cannot create listener: {v}"))?;
    Ok(l.socket.into())
}

/// One `touch-seq-latency` client on `socket`, held connected until the
/// server's view of its VM (`GET /v1/vms/{id}`) is read; returns the
/// client's line and that view.
fn client_latency(
    server: &TestServer,
    socket: &std::path::Path,
    mib: u64,
) -> Result<(serde_json::Value, VmInfo), Box<dyn std::error::Error>> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(bin("fc_client"))
        .arg("--socket")
        .arg(socket)
        .arg("--mib")
        .arg(mib.to_string())
        .args(["touch-seq-latency", "hold"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run fc_client: {e}"))?;
    let mut out = std::io::BufReader::new(child.stdout.take().ok_or("no stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let touched: serde_json::Value =
        serde_json::from_str(&line).map_err(|e| format!("fc_client printed no JSON: {e}"))?;
    // The newest running Firecracker VM is this client's.
    let vm = server
        .vm_ids()
        .iter()
        .rev()
        .map(|id| server.vm(id))
        .find(|v| v.kind == VmKind::Firecracker && v.state == RunState::Running)
        .ok_or("the client's VM is not listed")?;
    drop(child.stdin.take());
    // The client prints one more line (the hold's) before it exits.
    std::io::copy(&mut out, &mut std::io::sink())?;
    let status = child.wait()?;
    if !status.success() {
        return Err(format!("fc_client failed: {status}").into());
    }
    Ok((touched, vm))
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
        let l = server
            .try_add_listener(&CreateListener {
                fault_around_kib: Some(fa),
                readahead_kib: Some(ra),
                working_set: ws,
                ..server.listener_request(&format!("fc-{tag}-{key}"), file_source(image))
            })
            .map_err(|v| format!("cannot create listener: {v}"))?;
        let socket = std::path::PathBuf::from(l.socket);
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
    // The same server polling each uffd for 50 µs after serving it.
    let polling = TestServer::start_with_args(&["--fault-poll-us", "50"]);
    if let Err(e) = latency_rows(
        &server,
        &polling,
        image.file.path(),
        mib,
        len,
        &plan,
        expected,
    ) {
        eprintln!("{BENCH}: fault latency: {e}");
        return ExitCode::FAILURE;
    }
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
        let socket = match single_listener(&polling, image.file.path(), label) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("{BENCH}: {e}");
                return ExitCode::FAILURE;
            }
        };
        let mut single_poll = Vec::new();
        for _ in 0..plan.reps {
            match client_touch(&socket, mib, cmd) {
                Ok((us, sum)) if sum == expected => single_poll.push(us),
                Ok((_, sum)) => {
                    eprintln!("{BENCH}: fc_client read wrong bytes with polling (sum {sum})");
                    return ExitCode::FAILURE;
                }
                Err(e) => {
                    eprintln!("{BENCH}: pagefork {label} with polling: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
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
        Row::new(
            BENCH,
            &format!("{key}.single_poll"),
            TABLE,
            &format!("client touches {mib} MiB ({label} order): pagefork one page per fault, uffd polled 50 µs after each fault (--fault-poll-us 50)"),
            "µs",
            &single_poll,
            "one UFFDIO_COPY of one 4 KiB page per fault (Firecracker's example handler)",
            &times,
        )
        .goal("report (issue 13: a poll window, off by default)")
        .note("a second server in the same run, started with --fault-poll-us 50")
        .emit();
        Row::new(
            BENCH,
            &format!("{key}.poll_gain"),
            TABLE,
            &format!("client touches {mib} MiB ({label} order), one page per fault: pagefork polling 50 µs after each fault"),
            "µs",
            &single_poll,
            "pagefork defaults (no polling)",
            &pagefork[0],
        )
        .goal("< 1 to turn polling on (issue 13)")
        .note("same samples as the one-page-per-fault rows above")
        .emit();
    }
    ExitCode::SUCCESS
}

/// Issue 13's rows: one fault's round trip as the faulting thread sees it
/// (p50 and p99 of a sequential one-page-per-fault touch), pagefork with
/// its defaults and with a 50 µs poll window next to the baseline handler,
/// all timed the same way; the server's phases go in the notes.
fn latency_rows(
    server: &TestServer,
    polling: &TestServer,
    image: &std::path::Path,
    mib: u64,
    len: usize,
    plan: &Plan,
    expected: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let order: Vec<usize> = (0..len / PAGE).collect();
    let plain = single_listener(server, image, "latency")?;
    let polled_socket = single_listener(polling, image, "latency")?;
    let (mut ours, mut poll, mut base) =
        (Samples::default(), Samples::default(), Samples::default());
    let (mut ours_vm, mut poll_vm): (Option<VmInfo>, Option<VmInfo>) = (None, None);
    for _ in 0..plan.reps {
        for (srv, socket, s, vm) in [
            (server, &plain, &mut ours, &mut ours_vm),
            (polling, &polled_socket, &mut poll, &mut poll_vm),
        ] {
            let (touched, info) = client_latency(srv, socket, mib)?;
            if touched["sum"].as_u64() != Some(expected) {
                return Err(format!("fc_client read wrong bytes: {touched}").into());
            }
            s.push(&touched["p50_ns"], &touched["p99_ns"]);
            s.service_p50
                .push(pagefork_benches::phases::p50_p99_us(&info, "service").0 * 1e3);
            s.install_p50
                .push(pagefork_benches::phases::p50_p99_us(&info, "install").0 * 1e3);
            *vm = Some(info);
        }
        let vm = BaselineVm::start(image, len)?;
        let (_, sum, p50, p99) = vm.touch_latency(&order);
        let stats = vm.finish()?;
        base.install_p50.push(stats.copy_percentile(50) as f64);
        if sum != expected {
            return Err(format!("baseline read wrong bytes (sum {sum})").into());
        }
        base.p50.push(p50 as f64);
        base.p99.push(p99 as f64);
    }
    let handler = "Firecracker's example handler, timed the same way";
    for (q, ours_q, poll_q, base_q) in [
        ("p50", &ours.p50, &poll.p50, &base.p50),
        ("p99", &ours.p99, &poll.p99, &base.p99),
    ] {
        Row::new(
            BENCH,
            &format!("fc.seq.latency_{q}"),
            TABLE,
            &format!("one fault's round trip seen by the faulting thread, {q} (sequential, one page per fault, {mib} MiB): pagefork"),
            "ns",
            ours_q,
            handler,
            base_q,
        )
        .goal("≤ 0.9 (issue 13)")
        .note(format!(
            "last run: {}; with a 50 µs poll window {q} median {:.0} ns",
            ours_vm
                .as_ref()
                .map_or_else(String::new, pagefork_benches::phases::describe),
            pagefork_benches::Stats::of(poll_q).map_or(f64::NAN, |s| s.median)
        ))
        .emit();
    }
    Row::new(
        BENCH,
        "fc.seq.service_p50",
        TABLE,
        &format!("server's time on one fault event, p50 (sequential, one page per fault, {mib} MiB): pagefork"),
        "ns",
        &ours.service_p50,
        "the same with a 50 µs poll window",
        &poll.service_p50,
    )
    .goal("report (issue 13)")
    .note(format!(
        "from faults.phases of GET /v1/vms/{{id}}; with the poll window, last run: {}",
        poll_vm
            .as_ref()
            .map_or_else(String::new, pagefork_benches::phases::describe)
    ))
    .emit();
    Row::new(
        BENCH,
        "fc.seq.install_p50",
        TABLE,
        &format!("one UFFDIO_COPY of one 4 KiB page into the faulting client, p50 (sequential, {mib} MiB): pagefork's install phase"),
        "ns",
        &ours.install_p50,
        "the baseline handler's UFFDIO_COPY, timed around the ioctl",
        &base.install_p50,
    )
    .goal("report: the kernel's part of a fault (the floor)")
    .note(format!(
        "the ioctl wakes the faulting thread, so its time includes that wake; with a 50 µs poll window: {:.0} ns",
        pagefork_benches::Stats::of(&poll.install_p50).map_or(f64::NAN, |s| s.median)
    ))
    .emit();
    Ok(())
}

/// Per-repetition quantiles of one configuration.
#[derive(Default)]
struct Samples {
    p50: Vec<f64>,
    p99: Vec<f64>,
    service_p50: Vec<f64>,
    install_p50: Vec<f64>,
}

impl Samples {
    fn push(&mut self, p50: &serde_json::Value, p99: &serde_json::Value) {
        self.p50.push(p50.as_f64().unwrap_or(f64::NAN));
        self.p99.push(p99.as_f64().unwrap_or(f64::NAN));
    }
}
