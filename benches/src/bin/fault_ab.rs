//! The fault path against the commit before (issue 45: "the fault path no
//! slower than before"): this build's `uffd-server` and `vmm` (A) next to
//! those of the commit before the restart work (B, `ecc19e4`), alternated
//! in one run so the machine's load hits both alike.
//!
//! Each repetition starts a fresh server of each side, in the order A B on
//! even repetitions and B A on odd ones (ABBA), and runs the three
//! measurements on it:
//!
//! 1. `ab.fault_rtt`: one fault's round trip. A fresh VM on zeroes, no
//!    fault-around and no readahead (one page per fault), writes one byte
//!    of every page; the guest's time (`exec` `elapsed_us`) per page, the
//!    median of [`FAULT_VMS`] VMs.
//! 2. `ab.lazy_restore`: a VM created from a raw image of random bytes
//!    with the server's defaults (fault-around and readahead) touches all
//!    of its memory: the guest's time, as `lazy.touch.readahead` measures.
//! 3. `ab.fork_child`: live fork of a running VM with a quarter written
//!    (rewritten before each fork, untimed, so each pause protects written
//!    pages), from the fork request until the child answers `exec
//!    identity`, as `fork.e2e1` measures; the median of a few forks.
//!
//! Both sides are driven by the same client (`pagefork-tests`' [`Api`])
//! with requests both understand: the base knows no `reclaim` field
//! (never sent when unset) and no `--reclaim` or `--no-keeper` flag, so
//! both servers start with `--state-dir` and `--vmm-bin` only, and without
//! the `PAGEFORK_*` variables that change a server's defaults. Each runs
//! as users run it by default: this build under its keeper (the process
//! holding its fds across a restart), the base without one (it has none).
//!
//! The base's binaries are read from `$PAGEFORK_AB_BASE_BIN` (built by
//! `scripts/bench.sh`), its name from `$PAGEFORK_AB_BASE`; this build's
//! from `$PAGEFORK_BIN_DIR` as for every bench. A full run needs the base;
//! `--quick` without it runs both sides on this build (a smoke run of the
//! bench, which never judges a timing).
//!
//! Usage: `fault_ab [--quick]`. Prints JSON rows.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use pagefork_benches::{Plan, Row, Stats};
use pagefork_tests::{bin_dir, new_vm, op, pages_of, tail, Api, RandomImage, Reply};
use proto::api::{CreateVm, ExecRequest, ForkRequest, VmInfo};

const BENCH: &str = "fault_ab";
const TABLE: &str = "The fault path against the commit before issue 45 (A/B in one run)";

/// The commit the issue compares with, when `$PAGEFORK_AB_BASE` does not
/// name one.
const DEFAULT_BASE: &str = "ecc19e4";

/// VMs whose one-page-per-fault write is timed per server; the median is
/// the repetition's sample.
const FAULT_VMS: usize = 3;

/// Environment variables that change a server's defaults; neither side
/// gets them, so both run with their own defaults.
const SERVER_ENV: [&str; 6] = [
    "PAGEFORK_STATE_DIR",
    "PAGEFORK_VMM_POOL",
    "PAGEFORK_HUGEPAGES",
    "PAGEFORK_SHARED_BASES",
    "PAGEFORK_NO_KEEPER",
    "NOTIFY_SOCKET",
];

/// How long a server may take to answer `GET /v1/health` after its start.
const START_WITHIN: Duration = Duration::from_secs(30);

