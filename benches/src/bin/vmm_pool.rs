//! VM start from a warm VMM pool (issue 13), 256 MiB guests with a quarter
//! of memory written, each figure next to the same operation on a server
//! without a pool (a `vmm` process spawned per VM), in one run:
//!
//! 1. Fork of a template (a paused VM used only as a source) → the child
//!    answers `exec identity`; p50 and p99 over many samples.
//! 2. Create from a snapshot of that template → the VM answers identity.
//! 3. Live fork of a running VM → the child answers, next to the parent's
//!    pause (goal: pause + 1 ms).
//! 4. Fan-out: 100 and 1,000 children (quick: 10 and 40) of the template in
//!    one request → all answer identity.
//! 5. Host memory per child once the 1,000 answer: each child's VMM
//!    (proportional set size), the server's RSS and host Shmem added.
//!
//! Requests go straight to the API socket (a fresh connection each, as a
//! client would), never through helper threads, so the figures include the
//! HTTP round trips and nothing else of the bench. Between samples the
//! bench waits until the pool is full again (refills run in the
//! background, after a take).
//!
//! Usage: `vmm_pool [--quick]`. Prints JSON rows.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use pagefork_benches::sys::{meminfo_kib, proc_status_kib};
use pagefork_benches::{Plan, Row, Stats};
use pagefork_tests::{body, from_snapshot, new_vm, op, pages_of, request_within, TestServer};
use proto::api::{CreateSnapshot, ForkRequest, SnapshotMode};
use serde_json::Value;

const BENCH: &str = "vmm_pool";
const T_START: &str = "VM start from a warm VMM pool (issue 13)";
const T_FAN: &str = "Fan-out from a warm VMM pool (issue 13)";
const MIB: u64 = 256;
const TIMEOUT: Duration = Duration::from_secs(120);

/// One API call on a fresh connection; panics on no answer or a status
/// other than `want`.
fn call(sock: &Path, method: &str, path: &str, body: Option<Value>, want: u16) -> Value {
    let (status, text) = request_within(sock, method, path, body.as_ref(), TIMEOUT)
        .unwrap_or_else(|| panic!("{method} {path}: no answer within {TIMEOUT:?}"));
    assert_eq!(status, want, "{method} {path} answered {status}: {text}");
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

fn identity(sock: &Path, id: &str) {
    call(
        sock,
        "POST",
        &format!("/v1/vms/{id}/exec"),
        Some(body(&op::identity())),
        200,
    );
}

fn delete(sock: &Path, id: &str) {
    call(sock, "DELETE", &format!("/v1/vms/{id}"), None, 200);
}

fn ids(v: &Value, key: &str) -> Vec<String> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} in {v}"))
        .iter()
        .map(|c| c.as_str().expect("an id is a string").to_owned())
        .collect()
}

/// Wait until the pool of `server` holds `want` ready VMMs.
fn wait_pool(server: &TestServer, want: usize) {
    if want > 0 {
        server.wait_pool_ready(want as u64, Duration::from_secs(300));
    }
}

/// Every VM in `ids` answers identity, from `threads` client threads.
fn all_answer(sock: &Path, ids: &[String], threads: usize) {
    let chunk = ids.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        for part in ids.chunks(chunk) {
            s.spawn(move || {
                for id in part {
                    identity(sock, id);
                }
            });
        }
    });
}

/// The `p`th percentile (nearest rank) of `v`.
fn pct(v: &[f64], p: usize) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[(p * v.len()).div_ceil(100).clamp(1, v.len()) - 1]
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// A server for this bench: a pool of `pool` VMMs, room for the fan-out.
fn server(pool: usize) -> TestServer {
    let pool = pool.to_string();
    TestServer::start_with_args(&[
        "--vmm-pool",
        &pool,
        "--memory-budget-mib",
        "100000000",
        "--max-vms",
        "4096",
    ])
}

/// A paused 256 MiB template with a quarter written (and, with `snap`, a
/// full snapshot of it under that name); returns its id.
fn template(sock: &Path, snap: Option<&str>) -> String {
    let v = call(sock, "POST", "/v1/vms", Some(body(&new_vm(MIB))), 201);
    let id = v["id"].as_str().expect("id").to_owned();
    call(
        sock,
        "POST",
        &format!("/v1/vms/{id}/exec"),
        Some(body(&op::fill(0, pages_of(MIB) / 4, 7))),
        200,
    );
    if let Some(name) = snap {
        call(
            sock,
            "POST",
            &format!("/v1/vms/{id}/snapshots"),
            Some(body(&CreateSnapshot {
                name: name.to_owned(),
                mode: SnapshotMode::Full,
                compress: false,
            })),
            201,
        );
    }
    call(sock, "POST", &format!("/v1/vms/{id}/pause"), None, 200);
    id
}

