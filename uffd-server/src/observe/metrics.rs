//! Prometheus metrics: `GET /metrics` on the API socket, and on TCP with
//! `--metrics-addr` for a scraper.
//!
//! The core keeps its counters per VM ([`crate::observe::stats::FaultStats`]);
//! a scrape asks it for a [`Sample`] of them and this module renders it
//! with the `prometheus-client` crate. Counters of VMs that are gone are
//! kept in the server totals (`retired`), so `pagefork_*_total` series
//! without a `vm` label never go down.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::observe::stats::FaultStats;

/// Content type of the text exposition format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels of one series.
type Labels = Vec<(String, String)>;

/// A fault-engine counter: its name, help, and how to read it.
type StatCounter = (&'static str, &'static str, fn(&FaultStats) -> u64);

/// Time the core spends on one uffd event, in seconds: from 1 µs to ~16 ms.
pub fn fault_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-6, 2.0, 15))
}

/// One VM as a scrape sees it.
#[derive(Debug, Clone)]
pub struct VmSample {
    pub id: String,
    /// `pagefork` or `firecracker`.
    pub kind: &'static str,
    /// The state as the API names it.
    pub state: String,
    pub stats: FaultStats,
    /// Pages present in the VM's own memory.
    pub resident_pages: u64,
    /// Bytes of guest RAM it maps from a shared base.
    pub shared_bytes: u64,
    /// Pages by the kind of their source (`uninitialized`, `vm`, `file`).
    pub pages_by_source: Vec<(String, u64)>,
    /// Deleted but kept while other VMs read pages from it.
    pub frozen: bool,
    /// Listeners of its live fault trace.
    pub trace_listeners: u64,
    /// Pages reclaim gave back (dropped or swapped) since it was made.
    pub reclaimed_pages: u64,
    /// Faults on pages reclaimed before.
    pub refaults: u64,
}

/// Everything a scrape reports, taken from the core at once.
#[derive(Debug, Clone)]
pub struct Sample {
    /// The core's fault-service-time histogram (shared, not copied).
    pub fault_seconds: Histogram,
    pub vms: Vec<VmSample>,
    /// Counters of VMs that are gone.
    pub retired: FaultStats,
    /// Page sources in the arena by kind.
    pub sources_by_kind: Vec<(String, u64)>,
    /// The warm VMM pool.
    pub pool: PoolSample,
    /// The shared bases.
    pub bases: Vec<BaseSample>,
    /// The server's fds and their admission.
    pub fds: FdSample,
    /// How this serving process started.
    pub start: StartSample,
    /// The memory limit, usage and what reclaim gave back.
    pub memory: proto::api::MemoryStatus,
}

/// How the serving process started: what it took back from the one
/// before it, and how long that took.
#[derive(Debug, Clone, Copy, Default)]
pub struct StartSample {
    /// VMs taken back at start (0 on a first start).
    pub adopted: u64,
    /// VMs it could not take back.
    pub lost: u64,
    /// From process start to serving them, in seconds (0 on a first start).
    pub recovery_seconds: f64,
    /// 0 first start, 1 after a crash, 2 after an upgrade.
    pub kind: u64,
}

/// The server's file descriptors as admission sees them.
#[derive(Debug, Clone, Copy, Default)]
pub struct FdSample {
    /// Open now.
    pub open: u64,
    /// The soft `RLIMIT_NOFILE`.
    pub limit: u64,
    /// Kept free of admission for running VMs and the API.
    pub reserve: u64,
    /// Creates, restores, clones and forks refused for want of fds.
    pub refused: u64,
}

/// One shared base as a scrape sees it.
#[derive(Debug, Clone)]
pub struct BaseSample {
    /// `base-N`.
    pub id: String,
    /// What it holds the pages of.
    pub of: String,
    /// Host memory it holds.
    pub bytes: u64,
    /// VMs mapping it.
    pub users: u64,
}

/// The warm VMM pool's figures.
#[derive(Debug, Clone, Copy, Default)]
pub struct PoolSample {
    /// VMMs it keeps ready (`--vmm-pool`).
    pub target: u64,
    /// VMMs connected and waiting for a VM.
    pub ready: u64,
    /// VMMs launched for it that have not said hello yet.
    pub starting: u64,
    /// VM launches served from it.
    pub taken: u64,
    /// VM launches that found it empty (while it has a target).
    pub missed: u64,
}

