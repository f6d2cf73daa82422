//! Reclaim under memory pressure: what a page given back costs when its
//! guest reads it again, how much of its throughput a fleet keeps when its
//! memory does not fit its limit, and how fast memory is given back.
//!
//! 1. Refault cost, per page. A VM on a raw image of random bytes (in the
//!    page cache) reads all its N pages: each page's first fault is served
//!    from the image (a). `POST /v1/vms/{id}/reclaim` then drops every page
//!    (each equals the image) and the same read refaults them from the
//!    image again (b). A VM that wrote all its pages (`fill` over an image
//!    of realistic memory, so the pages compress as real ones do) is
//!    reclaimed, which swaps its pages out (zstd, into the swap store), and
//!    the same read refaults them from the store (c). Every VM here has
//!    fault-around off, so each read is one fault per page; the figure is
//!    the guest's time of the read over N. A reclaim answer that gives back
//!    less than 90 % of N pages the way expected fails the bench.
//! 2. Hot set. Four VMs each loop: read their hot tenth (pages 0..N/10)
//!    nine times, then one cold tenth chosen by a seeded PRNG, for a fixed
//!    time; the figure is pages read per second over all VMs (wall time,
//!    each read one guest op). The
//!    baseline is the same fleet with no limit (`--reclaim off`, no
//!    cgroup); each other run puts the server and its VMMs in a memory
//!    cgroup (v1) limited to the VMs' guest RAM / 1.0, 1.5 and 2.0 plus an
//!    allowance for the server and the VMMs themselves: the group's usage
//!    less its page cache, measured with the VMs created and no guest page
//!    written. The server keeps its VMs' memory under 85 % of the limit
//!    (its default watermark), so even / 1.0 needs reclaim. When the
//!    group runs out, the OOM killer's victim is a VMM, not the server (as
//!    a deployment arranges it): each VMM's `oom_score_adj` is 1000, the
//!    server's -1000 where this process may lower it. Refaults in the
//!    timed window and the group's OOM kills go in the note; every VM
//!    still running is checked exact afterwards. Before the loops each VM
//!    writes all its memory (`fill` over a realistic image, so its pages
//!    compress as real memory does) a tenth at a time, each tenth once the
//!    server is under its watermark again: the fill prepares the run, how
//!    fast reclaim keeps up with a writing guest is not what it measures.
//! 3. Memory given back per second: `POST /v1/vms/{id}/reclaim` of a VM
//!    that wrote all its memory (swapped) and of a VM that read all its
//!    memory from a raw image (dropped), timed by the client, against one
//!    thread in this process doing the work of each alone.
//!
//! Every server runs with `--shared-bases=false`: a VM on a shared base
//! keeps its image's pages in the base and what it writes in its VMM's
//! private memory, neither of which reclaim takes; here each VM's pages
//! are its own, in the server's memfd. Measurements run interleaved within
//! each repetition so load on the machine hits them alike. Part 2 needs
//! root and the cgroup v1 memory controller; without them the other rows
//! are emitted and the bench fails.
//!
//! Usage: `reclaim [--quick]`. Prints JSON rows.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use pagefork_benches::plan::{reclaim_hot_key, RECLAIM_OVERCOMMIT_TENTHS};
use pagefork_benches::{Plan, Row};
use pagefork_tests::{
    apply_fill, body, new_vm, op, pages_of, realistic_memory, require_memcg_v1, set_oom_score_adj,
    Memcg, OneShot, OneShotError, RandomImage, Reply, Rng, TestServer,
};
use proto::api::{
    CreateVm, ExecRequest, ExecResponse, MemorySource, MemoryStatus, RunState, VmInfo, VmReclaimed,
};
use serde::de::DeserializeOwned;
use serde_json::Value;
use uffd_server::reclaim::store::DEFAULT_LEVEL;

