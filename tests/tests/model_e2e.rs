//! Randomized, model-checked end to end: VMs of every kind driven at once
//! by several client threads doing random operations, every read checked
//! against a model of what each VM must hold. Real server, VMMs, KVM and
//! userfaultfd; snapshots on the XFS mount (PAGEFORK_XFS_DIR).
//!
//! **The model.** Guest RAM (32 MiB) is cut into 16 chunks of 512 pages,
//! one 2 MiB block each on hugepage RAM. For every VM the model keeps the
//! seed each chunk was last `fill`ed with, 0 for a chunk that reads zero,
//! or "unknown" after an operation whose effect cannot be known (a fill
//! that failed). A never-written chunk reads what the VM's origin held, so
//! a VM starts with its origin's model: zero for a fresh VM, the image's
//! seeds for a VM made from a raw or a compressed (`memory.zst`) image, the
//! model of the snapshot (its VM's model when it was taken) for a restore
//! or a clone, its parent's model at the fork for a fork child. A rollback
//! resets a VM's model to the snapshot's.
//!
//! **The VMs.** Fresh VMs on 4 KiB and on hugepage guest RAM; restores of
//! snapshots and VMs made from raw and compressed images (all of these map
//! a shared base), on either kind of RAM; children of running VMs and of
//! paused templates (a template on its own memory and one on a base);
//! clones. Never more than 20 at once, 6 of them on hugepages.
//!
//! **The operations**, picked at random by 3 client threads: fill a chunk
//! with a new seed; verify a chunk (the guest's `verify`/`checksum`, or the
//! VMM's `digest` against the digest the model predicts); fork a running VM
//! or a paused one (1 or 2 children; one fork of a running VM in four has
//! its parent's VMM SIGKILLed the moment it answers); pause or resume; delete; snapshot
//! (full, dirty or incremental, compressed or not); restore one of the
//! snapshots taken (on the other kind of RAM one time in four); roll back
//! to a snapshot (of the same VM or the one it came from, any one a time
//! in four); clone (1 to 3 copies); SIGKILL a VM's VMM; create a VM; delete
//! a snapshot. A VM is driven by one thread at a time (a thread claims it
//! for the operation); operations on different VMs run concurrently.
//!
//! **What passes.** A VM whose VMM the test killed is dead: it may fail,
//! and is only deleted later. Any error or wrong read on any other VM is
//! a failure; so is a 5xx other than 503 and 507. Refusals for a
//! documented reason (507 admission or no space, 503 a full queue, 409 busy
//! with another pausing operation or a snapshot still read) are counted,
//! not failed. Failures are collected (with the op log lines of the VM and
//! of every VM and snapshot it reads from) and reported together at the
//! end. Then every surviving VM is checked whole (`digest` of all of RAM
//! against the model), paused ones after a resume; the page-source
//! invariant is checked; every VM is deleted, every snapshot left is
//! restored once and checked whole, and deleted; and the server's fds,
//! userfaultfds, threads, VMM processes and shared bases are back where
//! they were before the first VM.
//!
//! **Replay.** It prints `model: seed N`; `PAGEFORK_MODEL_SEED=N` runs the
//! same choices again, `PAGEFORK_MODEL_SECS` (default 75) sets how long
//! the random phase runs and `PAGEFORK_MODEL_THREADS` (default 3) how many
//! clients run it. Threads interleave as the host schedules them, so a
//! replay with several clients is the same mix, not the same history;
//! with `PAGEFORK_MODEL_THREADS=1` the operations are the same, in the
//! same order (as many as fit in the time), as long as the server answers
//! the same. When it fails, the whole op log is written next to the
//! server's state directory, which is kept (`model-ops.log`).

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;
use pagefork_tests::{
    apply_fill, expected_digest, file_source, from_snapshot, new_vm, op, require_hugepages,
    server_on_xfs, vm_num, wait_for, zstd_source, Api, Holdings, RandomImage, Reply, Rng,
    TestServer,
};
use proto::api::{
    CloneVm, CreateSnapshot, CreateVm, ForkRequest, MemorySource, RunState, SnapshotMode,
};
use shared::PAGE_SIZE;

/// Guest RAM of every VM.
const MIB: u64 = 32;
const PAGES: u64 = MIB * 256;
/// Chunks the model tracks one seed each.
const CHUNKS: usize = 16;
/// Pages per chunk: one 2 MiB block.
const CHUNK: u64 = PAGES / CHUNKS as u64;
/// VMs held at once (dead ones count until deleted).
const MAX_VMS: usize = 20;
/// Live VMs below which no live VM is deleted.
const MIN_VMS: usize = 8;
/// Hugepage VMs held at once: 6 × 16 blocks, with their bases, stay well
/// inside the host's reserved pool.
const MAX_HUGE_VMS: usize = 6;
const HUGEPAGES_NEEDED: u64 = 384;
/// Snapshots kept at once; above half of it, deleting one is an operation.
const MAX_SNAPSHOTS: usize = 32;
const DEFAULT_SEED: u64 = 20_250_611;
const DEFAULT_SECS: u64 = 75;
const DEFAULT_THREADS: u64 = 3;
/// Failures reported with their whole trail; later ones in one line each.
const DETAILED: usize = 8;

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={v:?} is not a number: {e}")),
        Err(_) => default,
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---------------------------------------------------------------- model --

/// Per chunk: the seed it holds (0: zeroes), None when unknown.
type Seeds = [Option<u64>; CHUNKS];

/// Every chunk zero, as a fresh VM reads.
const ZERO: Seeds = [Some(0); CHUNKS];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    Running,
    Paused,
    /// Its VMM was killed by the test: it may fail, and waits to be deleted.
    Killed,
    /// It failed for no reason the test gave it (reported already).
    Broken,
}

impl Life {
    fn live(self) -> bool {
        matches!(self, Life::Running | Life::Paused)
    }
}

#[derive(Debug, Clone)]
struct VmModel {
    id: String,
    seeds: Seeds,
    huge: bool,
    life: Life,
    /// How it came to be, newest step first.
    history: String,
    /// The VMs and snapshots whose pages it may read (the report's trail).
    kin: Vec<String>,
    /// The snapshot it was restored from or rolled back to last.
    from_snapshot: Option<String>,
}

impl VmModel {
    fn new(id: String, seeds: Seeds, huge: bool, history: String) -> Self {
        VmModel {
            id,
            seeds,
            huge,
            life: Life::Running,
            history,
            kin: Vec::new(),
            from_snapshot: None,
        }
    }

    /// A VM made from this one as it is now (a fork child, a clone).
    fn derive(&self, id: String, step: &str) -> Self {
        let mut kin = self.kin.clone();
        add_kin(&mut kin, std::slice::from_ref(&self.id));
        VmModel {
            id,
            seeds: self.seeds,
            huge: self.huge,
            life: Life::Running,
            history: chain(step, &self.history),
            kin,
            from_snapshot: self.from_snapshot.clone(),
        }
    }

    fn known(&self) -> bool {
        self.seeds.iter().all(Option::is_some)
    }

    fn trail_ids(&self) -> Vec<String> {
        let mut ids = vec![self.id.clone()];
        ids.extend(self.kin.iter().cloned());
        ids
    }
}

fn chain(step: &str, before: &str) -> String {
    let mut h = format!("{step} <- {before}");
    if h.len() > 400 {
        h.truncate(400);
        h.push_str("...");
    }
    h
}

fn add_kin(kin: &mut Vec<String>, more: &[String]) {
    for k in more {
        if !kin.contains(k) {
            kin.push(k.clone());
        }
    }
    let over = kin.len().saturating_sub(48);
    kin.drain(..over);
}

#[derive(Debug, Clone)]
struct SnapModel {
    name: String,
    /// The VM it was taken of.
    of: String,
    seeds: Seeds,
    huge: bool,
    history: String,
    kin: Vec<String>,
    /// Operations using it now (it is not deleted meanwhile).
    users: usize,
}

