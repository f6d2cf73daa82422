//! Reclaim under a memory limit: a server whose VMs' guest RAM would
//! outgrow its memory cgroup keeps what is resident under a watermark
//! below the limit, by dropping pages equal to their source (zero pages,
//! image pages) and compressing pages a guest wrote into a swap store
//! under its state directory, served back on the next fault. Without
//! reclaim (`--reclaim off`) the kernel's OOM killer takes a VMM.
//!
//! Each test runs a server and its VMMs in a memory cgroup (v1) of its
//! own, limited before the server starts, so the server finds the limit
//! in its cgroup. Every VMM is the OOM killer's first choice
//! (`oom_score_adj` 1000, which needs no privilege, unlike protecting the
//! server): when the group runs out, a VMM is the first victim.
//!
//! Needs root and the cgroup v1 memory controller
//! (`/sys/fs/cgroup/memory`). One test runs at a time: each takes both
//! cores of a small machine.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pagefork_tests::{
    apply_fill, expected_digest, new_vm, op, pages_of, require_memcg_v1, set_oom_score_adj,
    status_kib, wait_for, Memcg, RandomImage, TestServer,
};
use proto::api::{CreateVm, ExecRequest, MemoryStatus, RunState};
use shared::pattern::{digest_page, fill_page};
use shared::PAGE_SIZE;

/// The limit of tests A and B, and their fleet: twice the limit in guest RAM.
const LIMIT: u64 = 512 << 20;
const VMS: u64 = 8;
const VM_MIB: u64 = 128;

static ONE_FLEET: Mutex<()> = Mutex::new(());

fn one_fleet() -> MutexGuard<'static, ()> {
    ONE_FLEET
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The fill seed of VM number `i` of a fleet.
fn seed(i: u64) -> u64 {
    0x5eed_0100 + i
}

/// `new_vm(mib)` on 4 KiB pages (hugetlb pages are not charged like
/// shmem, whatever the run's default).
fn vm_of(mib: u64) -> CreateVm {
    CreateVm {
        hugepages: Some(false),
        ..new_vm(mib)
    }
}

/// The VMM `digest` of `pages` pages that held zeroes before page `p`
/// got the `fill` of `seed_of(p)`.
fn fill_digest(pages: u64, seed_of: impl Fn(u64) -> u64) -> u64 {
    let mut page = vec![0u8; usize::try_from(PAGE_SIZE).expect("page size fits")];
    (0..pages).fold(0, |h, p| {
        page.fill(0);
        fill_page(&mut page, p, seed_of(p));
        digest_page(h, &page)
    })
}

// ---------------------------------------------------------------- fleet --

/// A server and its VMMs in a memory cgroup of their own.
struct Fleet {
    /// Dropped first (fields drop in order): its processes leave the
    /// group before the group is removed.
    s: TestServer,
    cg: Memcg,
    name: &'static str,
    started: Instant,
}

impl Fleet {
    /// A server started with `args` in a fresh group limited to `limit`
    /// bytes.
    fn start(name: &'static str, limit: u64, args: &[&str]) -> Fleet {
        let cg = Memcg::new(&format!("pagefork-{name}-{}", std::process::id()));
        cg.limit(limit);
        let s = cg.spawn_inside(|| TestServer::start_with_args(args));
        Fleet {
            s,
            cg,
            name,
            started: Instant::now(),
        }
    }

    /// Create a VM; its VMM is the OOM killer's first choice.
    fn create(&self, req: &CreateVm) -> String {
        let id = self.s.create_vm(req);
        set_oom_score_adj(self.s.vmm_pid(&id), 1000);
        id
    }

    /// Fork `parent` into `count` children, each the OOM killer's first
    /// choice too.
    fn fork(&self, parent: &str, count: u32) -> Vec<String> {
        let children = self.s.fork(parent, count).children;
        for c in &children {
            set_oom_score_adj(self.s.vmm_pid(c), 1000);
        }
        children
    }