const BENCH: &str = "reclaim";
const T_REFAULT: &str = "Reclaim: reading a page given back";
const T_HOT: &str = "Reclaim: a hot set under a memory limit";
const T_GIVE: &str = "Reclaim: memory given back per second";
const PAGE: usize = 4096;
/// Share of a VM's pages a reclaim answer must give back.
const MIN_GIVEN_BACK: f64 = 0.9;
/// VMs of the hot-set fleet.
const HOT_VMS: u64 = 4;
/// Reads of the hot tenth before each read of a cold tenth.
const HOT_READS: u64 = 9;
/// Seed of every `fill` of this bench (VM `i` of the fleet: `SEED + i`).
const SEED: u64 = 0x5eed_2ec1;
/// Every server of this bench: VMs made from an image copy its pages. On a
/// shared base their pages would be the base's (clean) or their VMM's
/// private memory (written), which reclaim leaves alone.
const UNSHARED: &str = "--shared-bases=false";

/// Why the bench fails (not a timing).
#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error("reclaim of {vm} ({what}) {how} {got} of its {pages} pages, under 90 %: {answer:?}")]
    TooLittleGivenBack {
        vm: String,
        what: &'static str,
        how: &'static str,
        got: u64,
        pages: u64,
        answer: Box<VmReclaimed>,
    },
    #[error("{vm} read back {bad} pages wrong after the hot-set run ({run})")]
    WrongPages { vm: String, bad: u64, run: String },
    #[error("the hot-set rows need root and the cgroup v1 memory controller (see above)")]
    NoMemcg,
}

type Result<T> = std::result::Result<T, BenchError>;

fn mib_of_pages(pages: u64) -> f64 {
    (pages * PAGE as u64) as f64 / f64::from(1u32 << 20)
}

/// A VM of `mib` MiB on 4 KiB pages (hugepage VMs are never reclaimed)
/// from `source`; with `per_page`, one page per fault (no fault-around).
fn vm_body(mib: u64, source: MemorySource, per_page: bool) -> CreateVm {
    CreateVm {
        memory_source: Some(source),
        hugepages: Some(false),
        fault_around_kib: per_page.then_some(0),
        ..new_vm(mib)
    }
}

/// Run guest op `req` on `id`; its guest time, µs.
fn exec_us(s: &TestServer, id: &str, req: &ExecRequest) -> f64 {
    s.try_exec(id, req)
        .unwrap_or_else(|r| panic!("{req:?} on {id} failed: {r}"))
        .elapsed_us as f64
}

/// The guest reads pages `0..pages` of `id`: µs per page.
fn read_us_per_page(s: &TestServer, id: &str, pages: u64) -> f64 {
    exec_us(s, id, &op::touch(0, pages, false)) / pages as f64
}

/// What the reclaim answer gave back the way expected.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Gave {
    Dropped,
    Swapped,
}

/// `POST /v1/vms/{id}/reclaim`: the answer and the client's time, s.
/// Fails unless at least 90 % of `pages` went the way of `want`.
fn reclaim(
    s: &TestServer,
    id: &str,
    what: &'static str,
    pages: u64,
    want: Gave,
) -> Result<(VmReclaimed, f64)> {
    let t = Instant::now();
    let answer = s.reclaim(id);
    let secs = t.elapsed().as_secs_f64();
    let (got, how) = match want {
        Gave::Dropped => (answer.dropped_pages, "dropped"),
        Gave::Swapped => (answer.swapped_pages, "swapped"),
    };
    if (got as f64) < MIN_GIVEN_BACK * pages as f64 {
        return Err(BenchError::TooLittleGivenBack {
            vm: id.to_owned(),
            what,
            how,
            got,
            pages,
            answer: Box::new(answer),
        });
    }
    Ok((answer, secs))
}

// ------------------------------------------------------ 1. refault cost --

/// Per-page read times of the refault measurements, µs, per repetition.
#[derive(Debug, Default)]
struct Refaults {
    /// (a) first fault from the image.
    first: Vec<f64>,
    /// The same read with every page resident.
    resident: Vec<f64>,
    /// (b) after the pages were dropped.
    dropped: Vec<f64>,
    /// (c) after the written pages were swapped.
    swapped: Vec<f64>,
}

