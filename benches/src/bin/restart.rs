//! Restarts of the server under load: how long busy VMs stall when the
//! serving process dies (SIGKILL) or hands over (`POST
//! /v1/server/upgrade`), and whether the fault path is as fast after.
//!
//! `uffd-server` runs under its keeper (the harness starts it with a state
//! directory), which holds the VMs' memory and userfaultfds while no
//! process serves: a fault that comes meanwhile waits in the kernel, and
//! the next process takes every VM back (adopts it) and serves it. For
//! N = 1, 100 and 1000 VMs (quick: 1 and 10), each a fork of one VM on
//! zeroes (no fault-around: one fault per page):
//!
//! 1. Crash: every VM runs a `fill` over all its guest RAM (fresh pages,
//!    one fault each), sized so that it runs through both restarts below;
//!    once each VM has installed pages, t0 is taken and the serving
//!    process is SIGKILLed. The keeper starts the next one, which adopts
//!    every VM. Per VM, `adopted.at_unix_us` and
//!    `adopted.first_fault_unix_us` (when the new process served its first
//!    fault; `GET /v1/vms/{id}`, read for all VMs at once from
//!    `GET /v1/vms`): the stall is first fault − t0. The row gives p50 and the
//!    spread over VMs (p99 and max in the note), against the time from t0
//!    until `GET /v1/health` answered the new pid; the note has the
//!    process's `recovery_ms` (its start → serving the adopted VMs).
//! 2. Handover: the same fills still running, t0 is taken right before
//!    `POST /v1/server/upgrade`; the old process serves faults until it
//!    exits, so first fault − t0 bounds the stall from above.
//!
//! A VM whose fill had ended by t0 (all its pages resident, no fault
//! after) is not stalled and is left out (the note counts them); a busy VM
//! the new process never serves within [`WAIT`] fails the bench. Each
//! round checks every VM's pages afterwards (`verify`). Small counts are
//! repeated (fresh VMs each round) and their VMs' stalls pooled.
//!
//! 3. Fault path: one VM fills fresh pages ([`PROBE_PAGES`] per fill)
//!    before and after each crash and each handover: pages per second in
//!    the guest (the op's `elapsed_us`), after / before.
//!
//! The VMs' memory and count are checked against MemAvailable and the
//! server's admission (a fork it refuses); a count that does not fit is
//! measured at the largest count that does, and the row says so.
//!
//! Usage: `restart [--quick] [--counts 1,5]` (`--counts` overrides the VM
//! counts for a quick look; the report then lacks rows). Prints JSON rows.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use nix::sys::signal::Signal;
use pagefork_benches::sys::meminfo_kib;
use pagefork_benches::{Plan, Row, Stats};
use pagefork_tests::{new_vm, op, signal, OneShot, OneShotError, Reply, Sent, TestServer};
use proto::api::{CreateVm, ExecRequest, ForkRequest, Health};
use serde_json::{json, Value};

const BENCH: &str = "restart";
const T_STALL: &str = "Server restart: fault stall of busy VMs (crash and handover)";
const T_FAULT: &str = "Server restart: the fault path before and after";
/// Fresh pages of one fill of the fault-path VM.
const PROBE_PAGES: u64 = 2048;
/// Fills of the fault-path VM on each side of each restart.
const PROBE_FILLS: usize = 3;
/// Client threads polling VMs at once.
const THREADS: usize = 8;
/// How long anything may take: a restart, a VM's first fault after it,
/// a fill to start or to end.
const WAIT: Duration = Duration::from_secs(180);
/// Statuses a request may get while a server restarts: 503 (handing
/// over), 409 and 502 (the VM's VMM has not rejoined yet), 504.
const TRANSIENT: [u16; 4] = [409, 502, 503, 504];
/// Children per fork request when making the VMs.
const FORK_CHUNK: u32 = 250;
/// Smallest guest RAM of a VM, MiB, and the share of MemAvailable the
/// VMs' memory may take at most.
const MIN_MIB: u64 = 4;
const MEM_SHARE: f64 = 0.5;
/// Host memory a VM takes besides its guest RAM (its VMM), MiB, at most.
const VMM_MIB: f64 = 4.0;
/// Seed of the fills.
const SEED: u64 = 29;