impl SnapModel {
    fn of_vm(name: String, vm: &VmModel, how: &str) -> Self {
        let mut kin = vm.kin.clone();
        add_kin(&mut kin, &[vm.id.clone(), name.clone()]);
        SnapModel {
            history: chain(&format!("{how} {name} of {}", vm.id), &vm.history),
            name,
            of: vm.id.clone(),
            seeds: vm.seeds,
            huge: vm.huge,
            kin,
            users: 0,
        }
    }
}

struct Slot {
    vm: VmModel,
    claimed: bool,
}

#[derive(Default)]
struct World {
    vms: BTreeMap<u64, Slot>,
    snaps: Vec<SnapModel>,
    /// VM slots reserved by creating operations under way: all, hugepage.
    pending: usize,
    pending_huge: usize,
    next_snap: u64,
    /// The most VMs held at once.
    peak: usize,
}

impl World {
    fn held(&self) -> usize {
        self.vms.len() + self.pending
    }

    fn huge_held(&self) -> usize {
        self.vms.values().filter(|s| s.vm.huge).count() + self.pending_huge
    }

    fn live(&self) -> usize {
        self.vms.values().filter(|s| s.vm.life.live()).count()
    }
}

/// A memory image VMs are made from, and its model.
struct Image {
    what: &'static str,
    source: MemorySource,
    seeds: Seeds,
}

/// The bytes of guest memory whose chunks hold `seeds` (all known).
fn memory_of(seeds: &Seeds) -> Vec<u8> {
    let mut mem = vec![0u8; usize::try_from(MIB << 20).expect("fits")];
    for (c, s) in seeds.iter().enumerate() {
        let s = s.expect("a known chunk");
        if s != 0 {
            apply_fill(&mut mem, c as u64 * CHUNK, CHUNK, s);
        }
    }
    mem
}

/// Chunk `chunk` filled with `seed` (zeroes for 0), as bytes; page 0 of
/// the buffer is the chunk's first page.
fn chunk_bytes(chunk: usize, seed: u64) -> Vec<u8> {
    let first = chunk as u64 * CHUNK;
    let ps = usize::try_from(PAGE_SIZE).expect("fits");
    let mut mem = vec![0u8; usize::try_from(CHUNK).expect("fits") * ps];
    if seed != 0 {
        for (i, page) in mem.chunks_exact_mut(ps).enumerate() {
            shared::pattern::fill_page(page, first + i as u64, seed);
        }
    }
    mem
}

/// The VMM's `digest` of pages `[start, start+n)` of a chunk holding `seed`.
fn chunk_digest(chunk: usize, seed: u64, start: u64, n: u64) -> u64 {
    let first = chunk as u64 * CHUNK;
    shared::pattern::digest(&chunk_bytes(chunk, seed), first, start, n)
}

fn random_seeds(rng: &mut Rng) -> Seeds {
    let mut s = ZERO;
    for c in &mut s {
        if !rng.one_in(4) {
            *c = Some(rng.seed());
        }
    }
    s
}

fn show(seed: Option<u64>) -> String {
    match seed {
        Some(0) => "zero".into(),
        Some(s) => format!("{s:#x}"),
        None => "unknown".into(),
    }
}

// ------------------------------------------------------------- the run --

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    Fill,
    Verify,
    Fork,
    PauseResume,
    Snapshot,
    Restore,
    Rollback,
    Clone,
    Kill,
    Delete,
    Create,
    DeleteSnapshot,
    Restart,
    Reclaim,
}

/// Operations and how often each is picked.
const MIX: [(Op, usize); 14] = [
    (Op::Fill, 20),
    (Op::Verify, 22),
    (Op::Fork, 8),
    (Op::PauseResume, 6),
    (Op::Snapshot, 8),
    (Op::Restore, 6),
    (Op::Rollback, 6),
    (Op::Clone, 4),
    (Op::Kill, 3),
    (Op::Delete, 7),
    (Op::Create, 4),
    (Op::DeleteSnapshot, 3),
    (Op::Restart, 1),
    (Op::Reclaim, 5),
];

impl Op {
    fn pick(rng: &mut Rng) -> Op {
        let total: usize = MIX.iter().map(|(_, w)| w).sum();
        let mut x = rng.below(total);
        for (op, w) in MIX {
            if x < w {
                return op;
            }
            x -= w;
        }
        Op::Verify
    }

    fn name(self) -> &'static str {
        match self {
            Op::Fill => "fill",
            Op::Verify => "verify",
            Op::Fork => "fork",
            Op::PauseResume => "pause/resume",
            Op::Snapshot => "snapshot",
            Op::Restore => "restore",
            Op::Rollback => "rollback",
            Op::Clone => "clone",
            Op::Kill => "kill",
            Op::Delete => "delete",
            Op::Create => "create",
            Op::DeleteSnapshot => "delete snapshot",
            Op::Restart => "restart",
            Op::Reclaim => "reclaim",
        }
    }
}

/// How an operation ended.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    Done,
    /// Refused for a documented reason.
    Refused,
    Failed,
    /// Nothing to do it on (no VM free in the right state, limits).
    Skipped,
}

#[derive(Debug, Default)]
struct Tally {
    done: u64,
    refused: u64,
    failed: u64,
    skipped: u64,
}

/// Whether a refusal is one the API documents for a request a correct
/// client may send (true), or a failure.
fn documented_refusal(r: &Reply) -> bool {
    match r.status {
        // Admission (memory budget, VM limit) or no space; a full queue.
        503 | 507 => true,
        // Another pausing operation under way (a reclaim pass is waited
        // for, never a refusal); a snapshot VMs still read.
        409 => {
            (r.error().contains("while it runs") && !r.error().contains("while it runs a reclaim"))
                || r.error().contains("is in use by")
        }
        _ => false,
    }
}

struct Entry {
    line: String,
    /// The VMs and snapshots the line is about.
    about: Vec<String>,
}

struct Failure {
    what: String,
    trail: String,
}

struct Run {
    api: Api,
    seed: u64,
    t0: Instant,
    /// Whether hugepage VMs are made.
    huge: bool,
    images: Vec<Image>,
    world: Mutex<World>,
    log: Mutex<Vec<Entry>>,
    failures: Mutex<Vec<Failure>>,
    tally: Mutex<BTreeMap<String, Tally>>,
    /// Every operation holds it shared; a restart of the server holds it
    /// alone, between operations.
    gate: std::sync::RwLock<()>,
}

/// A VM claimed by one client: its model, written back when dropped (or
/// the VM forgotten if `removed`).
struct Claim<'r> {
    run: &'r Run,
    num: u64,
    vm: VmModel,
    removed: bool,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut w = lock(&self.run.world);
        if self.removed {
            w.vms.remove(&self.num);
        } else if let Some(slot) = w.vms.get_mut(&self.num) {
            slot.vm = self.vm.clone();
            slot.claimed = false;
        }
    }
}

/// VM slots held for VMs being made; given back when dropped.
struct Reserved<'r> {
    run: &'r Run,
    n: usize,
    huge: usize,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        let mut w = lock(&self.run.world);
        w.pending -= self.n;
        w.pending_huge -= self.huge;
    }
}

/// A snapshot an operation uses (it is not deleted meanwhile).
struct SnapUse<'r> {
    run: &'r Run,
    snap: SnapModel,
}

impl Drop for SnapUse<'_> {
    fn drop(&mut self) {
        let mut w = lock(&self.run.world);
        if let Some(s) = w.snaps.iter_mut().find(|s| s.name == self.snap.name) {
            s.users -= 1;
        }
    }
}

impl Run {
    // ------------------------------------------------------ bookkeeping --