/// One repetition of part 1 on `s`.
fn refault_rep(
    s: &TestServer,
    mib: u64,
    random: &RandomImage,
    realistic: &RandomImage,
    out: &mut Refaults,
) -> Result<()> {
    let pages = pages_of(mib);
    let id = s.create_vm(&vm_body(mib, random.source(), true));
    out.first.push(read_us_per_page(s, &id, pages));
    out.resident.push(read_us_per_page(s, &id, pages));
    reclaim(s, &id, "read all of its image", pages, Gave::Dropped)?;
    out.dropped.push(read_us_per_page(s, &id, pages));
    s.delete_vm(&id);

    let id = s.create_vm(&vm_body(mib, realistic.source(), true));
    s.fill(&id, 0, pages, SEED);
    reclaim(s, &id, "wrote all its memory", pages, Gave::Swapped)?;
    out.swapped.push(read_us_per_page(s, &id, pages));
    s.delete_vm(&id);
    Ok(())
}

/// `swap_ratio`: how the written pages compress, one at a time.
fn emit_refaults(mib: u64, r: &Refaults, swap_ratio: f64) {
    let per_page = "fault-around off (fault_around_kib 0): one fault per page; guest time of \
                    one `touch` (read) over all pages / pages; server --shared-bases=false \
                    (each VM's pages its own, so reclaim can take them)";
    Row::new(
        BENCH,
        "reclaim.refault.image",
        T_REFAULT,
        &format!(
            "(a) guest reads {mib} MiB, each page's first fault served from a raw image \
             (random bytes, in the page cache)"
        ),
        "µs/page",
        &r.first,
        "the same read again, every page resident (no fault)",
        &r.resident,
    )
    .goal("report")
    .note(format!("{per_page}; server's default readahead"))
    .emit();
    Row::new(
        BENCH,
        "reclaim.refault.dropped",
        T_REFAULT,
        &format!(
            "(b) the same {mib} MiB read after POST /v1/vms/{{id}}/reclaim dropped the VM's \
             pages (equal to the image): each refaults from the image"
        ),
        "µs/page",
        &r.dropped,
        "(a): the first fault of each page from the image",
        &r.first,
    )
    .goal("report (≈ 1: a dropped page costs what its first fault did)")
    .note(per_page)
    .emit();
    Row::new(
        BENCH,
        "reclaim.refault.swapped",
        T_REFAULT,
        &format!(
            "(c) a VM that wrote all its {mib} MiB, reclaimed (its pages swapped), reads it \
             again: each page refaults from the swap store (zstd)"
        ),
        "µs/page",
        &r.swapped,
        "(a): the first fault of each page from a raw image",
        &r.first,
    )
    .goal("report")
    .note(format!(
        "{per_page}; the VM wrote 16 bytes into each page of an image of realistic memory \
         (system binaries, a third zero pages), so its pages compress as real memory does: \
         {swap_ratio:.1}:1 page by page at the store's zstd level"
    ))
    .emit();
}

// ------------------------------------------------- 3. given back per s --

/// Part 3's figures per repetition, MiB/s.
#[derive(Debug, Default)]
struct GiveBack {
    swapped: Vec<f64>,
    swap_floor: Vec<f64>,
    dropped: Vec<f64>,
    drop_floor: Vec<f64>,
    /// How the written pages compress, one at a time.
    swap_ratio: f64,
}

/// The bytes a VM on `realistic` holds after `fill` of all its pages.
fn written_bytes(realistic: &RandomImage, mib: u64) -> Vec<u8> {
    let mut mem = realistic.bytes.clone();
    apply_fill(&mut mem, 0, pages_of(mib), SEED);
    mem
}

/// One thread compressing each page of `mem` at the swap store's zstd
/// level and appending it to a file: MiB/s, and the bytes of `mem` over
/// the bytes written.
fn compress_floor(mem: &[u8]) -> (f64, f64) {
    let mut zstd = zstd::bulk::Compressor::new(DEFAULT_LEVEL).expect("a zstd compressor");
    let file = tempfile::tempfile().expect("a temporary file");
    let mut out = vec![0u8; PAGE];
    let mut end = 0u64;
    let t = Instant::now();
    for page in mem.chunks_exact(PAGE) {
        // As the store does: a page zstd cannot make smaller is stored raw.
        let n = match zstd.compress_to_buffer(page, &mut out[..PAGE - 1]) {
            Ok(n) => n,
            Err(_) => {
                out.copy_from_slice(page);
                PAGE
            }
        };
        file.write_all_at(&out[..n], end)
            .expect("append to the temporary file");
        end += n as u64;
    }
    let secs = t.elapsed().as_secs_f64();
    (
        mib_of_pages((mem.len() / PAGE) as u64) / secs,
        mem.len() as f64 / end.max(1) as f64,
    )
}