/// Pages read back wrong (a bench over wrong memory is no bench), and
/// busy VMs never served after a restart.
static WRONG: AtomicU64 = AtomicU64::new(0);
static STUCK: AtomicU64 = AtomicU64::new(0);

// ------------------------------------------------------------ the wire --

/// What the bench failed at.
#[derive(Debug, thiserror::Error)]
enum Error {
    #[error("{what}: no whole answer")]
    Request {
        what: String,
        #[source]
        source: OneShotError,
    },
    #[error("{what}: the server answered {reply}")]
    Answer { what: String, reply: Reply },
    #[error("still failing after {WAIT:?}")]
    Retries(#[source] Box<Error>),
    #[error("cannot encode an exec request")]
    EncodeExec(#[source] serde_json::Error),
    #[error("GET /v1/vms answered no list of VMs: {0}")]
    ListVms(Value),
    #[error("no health answer with {what} within {WAIT:?}; the last: {last:?}")]
    WaitHealth {
        what: String,
        last: Option<Box<Health>>,
    },
    #[error("the server runs without a keeper (the bench needs a state directory): {0:?}")]
    NoKeeper(Box<Health>),
    #[error("POST /v1/server/upgrade answered {answer}, not the serving process's pid {pid}")]
    Upgrade { answer: Value, pid: u32 },
    #[error("after a {kind}, the new process reports another start or lost VMs: {health:?}")]
    Restart {
        kind: &'static str,
        health: Box<Health>,
    },
    #[error("{0} is not listed any more")]
    Unlisted(String),
    #[error("gave up polling GET /v1/vms after {WAIT:?}: a VM never got where it was awaited")]
    Poll,
}

type Result<T> = std::result::Result<T, Error>;

/// The API's client, retrying what a restart makes fail.
struct Http {
    /// One connection per request (the harness's [`pagefork_tests::Api`]
    /// fails on a broken one).
    raw: OneShot,
}

impl Http {
    fn new(sock: PathBuf) -> Self {
        Http {
            raw: OneShot::new(sock, WAIT),
        }
    }

    fn once(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Reply> {
        self.raw
            .request(method, path, body)
            .map_err(|source| Error::Request {
                what: format!("{method} {path}"),
                source,
            })
    }

    /// Send until the answer has status `ok`; broken connections and
    /// [`TRANSIENT`] statuses are retried for up to [`WAIT`].
    fn call(&self, method: &str, path: &str, body: Option<&Value>, ok: u16) -> Result<Value> {
        let deadline = Instant::now() + WAIT;
        loop {
            let last = match self.once(method, path, body) {
                Ok(r) if r.status == ok => return Ok(r.body),
                Ok(r) => {
                    let transient = TRANSIENT.contains(&r.status);
                    let e = Error::Answer {
                        what: format!("{method} {path}"),
                        reply: r,
                    };
                    if !transient {
                        return Err(e);
                    }
                    e
                }
                Err(e) => e,
            };
            if Instant::now() > deadline {
                return Err(Error::Retries(Box::new(last)));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn exec(&self, id: &str, req: &ExecRequest) -> Result<Value> {
        let body = serde_json::to_value(req).map_err(Error::EncodeExec)?;
        self.call("POST", &format!("/v1/vms/{id}/exec"), Some(&body), 200)
    }

    fn health(&self) -> Option<Health> {
        let r = self.raw.request("GET", "/v1/health", None).ok()?;
        (r.status == 200)
            .then(|| serde_json::from_value(r.body).ok())
            .flatten()
    }
}

/// Send an exec (`what`: "fill", "verify") to `id` without waiting for
/// its answer.
fn fire(http: &Http, what: &str, id: &str, req: &ExecRequest) -> Result<Sent> {
    let body = serde_json::to_value(req).map_err(Error::EncodeExec)?;
    http.raw
        .send("POST", &format!("/v1/vms/{id}/exec"), Some(&body))
        .map_err(|source| Error::Request {
            what: format!("{what} of {id}"),
            source,
        })
}

// ------------------------------------------------------------- helpers --

fn unix_us(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

fn median(v: &[f64]) -> f64 {
    Stats::of(v).map_or(f64::NAN, |s| s.median)
}

/// Nearest-rank percentile.
fn pct(v: &[f64], p: usize) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[(p * v.len()).div_ceil(100).clamp(1, v.len()) - 1]
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NAN, f64::max)
}

/// `f` of every id (and its index), from up to [`THREADS`] client
/// threads; the results in the ids' order.
fn par_map<T: Send>(ids: &[String], f: impl Fn(usize, &str) -> T + Sync) -> Vec<T> {
    let next = AtomicUsize::new(0);
    let out: Mutex<Vec<Option<T>>> = Mutex::new((0..ids.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..THREADS.min(ids.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(id) = ids.get(i) else { break };
                let r = f(i, id);
                out.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
            });
        }
    });
    out.into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .map(|r| r.expect("every id was mapped"))
        .collect()
}

fn resident(v: &Value) -> u64 {
    v["resident_pages"].as_u64().unwrap_or(0)
}

/// The bench opens a connection per VM at once: raise its own fd limit.
fn raise_nofile() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                eprintln!("{BENCH}: cannot raise RLIMIT_NOFILE to {hard}: {e}");
            }
        }
    }
}