    fn note(&self, t: usize, about: &[&str], line: String) {
        let line = format!("[{:7.3}s t{t}] {line}", self.t0.elapsed().as_secs_f64());
        lock(&self.log).push(Entry {
            line,
            about: about.iter().map(|s| (*s).to_owned()).collect(),
        });
    }

    fn count(&self, key: &str, outcome: Outcome) {
        let mut tally = lock(&self.tally);
        let t = tally.entry(key.to_owned()).or_default();
        match outcome {
            Outcome::Done => t.done += 1,
            Outcome::Refused => t.refused += 1,
            Outcome::Failed => t.failed += 1,
            Outcome::Skipped => t.skipped += 1,
        }
    }

    /// Record a failure about `ids` (a VM and its kin): what happened and
    /// the op log lines about any of them.
    fn fail(&self, t: usize, ids: &[String], what: String) {
        let about: Vec<&str> = ids.iter().map(String::as_str).collect();
        self.note(t, &about[..1.min(about.len())], format!("FAILURE: {what}"));
        let log = lock(&self.log);
        let related: Vec<&str> = log
            .iter()
            .filter(|e| e.about.iter().any(|a| ids.contains(a)))
            .map(|e| e.line.as_str())
            .collect();
        let from = related.len().saturating_sub(40);
        let trail = related[from..].join("\n    ");
        let total = log.len();
        drop(log);
        lock(&self.failures).push(Failure {
            what: format!("[op {total}] {what}"),
            trail,
        });
    }

    fn fail_vm(&self, t: usize, vm: &VmModel, what: String) {
        self.fail(
            t,
            &vm.trail_ids(),
            format!("{} ({}): {what}", vm.id, vm.history),
        );
    }

    /// A refusal or a failure of `op` on `c`'s VM: a failure breaks it.
    fn refused_or_failed(&self, t: usize, op: Op, c: &mut Claim<'_>, r: &Reply) -> Outcome {
        if documented_refusal(r) || c.vm.life == Life::Killed {
            self.note(
                t,
                &[&c.vm.id],
                format!("{} {}: refused: {r}", op.name(), c.vm.id),
            );
            return Outcome::Refused;
        }
        let state = self
            .api
            .try_vm(&c.vm.id)
            .map(|v| format!("{} {}", v.state, v.failure.unwrap_or_default()))
            .unwrap_or_else(|r| r.to_string());
        self.fail_vm(
            t,
            &c.vm,
            format!("{} failed: {r} (the VM is now: {state})", op.name()),
        );
        c.vm.life = Life::Broken;
        Outcome::Failed
    }

    // ---------------------------------------------------------- claims --