    /// Run a guest op on `id` through a client that says what went wrong
    /// instead of panicking, also when the server is gone.
    fn try_exec(&self, id: &str, req: &ExecRequest) -> Result<u64, String> {
        let client = uffdctl::client::Client::new(self.s.api_sock());
        let body = serde_json::to_value(req).map_err(|e| e.to_string())?;
        let r = client
            .request("POST", &format!("/v1/vms/{id}/exec"), Some(&body))
            .map_err(|e| format!("no answer: {e}"))?;
        match r.body["result"].as_u64() {
            Some(n) if r.status == 200 => Ok(n),
            _ => Err(format!("{} {}", r.status, r.body)),
        }
    }

    /// Run a guest op on `id` and return its result; panics with the
    /// VM's state and the group's counters if it is refused.
    fn exec(&self, id: &str, req: &ExecRequest) -> u64 {
        match self.s.try_exec(id, req) {
            Ok(r) => r.result,
            Err(r) => panic!(
                "{req:?} on {id} failed: {r}\n{id}: {:?}\n{}",
                self.s.vm(id),
                self.counters()
            ),
        }
    }

    /// Assert `id` runs and `check` of it gives `want`.
    fn expect(&self, id: &str, what: &str, check: ExecRequest, want: u64) {
        let got = self.exec(id, &check);
        assert_eq!(got, want, "{what} of {id}: {check:?}\n{}", self.counters());
    }

    /// The group's and the server's memory, and the time so far.
    fn counters(&self) -> String {
        format!(
            "[{}] cgroup usage {} MiB (peak {} MiB), {} OOM kills, {} failed charges; \
             server RSS {} MiB; {:.1} s",
            self.name,
            self.cg.usage() >> 20,
            self.cg.max_usage() >> 20,
            self.cg.oom_kills(),
            self.cg.failcnt(),
            self.server_rss_kib()
                .map_or(-1, |k| i64::try_from(k >> 10).unwrap_or(-1)),
            self.started.elapsed().as_secs_f64()
        )
    }

    /// The serving process's RSS, if it answers (it can say it in a
    /// panic message).
    fn server_rss_kib(&self) -> Option<u64> {
        let pid = self.s.health_now()?.pid;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    }

    fn report(&self, what: &str) {
        eprintln!("{what}: {}", self.counters());
    }

    /// Every VM of `ids` that is not running, with its state.
    fn not_running(&self, ids: &[String]) -> Vec<String> {
        ids.iter()
            .map(|id| self.s.vm(id))
            .filter(|v| v.state != RunState::Running)
            .map(|v| format!("{} {} {:?}", v.id, v.state, v.failure.or(v.exit_reason)))
            .collect()
    }
}

// ------------------------------------------- what the server says it did --

/// What the server says reclaim took from some VMs (`VmInfo.reclaim`),
/// summed.
#[derive(Debug, Default, Clone, Copy)]
struct Reclaimed {
    dropped: u64,
    swapped: u64,
    refaults: u64,
}

impl Reclaimed {
    /// The sums over VMs `ids`.
    fn of(s: &TestServer, ids: &[String]) -> Reclaimed {
        ids.iter()
            .map(|id| s.vm(id).reclaim)
            .fold(Reclaimed::default(), |sum, r| Reclaimed {
                dropped: sum.dropped + r.dropped_pages,
                swapped: sum.swapped + r.swapped_out_total,
                refaults: sum.refaults + r.refaults,
            })
    }
}

/// `GET /v1/memory`; panics unless 200.
fn memory_status(s: &TestServer) -> MemoryStatus {
    let r = s.raw("GET", "/v1/memory", None);
    assert_eq!(r.status, 200, "GET /v1/memory: {r}");
    serde_json::from_value(r.body.clone())
        .unwrap_or_else(|e| panic!("GET /v1/memory: not a MemoryStatus: {e}: {r}"))
}

/// The server says it reclaimed under `f`'s group's limit, `limit`, with
/// nothing killed.
fn assert_reclaimed_under(f: &Fleet, limit: u64) {
    let m = memory_status(&f.s);
    assert!(m.reclaim, "{m:?}");
    assert_eq!(m.limit_bytes, Some(limit), "{m:?}");
    let group = f.cg.path().to_string_lossy().into_owned();
    assert!(m.limit_source.contains(&group), "not {group}: {m:?}");
    assert_eq!(m.oom_kills, Some(0), "{m:?}");
    assert!(m.given_back_bytes > 0, "{m:?}");
}

