//! End to end: the server survives its own death. `uffd-server` runs under
//! its keeper (the process [`TestServer`] holds), which restarts the
//! serving process when it dies and starts a new binary on
//! `POST /v1/server/upgrade`; every VM goes on with the same id, the same
//! VMM process and the same memory, and forks keep reading their parents'
//! pages. Real server, VMMs, KVM and userfaultfd; snapshots on the XFS
//! mount (PAGEFORK_XFS_DIR).
//!
//! - `crash_and_upgrade_keep_every_vm`: VMs of every kind (plain, a
//!   running parent with children and grandchildren, a paused template
//!   and its children, raw and zstd images, restores of a snapshot,
//!   hugepage VMs when the host has huge pages free) written and checked
//!   by two clients against a model of what every chunk holds, while a
//!   third thread forks, snapshots, rolls back, restores, clones and
//!   deletes, and the main thread SIGKILLs the serving process and
//!   upgrades it at random moments. `PAGEFORK_RESTART_SEED` replays the
//!   same choices, `PAGEFORK_RESTART_ROUNDS` (default 20) sets the rounds
//!   of one kill and one upgrade each.
//! - `upgrade_never_refuses_a_connection`: a client connecting anew for
//!   every request meanwhile never gets ECONNREFUSED or ENOENT.
//! - `a_failed_upgrade_falls_back_to_the_old_binary`.
//! - `without_a_keeper_upgrade_is_refused`.
//! - `a_crash_mid_fork_loses_no_vm`: the parent runs (its guest answers)
//!   and every VM listed holds its pages.
//! - `a_crash_mid_rollback_finishes_it_or_leaves_the_vm_as_it_was`: the
//!   VM holds all of its pages or all of the snapshot's, and a rollback
//!   cut after its pause is finished by the next process.
//! - `a_crash_while_a_child_faults_in_keeps_its_table_true`: what a fork
//!   child wrote reaches its own fork child (the table says where each
//!   page is, also for a page the dying process was putting in).
//! - `a_crash_while_children_start_leaves_nothing_of_theirs`: the
//!   memories of fork children a crash cut while they started (in the fd
//!   store already, never recorded as VMs) leave the store and the server.
//!
//! Requests are sent on connections of their own ([`OneShot`], not the
//! harness's [`pagefork_tests::Api`], which fails the test on a broken
//! connection) by a retrying client here: a request the dying process
//! had accepted can break (reset, empty answer) or be refused with 503,
//! and right after a restart a VM's VMM may not have rejoined yet (409,
//! 502). Those are retried, for up to [`RETRY_FOR`]; an answer that comes
//! must be exact.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use pagefork_tests::{
    anchor_processes, apply_fill, compress_image, file_source, free_hugepages, new_vm, op,
    open_fds, require_kvm_uffd, server_on_xfs, signal, uffdctl, vmm_processes, zstd_source,
    OneShot, OneShotError, RandomImage, Reply, Rng, TestServer,
};
use proto::api::{CreateVm, ExecRequest, Health, MemorySource, RunState, VmInfo};
use serde_json::{json, Value};

/// Guest RAM of every VM.
const MIB: u64 = 32;
const PAGES: u64 = MIB * 256;
/// Chunks the model keeps a seed of; one 2 MiB block each.
const CHUNKS: usize = 16;
const CHUNK: u64 = PAGES / CHUNKS as u64;
/// Huge pages the hugepage VMs take (3 VMs of 16 blocks, and their base).
const HUGEPAGES_NEEDED: u64 = 96;
/// How long one request may go unanswered before the test fails.
const ANSWER_WITHIN: Duration = Duration::from_secs(45);
/// How long a request failing for a restart's reason is retried.
const RETRY_FOR: Duration = Duration::from_secs(30);
/// How long a restart may take before a new process answers.
const RESTART_WITHIN: Duration = Duration::from_secs(30);
/// Statuses a request may get while a server restarts: 503 (handing
/// over), 409 and 502 (the VM's VMM has not rejoined yet), 504.
const TRANSIENT: [u16; 4] = [409, 502, 503, 504];

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={v:?} is not a number: {e}"))
    })
}

// ------------------------------------------------------------ the wire --

/// How a request on a connection of its own ended, as the tests count
/// outcomes.
fn request_outcome(r: &Result<Reply, OneShotError>) -> String {
    match r {
        Ok(r) => format!("status {}", r.status),
        Err(e) if e.refused() => "refused".into(),
        Err(OneShotError::Connect(e)) => format!("connect error {}", e.kind()),
        Err(OneShotError::Timeout(_)) => "timeout".into(),
        Err(_) => "broken".into(),
    }
}

/// A client that retries what a restart makes fail, counting it.
struct Client {
    raw: OneShot,
    /// Connections that broke before a whole answer.
    broken: AtomicU64,
    /// Connections refused (ECONNREFUSED, ENOENT): never expected.
    refused: AtomicU64,
    /// Transient statuses, by status.
    statuses: Mutex<BTreeMap<u16, u64>>,
}

impl Client {
    fn new(sock: PathBuf) -> Self {
        Client {
            raw: OneShot::new(sock, ANSWER_WITHIN),
            broken: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            statuses: Mutex::default(),
        }
    }