/// One thread reading each page of `image` back and comparing it with
/// `mem`: MiB/s.
fn compare_floor(image: &File, mem: &[u8]) -> f64 {
    let mut buf = vec![0u8; PAGE];
    let mut same = 0u64;
    let t = Instant::now();
    for (page, off) in mem.chunks_exact(PAGE).zip((0u64..).step_by(PAGE)) {
        image.read_exact_at(&mut buf, off).expect("read the image");
        same += u64::from(buf == page);
    }
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(same, (mem.len() / PAGE) as u64, "the image changed");
    mib_of_pages(same) / secs
}

/// One repetition of part 3 on `s`.
fn give_back_rep(
    s: &TestServer,
    mib: u64,
    random: &RandomImage,
    realistic: &RandomImage,
    written: &[u8],
    out: &mut GiveBack,
) -> Result<()> {
    let pages = pages_of(mib);
    let id = s.create_vm(&vm_body(mib, realistic.source(), false));
    s.fill(&id, 0, pages, SEED);
    let (answer, secs) = reclaim(s, &id, "wrote all its memory", pages, Gave::Swapped)?;
    out.swapped.push(mib_of_pages(answer.swapped_pages) / secs);
    s.delete_vm(&id);
    let (floor, ratio) = compress_floor(written);
    out.swap_floor.push(floor);
    out.swap_ratio = ratio;

    let id = s.create_vm(&vm_body(mib, random.source(), false));
    s.touch(&id, 0, pages, false);
    let (answer, secs) = reclaim(s, &id, "read all of its image", pages, Gave::Dropped)?;
    out.dropped.push(mib_of_pages(answer.dropped_pages) / secs);
    s.delete_vm(&id);
    out.drop_floor
        .push(compare_floor(random.file.as_file(), &random.bytes));
    Ok(())
}

fn emit_give_back(mib: u64, g: &GiveBack) {
    let timed = "client's wall time of the request (HTTP included); higher is better; server \
                 --shared-bases=false";
    Row::new(
        BENCH,
        "reclaim.giveback.swapped",
        T_GIVE,
        &format!(
            "POST /v1/vms/{{id}}/reclaim of a {mib} MiB VM that wrote all its memory: MiB \
             swapped per second"
        ),
        "MiB/s",
        &g.swapped,
        "one thread in this process: zstd (the store's level) of each page of the same bytes, \
         appended to a file",
        &g.swap_floor,
    )
    .goal("report")
    .note(format!(
        "{timed}; the baseline does no write-protect, pagemap read, table update or punch; \
         pages: 16 bytes written into each page of realistic memory, {:.1}:1 page by page",
        g.swap_ratio
    ))
    .emit();
    Row::new(
        BENCH,
        "reclaim.giveback.dropped",
        T_GIVE,
        &format!(
            "POST /v1/vms/{{id}}/reclaim of a {mib} MiB VM that read all its memory from a \
             raw image (random bytes): MiB dropped per second"
        ),
        "MiB/s",
        &g.dropped,
        "one thread in this process: pread of each page of the image, compared with the \
         same bytes",
        &g.drop_floor,
    )
    .goal("report")
    .note(format!(
        "{timed}; the baseline does no write-protect, pagemap read, table update or punch"
    ))
    .emit();
}

// ----------------------------------------------------------- 2. hot set --

/// Requests to a fleet's server once its limit is set: the OOM killer may
/// take the serving process (its keeper starts another), so a request
/// that gets no answer is an outcome of the run, not a failed bench.
#[derive(Debug)]
struct Client(OneShot);

/// How long one request may take (a guest op under pressure is slow).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the fill and the read-back check wait at most for the server
/// to get under its watermark before their next tenth.
const PACE_WAIT: Duration = Duration::from_secs(10);

/// Why a request of the hot-set run got no usable answer (an outcome
/// of the run under pressure, reported, not a failed bench).
#[derive(Debug, thiserror::Error)]
enum ClientError {
    #[error("{what}: no answer")]
    Request {
        what: String,
        #[source]
        source: OneShotError,
    },
    #[error("{what}: the server answered {reply}")]
    Status { what: String, reply: Reply },
    #[error("{what}: not the answer's type")]
    Decode {
        what: String,
        #[source]
        source: serde_json::Error,
    },
}