/// Samples of one kind of start on one server.
#[derive(Default)]
struct Starts {
    template_fork_ms: Vec<f64>,
    restore_ms: Vec<f64>,
    live_fork_ms: Vec<f64>,
    live_pause_ms: Vec<f64>,
    live_pause_only_ms: Vec<f64>,
}

fn starts(server: &TestServer, pool: usize, n: usize) -> Starts {
    let sock = &server.api_sock();
    let mut s = Starts::default();
    let snap = format!("pool-bench-{pool}");
    let tpl = template(sock, Some(&snap));
    // The first fork protects the template's pages; later ones find them
    // protected (as a template forked again and again does).
    let first = call(sock, "POST", &format!("/v1/vms/{tpl}/fork"), None, 201);
    for c in ids(&first, "children") {
        delete(sock, &c);
    }
    for _ in 0..n {
        wait_pool(server, pool);
        let t = Instant::now();
        let v = call(sock, "POST", &format!("/v1/vms/{tpl}/fork"), None, 201);
        let child = ids(&v, "children").remove(0);
        identity(sock, &child);
        s.template_fork_ms.push(ms(t));
        delete(sock, &child);

        wait_pool(server, pool);
        let t = Instant::now();
        let v = call(
            sock,
            "POST",
            "/v1/vms",
            Some(body(&from_snapshot(&snap))),
            201,
        );
        let id = v["id"].as_str().expect("id").to_owned();
        identity(sock, &id);
        s.restore_ms.push(ms(t));
        delete(sock, &id);
    }
    // Live forks: the template runs again.
    call(sock, "POST", &format!("/v1/vms/{tpl}/resume"), None, 200);
    for _ in 0..n {
        wait_pool(server, pool);
        let t = Instant::now();
        let v = call(sock, "POST", &format!("/v1/vms/{tpl}/fork"), None, 201);
        let child = ids(&v, "children").remove(0);
        identity(sock, &child);
        s.live_fork_ms.push(ms(t));
        // The parent's part of the fork: its pause, and the write-protect
        // armed just before it while it ran (inside the pause until the
        // protection moved out of it).
        let pause = v["pause_us"].as_f64().unwrap_or(f64::NAN);
        let ahead = v["phases"]["armed_ahead_us"].as_f64().unwrap_or(f64::NAN);
        s.live_pause_ms.push((pause + ahead) / 1e3);
        s.live_pause_only_ms.push(pause / 1e3);
        delete(sock, &child);
    }
    delete(sock, &tpl);
    call(sock, "DELETE", &format!("/v1/snapshots/{snap}"), None, 200);
    s
}

/// Samples of one fan-out size on one server, and the memory per child
/// of the last repetition.
#[derive(Default)]
struct Fan {
    ms: Vec<f64>,
    vmm_pss_kib: f64,
    server_rss_kib: f64,
    shmem_kib: f64,
}

fn pss_kib(pid: u64) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    text.lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

fn fan_out(server: &TestServer, pool: usize, count: usize, reps: usize) -> Fan {
    let sock = server.api_sock();
    let tpl = template(&sock, None);
    let mut f = Fan::default();
    for _ in 0..reps {
        wait_pool(server, pool);
        let (shmem0, rss0) = (meminfo_kib("Shmem"), proc_status_kib(server.pid(), "VmRSS"));
        let t = Instant::now();
        let v = call(
            &sock,
            "POST",
            &format!("/v1/vms/{tpl}/fork"),
            Some(body(&ForkRequest {
                count: u32::try_from(count).expect("fork count fits in u32"),
            })),
            201,
        );
        let children = ids(&v, "children");
        all_answer(&sock, &children, 8);
        f.ms.push(ms(t));
        let (shmem1, rss1) = (meminfo_kib("Shmem"), proc_status_kib(server.pid(), "VmRSS"));
        let n = children.len() as f64;
        let pss: f64 = children
            .iter()
            .filter_map(|c| {
                let v = call(&sock, "GET", &format!("/v1/vms/{c}"), None, 200);
                v["pid"].as_u64().and_then(pss_kib)
            })
            .sum();
        f.vmm_pss_kib = pss / n;
        let delta = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => (a as f64 - b as f64) / n,
            _ => f64::NAN,
        };
        f.server_rss_kib = delta(rss1, rss0);
        f.shmem_kib = delta(shmem1, shmem0);
        for c in &children {
            delete(&sock, c);
        }
    }
    delete(&sock, &tpl);
    f
}