// ---------------------------------------------------------------- tests --

#[test]
fn without_reclaim_the_kernel_oom_kills_a_vmm() {
    if !require_memcg_v1() {
        return;
    }
    let _one = one_fleet();
    // Arrange: 8 VMs of 128 MiB in a 512 MiB group, reclaim off.
    let f = Fleet::start("no-reclaim", LIMIT, &["--reclaim", "off"]);
    let vms: Vec<String> = (0..VMS).map(|_| f.create(&vm_of(VM_MIB))).collect();
    f.report("8 VMs created");

    // Act: each writes all its memory in turn, until the kernel kills.
    // Near the limit the group's processes thrash on their own text pages
    // (each charge evicts some), so each write past the first kill could
    // take the kernel many seconds more to end.
    for (vm, i) in vms.iter().zip(0..) {
        if let Err(e) = f.try_exec(vm, &op::fill(0, pages_of(VM_MIB), seed(i))) {
            eprintln!("fill of {vm}: {e}");
        }
        if f.cg.oom_kills() > 0 {
            break;
        }
    }
    f.report("written until the first OOM kill");

    // Assert: the kernel killed a VMM (the first choice), whose VM ended;
    // the server that holds their memory lives on.
    assert!(
        f.cg.oom_kills() >= 1,
        "no OOM kill in a group holding twice its limit\n{}",
        f.counters()
    );
    let gone = wait_for(Duration::from_secs(10), || {
        Some(f.not_running(&vms)).filter(|g| !g.is_empty())
    });
    eprintln!("not running: {gone:#?}");
    assert!(gone.is_some(), "every VM still runs\n{}", f.counters());
    f.s.assert_healthy();
}

#[test]
fn reclaim_keeps_eight_vms_exact_under_a_512_mib_limit() {
    if !require_memcg_v1() {
        return;
    }
    let _one = one_fleet();
    // Arrange: 8 VMs of 128 MiB in a 512 MiB group, reclaim on (default).
    let pages = pages_of(VM_MIB);
    let want: Vec<u64> = (0..VMS).map(|i| fill_digest(pages, |_| seed(i))).collect();
    let f = Fleet::start("reclaim", LIMIT, &[]);
    let rss_at_start = status_kib(f.s.pid(), "VmRSS");
    let vms: Vec<String> = (0..VMS).map(|_| f.create(&vm_of(VM_MIB))).collect();
    f.report("8 VMs created");

    // Act: each writes all its memory with a seed of its own, then each
    // is read back whole, twice, in turn.
    for (vm, i) in vms.iter().zip(0..) {
        assert_eq!(f.exec(vm, &op::fill(0, pages, seed(i))), 0);
    }
    f.report("all written");
    for round in 1..=2 {
        for ((vm, want), i) in vms.iter().zip(&want).zip(0..) {
            let what = format!("round {round}");
            f.expect(vm, &what, op::verify(0, pages, seed(i)), 0);
            f.expect(vm, &what, op::digest(0, pages), *want);
        }
        f.report(&format!("read back, round {round}"));
    }

    // Assert: nothing killed, every VM runs and was exact (above), the
    // server's own memory stayed small, and it says what it did.
    assert_eq!(f.cg.oom_kills(), 0, "{}", f.counters());
    assert_eq!(
        f.not_running(&vms),
        Vec::<String>::new(),
        "{}",
        f.counters()
    );
    let rss = status_kib(f.s.pid(), "VmRSS");
    assert!(
        rss <= rss_at_start + (64 << 10),
        "the server's RSS grew from {rss_at_start} KiB to {rss} KiB\n{}",
        f.counters()
    );
    let seen = Reclaimed::of(&f.s, &vms);
    eprintln!("reclaimed: {seen:?}");
    assert!(seen.swapped > 0, "no written page was swapped: {seen:?}");
    assert!(seen.refaults > 0, "no swapped page came back: {seen:?}");
    assert_reclaimed_under(&f, LIMIT);
    f.s.assert_healthy();
}

