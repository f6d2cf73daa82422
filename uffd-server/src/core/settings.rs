//! The server-wide settings the core works with (from the command line,
//! `main.rs`), and the few rules that read them alone.

use std::path::PathBuf;
use std::time::Duration;

use crate::core::error::{Error, Result};
use crate::memory::PageSize;

/// `--reclaim`: whether the server gives memory back under pressure
/// (see `core/reclaim/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReclaimMode {
    /// Reclaim whenever a memory limit applies (the server's cgroup's, or
    /// the host's memory).
    Auto,
    /// Never: the kernel's OOM killer decides under pressure.
    Off,
}

/// Server-wide settings the core needs.
#[derive(Debug, Clone)]
pub struct Settings {
    pub state_dir: PathBuf,
    pub vmm_bin: PathBuf,
    /// Default fault-around block in pages (1 = off).
    pub fault_around_pages: u64,
    /// Default largest readahead window in pages for sequential faults on
    /// image-backed memory (at most the fault-around block = off).
    pub readahead_pages: u64,
    /// How long a VMM may take to connect and start its guest.
    pub start_timeout: Duration,
    /// How long one guest op may take.
    pub exec_timeout: Duration,
    /// How long a VMM may take to pause, resume or capture its state.
    pub vmm_deadline: Duration,
    /// How long after a rollback's resume its discarded pages start being
    /// punched in the background (see `rollback/discard.rs`).
    pub rollback_scrub_delay: Duration,
    /// Requests in flight per VM at most; beyond it that VM answers 503.
    pub vmm_queue: usize,
    /// Logs of deleted VMs kept for post-mortems.
    pub keep_logs: usize,
    /// Guest memory the server may promise, in bytes (admission control).
    pub memory_budget: u64,
    /// VMs at most (pagefork and Firecracker, frozen ones included).
    pub max_vms: usize,
    /// Images are served only from under this directory (canonical).
    pub image_dir: Option<PathBuf>,
    /// Threads compressing a snapshot's `memory.zst`.
    pub compress_threads: usize,
    /// A snapshot image with more extents than this is rewritten
    /// sequentially in the background (0 = never).
    pub rewrite_extents: u64,
    /// For tests: how long a snapshot's writer waits before the first run
    /// it copies out of guest memory (`writer::Memory::hold`).
    pub snapshot_copy_hold: Duration,
    /// VMM processes kept started and connected, waiting for a VM.
    pub vmm_pool: usize,
    /// Guest RAM size (MiB) pooled VMMs prepare their KVM slot for.
    pub vmm_pool_memory_mib: u64,
    /// Back new VMs' guest RAM with 2 MiB hugetlb pages unless a create
    /// says otherwise.
    pub hugepages: bool,
    /// How long a uffd is polled after its events were served before the
    /// core waits for it in the event loop again (zero = never polled; see
    /// `core/fault/serve.rs`).
    pub fault_poll: Duration,
    /// A readahead window is installed in pieces of this many pages, the
    /// faulting page's first, so its thread runs while the rest goes in
    /// (0 = the whole window before the wake).
    pub readahead_piece_pages: u64,
    /// VMs made from an image, restored from a snapshot, or forked from a
    /// paused VM map their clean pages from a shared base instead of
    /// copying them (`crate::bases`); off where the kernel cannot.
    pub shared_bases: bool,
    /// Restores install their snapshot's recorded working set ahead of
    /// the guest (see `core/workset/`).
    pub prefetch_working_set: bool,
    /// A snapshot's first restore records its working set for this long
    /// at most (it ends sooner when the VM is deleted).
    pub working_set_window: Duration,
    /// Give memory back under pressure (`--reclaim`).
    pub reclaim: ReclaimMode,
    /// Reclaim starts above this share of the memory limit, in percent.
    pub reclaim_watermark_pct: u64,
    /// Where the swap store lives (default `STATE/swap`).
    pub swap_dir: Option<PathBuf>,
    /// The swap store's file grows to this many bytes at most.
    pub swap_max_bytes: Option<u64>,
}

impl Settings {
    /// Where VM `id`'s VMM writes its log (`STATE/logs/<id>.log`).
    pub fn log_path(&self, id: shared::VmId) -> PathBuf {
        self.state_dir.join("logs").join(format!("{id}.log"))
    }

    /// The page size a new VM of `size` bytes gets: `hugepages` as asked,
    /// else the server's default; a size that is no whole number of huge
    /// pages is a bad request.
    pub fn page_size_for(&self, hugepages: Option<bool>, size: u64) -> Result<PageSize> {
        let page_size = PageSize::huge(hugepages.unwrap_or(self.hugepages));
        if !size.is_multiple_of(page_size.bytes()) {
            return Err(Error::BadRequest(format!(
                "hugepages needs memory_mib to be a multiple of {}",
                page_size.bytes() >> 20
            )));
        }
        Ok(page_size)
    }
}

/// A fault-around block in pages as the API reports it: KiB, 0 when off
/// (one page per fault).
pub fn fault_around_kib(pages: u64) -> u64 {
    if pages <= 1 {
        0
    } else {
        pages * shared::PAGE_SIZE / 1024
    }
}