    /// Send until an answer `accept` takes; a broken connection or a
    /// [`TRANSIENT`] status is retried for up to [`RETRY_FOR`]. Returns
    /// the answer and how many tries failed before it; an answer that is
    /// neither is an error.
    fn call_counted(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        accept: impl Fn(&Reply) -> bool,
    ) -> Result<(Reply, u32), String> {
        let deadline = Instant::now() + RETRY_FOR;
        let mut failed = 0;
        loop {
            let last = match self.raw.request(method, path, body.as_ref()) {
                Ok(r) if accept(&r) => return Ok((r, failed)),
                Ok(r) if TRANSIENT.contains(&r.status) => {
                    *lock(&self.statuses).entry(r.status).or_default() += 1;
                    r.to_string()
                }
                Ok(r) => return Err(format!("{method} {path}: {r}")),
                Err(e @ OneShotError::Timeout(_)) => return Err(format!("{method} {path}: {e}")),
                Err(e) => {
                    let n = if e.refused() {
                        &self.refused
                    } else {
                        &self.broken
                    };
                    n.fetch_add(1, Ordering::Relaxed);
                    shared::error_chain(&e)
                }
            };
            failed += 1;
            if Instant::now() > deadline {
                return Err(format!(
                    "{method} {path}: still failing after {RETRY_FOR:?} ({failed} tries): {last}"
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        accept: impl Fn(&Reply) -> bool,
    ) -> Result<Reply, String> {
        self.call_counted(method, path, body, accept)
            .map(|(r, _)| r)
    }

    /// The body of an answer with status `ok`.
    fn ok(&self, method: &str, path: &str, body: Option<Value>, ok: u16) -> Result<Value, String> {
        self.call(method, path, body, |r| r.status == ok)
            .map(|r| r.body)
    }

    fn exec(&self, id: &str, req: &ExecRequest) -> Result<u64, String> {
        let body = serde_json::to_value(req).expect("an exec request encodes");
        let what = body.to_string();
        let r = self.ok("POST", &format!("/v1/vms/{id}/exec"), Some(body), 200)?;
        r["result"]
            .as_u64()
            .ok_or_else(|| format!("exec {what} on {id}: no result in {r}"))
    }

    fn fill(&self, id: &str, chunk: usize, seed: u64) -> Result<(), String> {
        match self.exec(id, &op::fill(chunk as u64 * CHUNK, CHUNK, seed))? {
            0 => Ok(()),
            r => Err(format!("fill of chunk {chunk} of {id} returned {r}")),
        }
    }

    /// The VMM's digest of all of `id`'s RAM.
    fn digest(&self, id: &str) -> Result<u64, String> {
        self.exec(id, &op::digest(0, PAGES))
    }

    /// `GET /v1/vms/{id}`; None if there is no such VM.
    fn vm(&self, id: &str) -> Result<Option<VmInfo>, String> {
        let r = self.call("GET", &format!("/v1/vms/{id}"), None, |r| {
            matches!(r.status, 200 | 404)
        })?;
        if r.status == 404 {
            return Ok(None);
        }
        serde_json::from_value(r.body.clone())
            .map(Some)
            .map_err(|e| format!("GET {id}: not a VM: {e}: {r}"))
    }

    fn vms(&self) -> Result<Vec<VmInfo>, String> {
        let r = self.ok("GET", "/v1/vms", None, 200)?;
        serde_json::from_value(r["vms"].clone()).map_err(|e| format!("GET /v1/vms: {e}: {r}"))
    }

    /// Create a VM; its id.
    fn create(&self, req: Value) -> Result<String, String> {
        let r = self.ok("POST", "/v1/vms", Some(req), 201)?;
        r["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("create: no id in {r}"))
    }

    /// Delete a VM (done already if there is none).
    fn delete_vm(&self, id: &str) -> Result<(), String> {
        self.call("DELETE", &format!("/v1/vms/{id}"), None, |r| {
            matches!(r.status, 200 | 404)
        })
        .map(|_| ())
    }

    fn snapshot_names(&self) -> Result<(Vec<String>, Vec<String>), String> {
        let r = self.ok("GET", "/v1/snapshots", None, 200)?;
        let names = |key: &str| -> Vec<String> {
            r[key]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|s| s.get("name").and_then(Value::as_str).or(s.as_str()))
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default()
        };
        Ok((names("snapshots"), names("quarantined")))
    }

    fn hiccups(&self) -> String {
        format!(
            "{} broken connections, {} refused, transient statuses {:?}",
            self.broken.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
            lock(&self.statuses)
        )
    }
}

// -------------------------------------------------- restarts and health --

/// `GET /v1/health` once, if it answers.
fn health_once(raw: &OneShot) -> Option<Health> {
    let r = raw.request("GET", "/v1/health", None).ok()?;
    (r.status == 200).then(|| {
        serde_json::from_value(r.body.clone())
            .unwrap_or_else(|e| panic!("GET /v1/health: not a Health: {e}: {r}"))
    })
}

/// Poll `GET /v1/health` until an answer `want` takes; panics after
/// [`RESTART_WITHIN`], saying it waited for `what`.
fn wait_health(c: &Client, what: &str, want: impl Fn(&Health) -> bool) -> Health {
    let deadline = Instant::now() + RESTART_WITHIN;
    let mut last = None;
    loop {
        if let Some(h) = health_once(&c.raw) {
            if want(&h) {
                return h;
            }
            last = Some(h);
        }
        assert!(
            Instant::now() < deadline,
            "no health answer with {what} within {RESTART_WITHIN:?}; last: {last:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// SIGKILL the serving process and wait until its successor answers.
/// Returns the new health and how long that took.
fn crash(c: &Client) -> (Health, Duration) {
    let before = wait_health(c, "any process", |_| true);
    assert!(before.kept, "a server without a keeper: {before:?}");
    let t0 = Instant::now();
    signal(before.pid, Signal::SIGKILL);
    let h = wait_health(c, &format!("a pid other than {}", before.pid), |h| {
        h.pid != before.pid
    });
    let gap = t0.elapsed();
    assert_eq!(
        h.start, "crash",
        "after a SIGKILL of pid {}: {h:?}",
        before.pid
    );
    assert!(h.kept, "{h:?}");
    (h, gap)
}

/// `POST /v1/server/upgrade` (to `binary`, or the same binary) and wait
/// until the new process answers; returns its health and how long that
/// took.
fn upgrade(c: &Client, binary: Option<&Path>) -> (Health, Duration) {
    let before = wait_health(c, "any process", |_| true);
    let body = match binary {
        Some(b) => json!({ "binary": b.to_str().expect("a UTF-8 path") }),
        None => json!({}),
    };
    let t0 = Instant::now();
    // Only a handover under way is worth a retry; nothing else restarts.
    let r = c
        .call("POST", "/v1/server/upgrade", Some(body), |r| {
            r.status == 200
        })
        .unwrap_or_else(|e| panic!("upgrade: {e}"));
    assert_eq!(
        r.body["pid"].as_u64(),
        Some(u64::from(before.pid)),
        "upgrade answer: {r}"
    );
    let h = wait_health(c, &format!("a pid other than {}", before.pid), |h| {
        h.pid != before.pid
    });
    (h, t0.elapsed())
}

/// `uffdctl server upgrade`, as a user would, and the health it prints.
fn upgrade_by_cli(s: &TestServer, c: &Client) -> (Health, Duration) {
    let before = wait_health(c, "any process", |_| true);
    let t0 = Instant::now();
    let out = uffdctl(s, &["--json", "server", "upgrade"]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "uffdctl server upgrade: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let h: Health = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("uffdctl server upgrade printed no health: {e}: {text}"));
    assert_ne!(h.pid, before.pid, "uffdctl server upgrade: {h:?}");
    (h, t0.elapsed())
}

// ---------------------------------------------------------------- model --

/// Per chunk: the seed it was last filled with, 0 for zeroes.
type Seeds = [u64; CHUNKS];

/// The bytes of guest memory whose chunks hold `seeds`.
fn memory_of(seeds: &Seeds) -> Vec<u8> {
    let mut mem = vec![0u8; usize::try_from(MIB << 20).expect("fits")];
    for (c, s) in seeds.iter().enumerate() {
        if *s != 0 {
            apply_fill(&mut mem, c as u64 * CHUNK, CHUNK, *s);
        }
    }
    mem
}

/// The VMM's digest of all of the RAM of a VM holding `seeds`.
fn digest_of(seeds: &Seeds) -> u64 {
    shared::pattern::digest(&memory_of(seeds), 0, 0, PAGES)
}

/// The VMM's digest of chunk `chunk` holding `seed`.
fn chunk_digest(chunk: usize, seed: u64) -> u64 {
    let first = chunk as u64 * CHUNK;
    let ps = usize::try_from(shared::PAGE_SIZE).expect("fits");
    let mut mem = vec![0u8; usize::try_from(CHUNK).expect("fits") * ps];
    if seed != 0 {
        for (i, page) in mem.chunks_exact_mut(ps).enumerate() {
            shared::pattern::fill_page(page, first + i as u64, seed);
        }
    }
    shared::pattern::digest(&mem, first, first, CHUNK)
}

fn random_seeds(rng: &mut Rng) -> Seeds {
    let mut s = [0; CHUNKS];
    for c in &mut s {
        if !rng.one_in(4) {
            *c = rng.seed();
        }
    }
    s
}

/// A VM the test made, and what it must hold.
#[derive(Debug, Clone)]
struct Model {
    what: String,
    seeds: Seeds,
    /// Its VMM: the same process across every restart.
    pid: u32,
    /// Paused (a template): checked, never written.
    paused: bool,
    /// Written and checked by the two clients.
    driven: bool,
}

/// A snapshot the test asked for, and what it holds.
#[derive(Debug, Clone, Copy)]
struct Snap {
    seeds: Seeds,
    /// Its creation was answered 201 (else a crash cut it: it may be
    /// listed or not, but if listed it must be whole).
    sure: bool,
}

struct World {
    t0: Instant,
    vms: Mutex<BTreeMap<String, Model>>,
    snaps: Mutex<BTreeMap<String, Snap>>,
    /// What a VM an interrupted create, fork or clone may have left can
    /// hold: the content of a VM or snapshot it was made from.
    candidates: Mutex<Vec<Seeds>>,
    failures: Mutex<Vec<String>>,
    stop: AtomicBool,
    /// Per operation: (done, of them after failed tries).
    tally: Mutex<BTreeMap<&'static str, (u64, u64)>>,
}

impl World {
    fn fail(&self, what: String) {
        let line = format!("[{:7.3}s] {what}", self.t0.elapsed().as_secs_f64());
        eprintln!("restart: FAILURE {line}");
        lock(&self.failures).push(line);
        self.stop.store(true, Ordering::SeqCst);
    }

    fn count(&self, op: &'static str, retried: u32) {
        let mut t = lock(&self.tally);
        let e = t.entry(op).or_default();
        e.0 += 1;
        if retried > 0 {
            e.1 += 1;
        }
    }

    fn candidate(&self, seeds: Seeds) {
        let mut c = lock(&self.candidates);
        if !c.contains(&seeds) {
            c.push(seeds);
        }
    }

    fn add(&self, s: &TestServer, id: &str, what: &str, seeds: Seeds, driven: bool) {
        let info = s.vm(id);
        let pid = info
            .pid
            .unwrap_or_else(|| panic!("{id} has no VMM: {info:?}"));
        lock(&self.vms).insert(
            id.to_owned(),
            Model {
                what: what.to_owned(),
                seeds,
                pid,
                paused: info.state == RunState::Paused,
                driven,
            },
        );
    }

    fn seeds(&self, id: &str) -> Seeds {
        lock(&self.vms)[id].seeds
    }

    fn set_chunk(&self, id: &str, chunk: usize, seed: u64) {
        if let Some(m) = lock(&self.vms).get_mut(id) {
            m.seeds[chunk] = seed;
        }
    }
}

fn vm_req(source: Option<MemorySource>, huge: Option<bool>) -> Value {
    serde_json::to_value(CreateVm {
        memory_source: source,
        hugepages: huge,
        ..new_vm(MIB)
    })
    .expect("encodes")
}

/// Fill `n` random chunks of `id` with new seeds (setup: no restarts).
fn fill_some(s: &TestServer, id: &str, seeds: &mut Seeds, rng: &mut Rng, n: usize) {
    for _ in 0..n {
        let c = rng.below(CHUNKS);
        let seed = rng.seed();
        s.fill(id, c as u64 * CHUNK, CHUNK, seed);
        seeds[c] = seed;
    }
}

/// The images VMs are made from; their files live as long as this.
struct Images {
    raw: RandomImage,
    raw_seeds: Seeds,
    _zst_raw: RandomImage,
    _zst_dir: tempfile::TempDir,
    zst: PathBuf,
    zst_seeds: Seeds,
}

fn images(rng: &mut Rng) -> Images {
    let raw_seeds = random_seeds(rng);
    let raw = RandomImage::from_bytes(memory_of(&raw_seeds));
    let zst_seeds = random_seeds(rng);
    let zst_raw = RandomImage::from_bytes(memory_of(&zst_seeds));
    let zst_dir = tempfile::tempdir().expect("tempdir");
    let zst = zst_dir.path().join("memory.zst");
    compress_image(zst_raw.file.path(), &zst, Some(128));
    Images {
        raw,
        raw_seeds,
        _zst_raw: zst_raw,
        _zst_dir: zst_dir,
        zst,
        zst_seeds,
    }
}

/// Make the VMs the clients drive, the template, and the ops thread's
/// VM (returned).
fn populate(s: &TestServer, w: &World, img: &Images, huge: bool, rng: &mut Rng) -> String {
    let create = |req: Value| {
        let req: CreateVm = serde_json::from_value(req).expect("a create request");
        s.create_vm(&req)
    };
    // The gold VM and its snapshot, which restores share as their base.
    let gold = create(vm_req(None, None));
    let mut gold_seeds = [0; CHUNKS];
    fill_some(s, &gold, &mut gold_seeds, rng, 8);
    s.snapshot(&gold, "gold", proto::api::SnapshotMode::Full);
    lock(&w.snaps).insert(
        "gold".into(),
        Snap {
            seeds: gold_seeds,
            sure: true,
        },
    );
    w.add(s, &gold, "plain, snapshotted as gold", gold_seeds, true);
    for _ in 0..2 {
        let r = s.restore("gold");
        w.add(s, &r, "restore of gold", gold_seeds, true);
    }
    for _ in 0..3 {
        let p = create(vm_req(None, None));
        let mut seeds = [0; CHUNKS];
        fill_some(s, &p, &mut seeds, rng, 2);
        w.add(s, &p, "plain", seeds, true);
    }
    // A running parent, its children and grandchildren.
    let p = create(vm_req(None, None));
    let mut seeds = [0; CHUNKS];
    fill_some(s, &p, &mut seeds, rng, 4);
    w.add(s, &p, "running parent", seeds, true);
    let kids = s.fork(&p, 2).children;
    w.add(s, &kids[0], "child of the running parent", seeds, true);
    w.add(s, &kids[1], "child of the running parent", seeds, true);
    let mut kid_seeds = seeds;
    fill_some(s, &kids[0], &mut kid_seeds, rng, 2);
    lock(&w.vms).get_mut(&kids[0]).expect("modelled").seeds = kid_seeds;
    for g in s.fork(&kids[0], 2).children {
        w.add(s, &g, "grandchild of the running parent", kid_seeds, true);
    }
    // A paused template forked twice.
    let t = create(vm_req(None, None));
    let mut seeds = [0; CHUNKS];
    fill_some(s, &t, &mut seeds, rng, 3);
    s.pause(&t);
    w.add(s, &t, "paused template", seeds, false);
    for _ in 0..2 {
        let k = s.fork_one(&t);
        w.add(s, &k, "child of the paused template", seeds, true);
    }
    // Two VMs of each image, sharing its base.
    for _ in 0..2 {
        let r = create(vm_req(Some(file_source(img.raw.file.path())), None));
        w.add(s, &r, "raw image", img.raw_seeds, true);
        let z = create(vm_req(Some(zstd_source(&img.zst)), None));
        w.add(s, &z, "zstd image", img.zst_seeds, true);
    }
    if huge {
        let h = create(vm_req(None, Some(true)));
        let mut seeds = [0; CHUNKS];
        fill_some(s, &h, &mut seeds, rng, 3);
        w.add(s, &h, "hugepages", seeds, true);
        let k = s.fork_one(&h);
        w.add(s, &k, "child of a hugepage VM", seeds, true);
        let r = create(vm_req(Some(file_source(img.raw.file.path())), Some(true)));
        w.add(s, &r, "raw image on hugepages", img.raw_seeds, true);
    }
    // The ops thread's own VM.
    let o = create(vm_req(None, None));
    let mut seeds = [0; CHUNKS];
    fill_some(s, &o, &mut seeds, rng, 3);
    w.add(s, &o, "the ops thread's VM", seeds, false);
    o
}

// -------------------------------------------------------------- clients --

/// Client `t` fills and checks chunks `t`, `t + 2`, ... of the driven VMs.
fn client(w: &World, c: &Client, t: usize, mut rng: Rng) {
    let ids: Vec<String> = lock(&w.vms)
        .iter()
        .filter(|(_, m)| m.driven)
        .map(|(id, _)| id.clone())
        .collect();
    while !w.stop.load(Ordering::SeqCst) {
        let id = rng.pick(&ids).clone();
        let chunk = 2 * rng.below(CHUNKS / 2) + t;
        let seed = w.seeds(&id)[chunk];
        let start = chunk as u64 * CHUNK;
        let res = match rng.below(10) {
            0..=3 => {
                let new = rng.seed();
                c.fill(&id, chunk, new).map(|()| {
                    w.set_chunk(&id, chunk, new);
                })
            }
            4..=6 => {
                // The guest reads every page: its checksum of zeroes is 0,
                // its verify counts the pages that differ.
                let (how, req) = if seed == 0 {
                    ("guest checksum", op::checksum(start, CHUNK))
                } else {
                    ("guest verify", op::verify(start, CHUNK, seed))
                };
                c.exec(&id, &req).and_then(|got| {
                    (got == 0)
                        .then_some(())
                        .ok_or_else(|| format!("{how} gave {got}, 0 expected"))
                })
            }
            _ => {
                let want = chunk_digest(chunk, seed);
                c.exec(&id, &op::digest(start, CHUNK)).and_then(|got| {
                    (got == want)
                        .then_some(())
                        .ok_or_else(|| format!("vmm digest {got:#x}, {want:#x} expected"))
                })
            }
        };
        if let Err(e) = res {
            let what = lock(&w.vms)[&id].what.clone();
            let now = match c.vm(&id) {
                Ok(Some(v)) => format!("{} {}", v.state, v.failure.unwrap_or_default()),
                other => format!("{other:?}"),
            };
            w.fail(format!(
                "client {t}: {id} ({what}), chunk {chunk} (seed {seed:#x}): {e}; the VM is now \
                 {now}"
            ));
        }
    }
}

// ------------------------------------------------------------------ ops --

/// The ops thread: forks, snapshots, rollbacks, restores, clones and
/// deletes around VM `o`, which only it writes.
fn ops(w: &World, c: &Client, o: &str, mut rng: Rng) {
    let mut n = 0;
    while !w.stop.load(Ordering::SeqCst) {
        n += 1;
        let res = match rng.below(8) {
            0 => op_fill(w, c, o, &mut rng),
            1 | 2 => op_snapshot(w, c, o, &mut rng, n),
            3 => op_fork(w, c, o, &mut rng),
            4 => op_rollback(w, c, o, &mut rng),
            5 => op_restore(w, c, &mut rng),
            6 => op_clone(w, c, o),
            _ => op_delete_snapshot(w, c, &mut rng),
        };
        if let Err(e) = res {
            w.fail(format!("ops: {e}"));
        }
    }
}

/// The guest's `checksum` of chunk `chunk` holding `seed`.
fn chunk_checksum(chunk: usize, seed: u64) -> u64 {
    let first = chunk as u64 * CHUNK;
    let mut mem = vec![0u8; usize::try_from(CHUNK * shared::PAGE_SIZE).expect("fits")];
    if seed != 0 {
        let ps = usize::try_from(shared::PAGE_SIZE).expect("fits");
        for (i, page) in mem.chunks_exact_mut(ps).enumerate() {
            shared::pattern::fill_page(page, first + i as u64, seed);
        }
    }
    shared::pattern::checksum(&mem, first, first, CHUNK)
}

/// Check VM `id` holds `seeds` whole (`what` says what it is): the VMM's
/// digest of all of its RAM, and a guest's checksum of a chunk (its vCPU
/// runs: a VM left paused would never answer).
fn check_whole(c: &Client, id: &str, seeds: &Seeds, what: &str) -> Result<(), String> {
    let sum = c.exec(id, &op::checksum(0, CHUNK))?;
    if sum != chunk_checksum(0, seeds[0]) {
        return Err(format!(
            "{what} {id}: guest checksum of chunk 0 {sum:#x}, {:#x} expected",
            chunk_checksum(0, seeds[0])
        ));
    }
    let got = c.digest(id)?;
    let want = digest_of(seeds);
    if got != want {
        let bad: Vec<usize> = (0..CHUNKS)
            .filter(|ch| {
                c.exec(id, &op::digest(*ch as u64 * CHUNK, CHUNK))
                    .is_ok_and(|d| d != chunk_digest(*ch, seeds[*ch]))
            })
            .collect();
        return Err(format!(
            "{what} {id}: digest {got:#x}, {want:#x} expected; chunks that differ: {bad:?}"
        ));
    }
    Ok(())
}

fn op_fill(w: &World, c: &Client, o: &str, rng: &mut Rng) -> Result<(), String> {
    let chunk = rng.below(CHUNKS);
    let seed = rng.seed();
    c.fill(o, chunk, seed)?;
    w.set_chunk(o, chunk, seed);
    w.candidate(w.seeds(o));
    w.count("fill", 0);
    Ok(())
}

fn op_snapshot(w: &World, c: &Client, o: &str, rng: &mut Rng, n: u64) -> Result<(), String> {
    let name = format!("o-{n}");
    let seeds = w.seeds(o);
    let mode = *rng.pick(&["full", "incremental", "dirty"]);
    let compress = rng.one_in(4);
    lock(&w.snaps).insert(name.clone(), Snap { seeds, sure: false });
    // A cut one is not asked again (its name may be taken now): it is
    // listed whole, or not at all.
    let path = format!("/v1/vms/{o}/snapshots");
    let body = json!({ "name": name, "mode": mode, "compress": compress });
    let deadline = Instant::now() + RETRY_FOR;
    loop {
        match c.raw.request("POST", &path, Some(&body)) {
            Ok(r) if r.status == 201 => {
                if let Some(s) = lock(&w.snaps).get_mut(&name) {
                    s.sure = true;
                }
                w.count("snapshot", 0);
                return Ok(());
            }
            // Refused before anything was done: a handover, or a VMM
            // that has not rejoined.
            Ok(r) if matches!(r.status, 503 | 502 | 409) && !r.error().contains("exists") => {
                *lock(&c.statuses).entry(r.status).or_default() += 1;
            }
            Ok(r) if r.status == 409 => {
                w.count("snapshot", 1);
                return Ok(());
            }
            Ok(r) if r.status == 500 || r.status == 504 => {
                // Cut by a crash (its writer died with the process).
                eprintln!("restart: snapshot {name} of {o}: {r} (left to the end's check)");
                w.count("snapshot", 1);
                return Ok(());
            }
            Ok(r) => return Err(format!("snapshot {name} of {o}: {r}")),
            Err(e @ OneShotError::Timeout(_)) => {
                return Err(format!("snapshot {name} of {o}: {e}"))
            }
            Err(e) => {
                c.broken.fetch_add(1, Ordering::Relaxed);
                if e.refused() {
                    c.refused.fetch_add(1, Ordering::Relaxed);
                }
                w.count("snapshot", 1);
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(format!("snapshot {name} of {o} refused for {RETRY_FOR:?}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn op_fork(w: &World, c: &Client, o: &str, rng: &mut Rng) -> Result<(), String> {
    let seeds = w.seeds(o);
    w.candidate(seeds);
    let count = 1 + rng.below(2);
    let (r, retried) = c.call_counted(
        "POST",
        &format!("/v1/vms/{o}/fork"),
        Some(json!({ "count": count })),
        |r| r.status == 201,
    )?;
    let kids: Vec<String> = serde_json::from_value(r.body["children"].clone())
        .map_err(|e| format!("fork of {o}: {e}: {r}"))?;
    if kids.len() != count {
        return Err(format!("fork of {o} into {count}: {r}"));
    }
    for k in &kids {
        check_whole(c, k, &seeds, "a fork child of the ops VM")?;
    }
    check_whole(c, o, &seeds, "the ops VM after a fork")?;
    for k in &kids {
        c.delete_vm(k)?;
    }
    w.count("fork+delete", retried);
    Ok(())
}

/// A snapshot whose creation was answered (a cut one may not be there).
fn sure_snapshot(w: &World, rng: &mut Rng) -> (String, Seeds) {
    let snaps = lock(&w.snaps);
    let sure: Vec<(&String, &Snap)> = snaps.iter().filter(|(_, s)| s.sure).collect();
    let (name, snap) = rng.pick(&sure);
    ((*name).clone(), snap.seeds)
}

fn op_rollback(w: &World, c: &Client, o: &str, rng: &mut Rng) -> Result<(), String> {
    let (name, seeds) = sure_snapshot(w, rng);
    w.candidate(seeds);
    // Asked again until it is done: then it holds the snapshot's pages.
    let (_, retried) = c.call_counted(
        "POST",
        &format!("/v1/vms/{o}/rollback"),
        Some(json!({ "snapshot": name })),
        |r| r.status == 200,
    )?;
    lock(&w.vms).get_mut(o).expect("modelled").seeds = seeds;
    check_whole(c, o, &seeds, &format!("the ops VM rolled back to {name}"))?;
    w.count("rollback", retried);
    Ok(())
}

fn op_restore(w: &World, c: &Client, rng: &mut Rng) -> Result<(), String> {
    let (name, seeds) = sure_snapshot(w, rng);
    w.candidate(seeds);
    let (r, retried) = c.call_counted(
        "POST",
        "/v1/vms",
        Some(json!({ "from_snapshot": name })),
        |r| r.status == 201,
    )?;
    let id = r.body["id"].as_str().unwrap_or_default().to_owned();
    check_whole(c, &id, &seeds, &format!("a restore of {name}"))?;
    c.delete_vm(&id)?;
    w.count("restore+delete", retried);
    Ok(())
}

fn op_clone(w: &World, c: &Client, o: &str) -> Result<(), String> {
    let seeds = w.seeds(o);
    w.candidate(seeds);
    let (r, retried) = c.call_counted(
        "POST",
        &format!("/v1/vms/{o}/clone"),
        Some(json!({ "count": 1, "concurrency": 1 })),
        |r| r.status == 201,
    )?;
    let clones: Vec<String> = serde_json::from_value(r.body["clones"].clone())
        .map_err(|e| format!("clone of {o}: {e}: {r}"))?;
    if let Some(snap) = r.body["snapshot"].as_str() {
        lock(&w.snaps).insert(snap.to_owned(), Snap { seeds, sure: true });
    }
    for k in &clones {
        check_whole(c, k, &seeds, "a clone of the ops VM")?;
        c.delete_vm(k)?;
    }
    w.count("clone+delete", retried);
    Ok(())
}

fn op_delete_snapshot(w: &World, c: &Client, rng: &mut Rng) -> Result<(), String> {
    let names: Vec<String> = lock(&w.snaps)
        .keys()
        .filter(|n| *n != "gold")
        .cloned()
        .collect();
    if names.len() < 3 {
        return Ok(());
    }
    let name = rng.pick(&names).clone();
    // A snapshot VMs still read (restores a crash left) stays.
    let (r, retried) = c.call_counted("DELETE", &format!("/v1/snapshots/{name}"), None, |r| {
        matches!(r.status, 200 | 404) || (r.status == 409 && r.error().contains("in use"))
    })?;
    if r.status != 409 {
        lock(&w.snaps).remove(&name);
    }
    w.count("delete snapshot", retried);
    Ok(())
}

/// The last ERROR lines of the server's log (keeper and every serving
/// process), without colours.
fn server_errors(s: &TestServer) -> String {
    let text = s.server_log_text();
    let lines: Vec<String> = text
        .lines()
        .filter(|l| l.contains("ERROR"))
        .map(|l| {
            let mut out = String::new();
            let mut esc = false;
            for ch in l.chars() {
                match (esc, ch) {
                    (false, '\u{1b}') => esc = true,
                    (true, 'm') => esc = false,
                    (true, _) => {}
                    (false, ch) => out.push(ch),
                }
            }
            out
        })
        .collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// What a table that disagrees with its VM's memory (an invariant
/// violation) does to the bytes: the first violating page's explanation,
/// and whether a write there is seen by the VM itself, by a fork child
/// and by a restore of a snapshot taken after it.
fn diagnose(s: &TestServer, c: &Client, inv: &proto::api::Invariant) -> String {
    let Some(v) = inv.violations.first() else {
        return String::new();
    };
    let (id, page) = (v.id.as_str(), v.page);
    let mut out = format!(
        "page {page} of {id}: {}\n",
        s.raw(
            "GET",
            &format!("/v1/vms/{id}/pages/{page}?explain=true"),
            None
        )
    );
    let chunk = usize::try_from(page / CHUNK).expect("fits");
    let seed = 0xd1a6_0001;
    let verify = |vm: &str| c.exec(vm, &op::verify(chunk as u64 * CHUNK, CHUNK, seed));
    out += &format!(
        "after a fill of its chunk {chunk}: {id} verifies {:?} (pages that differ)",
        c.fill(id, chunk, seed).and_then(|()| verify(id))
    );
    if let Ok(k) = c
        .ok(
            "POST",
            &format!("/v1/vms/{id}/fork"),
            Some(json!({"count": 1})),
            201,
        )
        .map(|r| r["children"][0].as_str().unwrap_or_default().to_owned())
    {
        out += &format!(", its fork child {k} {:?}", verify(&k));
    }
    let snap = json!({"name": "diagnosis", "mode": "full"});
    if c.ok("POST", &format!("/v1/vms/{id}/snapshots"), Some(snap), 201)
        .is_ok()
    {
        if let Ok(r) = c.create(json!({"from_snapshot": "diagnosis"})) {
            out += &format!(", a restore of its snapshot {r} {:?}", verify(&r));
        }
    }
    out
}

// ------------------------------------------------------------ the tests --

#[test]
fn crash_and_upgrade_keep_every_vm() {
    let seed = env_u64("PAGEFORK_RESTART_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() % 1_000_000)
            .unwrap_or(1)
    });
    let rounds = env_u64("PAGEFORK_RESTART_ROUNDS").unwrap_or(20);
    eprintln!("restart: seed {seed} (PAGEFORK_RESTART_SEED={seed} to replay), {rounds} rounds");
    let Some(s) = server_on_xfs(&[]) else { return };
    let huge = free_hugepages() >= HUGEPAGES_NEEDED;
    if !huge {
        eprintln!(
            "restart: fewer than {HUGEPAGES_NEEDED} free huge pages: no hugepage VMs in this run"
        );
    }
    let c = Client::new(s.api_sock());
    let keeper = s.keeper_pid();
    let first = wait_health(&c, "the first process", |_| true);
    assert_eq!(first.start, "first", "{first:?}");
    assert!(first.kept, "{first:?}");
    assert_ne!(
        first.pid, keeper,
        "the serving process is the keeper's child"
    );

    // Baselines: a process that took over (as the last one will be), with
    // no VM; one of each operation made what the server makes once.
    let mut rng = Rng(seed);
    let img = images(&mut rng);
    let warm = s.create_vm(&new_vm(MIB));
    s.fill(&warm, 0, CHUNK, 1);
    s.snapshot(&warm, "warm", proto::api::SnapshotMode::Full);
    let wr = s.restore("warm");
    s.fork_one(&wr);
    for v in s.vm_ids() {
        s.delete_vm(&v);
    }
    s.delete_snapshot("warm");
    crash(&c);
    s.wait_pool_full();
    std::thread::sleep(Duration::from_millis(300));
    let serving_fds_before = open_fds(wait_health(&c, "any", |_| true).pid).len();
    let keeper_fds_before = open_fds(keeper).len();

    let w = World {
        t0: Instant::now(),
        vms: Mutex::default(),
        snaps: Mutex::default(),
        candidates: Mutex::default(),
        failures: Mutex::default(),
        stop: AtomicBool::new(false),
        tally: Mutex::default(),
    };
    let o = populate(&s, &w, &img, huge, &mut rng);
    let (all_pids, driven): (Vec<u32>, usize) = {
        let vms = lock(&w.vms);
        (
            vms.values().map(|m| m.pid).collect(),
            vms.values().filter(|m| m.driven).count(),
        )
    };
    eprintln!(
        "restart: {} VMs ({driven} driven by the clients){}",
        all_pids.len(),
        if huge { ", 3 on hugepages" } else { "" }
    );

    // The random phase: clients, ops, and crashes and upgrades.
    let mut crashes = Vec::new();
    let mut upgrades = Vec::new();
    let mut lost = Vec::new();
    let t_random = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..2 {
            let (w, c) = (&w, &c);
            let rng = Rng(seed ^ (t as u64 + 1).wrapping_mul(0xd1b5_4a32_d192_ed03));
            scope.spawn(move || client(w, c, t, rng));
        }
        {
            let (w, c, o) = (&w, &c, o.as_str());
            let rng = Rng(seed ^ 0x5eed_0f0b);
            scope.spawn(move || ops(w, c, o, rng));
        }
        let note = |h: &Health, lost: &mut Vec<String>| {
            lost.extend(h.lost_vms.iter().cloned());
        };
        // The threads stop when told, also when this one panics.
        let main = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for round in 0..rounds {
                if w.stop.load(Ordering::SeqCst) {
                    break;
                }
                std::thread::sleep(rng.millis(100, 600));
                let (h, gap) = crash(&c);
                note(&h, &mut lost);
                crashes.push((gap, h.recovery_ms.unwrap_or(0.0), h.adopted_vms));
                if w.stop.load(Ordering::SeqCst) {
                    break;
                }
                std::thread::sleep(rng.millis(100, 600));
                let (h, gap) = if round % 2 == 0 {
                    upgrade(&c, None)
                } else {
                    upgrade_by_cli(&s, &c)
                };
                if h.start != "upgrade" {
                    w.fail(format!(
                        "after an upgrade the server says start {:?}: {h:?}",
                        h.start
                    ));
                }
                note(&h, &mut lost);
                upgrades.push((gap, h.recovery_ms.unwrap_or(0.0), h.adopted_vms));
                eprintln!(
                "restart: round {}/{rounds}: crash {:.0} ms, upgrade {:.0} ms, {} VMs adopted; \
                 fds: keeper {}, serving process {}",
                round + 1,
                crashes
                    .last()
                    .map_or(0.0, |x: &(Duration, f64, u64)| x.0.as_secs_f64() * 1e3),
                gap.as_secs_f64() * 1e3,
                h.adopted_vms,
                open_fds(keeper).len(),
                open_fds(h.pid).len()
            );
            }
            // Let the last restart's requests go through before stopping.
            std::thread::sleep(Duration::from_millis(300));
        }));
        w.stop.store(true, Ordering::SeqCst);
        if let Err(p) = main {
            std::panic::resume_unwind(p);
        }
    });
    let random_secs = t_random.elapsed().as_secs_f64();
    let summary = |what: &str, v: &[(Duration, f64, u64)]| {
        let mut gaps: Vec<f64> = v.iter().map(|x| x.0.as_secs_f64() * 1e3).collect();
        gaps.sort_by(f64::total_cmp);
        let rec: f64 = v.iter().map(|x| x.1).fold(0.0, f64::max);
        if !gaps.is_empty() {
            eprintln!(
                "restart: {} {what}: until the new process answered {:.0}/{:.0}/{:.0} ms \
                 (min/median/max), its recovery at most {rec:.1} ms",
                gaps.len(),
                gaps[0],
                gaps[gaps.len() / 2],
                gaps[gaps.len() - 1]
            );
        }
    };
    summary("crashes", &crashes);
    summary("upgrades", &upgrades);
    eprintln!(
        "restart: {random_secs:.1} s of random phase; clients saw {}",
        c.hiccups()
    );
    eprintln!(
        "restart: operations (done, of them retried): {:?}",
        lock(&w.tally)
    );
    if !lost.is_empty() {
        eprintln!("restart: VMs the restarts reported lost: {lost:?}");
    }
    let failures = std::mem::take(&mut *lock(&w.failures));
    assert!(
        failures.is_empty(),
        "seed {seed} (PAGEFORK_RESTART_SEED={seed} to replay): {} failure(s) in the random \
         phase:\n{}\nthe server's errors:\n{}",
        failures.len(),
        failures.join("\n"),
        server_errors(&s)
    );

    // Every VM the test made and did not delete runs (the template is
    // paused), on the VMM it started with, and holds what it must.
    let models = lock(&w.vms).clone();
    for (id, m) in &models {
        let info = c
            .vm(id)
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("{id} ({}) is gone", m.what));
        let want = if m.paused {
            RunState::Paused
        } else {
            RunState::Running
        };
        assert_eq!(info.state, want, "{id} ({}): {info:?}", m.what);
        assert_eq!(
            info.pid,
            Some(m.pid),
            "{id} ({}) has another VMM than the one it started with",
            m.what
        );
        if m.paused {
            // A paused VM's memory is read once it runs again.
            c.ok("POST", &format!("/v1/vms/{id}/resume"), None, 200)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        check_whole(&c, id, &m.seeds, &m.what).unwrap_or_else(|e| panic!("at the end: {e}"));
        assert!(
            !lost
                .iter()
                .any(|l| l.contains(&format!("{id}:")) || l == id),
            "{id} ({}) was reported lost: {lost:?}",
            m.what
        );
    }

    // What VMs the interrupted operations left run and hold what the VM
    // or snapshot they were made from held.
    let candidates: Vec<u64> = lock(&w.candidates).iter().map(digest_of).collect();
    let listed = c.vms().unwrap_or_else(|e| panic!("{e}"));
    let mut leftovers = Vec::new();
    for v in &listed {
        if models.contains_key(&v.id) || v.state == RunState::Deleted {
            continue;
        }
        assert!(
            matches!(v.state, RunState::Running | RunState::Paused),
            "{} (left by an operation a restart cut, parent {:?}) is {}: {v:?}",
            v.id,
            v.parent,
            v.state
        );
        let d = c.digest(&v.id).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            candidates.contains(&d),
            "{} (left by an operation a restart cut, parent {:?}) holds what no VM or \
             snapshot it can come from held (digest {d:#x})",
            v.id,
            v.parent
        );
        leftovers.push(v.id.clone());
    }
    eprintln!(
        "restart: {} VMs checked whole; {} left by cut operations, each exact: {leftovers:?}",
        models.len(),
        leftovers.len()
    );

    // One more crash while nothing writes: every VM reads the same bytes.
    let live: Vec<String> = listed
        .iter()
        .filter(|v| matches!(v.state, RunState::Running | RunState::Paused))
        .map(|v| v.id.clone())
        .collect();
    let digests: BTreeMap<&String, u64> = live
        .iter()
        .map(|id| (id, c.digest(id).unwrap_or_else(|e| panic!("{e}"))))
        .collect();
    let (h, _) = crash(&c);
    assert!(h.lost_vms.is_empty(), "the last crash lost VMs: {h:?}");
    assert_eq!(h.adopted_vms, listed.len() as u64, "{h:?}");
    for (id, d) in &digests {
        let after = c.digest(id).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(after, *d, "{id} reads other bytes after a crash");
    }

    // Every snapshot listed is whole: a restore of it holds what its VM
    // held.
    let (names, quarantined) = c.snapshot_names().unwrap_or_else(|e| panic!("{e}"));
    let snaps = lock(&w.snaps).clone();
    let mut clone_leftovers = Vec::new();
    for name in &names {
        let id = c
            .create(json!({ "from_snapshot": name }))
            .unwrap_or_else(|e| panic!("restore of listed snapshot {name}: {e}"));
        match snaps.get(name) {
            Some(snap) => check_whole(&c, &id, &snap.seeds, &format!("a restore of {name}"))
                .unwrap_or_else(|e| panic!("{e}")),
            // The snapshot of a clone a restart cut (its name never
            // reached the client): whole, of what the ops VM held.
            None if name.starts_with(&format!("clone-{o}-")) => {
                let d = c.digest(&id).unwrap_or_else(|e| panic!("{e}"));
                assert!(
                    candidates.contains(&d),
                    "snapshot {name} (of a clone a restart cut) restores to what the ops VM \
                     never held (digest {d:#x})"
                );
                clone_leftovers.push(name.clone());
            }
            None => panic!("snapshot {name} is listed, and no one made it"),
        }
        c.delete_vm(&id).unwrap_or_else(|e| panic!("{e}"));
    }
    let missing: Vec<&String> = snaps
        .iter()
        .filter(|(n, s)| s.sure && !names.contains(n))
        .map(|(n, _)| n)
        .collect();
    assert!(
        missing.is_empty(),
        "snapshots made and not listed: {missing:?}"
    );
    eprintln!(
        "restart: {} snapshots listed, each restored whole ({} cut ones not listed; left by \
         cut clones: {clone_leftovers:?}); quarantined: {quarantined:?}",
        names.len(),
        snaps
            .iter()
            .filter(|(n, s)| !s.sure && !names.contains(n))
            .count()
    );
    let inv = s.invariant();
    assert!(
        inv.ok,
        "seed {seed}: the page tables disagree with the VMs' memory after the restarts: \
         {inv:?}\n{}\nthe server's errors:\n{}",
        diagnose(&s, &c, &inv),
        server_errors(&s)
    );

    // Everything goes: VMs, their VMMs, and what the server and the keeper
    // held for them.
    for v in &listed {
        c.delete_vm(&v.id).unwrap_or_else(|e| panic!("{e}"));
    }
    for name in &names {
        c.call("DELETE", &format!("/v1/snapshots/{name}"), None, |r| {
            matches!(r.status, 200 | 404)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    }
    s.wait_pool_full();
    let pool = s.metric("pagefork_vmm_pool_target").unwrap_or(0);
    let settled = pagefork_tests::wait_for(Duration::from_secs(20), || {
        let serving = wait_health(&c, "any", |_| true).pid;
        let back = c.vms().is_ok_and(|v| v.is_empty())
            && vmm_processes(s.state_dir()).len() as u64 <= pool
            && !all_pids.iter().any(|p| pagefork_tests::process_exists(*p))
            && open_fds(serving).len() <= serving_fds_before + 8
            && open_fds(keeper).len() <= keeper_fds_before + 2;
        back.then_some(())
    });
    if settled.is_none() {
        let serving = wait_health(&c, "any", |_| true).pid;
        panic!(
            "not back at the baseline 20 s after the last delete: VMs {:?}, vmm processes {:?} \
             (pool {pool}), VMMs of the test alive {:?}, serving fds {serving_fds_before} -> {}, \
             keeper fds {keeper_fds_before} -> {}: {:?}",
            c.vms().map(|v| v
                .iter()
                .map(|v| format!("{} {}", v.id, v.state))
                .collect::<Vec<_>>()),
            vmm_processes(s.state_dir()),
            all_pids
                .iter()
                .filter(|p| pagefork_tests::process_exists(**p))
                .collect::<Vec<_>>(),
            open_fds(serving).len(),
            open_fds(keeper).len(),
            open_fds(keeper)
        );
    }
}

/// Connect anew for every `GET /v1/health` while the server upgrades
/// itself ten times: no connection is refused.
#[test]
fn upgrade_never_refuses_a_connection() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let c = Client::new(s.api_sock());
    let vm = s.create_vm(&new_vm(16));
    s.fill(&vm, 0, 1024, 7);
    let pid = s.vmm_pid(&vm);

    let stop = AtomicBool::new(false);
    let counts: Mutex<BTreeMap<String, u64>> = Mutex::default();
    let refusals: Mutex<Vec<String>> = Mutex::default();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                let r = c.raw.request("GET", "/v1/health", None);
                if let Some(e) = r.as_ref().err().filter(|e| e.refused()) {
                    lock(&refusals).push(shared::error_chain(e));
                }
                *lock(&counts).entry(request_outcome(&r)).or_default() += 1;
            }
        });
        let main = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for i in 0..10 {
                std::thread::sleep(Duration::from_millis(50));
                let (h, gap) = upgrade(&c, None);
                assert_eq!(h.start, "upgrade", "{h:?}");
                assert_eq!(h.adopted_vms, 1, "{h:?}");
                eprintln!(
                    "upgrade {}: pid {} after {:.0} ms",
                    i + 1,
                    h.pid,
                    gap.as_secs_f64() * 1e3
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }));
        stop.store(true, Ordering::SeqCst);
        if let Err(p) = main {
            std::panic::resume_unwind(p);
        }
    });
    let counts = lock(&counts).clone();
    eprintln!("requests during 10 upgrades: {counts:?}");
    let refusals = lock(&refusals).clone();
    assert!(
        refusals.is_empty(),
        "{} connections refused during upgrades (the keeper holds the listener): {:?}",
        refusals.len(),
        &refusals[..refusals.len().min(5)]
    );
    assert!(
        counts.get("status 200").copied().unwrap_or(0) > 10,
        "too few answers: {counts:?}"
    );
    assert!(
        counts
            .keys()
            .all(|k| k == "status 200" || k == "status 503" || k == "broken"),
        "{counts:?}"
    );
    assert_eq!(c.exec(&vm, &op::verify(0, 1024, 7)), Ok(0));
    assert_eq!(
        s.vmm_pid(&vm),
        pid,
        "the VM's VMM is the one it started with"
    );
}

/// An upgrade to a binary that exits at once: the keeper starts the old
/// binary again, which takes every VM back.
#[test]
fn a_failed_upgrade_falls_back_to_the_old_binary() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let c = Client::new(s.api_sock());
    let mut rng = Rng(3);
    let img = RandomImage::new(MIB, 5);
    let p = s.create_vm(&new_vm(MIB));
    let mut p_seeds = [0; CHUNKS];
    fill_some(&s, &p, &mut p_seeds, &mut rng, 4);
    let k = s.fork_one(&p);
    let i = s.create_vm(&CreateVm {
        memory_source: Some(img.source()),
        ..new_vm(MIB)
    });
    s.fill(&i, 0, 100, 77);
    let want_p = digest_of(&p_seeds);
    let mut want_i = img.bytes.clone();
    apply_fill(&mut want_i, 0, 100, 77);
    let want_i = shared::pattern::digest(&want_i, 0, 0, PAGES);
    let pids: Vec<u32> = [&p, &k, &i].iter().map(|v| s.vmm_pid(v)).collect();

    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("uffd-server-broken");
    std::fs::write(
        &bad,
        "#!/bin/sh\necho this server exits at once >&2\nexit 1\n",
    )
    .expect("write the script");
    std::fs::set_permissions(&bad, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let before = wait_health(&c, "any", |_| true);
    let (h, gap) = upgrade(&c, Some(&bad));
    eprintln!(
        "failed upgrade: pid {} serves again after {:.0} ms: {h:?}",
        h.pid,
        gap.as_secs_f64() * 1e3
    );
    assert_ne!(h.pid, before.pid);
    assert_eq!(h.start, "crash", "the old binary started again: {h:?}");
    assert_eq!(h.adopted_vms, 3, "{h:?}");
    assert!(h.lost_vms.is_empty(), "{h:?}");
    let exe = std::fs::read_link(format!("/proc/{}/exe", h.pid)).expect("the server's exe");
    // (" (deleted)" when the binary was rebuilt meanwhile.)
    assert!(
        exe.file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("uffd-server")),
        "the server runs {}, not the old binary",
        exe.display()
    );
    for (id, want) in [(&p, want_p), (&k, want_p), (&i, want_i)] {
        assert_eq!(c.digest(id), Ok(want), "{id} after the failed upgrade");
    }
    let after: Vec<u32> = [&p, &k, &i].iter().map(|v| s.vmm_pid(v)).collect();
    assert_eq!(after, pids, "every VM keeps its VMM");
    let log = s.server_log_text();
    assert!(log.contains("UPGRADE FAILED"), "the keeper says why");
}

/// Without a keeper nothing holds the VMs while a process restarts: an
/// upgrade is refused, and the VM runs on.
#[test]
fn without_a_keeper_upgrade_is_refused() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start_with_args(&["--no-keeper"]);
    let c = Client::new(s.api_sock());
    let h = wait_health(&c, "any", |_| true);
    assert!(!h.kept, "{h:?}");
    assert_eq!(
        h.pid,
        s.keeper_pid(),
        "no keeper: the process started serves"
    );
    assert_eq!(h.start, "first", "{h:?}");
    let vm = s.create_vm(&new_vm(16));
    s.fill(&vm, 0, 512, 9);
    for body in [
        json!({}),
        json!({ "binary": pagefork_tests::bin("uffd-server") }),
    ] {
        let r = c
            .raw
            .request("POST", "/v1/server/upgrade", Some(&body))
            .unwrap_or_else(|e| panic!("upgrade: {}", shared::error_chain(&e)));
        r.assert_error(409, "keeper", "upgrade without a keeper");
    }
    let out = uffdctl(&s, &["server", "upgrade"]);
    assert!(
        !out.status.success(),
        "uffdctl server upgrade without a keeper succeeded"
    );
    assert_eq!(s.verify(&vm, 0, 512, 9), 0);
    s.fill(&vm, 512, 512, 10);
    assert_eq!(s.verify(&vm, 512, 512, 10), 0);
    assert_eq!(s.vm(&vm).state, RunState::Running);
    let after = wait_health(&c, "any", |_| true);
    assert_eq!(after.pid, h.pid, "the server did not restart");
}