impl Client {
    fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        req: Option<Value>,
        ok: u16,
    ) -> std::result::Result<T, ClientError> {
        let what = || format!("{method} {path}");
        let r = self
            .0
            .request(method, path, req.as_ref())
            .map_err(|source| ClientError::Request {
                what: what(),
                source,
            })?;
        if r.status != ok {
            return Err(ClientError::Status {
                what: what(),
                reply: r,
            });
        }
        serde_json::from_value(r.body).map_err(|source| ClientError::Decode {
            what: what(),
            source,
        })
    }

    fn exec(&self, id: &str, req: &ExecRequest) -> std::result::Result<ExecResponse, ClientError> {
        self.call("POST", &format!("/v1/vms/{id}/exec"), Some(body(req)), 200)
    }

    fn vm(&self, id: &str) -> std::result::Result<VmInfo, ClientError> {
        self.call("GET", &format!("/v1/vms/{id}"), None, 200)
    }

    fn memory(&self) -> std::result::Result<MemoryStatus, ClientError> {
        self.call("GET", "/v1/memory", None, 200)
    }

    /// Whether `id` runs (false if the server cannot say).
    fn running(&self, id: &str) -> bool {
        self.vm(id).is_ok_and(|v| v.state == RunState::Running)
    }

    /// Wait until the server's usage is under its watermark, `within` at
    /// most (no watermark, or no answer: no wait).
    fn under_watermark(&self, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            match self.memory() {
                Ok(m) if m.watermark_bytes.is_some_and(|w| m.usage_bytes > w) => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                _ => return,
            }
        }
    }
}

/// The hot-set fleet: a server, its VMs, and the memory cgroup it runs
/// in (none for the baseline).
#[derive(Debug)]
struct Fleet {
    /// The server, held for the fleet's life (requests go through `api`);
    /// dropped first (fields drop in order), so its processes leave the
    /// group before the group is removed.
    _server: TestServer,
    cg: Option<Memcg>,
    api: Client,
    vms: Vec<String>,
    /// The group's limit and the allowance in it for the server and its
    /// VMMs, bytes.
    limit: u64,
    allowance: u64,
    /// The server's `oom_score_adj` could be lowered to -1000.
    protected: bool,
}

/// `HOT_VMS` VMs of `mib` MiB on `image`; with `over` (tenths), in a
/// fresh memory cgroup limited to their guest RAM / (`over` / 10) plus the
/// allowance. Then each VM writes all its memory, a tenth at a time, each
/// tenth once the server is under its watermark again: the fill prepares
/// the run; how fast reclaim keeps up with a guest writing is not what it
/// measures.
fn start_fleet(mib: u64, image: &RandomImage, over: Option<u64>) -> Fleet {
    let body = vm_body(mib, image.source(), false);
    let (s, cg, protected) = match over {
        None => (
            TestServer::start_with_args(&[UNSHARED, "--reclaim", "off"]),
            None,
            false,
        ),
        Some(_) => {
            let cg = Memcg::new(&format!("pagefork-bench-reclaim-{}", std::process::id()));
            let s = cg.spawn_inside(|| TestServer::start_with_args(&[UNSHARED]));
            // Lowering needs CAP_SYS_RESOURCE in the host's namespace;
            // without it the VMMs' +1000 below still makes them the
            // victims.
            let protected = [s.keeper_pid(), s.pid()]
                .iter()
                .all(|pid| std::fs::write(format!("/proc/{pid}/oom_score_adj"), "-1000").is_ok());
            (s, Some(cg), protected)
        }
    };
    let vms: Vec<String> = (0..HOT_VMS)
        .map(|_| {
            let id = s.create_vm(&body);
            if cg.is_some() {
                set_oom_score_adj(s.vmm_pid(&id), 1000);
            }
            id
        })
        .collect();
    let (mut limit, mut allowance) = (0, 0);
    if let (Some(cg), Some(over)) = (&cg, over) {
        allowance = cg
            .usage()
            .saturating_sub(cg.keyed("memory.stat", "total_cache"));
        limit = allowance + HOT_VMS * (mib << 20) * 10 / over;
        cg.limit(limit);
    }
    let api = Client(OneShot::new(s.api_sock(), REQUEST_TIMEOUT));
    for (id, i) in vms.iter().zip(0..) {
        for (start, n) in tenths(pages_of(mib)) {
            api.under_watermark(PACE_WAIT);
            if let Err(e) = api.exec(id, &op::fill(start, n, SEED + i)) {
                eprintln!("  fill of {id}: {}", shared::error_chain(&e));
                break;
            }
        }
    }
    Fleet {
        _server: s,
        cg,
        api,
        vms,
        limit,
        allowance,
        protected,
    }
}