/// Errors of the A/B bench.
#[derive(Debug, thiserror::Error)]
enum AbError {
    #[error(
        "PAGEFORK_AB_BASE_BIN is not set: a full run compares with the base's uffd-server and vmm \
         (scripts/bench.sh builds them); --quick runs both sides on this build"
    )]
    NoBase,
    #[error("{0} is missing: build uffd-server and vmm there first")]
    MissingBinary(PathBuf),
    #[error("cannot make a temporary directory for a server")]
    TempDir(#[source] std::io::Error),
    #[error("cannot open the server log {0}")]
    OpenLog(PathBuf, #[source] std::io::Error),
    #[error("cannot start {0}")]
    Spawn(PathBuf, #[source] std::io::Error),
    #[error("the {side} server exited during start-up ({status}); log:\n{log}")]
    Exited {
        side: String,
        status: ExitStatus,
        log: String,
    },
    #[error("the {side} server did not answer /v1/health within {START_WITHIN:?}; log:\n{log}")]
    NotHealthy { side: String, log: String },
    #[error("{what} on the {side} server was refused: {reply}")]
    Refused {
        side: String,
        what: String,
        reply: Reply,
    },
    #[error("the {side} server's child VM of a fork is missing: {answer}")]
    NoChild { side: String, answer: String },
}

type Result<T> = std::result::Result<T, AbError>;

/// One side of the A/B: the directory holding its `uffd-server` and `vmm`.
#[derive(Debug, Clone)]
struct Side {
    /// How rows and errors name it ("this build", "ecc19e4").
    name: String,
    dir: PathBuf,
}

impl Side {
    fn new(name: impl Into<String>, dir: PathBuf) -> Result<Side> {
        for b in ["uffd-server", "vmm"] {
            if !dir.join(b).is_file() {
                return Err(AbError::MissingBinary(dir.join(b)));
            }
        }
        Ok(Side {
            name: name.into(),
            dir,
        })
    }
}

/// A server of one side on a fresh temporary state directory; stopped
/// (with any VMM it left) when dropped.
struct Server {
    side: String,
    child: Child,
    api: Api,
    log: PathBuf,
    /// Whether a keeper holds its fds (`GET /v1/health` `kept`; the base
    /// does not know the field).
    kept: bool,
    _dir: tempfile::TempDir,
}

impl Server {
    /// Start `side`'s server with the flags both sides accept, and wait
    /// until it answers.
    fn start(side: &Side) -> Result<Server> {
        let dir = tempfile::Builder::new()
            .prefix("pagefork-ab-")
            .tempdir()
            .map_err(AbError::TempDir)?;
        let state = dir.path().join("state");
        std::fs::create_dir_all(&state).map_err(AbError::TempDir)?;
        let log = dir.path().join("server.log");
        let log_file = File::create(&log).map_err(|e| AbError::OpenLog(log.clone(), e))?;
        let program = side.dir.join("uffd-server");
        let mut cmd = Command::new(&program);
        for v in SERVER_ENV {
            cmd.env_remove(v);
        }
        cmd.arg("--state-dir")
            .arg(&state)
            .arg("--vmm-bin")
            .arg(side.dir.join("vmm"))
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file));
        // SAFETY: the closure runs in the forked child before exec and
        // only calls prctl(2), which is async-signal-safe.
        unsafe {
            // A bench killed before its clean-up takes the server along.
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
                    .map_err(std::io::Error::from)
            });
        }
        let child = cmd.spawn().map_err(|e| AbError::Spawn(program, e))?;
        let mut server = Server {
            side: side.name.clone(),
            child,
            api: Api::new(state.join("api.sock")),
            log,
            kept: false,
            _dir: dir,
        };
        server.wait_healthy()?;
        server.kept = server.api.health_now().is_some_and(|h| h.kept);
        Ok(server)
    }

    fn wait_healthy(&mut self) -> Result<()> {
        let deadline = Instant::now() + START_WITHIN;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(AbError::Exited {
                    side: self.side.clone(),
                    status,
                    log: tail(&self.log, 30),
                });
            }
            if self.api.answers_health() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(AbError::NotHealthy {
                    side: self.side.clone(),
                    log: tail(&self.log, 30),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn refused(&self, what: impl Into<String>, reply: Reply) -> AbError {
        AbError::Refused {
            side: self.side.clone(),
            what: what.into(),
            reply,
        }
    }

    fn create(&self, req: &CreateVm) -> Result<String> {
        self.api
            .try_create_vm(req)
            .map(|v| v.id)
            .map_err(|r| self.refused("POST /v1/vms", r))
    }

    /// Run a guest op; its guest time in µs.
    fn exec(&self, id: &str, req: &ExecRequest) -> Result<u64> {
        self.api
            .try_exec(id, req)
            .map(|v| v.elapsed_us)
            .map_err(|r| self.refused(format!("exec on {id}"), r))
    }

    fn info(&self, id: &str) -> Result<VmInfo> {
        self.api
            .try_vm(id)
            .map_err(|r| self.refused(format!("GET /v1/vms/{id}"), r))
    }

    fn delete(&self, id: &str) -> Result<()> {
        self.api
            .try_delete_vm(id)
            .map(drop)
            .map_err(|r| self.refused(format!("DELETE /v1/vms/{id}"), r))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM stops the keeper (and its serving process) or the
        // server, and every VM with it.
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id()).unwrap_or(0));
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        for pid in self.api.take_vmm_pids() {
            if pagefork_tests::process_exists(pid) {
                pagefork_tests::signal(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
    }
}

/// Sizes and counts of one run.
struct Sizes {
    fault_mib: u64,
    lazy_mib: u64,
    fork_mib: u64,
    forks: usize,
}

/// One side's samples, one per repetition.
#[derive(Default)]
struct Samples {
    /// Guest µs per page of the one-page-per-fault write.
    fault_us: Vec<f64>,
    /// `faults.missing` of those VMs.
    fault_missing: Vec<f64>,
    /// The server's time on one fault event, p50, µs.
    fault_service_us: Vec<f64>,
    /// Guest time of the lazy restore's touch, ms, and create + touch
    /// (wall, client side), ms.
    lazy_ms: Vec<f64>,
    lazy_wall_ms: Vec<f64>,
    /// Fork request → the child answers, ms; the parent's pause, ms.
    fork_ms: Vec<f64>,
    fork_pause_ms: Vec<f64>,
    /// Whether each server had a keeper.
    kept: Vec<bool>,
}

fn median(v: &[f64]) -> f64 {
    Stats::of(v).map_or(f64::NAN, |s| s.median)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// A fresh VM on zeroes writes every page, one page per fault: guest µs
/// per page, `faults.missing` and the server's service p50 (µs).
fn fault_rtt(s: &Server, mib: u64) -> Result<(f64, f64, f64)> {
    let pages = pages_of(mib);
    let id = s.create(&CreateVm {
        fault_around_kib: Some(0),
        readahead_kib: Some(0),
        ..new_vm(mib)
    })?;
    let us = s.exec(&id, &op::touch(0, pages, true))?;
    let vm = s.info(&id)?;
    s.delete(&id)?;
    let service = pagefork_benches::phases::p50_p99_us(&vm, "service").0;
    Ok((us as f64 / pages as f64, vm.faults.missing as f64, service))
}

/// A VM from `image` with the server's defaults touches all of it: guest
/// ms and wall ms (create + touch).
fn lazy_restore(s: &Server, image: &RandomImage, mib: u64) -> Result<(f64, f64)> {
    let t = Instant::now();
    let id = s.create(&CreateVm {
        memory_source: Some(image.source()),
        ..new_vm(mib)
    })?;
    let us = s.exec(&id, &op::touch(0, pages_of(mib), false))?;
    let wall = ms(t);
    s.delete(&id)?;
    Ok((us as f64 / 1e3, wall))
}

/// `forks` live forks of a running `mib` VM with a quarter written: the
/// median of fork request → child answers identity, and of the pause (ms).
fn fork_child(s: &Server, mib: u64, forks: usize, seed: &mut u64) -> Result<(f64, f64)> {
    let quarter = pages_of(mib) / 4;
    let parent = s.create(&new_vm(mib))?;
    let (mut e2e, mut pause) = (Vec::new(), Vec::new());
    for _ in 0..forks {
        *seed += 1;
        s.exec(&parent, &op::fill(0, quarter, *seed))?;
        let t = Instant::now();
        let f = s
            .api
            .try_fork(&parent, &ForkRequest { count: 1 })
            .map_err(|r| s.refused(format!("fork of {parent}"), r))?;
        let child = f.children.first().ok_or_else(|| AbError::NoChild {
            side: s.side.clone(),
            answer: format!("{f:?}"),
        })?;
        s.exec(child, &op::identity())?;
        e2e.push(ms(t));
        pause.push(f.pause_us as f64 / 1e3);
        s.delete(child)?;
    }
    s.delete(&parent)?;
    Ok((median(&e2e), median(&pause)))
}

/// The three measurements on a fresh server of `side`.
fn one_server(
    side: &Side,
    sizes: &Sizes,
    image: &RandomImage,
    seed: &mut u64,
    out: &mut Samples,
) -> Result<()> {
    let s = Server::start(side)?;
    out.kept.push(s.kept);
    let (mut us, mut missing, mut service) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..FAULT_VMS {
        let (u, m, sv) = fault_rtt(&s, sizes.fault_mib)?;
        us.push(u);
        missing.push(m);
        service.push(sv);
    }
    out.fault_us.push(median(&us));
    out.fault_missing.push(median(&missing));
    out.fault_service_us.push(median(&service));
    let (guest, wall) = lazy_restore(&s, image, sizes.lazy_mib)?;
    out.lazy_ms.push(guest);
    out.lazy_wall_ms.push(wall);
    let (e2e, pause) = fork_child(&s, sizes.fork_mib, sizes.forks, seed)?;
    out.fork_ms.push(e2e);
    out.fork_pause_ms.push(pause);
    Ok(())
}

/// Per-repetition ratios A / B (the pairs the alternation makes): "median
/// X (min–max)".
fn paired(a: &[f64], b: &[f64]) -> String {
    let r: Vec<f64> = a.iter().zip(b).map(|(a, b)| a / b).collect();
    Stats::of(&r).map_or_else(
        || "n/a".into(),
        |s| format!("median {:.2} ({:.2}–{:.2})", s.median, s.min, s.max),
    )
}

/// The sides of this run: this build, and the base (or this build again
/// in a quick run without one).
fn sides(plan: &Plan) -> Result<(Side, Side, bool)> {
    let current = Side::new("this build", bin_dir())?;
    match std::env::var_os("PAGEFORK_AB_BASE_BIN").filter(|d| !d.is_empty()) {
        Some(dir) => {
            let name = std::env::var("PAGEFORK_AB_BASE")
                .ok()
                .filter(|n| !n.is_empty())
                .unwrap_or_else(|| DEFAULT_BASE.into());
            Ok((current, Side::new(name, PathBuf::from(dir))?, true))
        }
        None if plan.quick => {
            let again = Side::new("this build (again, no base)", bin_dir())?;
            Ok((current, again, false))
        }
        None => Err(AbError::NoBase),
    }
}

fn run(plan: &Plan) -> Result<()> {
    let (a, b, has_base) = sides(plan)?;
    let sizes = Sizes {
        fault_mib: plan.ab_fault_mib,
        lazy_mib: plan.lazy_mib,
        fork_mib: plan.fork_mib.first().copied().unwrap_or(256),
        forks: if plan.quick { 2 } else { 5 },
    };
    eprintln!(
        "{BENCH}: {} ({}) against {} ({}), {} reps",
        a.name,
        a.dir.display(),
        b.name,
        b.dir.display(),
        plan.ab_reps
    );
    let image = RandomImage::new(sizes.lazy_mib, 0xab);
    let (mut sa, mut sb) = (Samples::default(), Samples::default());
    let mut seed = 0;
    for rep in 0..plan.ab_reps {
        let t = Instant::now();
        if rep % 2 == 0 {
            one_server(&a, &sizes, &image, &mut seed, &mut sa)?;
            one_server(&b, &sizes, &image, &mut seed, &mut sb)?;
        } else {
            one_server(&b, &sizes, &image, &mut seed, &mut sb)?;
            one_server(&a, &sizes, &image, &mut seed, &mut sa)?;
        }
        eprintln!(
            "  rep {rep} ({}, {:.1} s): fault {:.1} / {:.1} µs, lazy {:.0} / {:.0} ms, fork {:.1} / {:.1} ms",
            if rep % 2 == 0 { "AB" } else { "BA" },
            t.elapsed().as_secs_f64(),
            sa.fault_us[rep],
            sb.fault_us[rep],
            sa.lazy_ms[rep],
            sb.lazy_ms[rep],
            sa.fork_ms[rep],
            sb.fork_ms[rep],
        );
    }
    emit(plan, &sizes, &b.name, has_base, &sa, &sb);
    Ok(())
}

fn emit(plan: &Plan, sizes: &Sizes, base: &str, has_base: bool, a: &Samples, b: &Samples) {
    let baseline = |what: &str| {
        if has_base {
            format!("{base} (the commit before issue 45): {what}")
        } else {
            format!("this build again: {what}")
        }
    };
    // A quick run without a base states the goal a full run judges.
    let goal = format!(
        "≤ 1.05× of {} (no slower)",
        if has_base { base } else { DEFAULT_BASE }
    );
    let keeper = |s: &Samples| {
        if s.kept.iter().all(|k| *k) {
            "under its keeper"
        } else if s.kept.iter().any(|k| *k) {
            "partly under a keeper"
        } else {
            "without a keeper"
        }
    };
    let (smoke, servers) = if has_base {
        (
            "",
            format!(
                "this build ran {} (its default), {base} {}",
                keeper(a),
                keeper(b)
            ),
        )
    } else {
        (
            "quick: both sides this build (smoke run); ",
            format!("each ran {} (the default)", keeper(a)),
        )
    };
    let how = format!(
        "{smoke}{} repetitions alternated AB/BA, each side on a fresh server started with \
         --state-dir and --vmm-bin only and the servers' defaults otherwise; {servers}",
        plan.ab_reps
    );
    let pages = pages_of(sizes.fault_mib);
    Row::new(
        BENCH,
        "ab.fault_rtt",
        TABLE,
        &format!(
            "one fault's round trip: a fresh {} MiB VM on zeroes writes each of its {pages} pages, one page per fault (guest µs per fault): this build",
            sizes.fault_mib
        ),
        "µs",
        &a.fault_us,
        &baseline("the same"),
        &b.fault_us,
    )
    .goal(goal.clone())
    .note(format!(
        "{how}; median of {FAULT_VMS} VMs per server; faults.missing median {:.0} / {:.0}; the server's \
         service p50 {:.1} / {:.1} µs; per-repetition ratios {}",
        median(&a.fault_missing),
        median(&b.fault_missing),
        median(&a.fault_service_us),
        median(&b.fault_service_us),
        paired(&a.fault_us, &b.fault_us)
    ))
    .emit();
    Row::new(
        BENCH,
        "ab.lazy_restore",
        TABLE,
        &format!(
            "lazy restore: a VM from a {} MiB raw image touches all of it, server defaults (guest ms): this build",
            sizes.lazy_mib
        ),
        "ms",
        &a.lazy_ms,
        &baseline("the same"),
        &b.lazy_ms,
    )
    .goal(goal.clone())
    .note(format!(
        "as row 1; create + touch (wall, client side) median {:.0} / {:.0} ms; per-repetition ratios {}",
        median(&a.lazy_wall_ms),
        median(&b.lazy_wall_ms),
        paired(&a.lazy_ms, &b.lazy_ms)
    ))
    .emit();
    Row::new(
        BENCH,
        "ab.fork_child",
        TABLE,
        &format!(
            "live fork of a running {} MiB VM with a quarter written → the child answers identity (ms): this build",
            sizes.fork_mib
        ),
        "ms",
        &a.fork_ms,
        &baseline("the same"),
        &b.fork_ms,
    )
    .goal(goal)
    .note(format!(
        "as row 1; median of {} forks per server, no VMM pool; the parent's pause median {:.2} / {:.2} ms; \
         per-repetition ratios {}",
        sizes.forks,
        median(&a.fork_pause_ms),
        median(&b.fork_pause_ms),
        paired(&a.fork_ms, &b.fork_ms)
    ))
    .emit();
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    if !pagefork_tests::require_kvm_uffd() {
        eprintln!("{BENCH}: needs /dev/kvm and /dev/userfaultfd");
        return ExitCode::FAILURE;
    }
    match run(&plan) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{BENCH}: {}", shared::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