/// SIGKILL the serving process 0–30 ms into a fork into 4, ten times:
/// the parent always runs and holds its pages; every VM listed runs and
/// holds the parent's pages, or is not listed.
#[test]
fn a_crash_mid_fork_loses_no_vm() {
    if !require_kvm_uffd() {
        return;
    }
    let seed = env_u64("PAGEFORK_RESTART_SEED").unwrap_or(5);
    let s = TestServer::start();
    let c = Client::new(s.api_sock());
    let mut rng = Rng(seed);
    let parent = s.create_vm(&new_vm(MIB));
    let mut seeds = [0; CHUNKS];
    fill_some(&s, &parent, &mut seeds, &mut rng, 6);
    let parent_pid = s.vmm_pid(&parent);
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let mut children_seen = 0;
    for round in 0..10 {
        let delay = rng.millis(0, 30);
        let answer = std::thread::scope(|scope| {
            let f = scope.spawn(|| {
                c.raw.request(
                    "POST",
                    &format!("/v1/vms/{parent}/fork"),
                    Some(&json!({ "count": 4 })),
                )
            });
            std::thread::sleep(delay);
            crash(&c);
            f.join().expect("the fork thread")
        });
        let key = request_outcome(&answer);
        *outcomes.entry(key.clone()).or_default() += 1;
        let told: Vec<String> = match &answer {
            Ok(r) if r.status == 201 => {
                serde_json::from_value(r.body["children"].clone()).expect("children")
            }
            _ => Vec::new(),
        };
        // The parent runs on its VMM and holds its pages.
        let p = c
            .vm(&parent)
            .unwrap_or_else(|e| panic!("{e}"))
            .expect("the parent is listed");
        assert_eq!(p.state, RunState::Running, "round {round}: {p:?}");
        assert_eq!(p.pid, Some(parent_pid), "round {round}: the parent's VMM");
        if let Err(e) = check_whole(&c, &parent, &seeds, "the parent") {
            let now = c.vm(&parent).map(|v| v.map(|v| (v.state, v.failure)));
            panic!(
                "round {round}: after a crash {delay:?} into a fork (its answer: {key}): {e}; \
                 the server says the parent is {now:?}\n{}",
                server_errors(&s)
            );
        }
        let listed = c.vms().unwrap_or_else(|e| panic!("{e}"));
        for t in &told {
            assert!(
                listed.iter().any(|v| &v.id == t),
                "round {round}: child {t} of an answered fork is not listed"
            );
        }
        for v in listed.iter().filter(|v| v.id != parent) {
            assert_eq!(
                v.state,
                RunState::Running,
                "round {round}: {} (a child of a fork cut {delay:?} in, told {}) is listed \
                 and does not run: {v:?}",
                v.id,
                told.contains(&v.id)
            );
            if let Err(e) = check_whole(&c, &v.id, &seeds, "a child of a fork cut short") {
                panic!("round {round}: crash {delay:?} into a fork: {e}");
            }
            c.delete_vm(&v.id).unwrap_or_else(|e| panic!("{e}"));
            children_seen += 1;
        }
        eprintln!(
            "round {}: crash {delay:?} into the fork: {key:?}, {} children listed",
            round + 1,
            listed.len() - 1
        );
    }
    eprintln!(
        "fork outcomes: {outcomes:?}; {children_seen} children checked; {}",
        c.hiccups()
    );
    assert_eq!(c.fill(&parent, 1, 0x99), Ok(()));
    assert_eq!(c.exec(&parent, &op::verify(CHUNK, CHUNK, 0x99)), Ok(0));
    let left = c.vms().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(left.len(), 1, "only the parent is left: {left:?}");
    // No VMM of a child a crash cut lingers.
    let pool = s.metric("pagefork_vmm_pool_target").unwrap_or(0);
    let settled = pagefork_tests::wait_for(Duration::from_secs(10), || {
        (vmm_processes(s.state_dir()).len() as u64 <= 1 + pool).then_some(())
    });
    assert!(
        settled.is_some(),
        "vmm processes left besides the parent's (pool {pool}): {:?}",
        vmm_processes(s.state_dir())
    );
    // Nor an anchor of one: each anchor left is a live VMM's.
    let vmms = vmm_processes(s.state_dir());
    let settled = pagefork_tests::wait_for(Duration::from_secs(10), || {
        anchor_processes(s.state_dir())
            .iter()
            .all(|(_, parent)| vmms.contains(parent))
            .then_some(())
    });
    assert!(
        settled.is_some(),
        "anchors left whose VMM is gone: {:?} (VMMs {vmms:?})",
        anchor_processes(s.state_dir())
    );
}