// ------------------------------------------------------------ restarts --

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Crash,
    Upgrade,
}

impl Kind {
    /// As `GET /v1/health`'s `start` names the new process's start.
    fn name(self) -> &'static str {
        match self {
            Kind::Crash => "crash",
            Kind::Upgrade => "upgrade",
        }
    }
}

/// One restart as the client saw it.
struct Restart {
    /// The moment before the SIGKILL or the upgrade request, µs since the
    /// Unix epoch.
    t0_us: u64,
    /// t0 → `GET /v1/health` answered the new process, ms.
    health_ms: f64,
    health: Health,
}

/// Poll `GET /v1/health` until an answer `want` takes.
fn wait_health(http: &Http, what: &str, want: impl Fn(&Health) -> bool) -> Result<Health> {
    let deadline = Instant::now() + WAIT;
    let mut last = None;
    loop {
        if let Some(h) = http.health() {
            if want(&h) {
                return Ok(h);
            }
            last = Some(h);
        }
        if Instant::now() > deadline {
            return Err(Error::WaitHealth {
                what: what.to_owned(),
                last: last.map(Box::new),
            });
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// SIGKILL the serving process, or ask it to hand over, and wait until
/// the next one answers.
fn restart(http: &Http, kind: Kind) -> Result<Restart> {
    let before = wait_health(http, "any process", |_| true)?;
    if !before.kept {
        return Err(Error::NoKeeper(Box::new(before)));
    }
    let t0 = SystemTime::now();
    let i0 = Instant::now();
    match kind {
        Kind::Crash => signal(before.pid, Signal::SIGKILL),
        Kind::Upgrade => {
            let r = http.call("POST", "/v1/server/upgrade", Some(&json!({})), 200)?;
            if r["pid"].as_u64() != Some(u64::from(before.pid)) {
                return Err(Error::Upgrade {
                    answer: r,
                    pid: before.pid,
                });
            }
        }
    }
    let health = wait_health(http, &format!("a pid other than {}", before.pid), |h| {
        h.pid != before.pid
    })?;
    let health_ms = i0.elapsed().as_secs_f64() * 1e3;
    if health.start != kind.name() || !health.lost_vms.is_empty() {
        return Err(Error::Restart {
            kind: kind.name(),
            health: Box::new(health),
        });
    }
    Ok(Restart {
        t0_us: unix_us(t0),
        health_ms,
        health,
    })
}

/// What one VM did after a restart.
enum After {
    /// Its first fault served by the new process: ms after t0, and when
    /// it was adopted, ms after t0.
    Served { stall_ms: f64, adopted_ms: f64 },
    /// Its fill had ended: no fault after t0.
    Idle,
}

/// Every VM `GET /v1/vms` lists, by id: one request for all of them
/// (one per VM would queue behind the faults of all the others).
fn vms(http: &Http) -> Result<HashMap<String, Value>> {
    let r = http.call("GET", "/v1/vms", None, 200)?;
    let Some(list) = r["vms"].as_array() else {
        return Err(Error::ListVms(r));
    };
    Ok(list
        .iter()
        .filter_map(|v| Some((v["id"].as_str()?.to_owned(), v.clone())))
        .collect())
}

/// Poll `GET /v1/vms` until `f` gives every id an answer; `f` gets the
/// index, the VM's info and whether time is up.
fn poll<T>(
    http: &Http,
    ids: &[String],
    f: impl Fn(usize, &Value, bool) -> Option<T>,
) -> Result<Vec<T>> {
    let deadline = Instant::now() + WAIT;
    let mut out: Vec<Option<T>> = (0..ids.len()).map(|_| None).collect();
    loop {
        let late = Instant::now() > deadline;
        let all = vms(http)?;
        for (i, id) in ids.iter().enumerate() {
            if out[i].is_none() {
                let v = all.get(id).ok_or_else(|| Error::Unlisted(id.clone()))?;
                out[i] = f(i, v, late);
            }
        }
        if out.iter().all(Option::is_some) {
            return Ok(out.into_iter().flatten().collect());
        }
        if late {
            return Err(Error::Poll);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Per VM, its first fault after the restart, or that its fill (over
/// `pages` pages from `before[i]` resident) had ended.
fn first_faults(
    http: &Http,
    ids: &[String],
    before: &[u64],
    pages: u64,
    t0_us: u64,
) -> Result<Vec<After>> {
    poll(http, ids, |i, v, late| {
        let a = &v["adopted"];
        if let (Some(ff), Some(at)) = (a["first_fault_unix_us"].as_u64(), a["at_unix_us"].as_u64())
        {
            let ms = |t: u64| (t as f64 - t0_us as f64) / 1e3;
            return Some(After::Served {
                stall_ms: ms(ff),
                adopted_ms: ms(at),
            });
        }
        if a.is_null() {
            panic!("{BENCH}: {} was not adopted: {v}", ids[i]);
        }
        if resident(v) >= before[i] + pages {
            return Some(After::Idle);
        }
        if late {
            eprintln!(
                "{BENCH}: {}: busy, yet no fault served within {WAIT:?}: {v}",
                ids[i]
            );
            STUCK.fetch_add(1, Ordering::Relaxed);
            return Some(After::Idle);
        }
        None
    })
}

/// Everything one kind of restart gave over the rounds of one count.
#[derive(Default)]
struct Stalls {
    stall_ms: Vec<f64>,
    adopted_ms: Vec<f64>,
    health_ms: Vec<f64>,
    recovery_ms: Vec<f64>,
    adopted_vms: Vec<f64>,
    /// VMs whose fill had ended by t0.
    idle: usize,
}

impl Stalls {
    fn add(&mut self, r: &Restart, after: Vec<After>) {
        self.health_ms.push(r.health_ms);
        self.recovery_ms
            .push(r.health.recovery_ms.unwrap_or(f64::NAN));
        self.adopted_vms.push(r.health.adopted_vms as f64);
        for a in after {
            match a {
                After::Served {
                    stall_ms,
                    adopted_ms,
                } => {
                    self.stall_ms.push(stall_ms);
                    self.adopted_ms.push(adopted_ms);
                }
                After::Idle => self.idle += 1,
            }
        }
    }
}

// ----------------------------------------------------------------- VMs --

/// A VM of `mib` on zeroes, one fault per page.
fn vm_req(mib: u64) -> CreateVm {
    CreateVm {
        fault_around_kib: Some(0),
        ..new_vm(mib)
    }
}

/// `n` VMs of `mib`: one created, the rest its children (forks of a
/// running VM), or as many as the server takes. Returns them and why
/// fewer, if so.
fn make_vms(s: &TestServer, n: u32, mib: u64) -> (Vec<String>, Option<String>) {
    let root = s.create_vm(&vm_req(mib));
    let mut ids = vec![root.clone()];
    let mut chunk = FORK_CHUNK;
    let mut why = None;
    while (ids.len() as u64) < u64::from(n) {
        let left = u32::try_from(u64::from(n) - ids.len() as u64).unwrap_or(u32::MAX);
        let count = chunk.min(left);
        match s.try_fork(&root, &ForkRequest { count }) {
            Ok(f) => ids.extend(f.children),
            Err(r) => {
                eprintln!("  a fork of {count} children refused: {r}");
                why.get_or_insert_with(|| format!("the server refused more VMs ({r})"));
                if count == 1 {
                    break;
                }
                chunk = count / 2;
            }
        }
    }
    (ids, why)
}

fn delete_all(http: &Http, ids: &[String]) -> Result<()> {
    par_map(ids, |_, id| {
        http.call("DELETE", &format!("/v1/vms/{id}"), None, 200)
            .map(drop)
    })
    .into_iter()
    .collect()
}

/// One round: `n` fresh VMs of `pages` pages fill all of them; the
/// server crashes, then hands over, while they do.
fn round(
    s: &TestServer,
    http: &Http,
    n: u32,
    pages: u64,
    crash: &mut Stalls,
    upgrade: &mut Stalls,
) -> Result<(usize, Option<String>)> {
    let mib = pages / 256;
    let t = Instant::now();
    let (ids, why) = make_vms(s, n, mib);
    let made_s = t.elapsed().as_secs_f64();
    let before: Vec<u64> = poll(http, &ids, |_, v, _| Some(resident(v)))?;
    // Every VM fills all its pages, one fault each.
    let t = Instant::now();
    let fill = op::fill(0, pages, SEED);
    let streams = ids
        .iter()
        .map(|id| fire(http, "fill", id, &fill))
        .collect::<Result<Vec<Sent>>>()?;
    // Each has installed pages (its fill runs) before t0.
    poll(http, &ids, |i, v, late| {
        assert!(
            !late,
            "{BENCH}: {} installed no page of its fill within {WAIT:?}",
            ids[i]
        );
        (resident(v) > before[i]).then_some(())
    })?;
    let ramp_s = t.elapsed().as_secs_f64();
    let c = restart(http, Kind::Crash)?;
    // Their requests went with the crashed process; the fills go on.
    drop(streams);
    let after = first_faults(http, &ids, &before, pages, c.t0_us)?;
    let crash_s = t.elapsed().as_secs_f64();
    let u = restart(http, Kind::Upgrade)?;
    let after_u = first_faults(http, &ids, &before, pages, u.t0_us)?;
    let upgrade_s = t.elapsed().as_secs_f64();
    let (ci, ui) = (crash.idle, upgrade.idle);
    crash.add(&c, after);
    upgrade.add(&u, after_u);
    // Once its fill ended, each VM reads back what it wrote.
    let verify = op::verify(0, pages, SEED);
    let streams = ids
        .iter()
        .map(|id| Ok((id.clone(), fire(http, "verify", id, &verify)?)))
        .collect::<Result<Vec<(String, Sent)>>>()?;
    let mut retried = 0;
    for (id, st) in streams {
        let r = st.answer().map_err(|source| Error::Request {
            what: format!("verify of {id}"),
            source,
        })?;
        let body = match r.status {
            200 => r.body,
            // Its VMM had not rejoined yet: again, as a client would.
            s if TRANSIENT.contains(&s) => {
                retried += 1;
                http.exec(&id, &verify)?
            }
            _ => {
                return Err(Error::Answer {
                    what: format!("verify of {id}"),
                    reply: r,
                })
            }
        };
        WRONG.fetch_add(
            body["result"].as_u64().unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }
    let done_s = t.elapsed().as_secs_f64();
    delete_all(http, &ids)?;
    eprintln!(
        "  {} VMs of {mib} MiB made in {made_s:.1} s; fills running after {ramp_s:.2} s; crash: \
         health after {:.0} ms (recovery_ms {:.1}), measured by {crash_s:.2} s; upgrade: health after \
         {:.0} ms (recovery_ms {:.1}), measured by {upgrade_s:.2} s; fills ended by {done_s:.1} s; \
         idle at t0: {} crash, {} upgrade; verifies answered 409/5xx and retried: {retried}",
        ids.len(),
        c.health_ms,
        c.health.recovery_ms.unwrap_or(f64::NAN),
        u.health_ms,
        u.health.recovery_ms.unwrap_or(f64::NAN),
        crash.idle - ci,
        upgrade.idle - ui,
    );
    Ok((ids.len(), why))
}

// ---------------------------------------------------------- fault path --

/// Fault path of one VM around restarts: pages/s of fills of fresh pages
/// before and after each kind.
#[derive(Default)]
struct Probe {
    before: [Vec<f64>; 2],
    after: [Vec<f64>; 2],
    /// Wall time of the fill requests, ms.
    wall_before: [Vec<f64>; 2],
    wall_after: [Vec<f64>; 2],
    /// The first fill after each restart, pages/s (in `after` too).
    first_after: [Vec<f64>; 2],
    health_ms: [Vec<f64>; 2],
}

/// Fill `PROBE_PAGES` fresh pages from `start`: pages/s in the guest and
/// the request's wall time, ms.
fn probe_fill(http: &Http, id: &str, start: u64) -> Result<(f64, f64)> {
    let t = Instant::now();
    let r = http.exec(id, &op::fill(start, PROBE_PAGES, SEED))?;
    let wall = t.elapsed().as_secs_f64() * 1e3;
    let us = r["elapsed_us"].as_f64().unwrap_or(f64::NAN);
    Ok((PROBE_PAGES as f64 / (us / 1e6), wall))
}

fn probe(s: &TestServer, http: &Http, plan: &Plan) -> Result<Probe> {
    let fills = (plan.reps * 2 * 2 * PROBE_FILLS) as u64;
    let mib = (fills * PROBE_PAGES).div_ceil(256);
    let id = s.create_vm(&vm_req(mib));
    let mut p = Probe::default();
    let mut next = 0;
    for _ in 0..plan.reps {
        for (k, kind) in [Kind::Crash, Kind::Upgrade].into_iter().enumerate() {
            for _ in 0..PROBE_FILLS {
                let (rate, wall) = probe_fill(http, &id, next)?;
                next += PROBE_PAGES;
                p.before[k].push(rate);
                p.wall_before[k].push(wall);
            }
            let r = restart(http, kind)?;
            p.health_ms[k].push(r.health_ms);
            for i in 0..PROBE_FILLS {
                let (rate, wall) = probe_fill(http, &id, next)?;
                next += PROBE_PAGES;
                if i == 0 {
                    p.first_after[k].push(rate);
                }
                p.after[k].push(rate);
                p.wall_after[k].push(wall);
            }
        }
    }
    let wrong = http.exec(&id, &op::verify(0, next, SEED))?["result"]
        .as_u64()
        .unwrap_or(u64::MAX);
    WRONG.fetch_add(wrong, Ordering::Relaxed);
    delete_all(http, &[id])?;
    for (k, kind) in [Kind::Crash, Kind::Upgrade].into_iter().enumerate() {
        let f = |v: &[f64]| {
            v.iter()
                .map(|r| format!("{r:.0}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        eprintln!(
            "  fault path around a {}: pages/s before {}; after {}",
            kind.name(),
            f(&p.before[k]),
            f(&p.after[k])
        );
    }
    Ok(p)
}

fn probe_rows(p: &Probe) {
    for (k, kind) in [Kind::Crash, Kind::Upgrade].into_iter().enumerate() {
        let (what, how) = match kind {
            Kind::Crash => ("a crash (SIGKILL of the serving process)", "crash"),
            Kind::Upgrade => ("a handover (POST /v1/server/upgrade)", "upgrade"),
        };
        let us = |v: &[f64]| 1e6 / median(v);
        Row::new(
            BENCH,
            &format!("restart.fault_{how}"),
            T_FAULT,
            &format!(
                "one VM filling {PROBE_PAGES} fresh pages (one fault each) after {what}: pages/s in the guest"
            ),
            "pages/s",
            &p.after[k],
            "the same VM, the same fill of fresh pages, before the restart",
            &p.before[k],
        )
        .goal("≥ 0.95: an adopted VM faults as fast as before")
        .note(format!(
            "{PROBE_FILLS} fills on each side of each of {} restarts; {:.1} µs per fault after, {:.1} before; \
             the first fill after a restart alone: median {:.0} pages/s; the fastest fill after / before: \
             {:.2} (fault rates here move with the load on the other CPUs: see the caveat above); the fill requests' wall time (API and VMM included): median {:.1} ms after, {:.1} ms \
             before; the restart itself: health answered the new process after {:.0} ms (median)",
            p.health_ms[k].len(),
            us(&p.after[k]),
            us(&p.before[k]),
            median(&p.first_after[k]),
            max(&p.after[k]) / max(&p.before[k]),
            median(&p.wall_after[k]),
            median(&p.wall_before[k]),
            median(&p.health_ms[k]),
        ))
        .emit();
    }
}

// --------------------------------------------------------------- rows --

/// Rounds of `n` VMs: many for small counts (each gives few stalls).
fn rounds_for(plan: &Plan, n: u32) -> usize {
    match n {
        0..=1 => plan.reps,
        2..=20 => plan.reps.min(3),
        21..=200 => 2,
        _ => 1,
    }
}

/// Pages per VM for `n` VMs: a fill that lasts through both restarts
/// and their measurements (~0.5 s + 10 ms per VM) if the VMs together
/// fault at `rate` pages/s (one VM's alone; many together fault slower).
fn pages_for(n: u32, rate: f64) -> u64 {
    let n = f64::from(n.max(1));
    let secs = 0.5 + n * 0.010;
    let pages = (rate * secs / n).ceil();
    // Finite and clamped first: the cast cannot truncate.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let pages = if pages.is_finite() {
        pages.clamp(0.0, 1e9) as u64
    } else {
        0
    };
    pages.div_ceil(256).max(MIN_MIB) * 256
}

/// The count that fits in [`MEM_SHARE`] of MemAvailable.
fn fits(want: u32, mib: u64) -> (u32, Option<String>) {
    let avail_mib = meminfo_kib("MemAvailable").unwrap_or(0) / 1024;
    let cap = (avail_mib as f64 * MEM_SHARE / (mib as f64 + VMM_MIB)).floor();
    if f64::from(want) <= cap {
        return (want, None);
    }
    // Clamped to [1, want] first: the cast cannot truncate.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let n = cap.clamp(1.0, f64::from(want)) as u32;
    (
        n,
        Some(format!(
            "{want} VMs of {mib} MiB need more than {:.0} % of MemAvailable ({avail_mib} MiB)",
            MEM_SHARE * 100.0
        )),
    )
}

fn stall_rows(
    want: u32,
    got: usize,
    pages: u64,
    why: Option<&str>,
    crash: &Stalls,
    upgrade: &Stalls,
) {
    let label = match why {
        Some(why) if (got as u64) < u64::from(want) => {
            format!("{got} VMs (not {want}: {why})")
        }
        _ if want == 1 => "1 VM".to_owned(),
        _ => format!("{want} VMs"),
    };
    let mib = pages / 256;
    for (kind, st) in [(Kind::Crash, crash), (Kind::Upgrade, upgrade)] {
        let (what, t0, goal) = match kind {
            Kind::Crash => (
                "SIGKILL of the serving process",
                "the SIGKILL",
                "report; ≈ 1: each VM is served as soon as the new process answers",
            ),
            Kind::Upgrade => (
                "handover (POST /v1/server/upgrade)",
                "the upgrade request",
                "report; an upper bound (the old process serves until it exits)",
            ),
        };
        Row::new(
            BENCH,
            &format!("restart.{}.{want}", kind.name()),
            T_STALL,
            &format!(
                "{label} of {mib} MiB, each filling its whole guest RAM (fresh pages): {what} → the new \
                 process serves the VM's first fault (stall per VM, p50)"
            ),
            "ms",
            &st.stall_ms,
            &format!("{t0} → GET /v1/health answers the new process"),
            &st.health_ms,
        )
        .goal(goal)
        .note(format!(
            "over {} VM stalls in {} round(s): p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms; adopted at {:.1} ms \
             after t0 (p50; max {:.1}); recovery_ms (health: the process's start → serving its adopted VMs) \
             median {:.1} ms; adopted_vms {:.0}; VMs whose fill had ended by t0 (not stalled, left out): {}",
            st.stall_ms.len(),
            st.health_ms.len(),
            median(&st.stall_ms),
            pct(&st.stall_ms, 99),
            max(&st.stall_ms),
            median(&st.adopted_ms),
            max(&st.adopted_ms),
            median(&st.recovery_ms),
            median(&st.adopted_vms),
            st.idle,
        ))
        .emit();
    }
}

fn counts(plan: &Plan) -> Vec<u32> {
    std::env::args()
        .skip_while(|a| a != "--counts")
        .nth(1)
        .map(|v| v.split(',').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_else(|| plan.restart_vms.clone())
}

fn run(plan: &Plan) -> Result<()> {
    let server = TestServer::start_with_args(&[
        "--memory-budget-mib",
        "100000000",
        "--max-vms",
        "4096",
        "--api-max-connections",
        "4096",
        "--api-idle-timeout-ms",
        "600000",
    ]);
    let http = Http::new(server.api_sock());
    let h = wait_health(&http, "any process", |_| true)?;
    if !h.kept {
        return Err(Error::NoKeeper(Box::new(h)));
    }
    let t = Instant::now();
    let p = probe(&server, &http, plan)?;
    let rate = median(&p.before[0]);
    eprintln!(
        "{BENCH}: fault path: {:.0} pages/s before, {:.0} after a crash; {:.0} before, {:.0} after a \
         handover ({:.1} s)",
        median(&p.before[0]),
        median(&p.after[0]),
        median(&p.before[1]),
        median(&p.after[1]),
        t.elapsed().as_secs_f64()
    );
    for want in counts(plan) {
        let pages = pages_for(want, rate);
        let (n, mem_why) = fits(want, pages / 256);
        let rounds = rounds_for(plan, want);
        eprintln!("{BENCH}: {n} VMs of {} MiB, {rounds} round(s)", pages / 256);
        let t = Instant::now();
        let (mut crash, mut upgrade) = (Stalls::default(), Stalls::default());
        let mut got = usize::MAX;
        let mut why = mem_why;
        for _ in 0..rounds {
            let (g, w) = round(&server, &http, n, pages, &mut crash, &mut upgrade)?;
            got = got.min(g);
            if why.is_none() {
                why = w;
            }
        }
        eprintln!(
            "{BENCH}: {n} VMs: crash stall p50 {:.1} ms, p99 {:.1}, max {:.1}; upgrade p50 {:.1} ms, p99 \
             {:.1}, max {:.1} ({:.1} s)",
            median(&crash.stall_ms),
            pct(&crash.stall_ms, 99),
            max(&crash.stall_ms),
            median(&upgrade.stall_ms),
            pct(&upgrade.stall_ms, 99),
            max(&upgrade.stall_ms),
            t.elapsed().as_secs_f64()
        );
        stall_rows(want, got, pages, why.as_deref(), &crash, &upgrade);
    }
    probe_rows(&p);
    server.assert_healthy();
    Ok(())
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    if !pagefork_tests::require_kvm_uffd() {
        eprintln!("{BENCH}: needs /dev/kvm and /dev/userfaultfd");
        return ExitCode::FAILURE;
    }
    raise_nofile();
    if let Err(e) = run(&plan) {
        eprintln!("{BENCH}: {}", shared::error_chain(&e));
        return ExitCode::FAILURE;
    }
    let (wrong, stuck) = (WRONG.load(Ordering::Relaxed), STUCK.load(Ordering::Relaxed));
    if wrong > 0 || stuck > 0 {
        eprintln!(
            "{BENCH}: {wrong} pages read back wrong, {stuck} busy VMs never served after a restart"
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