/// Pages `0..pages` in tenths `(first, n)`, the last taking the rest.
fn tenths(pages: u64) -> impl Iterator<Item = (u64, u64)> {
    let tenth = pages / 10;
    (0..10).map(move |t| (t * tenth, if t == 9 { pages - 9 * tenth } else { tenth }))
}

/// Pages of VM `id` whose fill words differ from `seed`'s, read a tenth
/// at a time as the fill wrote them; or why they could not be read.
fn read_back(
    api: &Client,
    id: &str,
    pages: u64,
    seed: u64,
) -> std::result::Result<u64, ClientError> {
    let mut bad = 0;
    for (start, n) in tenths(pages) {
        api.under_watermark(PACE_WAIT);
        bad += api.exec(id, &op::verify(start, n, seed))?.result;
    }
    Ok(bad)
}

/// What one VM's loop read until the deadline, and why it stopped early.
#[derive(Debug, Default)]
struct Loop {
    pages: u64,
    failed: Option<String>,
}

/// VM `id` reads its hot tenth `HOT_READS` times, then a cold tenth from
/// `rng`, over and over until `until`.
fn hot_loop(api: &Client, id: &str, pages: u64, until: Instant, mut rng: Rng) -> Loop {
    let tenth = pages / 10;
    let mut done = Loop::default();
    for k in 0u64.. {
        if Instant::now() >= until {
            break;
        }
        let start = if k % (HOT_READS + 1) < HOT_READS {
            0
        } else {
            tenth * (1 + rng.next() % 9)
        };
        match api.exec(id, &op::touch(start, tenth, false)) {
            Ok(_) => done.pages += tenth,
            Err(e) => {
                done.failed = Some(shared::error_chain(&e));
                break;
            }
        }
    }
    done
}

/// One timed hot-set run.
#[derive(Debug)]
struct HotRun {
    pages_per_sec: f64,
    refaults: u64,
    /// OOM kills in the group while timed, and in the whole run (the
    /// fill and the read-back check too).
    oom_kills_window: u64,
    oom_kills: u64,
    given_back_mib: u64,
    limit_mib: u64,
    allowance_mib: u64,
    /// VMs not running at the end (their VMM killed, or the server).
    lost: u64,
    protected: bool,
}