/// SIGKILL the serving process 0–6 ms into a rollback, until one crash
/// fell inside a rollback (12 to 60 rounds):
/// the VM runs and holds all of its pages from before the rollback, or
/// all of the snapshot's, never a mix. A crash after the rollback paused
/// the VM (its memory may be the snapshot's already while its vCPUs are
/// the old ones) is finished by the next process once the VMM rejoins,
/// and its log says so.
#[test]
fn a_crash_mid_rollback_finishes_it_or_leaves_the_vm_as_it_was() {
    if !require_kvm_uffd() {
        return;
    }
    let seed = env_u64("PAGEFORK_RESTART_SEED").unwrap_or(11);
    let s = TestServer::start();
    let c = Client::new(s.api_sock());
    let mut rng = Rng(seed);
    let vm = s.create_vm(&new_vm(MIB));
    let mut snap = [0; CHUNKS];
    fill_some(&s, &vm, &mut snap, &mut rng, 10);
    s.snapshot(&vm, "back", proto::api::SnapshotMode::Full);
    let mut now = snap;
    let mut outcomes: BTreeMap<&str, u64> = BTreeMap::new();
    let finishing = |log: &str| {
        let begun = log.matches("finishing the rollback to back").count();
        let ended = log.matches("the rollback to back is finished").count()
            + log
                .matches("the rollback to back a restart cut short cannot")
                .count();
        (begun, ended)
    };
    // Delays from 0 to 6 ms in steps of 250 us, round after round, until
    // some crash fell inside a rollback (at least 12 rounds, at most 60).
    for round in 0..60u64 {
        if round >= 12 && finishing(&s.server_log_text()).0 > 0 {
            break;
        }
        // Something to go back from: a few chunks unlike the snapshot's.
        for _ in 0..3 {
            let ch = rng.below(CHUNKS);
            let sd = rng.seed();
            c.fill(&vm, ch, sd)
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
            now[ch] = sd;
        }
        let delay = Duration::from_micros((round % 25) * 250);
        let answer = std::thread::scope(|scope| {
            let f = scope.spawn(|| {
                c.raw.request(
                    "POST",
                    &format!("/v1/vms/{vm}/rollback"),
                    Some(&json!({ "snapshot": "back" })),
                )
            });
            std::thread::sleep(delay);
            crash(&c);
            f.join().expect("the rollback thread")
        });
        // A rollback being finished is waited for.
        let settled = pagefork_tests::wait_for(RETRY_FOR, || {
            let (begun, ended) = finishing(&s.server_log_text());
            (begun == ended).then_some(())
        });
        assert!(
            settled.is_some(),
            "round {round}: a rollback cut short was never finished\n{}",
            server_errors(&s)
        );
        let v = c
            .vm(&vm)
            .unwrap_or_else(|e| panic!("{e}"))
            .expect("the VM is listed");
        assert_eq!(v.state, RunState::Running, "round {round}: {v:?}");
        let outcome = if check_whole(&c, &vm, &snap, "the VM").is_ok() {
            now = snap;
            "rolled back"
        } else if let Err(e) = check_whole(&c, &vm, &now, "the VM") {
            panic!(
                "round {round}: after a crash {delay:?} into a rollback (its answer: {:?}), \
                 the VM holds neither its pages nor the snapshot's: {e}\n{}",
                answer.as_ref().map(|r| r.status),
                server_errors(&s)
            );
        } else {
            "as it was"
        };
        *outcomes.entry(outcome).or_default() += 1;
        eprintln!("round {round}: crash {delay:?} into the rollback: {outcome}");
    }
    let log = s.server_log_text();
    let (finished, _) = finishing(&log);
    eprintln!(
        "rollback outcomes: {outcomes:?}; {finished} finished after a restart; {}",
        c.hiccups()
    );
    assert!(
        !log.contains("a restart cut short cannot be finished"),
        "a cut rollback failed its VM\n{}",
        server_errors(&s)
    );
    assert!(
        finished > 0,
        "no crash fell inside a rollback in 60 rounds: the test no longer tests that"
    );
}