    /// Claim a VM no other client drives, for which `want` holds.
    fn claim(&self, rng: &mut Rng, want: impl Fn(&VmModel) -> bool) -> Option<Claim<'_>> {
        let mut w = lock(&self.world);
        let free: Vec<u64> = w
            .vms
            .iter()
            .filter(|(_, s)| !s.claimed && want(&s.vm))
            .map(|(k, _)| *k)
            .collect();
        if free.is_empty() {
            return None;
        }
        let num = *rng.pick(&free);
        let slot = w.vms.get_mut(&num)?;
        slot.claimed = true;
        Some(Claim {
            run: self,
            num,
            vm: slot.vm.clone(),
            removed: false,
        })
    }

    fn add_vm(&self, vm: VmModel) {
        let mut w = lock(&self.world);
        w.vms.insert(vm_num(&vm.id), Slot { vm, claimed: false });
        w.peak = w.peak.max(w.vms.len());
    }

    /// Hold `n` VM slots (of hugepage VMs if `huge`), if the limits allow.
    fn reserve(&self, n: usize, huge: bool) -> Option<Reserved<'_>> {
        let mut w = lock(&self.world);
        let huge_n = if huge { n } else { 0 };
        if w.held() + n > MAX_VMS || (huge && w.huge_held() + n > MAX_HUGE_VMS) {
            return None;
        }
        w.pending += n;
        w.pending_huge += huge_n;
        Some(Reserved {
            run: self,
            n,
            huge: huge_n,
        })
    }

    /// Use a snapshot for which `want` holds (None if there is none).
    fn use_snapshot(
        &self,
        rng: &mut Rng,
        want: impl Fn(&SnapModel) -> bool,
    ) -> Option<SnapUse<'_>> {
        let mut w = lock(&self.world);
        let fit: Vec<usize> = (0..w.snaps.len()).filter(|i| want(&w.snaps[*i])).collect();
        if fit.is_empty() {
            return None;
        }
        let i = *rng.pick(&fit);
        w.snaps[i].users += 1;
        Some(SnapUse {
            run: self,
            snap: w.snaps[i].clone(),
        })
    }

    fn add_snapshot(&self, snap: SnapModel) {
        lock(&self.world).snaps.push(snap);
    }

    fn snapshot_name(&self) -> String {
        let mut w = lock(&self.world);
        w.next_snap += 1;
        format!("m-{}", w.next_snap)
    }

    // ------------------------------------------------------ the client --

    fn client(&self, t: usize, mut rng: Rng, until: Instant) {
        while Instant::now() < until {
            let op = Op::pick(&mut rng);
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                if op == Op::Restart {
                    let _alone = self.gate.write().unwrap_or_else(|p| p.into_inner());
                    self.step(t, op, &mut rng)
                } else {
                    let _shared = self.gate.read().unwrap_or_else(|p| p.into_inner());
                    self.step(t, op, &mut rng)
                }
            }))
            .unwrap_or_else(|p| {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                self.fail(t, &[], format!("{} panicked: {msg}", op.name()));
                Outcome::Failed
            });
            self.count(op.name(), outcome);
        }
    }

    fn step(&self, t: usize, op: Op, rng: &mut Rng) -> Outcome {
        match op {
            Op::Fill => self.fill(t, rng),
            Op::Verify => self.verify(t, rng),
            Op::Fork => self.fork(t, rng),
            Op::PauseResume => self.pause_resume(t, rng),
            Op::Snapshot => self.snapshot(t, rng),
            Op::Restore => self.restore(t, rng),
            Op::Rollback => self.rollback(t, rng),
            Op::Clone => self.clone_vm(t, rng),
            Op::Kill => self.kill(t, rng),
            Op::Delete => self.delete(t, rng),
            Op::Create => self.create(t, rng),
            Op::DeleteSnapshot => self.delete_snapshot(t, rng),
            Op::Restart => self.restart(t, rng),
            Op::Reclaim => self.reclaim(t, rng),
        }
    }

    /// Give back every page of a VM that can be given back now: its
    /// pages leave memory (dropped to their source, or swapped) and every
    /// later read, fork, snapshot, rollback and restart must find them as
    /// they were. A VM that cannot be reclaimed (hugepages, a shared
    /// base, busy) is refused with 409.
    fn reclaim(&self, t: usize, rng: &mut Rng) -> Outcome {
        let Some(mut c) = self.claim(rng, |v| v.life.live()) else {
            return Outcome::Skipped;
        };
        let id = c.vm.id.clone();
        match self.api.try_reclaim(&id) {
            Ok(r) => {
                self.note(
                    t,
                    &[&id],
                    format!(
                        "reclaim {id}: {} dropped, {} swapped, {} kept",
                        r.dropped_pages, r.swapped_pages, r.kept_pages
                    ),
                );
                Outcome::Done
            }
            Err(r) if r.status == 409 && r.error().contains("cannot reclaim") => {
                self.note(t, &[&id], format!("reclaim {id}: refused: {r}"));
                Outcome::Refused
            }
            Err(r) => self.refused_or_failed(t, Op::Reclaim, &mut c, &r),
        }
    }

    /// The server restarts under every VM, between two operations: its
    /// serving process SIGKILLed (the keeper starts it again) or upgraded
    /// to the same binary. The next process takes every VM back; the
    /// model goes on unchanged.
    fn restart(&self, t: usize, rng: &mut Rng) -> Outcome {
        let Some(before) = self.api.health_now() else {
            self.fail(t, &[], "no health answer before a restart".into());
            return Outcome::Failed;
        };
        let how = if rng.one_in(2) {
            if let Err(e) = nix::sys::signal::kill(
                Pid::from_raw(i32::try_from(before.pid).unwrap_or(0)),
                Signal::SIGKILL,
            ) {
                self.fail(t, &[], format!("cannot SIGKILL the server: {e}"));
                return Outcome::Failed;
            }
            "SIGKILL"
        } else {
            let r = self
                .api
                .raw("POST", "/v1/server/upgrade", Some(serde_json::json!({})));
            if r.status != 200 {
                self.fail(t, &[], format!("upgrade refused: {r}"));
                return Outcome::Failed;
            }
            "upgrade"
        };
        let after = wait_for(Duration::from_secs(30), || {
            self.api.health_now().filter(|h| h.pid != before.pid)
        });
        let Some(after) = after else {
            self.fail(t, &[], format!("no server 30 s after a {how}"));
            return Outcome::Failed;
        };
        self.note(
            t,
            &[],
            format!(
                "restart ({how}): pid {} -> {}, {} VMs adopted in {:.1} ms, lost {:?}",
                before.pid,
                after.pid,
                after.adopted_vms,
                after.recovery_ms.unwrap_or(0.0),
                after.lost_vms
            ),
        );
        if !after.lost_vms.is_empty() {
            self.fail(t, &[], format!("VMs lost in a {how}: {:?}", after.lost_vms));
            return Outcome::Failed;
        }
        Outcome::Done
    }

    // ------------------------------------------------------ operations --

    fn fill(&self, t: usize, rng: &mut Rng) -> Outcome {
        let Some(mut c) = self.claim(rng, |v| v.life == Life::Running) else {
            return Outcome::Skipped;
        };
        let chunk = rng.below(CHUNKS);
        let seed = rng.seed();
        let id = c.vm.id.clone();
        match self
            .api
            .try_exec(&id, &op::fill(chunk as u64 * CHUNK, CHUNK, seed))
        {
            Ok(r) if r.result == 0 => {
                c.vm.seeds[chunk] = Some(seed);
                self.note(t, &[&id], format!("fill {id} chunk {chunk} with {seed:#x}"));
                Outcome::Done
            }
            Ok(r) => {
                c.vm.seeds[chunk] = None;
                self.fail_vm(
                    t,
                    &c.vm,
                    format!("fill of chunk {chunk} returned {}", r.result),
                );
                c.vm.life = Life::Broken;
                Outcome::Failed
            }
            Err(r) => {
                let outcome = self.refused_or_failed(t, Op::Fill, &mut c, &r);
                if matches!(outcome, Outcome::Failed) {
                    c.vm.seeds[chunk] = None;
                }
                outcome
            }
        }
    }

    fn verify(&self, t: usize, rng: &mut Rng) -> Outcome {
        let Some(mut c) = self.claim(rng, |v| {
            v.life == Life::Running && v.seeds.iter().any(Option::is_some)
        }) else {
            return Outcome::Skipped;
        };
        let known: Vec<usize> = (0..CHUNKS).filter(|i| c.vm.seeds[*i].is_some()).collect();
        let chunk = *rng.pick(&known);
        let seed = c.vm.seeds[chunk].expect("a known chunk");
        let id = c.vm.id.clone();
        let start = chunk as u64 * CHUNK;
        // The guest reads the chunk, or the VMM digests all of its bytes.
        let by_guest = rng.one_in(2);
        let (how, req) = match (by_guest, seed) {
            (true, 0) => ("guest checksum", op::checksum(start, CHUNK)),
            (true, _) => ("guest verify", op::verify(start, CHUNK, seed)),
            (false, _) => ("vmm digest", op::digest(start, CHUNK)),
        };
        let want = if by_guest {
            0
        } else {
            chunk_digest(chunk, seed, start, CHUNK)
        };
        match self.api.try_exec(&id, &req) {
            Ok(r) if r.result == want => {
                self.note(
                    t,
                    &[&id],
                    format!("verify {id} chunk {chunk} = {} ({how})", show(Some(seed))),
                );
                Outcome::Done
            }
            Ok(r) => {
                let found = self.locate(&id, chunk, seed);
                self.fail_vm(
                    t,
                    &c.vm,
                    format!(
                        "chunk {chunk} (pages {start}..{}) does not hold {}: {how} gave {:#x}, \
                         {want:#x} expected; {found}",
                        start + CHUNK,
                        show(Some(seed)),
                        r.result
                    ),
                );
                c.vm.seeds[chunk] = None;
                Outcome::Failed
            }
            Err(r) => self.refused_or_failed(t, Op::Verify, &mut c, &r),
        }
    }

    /// What a chunk that does not hold `seed` holds: its first wrong page
    /// (found by digests of halves), whether that page reads zero, where
    /// the server says it comes from, and the VM's state.
    fn locate(&self, id: &str, chunk: usize, seed: u64) -> String {
        let digest = |start: u64, n: u64| {
            self.api
                .try_exec(id, &op::digest(start, n))
                .map(|r| r.result)
                .map_err(|r| r.to_string())
        };
        let (mut lo, mut n) = (chunk as u64 * CHUNK, CHUNK);
        while n > 1 {
            let half = n / 2;
            match digest(lo, half) {
                Ok(d) if d != chunk_digest(chunk, seed, lo, half) => n = half,
                Ok(_) => {
                    lo += half;
                    n -= half;
                }
                Err(e) => return format!("cannot digest {id}: {e}"),
            }
        }
        let zero = match digest(lo, 1) {
            Ok(0) => "reads zeroes",
            Ok(_) => "reads other bytes",
            Err(_) => "cannot be read",
        };
        let wrong = if seed == 0 {
            String::new()
        } else {
            self.api
                .try_exec(id, &op::verify(chunk as u64 * CHUNK, CHUNK, seed))
                .map(|r| format!("{} of its {CHUNK} pages differ; ", r.result))
                .unwrap_or_default()
        };
        let explain = self
            .api
            .raw(
                "GET",
                &format!("/v1/vms/{id}/pages/{lo}?explain=true"),
                None,
            )
            .body
            .to_string();
        let state = self
            .api
            .try_vm(id)
            .map(|v| format!("{} {}", v.state, v.failure.unwrap_or_default()))
            .unwrap_or_else(|r| r.to_string());
        format!(
            "{wrong}first wrong page {lo} {zero}; explain: {}; VM {state}",
            &explain[..explain.len().min(700)]
        )
    }

    fn fork(&self, t: usize, rng: &mut Rng) -> Outcome {
        let Some(mut c) = self.claim(rng, |v| v.life.live()) else {
            return Outcome::Skipped;
        };
        let count = 1 + rng.below(2);
        let Some(_slots) = self.reserve(count, c.vm.huge) else {
            return Outcome::Skipped;
        };
        let id = c.vm.id.clone();
        let how = if c.vm.life == Life::Paused {
            "template"
        } else {
            "running"
        };
        let req = ForkRequest {
            count: u32::try_from(count).expect("fits"),
        };
        // Now and then the parent's VMM is killed the moment the fork
        // answers: its children must keep what it held (its pid is read
        // first, so the kill follows the answer at once).
        let kill_after = (how == "running" && rng.one_in(4) && lock(&self.world).live() > MIN_VMS)
            .then(|| self.api.try_vm(&id).ok().and_then(|v| v.pid))
            .flatten()
            .and_then(|p| i32::try_from(p).ok());
        match self.api.try_fork(&id, &req) {
            Ok(f) => {
                if let Some(pid) = kill_after {
                    if let Err(e) = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL) {
                        self.fail_vm(
                            t,
                            &c.vm,
                            format!("its VMM {pid} was gone before the kill: {e}"),
                        );
                        c.vm.life = Life::Broken;
                        return Outcome::Failed;
                    }
                }
                if f.children.len() != count {
                    self.fail_vm(t, &c.vm, format!("fork into {count} made {:?}", f.children));
                }
                let step = format!("fork of {id} ({how})");
                for child in &f.children {
                    self.add_vm(c.vm.derive(child.clone(), &step));
                }
                let mut about = vec![id.as_str()];
                about.extend(f.children.iter().map(String::as_str));
                self.note(t, &about, format!("fork {id} ({how}) -> {:?}", f.children));
                match kill_after {
                    Some(pid) => {
                        let killed = self.kill_vmm(t, &mut c, pid, true);
                        self.count("fork, its parent killed at once", killed);
                        killed
                    }
                    None => Outcome::Done,
                }
            }
            Err(r) => self.refused_or_failed(t, Op::Fork, &mut c, &r),
        }
    }

    fn pause_resume(&self, t: usize, rng: &mut Rng) -> Outcome {
        let Some(mut c) = self.claim(rng, |v| v.life.live()) else {
            return Outcome::Skipped;
        };
        let id = c.vm.id.clone();
        let (op, r) = if c.vm.life == Life::Running {
            ("pause", self.api.try_pause(&id))
        } else {
            ("resume", self.api.try_resume(&id))
        };
        match r {
            Ok(v) => {
                let want = if op == "pause" {
                    RunState::Paused
                } else {
                    RunState::Running
                };
                if v.state != want {
                    self.fail_vm(t, &c.vm, format!("{op} answered state {}", v.state));
                }
                c.vm.life = if want == RunState::Paused {
                    Life::Paused
                } else {
                    Life::Running
                };
                self.note(t, &[&id], format!("{op} {id}"));
                Outcome::Done
            }
            Err(r) => self.refused_or_failed(t, Op::PauseResume, &mut c, &r),
        }
    }

    fn snapshot(&self, t: usize, rng: &mut Rng) -> Outcome {
        if lock(&self.world).snaps.len() >= MAX_SNAPSHOTS {
            return Outcome::Skipped;
        }
        let Some(mut c) = self.claim(rng, |v| v.life.live()) else {
            return Outcome::Skipped;
        };
        let mode = *rng.pick(&[
            SnapshotMode::Full,
            SnapshotMode::Dirty,
            SnapshotMode::Incremental,
        ]);
        let compress = rng.one_in(3);
        let name = self.snapshot_name();
        let id = c.vm.id.clone();
        let req = CreateSnapshot {
            name: name.clone(),
            mode,
            compress,
        };
        match self.api.try_snapshot(&id, &req) {
            Ok(r) => {
                let z = if compress { ", compressed" } else { "" };
                self.count(
                    &format!("  snapshot {mode} as {}", r.mode_used),
                    Outcome::Done,
                );
                self.add_snapshot(SnapModel::of_vm(name.clone(), &c.vm, "snapshot"));
                self.note(
                    t,
                    &[&id, &name],
                    format!(
                        "snapshot {id} as {name} ({mode}{z}; {} used, {} pages written)",
                        r.mode_used, r.pages_written
                    ),
                );
                Outcome::Done
            }
            Err(r) => self.refused_or_failed(t, Op::Snapshot, &mut c, &r),
        }
    }

    fn restore(&self, t: usize, rng: &mut Rng) -> Outcome {
        let Some(u) = self.use_snapshot(rng, |_| true) else {
            return Outcome::Skipped;
        };
        let snap = &u.snap;
        let hugepages = (self.huge && rng.one_in(4)).then_some(!snap.huge);
        let huge = hugepages.unwrap_or(snap.huge);
        let Some(_slot) = self.reserve(1, huge) else {
            return Outcome::Skipped;
        };
        let req = CreateVm {
            hugepages,
            ..from_snapshot(&snap.name)
        };
        match self.api.try_create_vm(&req) {
            Ok(v) => {
                let ram = if huge { "hugepages" } else { "4 KiB" };
                let mut vm = VmModel::new(
                    v.id.clone(),
                    snap.seeds,
                    v.hugepages,
                    chain(&format!("restore of {} on {ram}", snap.name), &snap.history),
                );
                vm.kin = snap.kin.clone();
                vm.from_snapshot = Some(snap.name.clone());
                if v.hugepages != huge {
                    self.fail_vm(t, &vm, format!("restored on hugepages={}", v.hugepages));
                }
                self.note(
                    t,
                    &[&snap.name, &v.id],
                    format!("restore {} on {ram} -> {}", snap.name, v.id),
                );
                self.add_vm(vm);
                Outcome::Done
            }
            Err(r) if documented_refusal(&r) => {
                self.note(
                    t,
                    &[&snap.name],
                    format!("restore {}: refused: {r}", snap.name),
                );
                Outcome::Refused
            }
            Err(r) => {
                self.fail(
                    t,
                    &snap.kin,
                    format!("restore of {} ({}) failed: {r}", snap.name, snap.history),
                );
                Outcome::Failed
            }
        }
    }

    fn rollback(&self, t: usize, rng: &mut Rng) -> Outcome {
        let Some(mut c) = self.claim(rng, |v| v.life == Life::Running) else {
            return Outcome::Skipped;
        };
        let id = c.vm.id.clone();
        let came_from = c.vm.from_snapshot.clone();
        let any = rng.one_in(4);
        let own = |s: &SnapModel| s.of == id || came_from.as_ref() == Some(&s.name);
        let Some(u) = self
            .use_snapshot(rng, |s| any || own(s))
            .or_else(|| self.use_snapshot(rng, |_| true))
        else {
            return Outcome::Skipped;
        };
        let snap = &u.snap;
        match self.api.try_rollback(&id, &snap.name) {
            Ok(r) => {
                c.vm.seeds = snap.seeds;
                c.vm.history = chain(&format!("rollback to {}", snap.name), &c.vm.history);
                c.vm.from_snapshot = Some(snap.name.clone());
                add_kin(&mut c.vm.kin, &snap.kin);
                self.note(
                    t,
                    &[&id, &snap.name],
                    format!(
                        "rollback {id} to {} ({}; {} pages handed over)",
                        snap.name,
                        if own(snap) { "its own" } else { "another VM's" },
                        r.pages_handed_over
                    ),
                );
                Outcome::Done
            }
            Err(r) => {
                let outcome = self.refused_or_failed(t, Op::Rollback, &mut c, &r);
                if matches!(outcome, Outcome::Failed) {
                    c.vm.seeds = [None; CHUNKS];
                }
                outcome
            }
        }
    }

    fn clone_vm(&self, t: usize, rng: &mut Rng) -> Outcome {
        let Some(mut c) = self.claim(rng, |v| v.life.live()) else {
            return Outcome::Skipped;
        };
        let n = 1 + rng.below(3);
        let Some(_slots) = self.reserve(n, c.vm.huge) else {
            return Outcome::Skipped;
        };
        let id = c.vm.id.clone();
        let req = CloneVm {
            count: u32::try_from(n).expect("fits"),
            concurrency: u32::try_from(1 + rng.below(3)).expect("fits"),
        };
        match self.api.try_clone_vm(&id, &req) {
            Ok(cl) => {
                if cl.clones.len() != n {
                    self.fail_vm(t, &c.vm, format!("clone of {n} made {:?}", cl.clones));
                }
                self.add_snapshot(SnapModel::of_vm(
                    cl.snapshot.clone(),
                    &c.vm,
                    "clone's snapshot",
                ));
                let step = format!("clone of {id} (snapshot {})", cl.snapshot);
                for k in &cl.clones {
                    let mut vm = c.vm.derive(k.clone(), &step);
                    add_kin(&mut vm.kin, std::slice::from_ref(&cl.snapshot));
                    vm.from_snapshot = Some(cl.snapshot.clone());
                    self.add_vm(vm);
                }
                let mut about = vec![id.as_str(), cl.snapshot.as_str()];
                about.extend(cl.clones.iter().map(String::as_str));
                self.note(
                    t,
                    &about,
                    format!(
                        "clone {id} x{n} (snapshot {}) -> {:?}",
                        cl.snapshot, cl.clones
                    ),
                );
                Outcome::Done
            }
            Err(r) => self.refused_or_failed(t, Op::Clone, &mut c, &r),
        }
    }

    fn kill(&self, t: usize, rng: &mut Rng) -> Outcome {
        if lock(&self.world).live() <= MIN_VMS {
            return Outcome::Skipped;
        }
        let Some(mut c) = self.claim(rng, |v| v.life.live()) else {
            return Outcome::Skipped;
        };
        let id = c.vm.id.clone();
        let pid = match self.api.try_vm(&id) {
            Ok(v) => v.pid,
            Err(r) => {
                self.fail_vm(t, &c.vm, format!("GET before the kill: {r}"));
                c.vm.life = Life::Broken;
                return Outcome::Failed;
            }
        };
        let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) else {
            self.fail_vm(t, &c.vm, "no VMM pid to kill".into());
            c.vm.life = Life::Broken;
            return Outcome::Failed;
        };
        self.kill_vmm(t, &mut c, pid, false)
    }

    /// SIGKILL `pid`, the VMM of the claimed VM (unless `sent` already),
    /// and wait for the server to see it go.
    fn kill_vmm(&self, t: usize, c: &mut Claim<'_>, pid: i32, sent: bool) -> Outcome {
        let id = c.vm.id.clone();
        let was = c.vm.life;
        let killed = if sent {
            Ok(())
        } else {
            nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL)
        };
        if let Err(e) = killed {
            self.fail_vm(
                t,
                &c.vm,
                format!("its VMM {pid} was gone before the kill: {e}"),
            );
            c.vm.life = Life::Broken;
            return Outcome::Failed;
        }
        c.vm.life = Life::Killed;
        self.note(
            t,
            &[&id],
            format!("kill {id} ({was:?}): SIGKILL to VMM {pid}"),
        );
        // The server sees its VMM go.
        let gone = wait_for(Duration::from_secs(10), || {
            self.api
                .try_vm(&id)
                .ok()
                .filter(|v| matches!(v.state, RunState::Exited | RunState::Failed))
        });
        if gone.is_none() {
            let now = self.api.try_vm(&id).map(|v| v.state.to_string());
            self.fail_vm(
                t,
                &c.vm,
                format!("still {now:?} 10 s after its VMM was killed"),
            );
            c.vm.life = Life::Broken;
            return Outcome::Failed;
        }
        Outcome::Done
    }

    fn delete(&self, t: usize, rng: &mut Rng) -> Outcome {
        let dead = if rng.one_in(2) {
            self.claim(rng, |v| v.life == Life::Killed)
        } else {
            None
        };
        let c = dead.or_else(|| {
            let live = lock(&self.world).live();
            (live > MIN_VMS)
                .then(|| self.claim(rng, |v| v.life.live()))
                .flatten()
        });
        let Some(mut c) = c else {
            return Outcome::Skipped;
        };
        let id = c.vm.id.clone();
        match self.api.try_delete_vm(&id) {
            Ok(d) if d.deleted => {
                c.removed = true;
                let frozen = if d.frozen { ", kept frozen" } else { "" };
                self.note(t, &[&id], format!("delete {id} ({:?}{frozen})", c.vm.life));
                Outcome::Done
            }
            Ok(d) => {
                self.fail_vm(t, &c.vm, format!("delete answered {d:?}"));
                c.vm.life = Life::Broken;
                Outcome::Failed
            }
            // Deleting a VM must work whatever became of its VMM.
            Err(r) if documented_refusal(&r) => {
                self.note(t, &[&id], format!("delete {id}: refused: {r}"));
                Outcome::Refused
            }
            Err(r) => {
                self.fail_vm(t, &c.vm, format!("delete failed: {r}"));
                c.vm.life = Life::Broken;
                Outcome::Failed
            }
        }
    }

    fn create(&self, t: usize, rng: &mut Rng) -> Outcome {
        let huge = self.huge && rng.one_in(2);
        let Some(_slot) = self.reserve(1, huge) else {
            return Outcome::Skipped;
        };
        let kind = rng.below(self.images.len() + 1);
        let (what, source, seeds) = match self.images.get(kind) {
            Some(i) => (i.what, Some(i.source.clone()), i.seeds),
            None => ("zeroes", None, ZERO),
        };
        match self.api.try_create_vm(&vm_of(source, huge)) {
            Ok(v) => {
                let ram = if huge { "hugepages" } else { "4 KiB" };
                self.note(t, &[&v.id], format!("create {} from {what} on {ram}", v.id));
                self.add_vm(VmModel::new(
                    v.id,
                    seeds,
                    v.hugepages,
                    format!("created from {what} on {ram}"),
                ));
                Outcome::Done
            }
            Err(r) if documented_refusal(&r) => {
                self.note(t, &[], format!("create from {what}: refused: {r}"));
                Outcome::Refused
            }
            Err(r) => {
                self.fail(t, &[], format!("create from {what} failed: {r}"));
                Outcome::Failed
            }
        }
    }

    fn delete_snapshot(&self, t: usize, rng: &mut Rng) -> Outcome {
        let snap = {
            let mut w = lock(&self.world);
            let free: Vec<usize> = (0..w.snaps.len())
                .filter(|i| w.snaps[*i].users == 0 && w.snaps[*i].name != "gold")
                .collect();
            if w.snaps.len() <= MAX_SNAPSHOTS / 2 || free.is_empty() {
                return Outcome::Skipped;
            }
            let i = *rng.pick(&free);
            w.snaps.remove(i)
        };
        match self.api.try_delete_snapshot(&snap.name) {
            Ok(d) if d.deleted => {
                self.note(t, &[&snap.name], format!("delete snapshot {}", snap.name));
                Outcome::Done
            }
            Err(r) if documented_refusal(&r) => {
                self.note(
                    t,
                    &[&snap.name],
                    format!("delete snapshot {}: refused: {r}", snap.name),
                );
                self.add_snapshot(snap);
                Outcome::Refused
            }
            other => {
                let what = match other {
                    Ok(d) => format!("{d:?}"),
                    Err(r) => r.to_string(),
                };
                self.fail(
                    t,
                    &snap.kin,
                    format!("delete of snapshot {} failed: {what}", snap.name),
                );
                self.add_snapshot(snap);
                Outcome::Failed
            }
        }
    }

    // ------------------------------------------------------- the end --

    /// Check `vm`'s whole memory against its model: one digest of all of
    /// RAM when every chunk is known, then chunk by chunk where it differs.
    fn check_whole(&self, vm: &VmModel) {
        if vm.known() {
            let want = expected_digest(&memory_of(&vm.seeds), 0, PAGES);
            match self.api.try_exec(&vm.id, &op::digest(0, PAGES)) {
                Ok(r) if r.result == want => return,
                Ok(_) => {}
                Err(r) => {
                    self.fail_vm(0, vm, format!("digest of all of RAM failed: {r}"));
                    return;
                }
            }
        }
        for (chunk, seed) in vm.seeds.iter().enumerate() {
            let Some(seed) = *seed else { continue };
            let start = chunk as u64 * CHUNK;
            match self.api.try_exec(&vm.id, &op::digest(start, CHUNK)) {
                Ok(r) if r.result == chunk_digest(chunk, seed, start, CHUNK) => {}
                Ok(_) => {
                    let found = self.locate(&vm.id, chunk, seed);
                    self.fail_vm(
                        0,
                        vm,
                        format!(
                            "at the end, chunk {chunk} does not hold {}; {found}",
                            show(Some(seed))
                        ),
                    );
                }
                Err(r) => {
                    self.fail_vm(0, vm, format!("digest of chunk {chunk} failed: {r}"));
                    return;
                }
            }
        }
    }

    /// Every surviving VM checked whole: running ones, then paused ones
    /// after a resume (a template moves onto its children's base then).
    fn check_survivors(&self) -> usize {
        let vms: Vec<VmModel> = lock(&self.world)
            .vms
            .values()
            .map(|s| s.vm.clone())
            .collect();
        let mut checked = 0;
        for pass in [Life::Running, Life::Paused] {
            for vm in vms.iter().filter(|v| v.life == pass) {
                if pass == Life::Paused {
                    if let Err(r) = self.api.try_resume(&vm.id) {
                        self.fail_vm(0, vm, format!("resume at the end failed: {r}"));
                        continue;
                    }
                    self.note(0, &[&vm.id], format!("resume {} to check it", vm.id));
                }
                self.guarded("final check", || self.check_whole(vm));
                checked += 1;
            }
        }
        checked
    }

    /// Every snapshot left, restored once and checked whole after every VM
    /// is gone, then deleted.
    fn check_snapshots(&self) -> usize {
        let snaps = std::mem::take(&mut lock(&self.world).snaps);
        let mut checked = 0;
        for snap in &snaps {
            if snap.seeds.iter().all(Option::is_some) {
                match self.api.try_create_vm(&from_snapshot(&snap.name)) {
                    Ok(v) => {
                        let mut vm = VmModel::new(
                            v.id.clone(),
                            snap.seeds,
                            v.hugepages,
                            chain(&format!("final restore of {}", snap.name), &snap.history),
                        );
                        vm.kin = snap.kin.clone();
                        self.note(
                            0,
                            &[&snap.name, &v.id],
                            format!("restore {} -> {} to check it", snap.name, v.id),
                        );
                        self.guarded("snapshot check", || self.check_whole(&vm));
                        checked += 1;
                        if let Err(r) = self.api.try_delete_vm(&v.id) {
                            self.fail_vm(0, &vm, format!("delete failed: {r}"));
                        }
                    }
                    Err(r) => self.fail(
                        0,
                        &snap.kin,
                        format!(
                            "restore of {} ({}) at the end failed: {r}",
                            snap.name, snap.history
                        ),
                    ),
                }
            }
            if let Err(r) = self.api.try_delete_snapshot(&snap.name) {
                self.fail(
                    0,
                    &snap.kin,
                    format!("delete of snapshot {} at the end failed: {r}", snap.name),
                );
            }
        }
        checked
    }

    /// Run `f`; a panic (an API call that never answered) is a failure.
    fn guarded(&self, what: &str, f: impl FnOnce()) {
        if let Err(p) = catch_unwind(AssertUnwindSafe(f)) {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            self.fail(0, &[], format!("{what} panicked: {msg}"));
        }
    }

    /// Delete every VM the model holds (dead ones too).
    fn delete_all(&self) {
        let vms: Vec<VmModel> = std::mem::take(&mut lock(&self.world).vms)
            .into_values()
            .map(|s| s.vm)
            .collect();
        for vm in &vms {
            match self.api.try_delete_vm(&vm.id) {
                Ok(d) if d.deleted => {}
                other => self.fail_vm(0, vm, format!("delete at the end: {other:?}")),
            }
        }
    }

    fn write_log(&self, path: &Path) {
        let text: String = lock(&self.log)
            .iter()
            .map(|e| format!("{}\n", e.line))
            .collect();
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("model: cannot write {}: {e}", path.display());
        }
    }

    fn report(&self, secs: f64) {
        let tally = lock(&self.tally);
        eprintln!(
            "model: {secs:.1} s of random operations, seed {}:",
            self.seed
        );
        eprintln!(
            "  {:<34} {:>6} {:>8} {:>7} {:>8}",
            "operation", "done", "refused", "failed", "skipped"
        );
        for (op, t) in tally.iter() {
            eprintln!(
                "  {op:<34} {:>6} {:>8} {:>7} {:>8}",
                t.done, t.refused, t.failed, t.skipped
            );
        }
    }
}