#[test]
fn reclaim_drops_clean_pages_and_swaps_written_ones_in_a_mixed_fleet() {
    if !require_memcg_v1() {
        return;
    }
    let _one = one_fleet();
    // Arrange: 3 VMs of one 96 MiB image and 3 forks of a 64 MiB template
    // in a 192 MiB group: the image's pages, the template's and what
    // the forks write (96 + 64 + 3 x 32 MiB, once each on shared bases)
    // do not fit with the VMMs.
    const LIMIT: u64 = 192 << 20;
    const IMAGE_MIB: u64 = 96;
    const TEMPLATE_MIB: u64 = 64;
    const TEMPLATE_SEED: u64 = 0x7e3;
    let image = RandomImage::new(IMAGE_MIB, 0x5eed_0c01);
    let image_pages = pages_of(IMAGE_MIB);
    let pages = pages_of(TEMPLATE_MIB);
    let half = pages / 2;
    let f = Fleet::start("mixed", LIMIT, &[]);
    let imaged: Vec<String> = (0..3)
        .map(|_| {
            f.create(&CreateVm {
                memory_source: Some(image.source()),
                ..vm_of(IMAGE_MIB)
            })
        })
        .collect();
    let template = f.create(&vm_of(TEMPLATE_MIB));
    assert_eq!(f.exec(&template, &op::fill(0, pages, TEMPLATE_SEED)), 0);
    let forks = f.fork(&template, 3);
    f.report("3 image VMs, a template and 3 forks created");

    // Act: the image VMs read all their memory (clean pages) and write
    // their first quarter (private pages of their VMMs, over the base);
    // each fork rewrites the second half of its own (written pages).
    let quarter = image_pages / 4;
    let mut image_digests = Vec::new();
    for (vm, i) in imaged.iter().zip(0..) {
        f.exec(vm, &op::touch(0, image_pages, false));
        assert_eq!(f.exec(vm, &op::fill(0, quarter, seed(10 + i))), 0);
        let mut bytes = image.bytes.clone();
        apply_fill(&mut bytes, 0, quarter, seed(10 + i));
        image_digests.push(expected_digest(&bytes, 0, image_pages));
    }
    f.report("image VMs read and written");
    for (c, i) in forks.iter().zip(0..) {
        assert_eq!(f.exec(c, &op::fill(half, pages - half, seed(i))), 0);
    }
    f.report("forks written");

    // Assert: every VM is exact, nothing was killed, and the server says
    // it dropped pages and swapped pages.
    for (vm, want) in imaged.iter().zip(&image_digests) {
        f.expect(vm, "image VM", op::digest(0, image_pages), *want);
    }
    f.expect(
        &template,
        "template",
        op::verify(0, pages, TEMPLATE_SEED),
        0,
    );
    for (c, i) in forks.iter().zip(0..) {
        f.expect(
            c,
            "fork's own half",
            op::verify(half, pages - half, seed(i)),
            0,
        );
        f.expect(
            c,
            "fork's template half",
            op::verify(0, half, TEMPLATE_SEED),
            0,
        );
        let want = fill_digest(pages, |p| if p < half { TEMPLATE_SEED } else { seed(i) });
        f.expect(c, "fork", op::digest(0, pages), want);
    }
    f.report("all verified");
    let all: Vec<String> = imaged
        .iter()
        .chain(&forks)
        .chain([&template])
        .cloned()
        .collect();
    assert_eq!(f.cg.oom_kills(), 0, "{}", f.counters());
    assert_eq!(
        f.not_running(&all),
        Vec::<String>::new(),
        "{}",
        f.counters()
    );
    let seen = Reclaimed::of(&f.s, &all);
    eprintln!("reclaimed: {seen:?}");
    // Clean pages: the image VMs' own, or (on a shared base, the
    // default) the base's, counted once for all of them.
    let base_dropped = memory_status(&f.s).base_pages_dropped;
    assert!(
        seen.dropped + base_dropped > 0,
        "no clean page was dropped: {seen:?}, {base_dropped} base pages"
    );
    assert!(seen.swapped > 0, "no written page was swapped: {seen:?}");
    // What the image VMs wrote over their base was given back too.
    let on_base = Reclaimed::of(&f.s, &imaged);
    assert!(
        on_base.swapped > 0,
        "no page an image VM wrote over its base was swapped: {on_base:?}"
    );
    assert_reclaimed_under(&f, LIMIT);
    f.s.assert_healthy();
}