/// SIGKILL the serving process while a fresh fork child faults its pages
/// in (reads and writes), 25 times: afterwards the child's writes reach
/// what is made of it. A page the dying process had put into the child's
/// memory but not yet into its table would be read from the parent by
/// the child's own fork child and its snapshot.
#[test]
fn a_crash_while_a_child_faults_in_keeps_its_table_true() {
    if !require_kvm_uffd() {
        return;
    }
    let seed = env_u64("PAGEFORK_RESTART_SEED").unwrap_or(7);
    let s = TestServer::start();
    let c = Client::new(s.api_sock());
    let mut rng = Rng(seed);
    let parent = s.create_vm(&new_vm(MIB));
    let mut seeds = [0; CHUNKS];
    fill_some(&s, &parent, &mut seeds, &mut rng, 8);
    for round in 0..25u64 {
        let child = s.fork_one(&parent);
        let delay = rng.millis(0, 40);
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let mut ch = usize::try_from(round).expect("fits");
                while !stop.load(Ordering::SeqCst) {
                    let start = (ch % CHUNKS) as u64 * CHUNK;
                    let _ = c.exec(&child, &op::touch(start, CHUNK, false));
                    let _ = c.fill(&child, (ch + 5) % CHUNKS, 0x300 + round);
                    ch += 1;
                }
            });
            std::thread::sleep(delay);
            crash(&c);
            std::thread::sleep(Duration::from_millis(30));
            stop.store(true, Ordering::SeqCst);
        });
        // The child writes all of its RAM; a fork of it must read the same.
        let now = [0x400 + round; CHUNKS];
        for (ch, seed) in now.iter().enumerate() {
            c.fill(&child, ch, *seed).unwrap_or_else(|e| panic!("{e}"));
        }
        let what = format!("round {round}, crash {delay:?} into the child's faults");
        check_whole(&c, &child, &now, "the child").unwrap_or_else(|e| panic!("{what}: {e}"));
        let grandchild = c
            .ok(
                "POST",
                &format!("/v1/vms/{child}/fork"),
                Some(json!({ "count": 1 })),
                201,
            )
            .map(|r| r["children"][0].as_str().unwrap_or_default().to_owned())
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let inv = s.invariant();
        if let Err(e) = check_whole(&c, &grandchild, &now, "the child's fork child") {
            panic!(
                "{what}: {e}\nthe invariant: {inv:?}\npage explained: {}",
                inv.violations.first().map_or(String::new(), |v| s
                    .raw(
                        "GET",
                        &format!("/v1/vms/{}/pages/{}?explain=true", v.id, v.page),
                        None
                    )
                    .to_string())
            );
        }
        assert!(inv.ok, "{what}: {inv:?}");
        c.delete_vm(&grandchild).unwrap_or_else(|e| panic!("{e}"));
        c.delete_vm(&child).unwrap_or_else(|e| panic!("{e}"));
    }
    check_whole(&c, &parent, &seeds, "the parent").unwrap_or_else(|e| panic!("{e}"));
}