/// A fresh VM of `MIB` on hugepages or not, its memory from `source`.
fn vm_of(source: Option<MemorySource>, huge: bool) -> CreateVm {
    CreateVm {
        memory_source: source,
        hugepages: Some(huge),
        ..new_vm(MIB)
    }
}

/// Threads of process `pid`.
fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(Iterator::count)
        .unwrap_or(0)
}

/// One of each thing the run does, undone, so that what the server makes
/// once (threads, buffers) is in the baseline taken after it.
fn warm_up(s: &TestServer) {
    let w = s.create_vm(&vm_of(None, false));
    s.fill(&w, 0, CHUNK, 1);
    let req = CreateSnapshot {
        name: "warm-up".into(),
        mode: SnapshotMode::Full,
        compress: true,
    };
    s.try_snapshot(&w, &req)
        .unwrap_or_else(|r| panic!("warm-up snapshot: {r}"));
    let r = s.restore("warm-up");
    s.pause(&r);
    let k = s.fork_one(&r);
    assert_eq!(s.verify(&k, 0, CHUNK, 1), 0, "warm-up fork child");
    for id in [&k, &r, &w] {
        s.delete_vm(id);
    }
    s.delete_snapshot("warm-up");
}

/// The VMs the random phase starts from: one or more of every kind.
fn populate(run: &Run, s: &TestServer, rng: &mut Rng) {
    let add = |id: &str, seeds: Seeds, history: &str| {
        let huge = s.vm(id).hugepages;
        run.note(0, &[id], format!("setup: {id} {history}"));
        run.add_vm(VmModel::new(id.to_owned(), seeds, huge, history.to_owned()));
    };
    let fill_some = |id: &str, seeds: &mut Seeds, rng: &mut Rng, n: usize| {
        for _ in 0..n {
            let c = rng.below(CHUNKS);
            let seed = rng.seed();
            s.fill(id, c as u64 * CHUNK, CHUNK, seed);
            seeds[c] = Some(seed);
        }
    };
    // The gold VM and its snapshot, which restores share as their base.
    let gold = s.create_vm(&vm_of(None, false));
    let mut gold_seeds = ZERO;
    for (c, seed) in random_seeds(rng).iter().enumerate() {
        let seed = seed.expect("known");
        if seed != 0 {
            s.fill(&gold, c as u64 * CHUNK, CHUNK, seed);
        }
        gold_seeds[c] = Some(seed);
    }
    s.snapshot(&gold, "gold", SnapshotMode::Full);
    add(
        &gold,
        gold_seeds,
        "created from zeroes on 4 KiB, filled whole",
    );
    let gold_vm = lock(&run.world).vms[&vm_num(&gold)].vm.clone();
    run.add_snapshot(SnapModel::of_vm("gold".into(), &gold_vm, "snapshot"));

    for huge in [false, true].into_iter().filter(|h| !h || run.huge) {
        let ram = if huge { "hugepages" } else { "4 KiB" };
        // Restored from the gold snapshot.
        let r = s.create_vm(&CreateVm {
            hugepages: Some(huge),
            ..from_snapshot("gold")
        });
        add(&r, gold_seeds, &format!("restore of gold on {ram}"));
        // From each image.
        for image in &run.images {
            let id = s.create_vm(&vm_of(Some(image.source.clone()), huge));
            add(
                &id,
                image.seeds,
                &format!("created from {} on {ram}", image.what),
            );
        }
    }
    if run.huge {
        let h = s.create_vm(&vm_of(None, true));
        let mut seeds = ZERO;
        fill_some(&h, &mut seeds, rng, 4);
        add(&h, seeds, "created from zeroes on hugepages");
    }
    // A template on its own memory, with two children.
    let t = s.create_vm(&vm_of(None, false));
    let mut seeds = ZERO;
    fill_some(&t, &mut seeds, rng, 6);
    s.pause(&t);
    add(&t, seeds, "created from zeroes on 4 KiB");
    let kids = s.fork(&t, 2).children;
    add_children(run, &t, &kids, Life::Paused);
    // A template on a base (a restore that wrote over it), with a child.
    let b = s.restore("gold");
    let mut seeds = gold_seeds;
    fill_some(&b, &mut seeds, rng, 4);
    s.pause(&b);
    add(&b, seeds, "restore of gold on 4 KiB");
    add_children(run, &b, &[s.fork_one(&b)], Life::Paused);
    // A running VM on a base that wrote over it, and its child.
    let p = s.restore("gold");
    let mut seeds = gold_seeds;
    fill_some(&p, &mut seeds, rng, 4);
    add(&p, seeds, "restore of gold on 4 KiB");
    add_children(run, &p, &[s.fork_one(&p)], Life::Running);
}