fn counter(v: u64) -> Counter {
    let c = Counter::default();
    c.inc_by(v);
    c
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Render `sample` as the exposition text.
pub fn render(sample: &Sample) -> String {
    let mut reg = Registry::with_prefix("pagefork");

    // Per-VM and server-wide counters of the fault engine.
    let kinds: [StatCounter; 9] = [
        ("faults_missing", "MISSING faults resolved", |s| s.missing),
        (
            "faults_write_protect",
            "write-protect faults resolved (copy-on-write steps)",
            |s| s.write_protect,
        ),
        (
            "faults_minor",
            "MINOR faults resolved (pages a rollback left unmapped)",
            |s| s.minor,
        ),
        ("pages_installed", "pages installed by the server", |s| {
            s.pages_installed
        }),
        ("remove_events", "REMOVE events (discarded ranges)", |s| {
            s.removes
        }),
        ("installs_deferred", "installs deferred by EAGAIN", |s| {
            s.deferred
        }),
        (
            "frame_waits",
            "faults that waited for a compressed frame to be decoded",
            |s| s.frame_waits,
        ),
        (
            "chunk_waits",
            "faults that waited for a chunk of a snapshot in the object store",
            |s| s.chunk_waits,
        ),
        (
            "wp_copies",
            "pre-write copies given to the VMs reading a page before its writer changed it",
            |s| s.wp_copies,
        ),
    ];
    for (name, help, get) in kinds {
        let per_vm = Family::<Labels, Counter>::default();
        let mut total = get(&sample.retired);
        for vm in &sample.vms {
            let v = get(&vm.stats);
            total += v;
            per_vm
                .get_or_create(&labels(&[("vm", &vm.id), ("kind", vm.kind)]))
                .inc_by(v);
        }
        reg.register(format!("vm_{name}"), format!("{help}, per VM"), per_vm);
        reg.register(
            name,
            format!("{help}, every VM ever served"),
            counter(total),
        );
    }

    let vms = Family::<Labels, Gauge>::default();
    let resident = Family::<Labels, Gauge>::default();
    let pages = Family::<Labels, Gauge>::default();
    let listeners = Family::<Labels, Gauge>::default();
    let mut frozen = 0i64;
    for vm in &sample.vms {
        if vm.kind == "pagefork" {
            listeners
                .get_or_create(&labels(&[("vm", &vm.id)]))
                .set(i64::try_from(vm.trace_listeners).unwrap_or(i64::MAX));
        }
        vms.get_or_create(&labels(&[("kind", vm.kind), ("state", &vm.state)]))
            .inc();
        resident
            .get_or_create(&labels(&[("vm", &vm.id)]))
            .set(i64::try_from(vm.resident_pages).unwrap_or(i64::MAX));
        for (src, n) in &vm.pages_by_source {
            pages
                .get_or_create(&labels(&[("vm", &vm.id), ("source", src)]))
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        frozen += i64::from(vm.frozen);
    }
    let shared = Family::<Labels, Gauge>::default();
    for vm in sample.vms.iter().filter(|v| v.shared_bytes > 0) {
        shared
            .get_or_create(&labels(&[("vm", &vm.id)]))
            .set(i64::try_from(vm.shared_bytes).unwrap_or(i64::MAX));
    }
    reg.register(
        "vm_shared_bytes",
        "bytes of each VM's guest RAM mapped from its shared base",
        shared,
    );
    let base_bytes = Family::<Labels, Gauge>::default();
    let base_users = Family::<Labels, Gauge>::default();
    for b in &sample.bases {
        let l = labels(&[("base", &b.id), ("of", &b.of)]);
        base_bytes
            .get_or_create(&l)
            .set(i64::try_from(b.bytes).unwrap_or(i64::MAX));
        base_users
            .get_or_create(&l)
            .set(i64::try_from(b.users).unwrap_or(i64::MAX));
    }
    reg.register(
        "base_bytes",
        "host memory each shared base holds (once for all its VMs)",
        base_bytes,
    );
    reg.register("base_users", "VMs mapping each shared base", base_users);
    reg.register("vms", "VMs by kind and state", vms);
    reg.register(
        "vm_resident_pages",
        "pages of guest RAM present in each VM: its own, plus those it maps from a shared base (vm_shared_bytes)",
        resident,
    );
    reg.register(
        "vm_trace_listeners",
        "clients following each VM's live fault trace",
        listeners,
    );
    reg.register(
        "vm_pages",
        "guest pages of each VM by the kind of their source",
        pages,
    );
    let frozen_gauge = Gauge::<i64>::default();
    frozen_gauge.set(frozen);
    reg.register(
        "frozen_vms",
        "deleted VMs kept as page sources for others",
        frozen_gauge,
    );
    let sources = Family::<Labels, Gauge>::default();
    for (kind, n) in &sample.sources_by_kind {
        sources
            .get_or_create(&labels(&[("kind", kind)]))
            .set(i64::try_from(*n).unwrap_or(i64::MAX));
    }
    reg.register("page_sources", "page sources in the arena by kind", sources);
    reg.register(
        "fault_service_seconds",
        "time the core spent on one uffd event",
        sample.fault_seconds.clone(),
    );

    let pool = Family::<Labels, Gauge>::default();
    for (state, n) in [
        ("ready", sample.pool.ready),
        ("starting", sample.pool.starting),
    ] {
        pool.get_or_create(&labels(&[("state", state)]))
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    reg.register("vmm_pool", "pooled VMMs by state", pool);
    let target = Gauge::<i64>::default();
    target.set(i64::try_from(sample.pool.target).unwrap_or(i64::MAX));
    reg.register("vmm_pool_target", "VMMs the pool keeps ready", target);
    reg.register(
        "vmm_pool_taken",
        "VM launches served from the VMM pool",
        counter(sample.pool.taken),
    );
    reg.register(
        "vmm_pool_missed",
        "VM launches that found the VMM pool empty",
        counter(sample.pool.missed),
    );

    for (name, help, v) in [
        (
            "fds_open",
            "file descriptors the server holds",
            sample.fds.open,
        ),
        (
            "fds_limit",
            "the server's file descriptor limit (soft RLIMIT_NOFILE)",
            sample.fds.limit,
        ),
        (
            "fds_reserve",
            "file descriptors admission keeps free for running VMs and the API",
            sample.fds.reserve,
        ),
    ] {
        let g = Gauge::<i64>::default();
        g.set(i64::try_from(v).unwrap_or(i64::MAX));
        reg.register(name, help, g);
    }
    reg.register(
        "fd_refusals",
        "creates, restores, clones and forks refused (503) for want of file descriptors",
        counter(sample.fds.refused),
    );

    for (name, help, v) in [
        (
            "server_adopted_vms",
            "VMs this serving process took back from the one before it",
            sample.start.adopted,
        ),
        (
            "server_lost_vms",
            "VMs this serving process could not take back",
            sample.start.lost,
        ),
        (
            "server_start_kind",
            "why this serving process started: 0 first start, 1 after a crash, 2 after an upgrade",
            sample.start.kind,
        ),
    ] {
        let g = Gauge::<i64>::default();
        g.set(i64::try_from(v).unwrap_or(i64::MAX));
        reg.register(name, help, g);
    }
    let g = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
    g.set(sample.start.recovery_seconds);
    reg.register(
        "server_recovery_seconds",
        "from this serving process's start to serving the VMs it took back",
        g,
    );

    let m = &sample.memory;
    for (name, help, v) in [
        (
            "memory_limit_bytes",
            "the memory limit reclaim keeps the VMs under (0: none)",
            m.limit_bytes.unwrap_or(0),
        ),
        (
            "memory_watermark_bytes",
            "reclaim starts above this many bytes in use (0: reclaim off)",
            if m.reclaim {
                m.watermark_bytes.unwrap_or(0)
            } else {
                0
            },
        ),
        (
            "memory_usage_bytes",
            "bytes in use as the memory limit counts them",
            m.usage_bytes,
        ),
        (
            "memory_reclaim_behind",
            "1 while reclaim cannot keep usage under the watermark (new VMs get 503)",
            u64::from(m.behind),
        ),
        ("swap_pages", "pages in the swap store", m.swap.pages),
        (
            "swap_stored_bytes",
            "bytes the swap store's pages take (compressed)",
            m.swap.stored_bytes,
        ),
        (
            "swap_file_bytes",
            "bytes of the swap store's file",
            m.swap.file_bytes,
        ),
    ] {
        let g = Gauge::<i64>::default();
        g.set(i64::try_from(v).unwrap_or(i64::MAX));
        reg.register(name, help, g);
    }
    reg.register(
        "memory_given_back_bytes",
        "bytes of guest memory reclaim gave back",
        counter(m.given_back_bytes),
    );
    let reclaimed = Family::<Labels, Counter>::default();
    let refaults = Family::<Labels, Counter>::default();
    for vm in sample.vms.iter().filter(|v| v.kind == "pagefork") {
        let l = labels(&[("vm", &vm.id)]);
        reclaimed.get_or_create(&l).inc_by(vm.reclaimed_pages);
        refaults.get_or_create(&l).inc_by(vm.refaults);
    }
    reg.register(
        "vm_reclaimed_pages",
        "pages reclaim gave back from each VM (dropped to their source or swapped)",
        reclaimed,
    );
    reg.register(
        "vm_refaults",
        "faults of each VM on pages reclaimed before",
        refaults,
    );

    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, &reg);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_include_retired_vms_and_series_carry_labels() {
        let stats = FaultStats {
            missing: 5,
            write_protect: 2,
            pages_installed: 40,
            removes: 1,
            deferred: 0,
            ..FaultStats::default()
        };
        let h = fault_histogram();
        h.observe(3e-6);
        let sample = Sample {
            fault_seconds: h,
            vms: vec![VmSample {
                id: "vm-3".into(),
                kind: "pagefork",
                state: "running".into(),
                stats,
                resident_pages: 40,
                shared_bytes: 0,
                pages_by_source: vec![("vm".into(), 40), ("uninitialized".into(), 984)],
                frozen: false,
                trace_listeners: 1,
                reclaimed_pages: 0,
                refaults: 0,
            }],
            retired: FaultStats {
                missing: 7,
                ..FaultStats::default()
            },
            sources_by_kind: vec![("vm".into(), 1)],
            pool: PoolSample {
                target: 4,
                ready: 3,
                starting: 1,
                taken: 9,
                missed: 2,
            },
            bases: vec![BaseSample {
                id: "base-2".into(),
                of: "snapshot:gold".into(),
                bytes: 4096,
                users: 3,
            }],
            fds: FdSample {
                open: 40,
                limit: 1024,
                reserve: 102,
                refused: 2,
            },
            start: StartSample {
                adopted: 5,
                lost: 0,
                recovery_seconds: 0.004,
                kind: 1,
            },
            memory: proto::api::MemoryStatus {
                reclaim: true,
                limit_bytes: Some(512 << 20),
                watermark_bytes: Some(435 << 20),
                given_back_bytes: 4096,
                ..Default::default()
            },
        };
        let text = render(&sample);
        assert!(
            text.contains(r#"pagefork_base_users{base="base-2",of="snapshot:gold"} 3"#),
            "{text}"
        );
        assert!(text.contains("pagefork_faults_missing_total 12"), "{text}");
        assert!(
            text.contains("pagefork_memory_limit_bytes 536870912"),
            "{text}"
        );
        assert!(
            text.contains("pagefork_memory_given_back_bytes_total 4096"),
            "{text}"
        );
        assert!(
            text.contains(r#"pagefork_vm_faults_missing_total{vm="vm-3",kind="pagefork"} 5"#),
            "{text}"
        );
        assert!(text.contains(r#"pagefork_vm_pages{vm="vm-3",source="uninitialized"} 984"#));
        assert!(
            text.contains("pagefork_fault_service_seconds_count 1"),
            "{text}"
        );
        assert!(
            text.contains(r#"pagefork_vmm_pool{state="ready"} 3"#),
            "{text}"
        );
        assert!(text.contains("pagefork_vmm_pool_taken_total 9"), "{text}");
        assert!(text.contains("pagefork_vmm_pool_target 4"), "{text}");
        assert!(text.contains("pagefork_fds_open 40"), "{text}");
        assert!(text.contains("pagefork_fds_limit 1024"), "{text}");
        assert!(text.contains("pagefork_fd_refusals_total 2"), "{text}");
        assert!(text.contains("pagefork_server_adopted_vms 5"), "{text}");
        assert!(
            text.contains("pagefork_server_recovery_seconds 0.004"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