/// The memfds of VMs other than `keep` that process `pid` holds.
fn vm_memfds_but(pid: u32, keep: &str) -> Vec<String> {
    let kept = format!("/memfd:pagefork-{keep} ");
    open_fds(pid)
        .iter()
        .map(|p| p.display().to_string())
        .filter(|p| p.starts_with("/memfd:pagefork-vm-") && !p.starts_with(&kept))
        .collect()
}

/// SIGKILL the serving process while a fork's children start, once their
/// memories are in the fd store (a request answered meanwhile put them
/// there) and before the fork answers: the children were never recorded,
/// so the next process does not take them back, and nothing of theirs
/// stays. Once only the parent is left, neither the keeper nor the
/// serving process holds the memory of another VM.
#[test]
fn a_crash_while_children_start_leaves_nothing_of_theirs() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let c = Client::new(s.api_sock());
    let keeper = s.keeper_pid();
    let parent = s.create_vm(&new_vm(MIB));
    let parent_pid = s.vmm_pid(&parent);
    let mut cut = 0;
    for round in 0..20 {
        if cut == 3 {
            break;
        }
        let serving = wait_health(&c, "any process", |_| true).pid;
        let stop = AtomicBool::new(false);
        let (answer, killed) = std::thread::scope(|scope| {
            let fork = scope.spawn(|| {
                c.raw.request(
                    "POST",
                    &format!("/v1/vms/{parent}/fork"),
                    Some(&json!({ "count": 6 })),
                )
            });
            // Every answer syncs the journal, and so hands the memories
            // of the children made so far to the store.
            scope.spawn(|| {
                while !stop.load(Ordering::SeqCst) {
                    let _ = c.raw.request("GET", "/v1/vms", None);
                }
            });
            let deadline = Instant::now() + Duration::from_secs(30);
            let killed = loop {
                if !vm_memfds_but(keeper, &parent).is_empty() {
                    signal(serving, Signal::SIGKILL);
                    break true;
                }
                if fork.is_finished() || Instant::now() > deadline {
                    break false;
                }
                std::thread::sleep(Duration::from_micros(200));
            };
            let answer = fork.join().expect("the fork thread");
            stop.store(true, Ordering::SeqCst);
            (answer, killed)
        });
        let outcome = request_outcome(&answer);
        let answered = matches!(&answer, Ok(r) if r.status == 201);
        let now = if killed {
            wait_health(&c, &format!("a pid other than {serving}"), |h| {
                h.pid != serving
            })
            .pid
        } else {
            serving
        };
        if killed && !answered {
            cut += 1;
        }
        let p = c
            .vm(&parent)
            .unwrap_or_else(|e| panic!("{e}"))
            .expect("the parent is listed");
        assert_eq!(p.pid, Some(parent_pid), "round {round}: {p:?}");
        for v in c.vms().unwrap_or_else(|e| panic!("{e}")) {
            if v.id != parent {
                c.delete_vm(&v.id).unwrap_or_else(|e| panic!("{e}"));
            }
        }
        let clean = pagefork_tests::wait_for(Duration::from_secs(10), || {
            (vm_memfds_but(keeper, &parent).is_empty() && vm_memfds_but(now, &parent).is_empty())
                .then_some(())
        });
        assert!(
            clean.is_some(),
            "round {round} (killed {killed}, the fork's answer {outcome}): with only {parent} \
             left, memories of other VMs are held by the keeper: {:?}, by the serving process: \
             {:?}\n{}",
            vm_memfds_but(keeper, &parent),
            vm_memfds_but(now, &parent),
            server_errors(&s)
        );
        eprintln!(
            "round {}: killed {killed}, the fork's answer {outcome}",
            round + 1
        );
    }
    assert!(
        cut > 0,
        "no crash fell while a fork's children started: the test proved nothing"
    );
}