/// Model fork children `kids` of `parent`, which is `life` now.
fn add_children(run: &Run, parent: &str, kids: &[String], life: Life) {
    let vm = {
        let mut w = lock(&run.world);
        let slot = w.vms.get_mut(&vm_num(parent)).expect("parent modelled");
        slot.vm.life = life;
        slot.vm.clone()
    };
    let how = if life == Life::Paused {
        "template"
    } else {
        "running"
    };
    let step = format!("fork of {parent} ({how})");
    for k in kids {
        run.note(0, &[parent, k], format!("setup: {step} -> {k}"));
        run.add_vm(vm.derive(k.clone(), &step));
    }
}

#[test]
fn random_operations_on_vms_of_every_kind_keep_every_vm_exact() {
    let seed = env_u64("PAGEFORK_MODEL_SEED", DEFAULT_SEED);
    let secs = env_u64("PAGEFORK_MODEL_SECS", DEFAULT_SECS);
    let clients =
        usize::try_from(env_u64("PAGEFORK_MODEL_THREADS", DEFAULT_THREADS).max(1)).expect("fits");
    eprintln!("model: seed {seed} (PAGEFORK_MODEL_SEED={seed} to replay)");
    let Some(s) = server_on_xfs(&[]) else { return };
    let huge = require_hugepages(HUGEPAGES_NEEDED);
    if !huge {
        eprintln!("model: no hugepage VMs in this run (above)");
    }
    let pid = s.pid();

    warm_up(&s);
    s.wait_pool_full();
    std::thread::sleep(Duration::from_millis(300));
    let before = Holdings::of(pid);
    let threads_before = threads(pid);
    // What the keeper holds for a server with no VM: the listeners.
    let keeper_before = Holdings::of(s.keeper_pid());

    // The images: a raw one, and a compressed one of other bytes.
    let mut rng = Rng::new(seed);
    let raw_seeds = random_seeds(&mut rng);
    let raw = RandomImage::from_bytes(memory_of(&raw_seeds));
    let zst_seeds = random_seeds(&mut rng);
    let zst_raw = RandomImage::from_bytes(memory_of(&zst_seeds));
    let zst_dir = tempfile::tempdir().expect("tempdir");
    let zst = zst_dir.path().join("memory.zst");
    pagefork_tests::compress_image(zst_raw.file.path(), &zst, Some(128));
    let run = Run {
        api: (*s).clone(),
        seed,
        t0: Instant::now(),
        huge,
        images: vec![
            Image {
                what: "a raw image",
                source: file_source(raw.file.path()),
                seeds: raw_seeds,
            },
            Image {
                what: "a zstd image",
                source: zstd_source(&zst),
                seeds: zst_seeds,
            },
        ],
        world: Mutex::default(),
        log: Mutex::default(),
        failures: Mutex::default(),
        tally: Mutex::default(),
        gate: std::sync::RwLock::default(),
    };
    populate(&run, &s, &mut rng);
    let first = lock(&run.world).vms.len();
    eprintln!(
        "model: {first} VMs to start from, {clients} clients for {secs} s{}",
        if huge { "" } else { " (no hugepage VMs)" }
    );

    let t_random = Instant::now();
    let until = t_random + Duration::from_secs(secs);
    std::thread::scope(|scope| {
        for t in 0..clients {
            let run = &run;
            let rng = Rng::new(seed ^ (t as u64 + 1).wrapping_mul(0xd1b5_4a32_d192_ed03));
            scope.spawn(move || run.client(t + 1, rng, until));
        }
    });
    let random_secs = t_random.elapsed().as_secs_f64();

    let survivors = run.check_survivors();
    let inv = s.invariant();
    if !inv.ok {
        run.fail(0, &[], format!("page-source invariant violated: {inv:?}"));
    }
    run.delete_all();
    let snaps = run.check_snapshots();

    // Everything goes: VMs (frozen ones with their last reader), bases,
    // VMM processes, fds, userfaultfds, threads. After a restart the
    // serving process is another one, started the same way: its holdings
    // are measured against the first one's baseline.
    let restarted = pid != s.pid();
    let pid = s.pid();
    // A serving process that took VMs over from another was not measured
    // empty: it may hold a few more fds of its own (its start differs);
    // what the VMs held goes back to the keeper's count, checked exact.
    let fd_slack = if restarted { 4 } else { 0 };
    s.wait_pool_full();
    let settled = wait_for(Duration::from_secs(20), || {
        let h = Holdings::of(pid);
        let back = s.vms().is_empty()
            && s.bases().bases.is_empty()
            && Holdings::of(s.keeper_pid()).fds <= keeper_before.fds
            && h.fds <= before.fds + fd_slack
            && h.userfaultfds <= before.userfaultfds
            && h.children <= before.children
            && threads(pid) <= threads_before;
        back.then_some(h)
    });
    if settled.is_none() {
        let h = Holdings::of(pid);
        let left: Vec<String> = s
            .vms()
            .iter()
            .map(|v| format!("{} {}", v.id, v.state))
            .collect();
        run.fail(
            0,
            &[],
            format!(
                "not back at the baseline 20 s after the last delete: VMs {left:?}, bases {:?}, \
                 holdings {before:?} -> {h:?}, threads {threads_before} -> {}, keeper {:?} -> \
                 {:?}, fds now {:?}",
                s.bases().bases,
                threads(pid),
                keeper_before,
                Holdings::of(s.keeper_pid()),
                pagefork_tests::host::open_fds(pid)
            ),
        );
    }

    let (peak, log_len) = (lock(&run.world).peak, lock(&run.log).len());
    run.report(random_secs);
    eprintln!(
        "model: {log_len} log lines, at most {peak} VMs at once; {survivors} survivors and \
         {snaps} snapshots checked whole at the end"
    );
    let failures = std::mem::take(&mut *lock(&run.failures));
    if failures.is_empty() {
        return;
    }
    // Kept with the state directory of a failed test.
    let log_path = s
        .state_dir()
        .parent()
        .map(|d| d.join("model-ops.log"))
        .unwrap_or_default();
    run.write_log(&log_path);
    let mut text = format!(
        "model: {} failure(s) with seed {seed} (PAGEFORK_MODEL_SEED={seed} to replay; op log {}):\n",
        failures.len(),
        log_path.display()
    );
    for (i, f) in failures.iter().enumerate() {
        text.push_str(&format!("\n{}. {}\n", i + 1, f.what));
        if i < DETAILED && !f.trail.is_empty() {
            text.push_str(&format!("  its op log lines:\n    {}\n", f.trail));
        }
    }
    panic!("{text}");
}