fn note_pcts(with: &[f64], without: &[f64]) -> String {
    format!(
        "p50 / p99 with the pool {:.2} / {:.2} ms, without {:.2} / {:.2} ms (n = {})",
        pct(with, 50),
        pct(with, 99),
        pct(without, 50),
        pct(without, 99),
        with.len()
    )
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    if !pagefork_tests::require_kvm_uffd() {
        eprintln!("{BENCH}: needs /dev/kvm and /dev/userfaultfd");
        return ExitCode::FAILURE;
    }
    let n = if plan.quick { 4 } else { 40 };
    let pool_small = 4;
    let (fan_small, fan_large) = if plan.quick { (10, 40) } else { (100, 1000) };
    let fan_reps = if plan.quick { 1 } else { 3 };

    eprintln!("{BENCH}: single starts, {n} samples each, pool {pool_small} vs none");
    let (with, without) = {
        let pooled = server(pool_small);
        let cold = server(0);
        let with = starts(&pooled, pool_small, n);
        let without = starts(&cold, 0, n);
        (with, without)
    };
    eprintln!("{BENCH}: fan-out of {fan_small} and {fan_large}");
    let (fan_with, fan_without, big_with, big_without) = {
        let pooled = server(fan_large);
        let cold = server(0);
        wait_pool(&pooled, fan_large);
        let fw = fan_out(&pooled, fan_large, fan_small, fan_reps);
        let fo = fan_out(&cold, 0, fan_small, fan_reps);
        let bw = fan_out(&pooled, fan_large, fan_large, fan_reps);
        let bo = fan_out(&cold, 0, fan_large, 1);
        (fw, fo, bw, bo)
    };

    let sz = format!("{MIB} MiB");
    Row::new(
        BENCH,
        "pool.template",
        T_START,
        &format!(
            "{sz} template (paused, a quarter written): fork → child answers identity, pooled VMM"
        ),
        "ms",
        &with.template_fork_ms,
        "the same, a vmm process started per child (no pool)",
        &without.template_fork_ms,
    )
    .goal("≤ 1 ms p50 (zeroboot: 0.79 ms p50, 1.74 ms p99)")
    .note(note_pcts(&with.template_fork_ms, &without.template_fork_ms))
    .emit();
    Row::new(
        BENCH,
        "pool.restore",
        T_START,
        &format!("create from a full snapshot of the {sz} template → answers identity, pooled VMM"),
        "ms",
        &with.restore_ms,
        "the same, a vmm process started per VM (no pool)",
        &without.restore_ms,
    )
    .goal("≤ 1 ms p50")
    .note(note_pcts(&with.restore_ms, &without.restore_ms))
    .emit();
    let pause = Stats::of(&with.live_pause_ms).map_or(f64::NAN, |s| s.median);
    Row::new(
        BENCH,
        "pool.live",
        T_START,
        &format!("live fork of a running {sz} VM → child answers identity, pooled VMM"),
        "ms",
        &with.live_fork_ms,
        "the parent's part of the same forks: its pause (pause_us) and the write-protect armed before it (phases.armed_ahead_us)",
        &with.live_pause_ms,
    )
    .goal("≤ parent pause + 1 ms")
    .note(format!(
        "median fork-to-answer minus the median parent's part = {:.2} ms; the pause alone: median {:.2} ms; {}",
        Stats::of(&with.live_fork_ms).map_or(f64::NAN, |s| s.median) - pause,
        Stats::of(&with.live_pause_only_ms).map_or(f64::NAN, |s| s.median),
        note_pcts(&with.live_fork_ms, &without.live_fork_ms)
    ))
    .emit();
    for (key, count, w, wo, goal) in [
        (
            "pool.fanout_small",
            fan_small,
            &fan_with,
            &fan_without,
            "≤ 100 ms for 100",
        ),
        (
            "pool.fanout_large",
            fan_large,
            &big_with,
            &big_without,
            "≤ 800 ms for 1,000 (zeroboot: 815 ms)",
        ),
    ] {
        Row::new(
            BENCH,
            key,
            T_FAN,
            &format!("{count} children of the {sz} template in one fork request → all answer identity, pooled VMMs"),
            "ms",
            &w.ms,
            "the same, a vmm process started per child (no pool)",
            &wo.ms,
        )
        .goal(goal)
        .note("identity requests from 8 client threads, each on a fresh API connection")
        .emit();
    }
    let per_child = |f: &Fan| f.vmm_pss_kib + f.server_rss_kib.max(0.0) + f.shmem_kib.max(0.0);
    Row::new(
        BENCH,
        "pool.child_memory",
        T_FAN,
        &format!("host memory per child once all {fan_large} answer, pooled VMMs"),
        "KiB",
        &[per_child(&big_with)],
        "the same without the pool",
        &[per_child(&big_without)],
    )
    .goal("≤ 265 KB beside the child's own written pages (zeroboot: ~265 KB)")
    .note(format!(
        "with the pool: vmm PSS {:.0} KiB + server RSS {:.1} KiB + Shmem {:.1} KiB per child; \
         without: {:.0} + {:.1} + {:.1} KiB",
        big_with.vmm_pss_kib,
        big_with.server_rss_kib,
        big_with.shmem_kib,
        big_without.vmm_pss_kib,
        big_without.server_rss_kib,
        big_without.shmem_kib
    ))
    .emit();
    ExitCode::SUCCESS
}