/// Run the fleet's loops for `secs` seconds; then check every VM still
/// running reads back what it wrote (paced as the fill).
fn run_fleet(f: &Fleet, mib: u64, secs: u64, rep: usize, what: &str) -> Result<HotRun> {
    let pages = pages_of(mib);
    // Warm-up: each VM reads its hot tenth once.
    for id in &f.vms {
        let _ = f.api.exec(id, &op::touch(0, pages / 10, false));
    }
    let refaults = |f: &Fleet| -> u64 {
        f.vms
            .iter()
            .filter_map(|v| f.api.vm(v).ok())
            .map(|v| v.reclaim.refaults)
            .sum()
    };
    let before = refaults(f);
    let t = Instant::now();
    let until = t + Duration::from_secs(secs);
    let loops: Vec<Loop> = std::thread::scope(|sc| {
        let handles: Vec<_> = f
            .vms
            .iter()
            .zip(0u64..)
            .map(|(id, i)| {
                let rng = Rng(SEED ^ (i << 32) ^ rep as u64);
                sc.spawn(move || hot_loop(&f.api, id, pages, until, rng))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a hot-set loop panicked"))
            .collect()
    });
    let elapsed = t.elapsed().as_secs_f64();
    let oom_kills = || f.cg.as_ref().map_or(0, Memcg::oom_kills);
    let oom_kills_window = oom_kills();
    let refaulted = refaults(f).saturating_sub(before);
    let read: u64 = loops.iter().map(|l| l.pages).sum();
    for l in loops.iter().filter_map(|l| l.failed.as_deref()) {
        eprintln!("  {what}: a VM stopped early: {l}");
    }
    for (id, i) in f.vms.iter().zip(0..) {
        if !f.api.running(id) {
            continue;
        }
        match read_back(&f.api, id, pages, SEED + i) {
            Ok(0) => {}
            Ok(bad) => {
                return Err(BenchError::WrongPages {
                    vm: id.clone(),
                    bad,
                    run: what.to_owned(),
                })
            }
            Err(e) => eprintln!(
                "  {what}: read-back check of {id}: {}",
                shared::error_chain(&e)
            ),
        }
    }
    Ok(HotRun {
        pages_per_sec: read as f64 / elapsed,
        refaults: refaulted,
        oom_kills_window,
        oom_kills: oom_kills(),
        given_back_mib: f.api.memory().map_or(0, |m| m.given_back_bytes >> 20),
        limit_mib: f.limit >> 20,
        allowance_mib: f.allowance >> 20,
        lost: f.vms.iter().filter(|v| !f.api.running(v)).count() as u64,
        protected: f.protected,
    })
}

/// One fleet, started, timed and stopped.
fn hot_run(plan: &Plan, image: &RandomImage, over: Option<u64>, rep: usize) -> Result<HotRun> {
    let what = over.map_or_else(
        || "no limit".to_owned(),
        |o| format!("overcommit {}.{}", o / 10, o % 10),
    );
    let fleet = start_fleet(plan.reclaim_hot_mib, image, over);
    let run = run_fleet(
        &fleet,
        plan.reclaim_hot_mib,
        plan.reclaim_hot_secs,
        rep,
        &what,
    )?;
    eprintln!(
        "  rep {rep}, {what}: {:.0} pages/s, {} refaults, {} OOM kills ({} while timed), {} VMs \
         lost, limit {} MiB (allowance {} MiB), given back {} MiB",
        run.pages_per_sec,
        run.refaults,
        run.oom_kills,
        run.oom_kills_window,
        run.lost,
        run.limit_mib,
        run.allowance_mib,
        run.given_back_mib
    );
    Ok(run)
}

fn emit_hot(plan: &Plan, base: &[HotRun], limited: &[Vec<HotRun>]) {
    let mib = plan.reclaim_hot_mib;
    let total = HOT_VMS * mib;
    let base_tput: Vec<f64> = base.iter().map(|r| r.pages_per_sec).collect();
    let list = |runs: &[HotRun], f: &dyn Fn(&HotRun) -> u64| {
        runs.iter()
            .map(|r| f(r).to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (over, runs) in RECLAIM_OVERCOMMIT_TENTHS.into_iter().zip(limited) {
        let tput: Vec<f64> = runs.iter().map(|r| r.pages_per_sec).collect();
        Row::new(
            BENCH,
            &reclaim_hot_key(over),
            T_HOT,
            &format!(
                "{HOT_VMS} VMs of {mib} MiB, each reading its hot tenth 9× then a random cold \
                 tenth, for {} s: pages read per second, in a memory cgroup limited to \
                 {total} MiB / {}.{} + the server's and VMMs' allowance",
                plan.reclaim_hot_secs,
                over / 10,
                over % 10
            ),
            "pages/s",
            &tput,
            "the same fleet with no limit (--reclaim off, no cgroup)",
            &base_tput,
        )
        .goal("report (share of the unlimited throughput kept; higher is better)")
        .note(format!(
            "per repetition: limit {} MiB (allowance {} MiB: the group's usage less page cache \
             with the server and {HOT_VMS} VMMs started, no guest page written); refaults in \
             the timed window {}; OOM kills while timed {}, in the whole run (fill and read-back \
             check too) {}; VMs lost {}; given back {} MiB. Reclaim keeps \
             the VMs under 85 % of the limit (default watermark). All memory written first \
             (16 bytes per page over realistic memory, a tenth at a time, each once usage was \
             under the watermark again); each read is one guest op of {} pages; servers \
             --shared-bases=false; server kept from the OOM killer: {}",
            list(runs, &|r| r.limit_mib),
            list(runs, &|r| r.allowance_mib),
            list(runs, &|r| r.refaults),
            list(runs, &|r| r.oom_kills_window),
            list(runs, &|r| r.oom_kills),
            list(runs, &|r| r.lost),
            list(runs, &|r| r.given_back_mib),
            pages_of(mib) / 10,
            if runs.iter().all(|r| r.protected) {
                "yes (oom_score_adj -1000; VMMs 1000)"
            } else {
                "no (cannot lower its oom_score_adj here; VMMs 1000)"
            }
        ))
        .emit();
    }
}

/// Part 2: the baseline and each overcommit, interleaved per repetition.
fn hot_set(plan: &Plan) -> Result<()> {
    if !require_memcg_v1() {
        return Err(BenchError::NoMemcg);
    }
    let image = RandomImage::from_bytes(realistic_memory(plan.reclaim_hot_mib));
    let mut base = Vec::new();
    let mut limited: Vec<Vec<HotRun>> = RECLAIM_OVERCOMMIT_TENTHS.map(|_| Vec::new()).into();
    for rep in 0..plan.reps {
        base.push(hot_run(plan, &image, None, rep)?);
        for (over, runs) in RECLAIM_OVERCOMMIT_TENTHS.into_iter().zip(&mut limited) {
            runs.push(hot_run(plan, &image, Some(over), rep)?);
        }
    }
    emit_hot(plan, &base, &limited);
    Ok(())
}

// ---------------------------------------------------------------- main --

/// Part 1 on a server of its own (reclaim on: the host's memory is its
/// limit, far away, so only the requests reclaim).
fn refault_costs(plan: &Plan) -> Result<()> {
    let mib = plan.reclaim_refault_mib;
    let random = RandomImage::new(mib, SEED);
    let realistic = RandomImage::from_bytes(realistic_memory(mib));
    let s = TestServer::start_with_args(&[UNSHARED]);
    let mut r = Refaults::default();
    for rep in 0..plan.reps {
        refault_rep(&s, mib, &random, &realistic, &mut r)?;
        eprintln!(
            "  rep {rep}: µs/page: first {:.2}, resident {:.3}, dropped {:.2}, swapped {:.2}",
            r.first[rep], r.resident[rep], r.dropped[rep], r.swapped[rep]
        );
    }
    let ratio = compress_floor(&written_bytes(&realistic, mib)).1;
    emit_refaults(mib, &r, ratio);
    Ok(())
}

/// Part 3 on a server of its own, as part 1.
fn give_back(plan: &Plan) -> Result<()> {
    let mib = plan.reclaim_giveback_mib;
    let random = RandomImage::new(mib, SEED + 1);
    let realistic = RandomImage::from_bytes(realistic_memory(mib));
    let written = written_bytes(&realistic, mib);
    let s = TestServer::start_with_args(&[UNSHARED]);
    let mut g = GiveBack::default();
    for rep in 0..plan.reps {
        give_back_rep(&s, mib, &random, &realistic, &written, &mut g)?;
        eprintln!(
            "  rep {rep}: MiB/s: swapped {:.0} (floor {:.0}), dropped {:.0} (floor {:.0})",
            g.swapped[rep], g.swap_floor[rep], g.dropped[rep], g.drop_floor[rep]
        );
    }
    emit_give_back(mib, &g);
    Ok(())
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    if !pagefork_tests::require_kvm_uffd() {
        eprintln!("{BENCH}: needs /dev/kvm and /dev/userfaultfd");
        return ExitCode::FAILURE;
    }
    eprintln!(
        "{BENCH}: refaults over {} MiB, give-back of {} MiB, hot set of {HOT_VMS} x {} MiB \
         for {} s; {} reps",
        plan.reclaim_refault_mib,
        plan.reclaim_giveback_mib,
        plan.reclaim_hot_mib,
        plan.reclaim_hot_secs,
        plan.reps
    );
    let mut failed = false;
    for part in [refault_costs, give_back, hot_set] {
        if let Err(e) = part(&plan) {
            eprintln!("{BENCH}: {e}");
            failed = true;
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
