//! What reclaim keeps: server-wide ([`Reclaimer`]: the limit it keeps the
//! VMs under, the swap store, what it gave back) and per VM
//! ([`VmReclaim`]: its policy, where its clock hand is, its swap source,
//! the pages lately reclaimed from it and how often they came back).

use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;

use shared::PAGE_SIZE;
use tracing::{info, warn};

pub use crate::core::settings::ReclaimMode as Mode;
use crate::pages::{PageTable, SourceId};
use crate::reclaim::cgroup::{self, MemoryCgroup};
use crate::reclaim::store::{StoreOptions, SwapStore};
use crate::snapshot::pageset::PageSet;

/// The limit the server keeps its VMs under, read now.
#[derive(Debug, Clone, Default)]
pub struct Reading {
    /// The limit that applies, in bytes.
    pub limit: Option<u64>,
    /// `cgroup v1 /sys/...` or `host`.
    pub source: String,
    /// Bytes in use, as the limit counts them.
    pub usage: u64,
    /// OOM kills in the server's cgroup.
    pub oom_kills: Option<u64>,
}

/// The watermark stays at least this far under the limit.
const HEADROOM: u64 = 24 << 20;

/// Server-wide reclaim state.
#[derive(Debug)]
pub struct Reclaimer {
    mode: Mode,
    /// Reclaim starts above this share of the limit (percent).
    watermark_pct: u64,
    cgroup: Option<MemoryCgroup>,
    store: Option<Rc<RefCell<SwapStore>>>,
    store_path: PathBuf,
    /// The store's disk is full (or its cap reached), since this many
    /// ticks; it is tried again now and then.
    store_full: bool,
    given_back: u64,
    base_dropped: u64,
    behind: Option<String>,
    last: Reading,
    /// Where the next drop of each image base's pages starts.
    base_hands: std::collections::HashMap<u32, u64>,
    /// The kernel reported memory stalls (a PSI trigger fired) since the
    /// last tick, and how many times ever.
    stalled: bool,
    stalls: u64,
}

impl Reclaimer {
    /// Reclaim as `settings` say: finds the server's memory cgroup and
    /// opens (or creates) the swap store (`pages` in `--swap-dir`, default
    /// `STATE/swap`), whose frames a crash left are found again.
    pub fn new(settings: &crate::core::settings::Settings) -> Self {
        let mode = settings.reclaim;
        let watermark_pct = settings.reclaim_watermark_pct;
        let store_path = settings
            .swap_dir
            .clone()
            .unwrap_or_else(|| settings.state_dir.join("swap"))
            .join("pages");
        let options = StoreOptions {
            max_file_bytes: settings.swap_max_bytes,
            ..StoreOptions::default()
        };
        let cgroup = match MemoryCgroup::of_self() {
            Ok(c) => c,
            Err(e) => {
                warn!("cannot read the server's memory cgroup: {e}");
                None
            }
        };
        let store = if mode == Mode::Off {
            None
        } else {
            match SwapStore::open(&store_path, options) {
                Ok((store, recovered)) => {
                    info!("swap store {}: {recovered}", store_path.display());
                    Some(Rc::new(RefCell::new(store)))
                }
                Err(e) => {
                    warn!(
                        "no swap store at {}: {e}; only pages equal to their source are given \
                         back",
                        store_path.display()
                    );
                    None
                }
            }
        };
        Reclaimer {
            mode,
            watermark_pct: watermark_pct.clamp(10, 99),
            cgroup,
            store,
            store_path,
            store_full: false,
            given_back: 0,
            base_dropped: 0,
            behind: None,
            last: Reading::default(),
            base_hands: std::collections::HashMap::new(),
            stalled: false,
            stalls: 0,
        }
    }

    /// A trigger on the memory stalls of the server's cgroup (its own
    /// pressure file on v2, the host's on v1 or without a cgroup): tasks
    /// stalled 100 ms in a 1 s window (2 s where the kernel gives a
    /// process without `CAP_SYS_RESOURCE` no shorter one).
    pub fn pressure_trigger(&self) -> cgroup::Result<cgroup::PressureTrigger> {
        use cgroup::{PressureTrigger, Stall};
        let stall = std::time::Duration::from_millis(100);
        let make = |window| match &self.cgroup {
            Some(c) => PressureTrigger::for_cgroup(c, Stall::Some, stall, window),
            None => PressureTrigger::host(Stall::Some, stall, window),
        };
        make(std::time::Duration::from_secs(1)).or_else(|_| make(cgroup::UNPRIVILEGED_WINDOW))
    }

    /// The kernel reported memory stalls.
    pub fn stalled(&mut self) {
        self.stalled = true;
        self.stalls += 1;
    }

    /// Whether the kernel reported stalls since the last call.
    pub fn take_stalled(&mut self) -> bool {
        std::mem::take(&mut self.stalled)
    }

    /// Stall reports so far.
    pub fn stalls(&self) -> u64 {
        self.stalls
    }

    /// Reclaim may run.
    pub fn on(&self) -> bool {
        self.mode == Mode::Auto
    }

    /// The swap store, while pages may go into it.
    pub fn store(&self) -> Option<&Rc<RefCell<SwapStore>>> {
        self.store.as_ref()
    }

    /// The swap store, to read from (full or not).
    pub fn store_for_reading(&self) -> Option<&Rc<RefCell<SwapStore>>> {
        self.store.as_ref()
    }

    /// Pages may go into the swap store now.
    pub fn can_swap(&self) -> bool {
        self.store.is_some() && !self.store_full
    }

    /// The store refused a page (its disk is full): written pages stay in
    /// memory until [`Self::retry_store`].
    pub fn store_is_full(&mut self) {
        if !self.store_full {
            warn!(
                "the swap store {} is full: written pages stay in memory; pages equal to their \
                 source are still given back",
                self.store_path.display()
            );
        }
        self.store_full = true;
    }

    /// Try the store again (space may have been freed).
    pub fn retry_store(&mut self) {
        self.store_full = false;
    }

    /// Where the next drop of base `id`'s pages starts.
    pub fn base_hand(&self, id: u32) -> u64 {
        self.base_hand_of(id)
    }

    /// `pages` of shared image bases were dropped.
    pub fn dropped_base_pages(&mut self, pages: u64) {
        self.base_dropped += pages;
        self.gave_back(pages * PAGE_SIZE);
    }

    fn base_hand_of(&self, id: u32) -> u64 {
        self.base_hands.get(&id).copied().unwrap_or(0)
    }

    /// The next drop of base `id`'s pages starts at `page`.
    pub fn set_base_hand(&mut self, id: u32, page: u64) {
        self.base_hands.insert(id, page);
    }

    /// `bytes` more were given back.
    pub fn gave_back(&mut self, bytes: u64) {
        self.given_back += bytes;
    }

    /// Read the limit and what is in use now.
    pub fn read(&mut self) -> &Reading {
        let mut r = Reading::default();
        let host_total = cgroup::mem_total_bytes().ok();
        let host_avail = cgroup::mem_available_bytes().ok();
        if let Some(cg) = &self.cgroup {
            if let Ok(Some(limit)) = cg.effective_limit_bytes() {
                if host_total.is_none_or(|t| limit < t) {
                    r.limit = Some(limit);
                    r.source = cg.describe();
                    r.usage = cg
                        .working_set_bytes()
                        .or_else(|_| cg.anon_and_shmem_bytes())
                        .unwrap_or(0);
                }
            }
            r.oom_kills = cg.oom_kills().ok();
        }
        if r.limit.is_none() {
            if let (Some(total), Some(avail)) = (host_total, host_avail) {
                r.limit = Some(total);
                r.source = "host".to_owned();
                r.usage = total.saturating_sub(avail);
            }
        }
        self.last = r;
        &self.last
    }

    /// The last reading.
    pub fn last(&self) -> &Reading {
        &self.last
    }

    /// Reclaim starts above this many bytes in use: the share
    /// `--reclaim-watermark-pct` of the limit, and at least
    /// [`HEADROOM`] under it (a small limit leaves the kernel's own needs
    /// and a burst of faults room).
    pub fn watermark(&self) -> Option<u64> {
        self.last
            .limit
            .map(|l| (l / 100 * self.watermark_pct).min(l.saturating_sub(HEADROOM)))
    }

    /// Reclaim goes on until usage is under this: 5 points of the limit
    /// (at least 8 MiB) below the watermark.
    pub fn low_watermark(&self) -> Option<u64> {
        let (limit, high) = (self.last.limit?, self.watermark()?);
        Some(high.saturating_sub((limit / 20).max(8 << 20)))
    }

    /// Reclaim cannot keep up, for `why`; `None`: it can.
    pub fn set_behind(&mut self, why: Option<String>) {
        match (&self.behind, &why) {
            (None, Some(w)) => warn!("reclaim cannot keep up: {w}; new VMs are refused"),
            (Some(_), None) => info!("reclaim keeps up again; new VMs are admitted"),
            _ => {}
        }
        self.behind = why;
    }

    /// Why new VMs are refused now, if they are.
    pub fn behind(&self) -> Option<&str> {
        self.behind.as_deref()
    }

    /// `GET /v1/memory`, but for the per-VM parts.
    pub fn to_api(
        &self,
        resident_bytes: u64,
        thrashing_vms: Vec<String>,
    ) -> proto::api::MemoryStatus {
        let stats = self.store.as_ref().map(|s| s.borrow().stats());
        proto::api::MemoryStatus {
            reclaim: self.on(),
            limit_bytes: self.last.limit,
            limit_source: self.last.source.clone(),
            watermark_bytes: self.watermark(),
            usage_bytes: self.last.usage,
            resident_bytes,
            given_back_bytes: self.given_back,
            base_pages_dropped: self.base_dropped,
            behind: self.behind.is_some(),
            behind_reason: self.behind.clone(),
            swap: proto::api::SwapStatus {
                path: self.store_path.display().to_string(),
                pages: stats.as_ref().map_or(0, |s| s.pages),
                stored_bytes: stats.as_ref().map_or(0, |s| s.stored_bytes),
                file_bytes: stats.as_ref().map_or(0, |s| s.file_bytes),
                full: self.store_full || self.store.is_none(),
            },
            oom_kills: self.last.oom_kills,
            thrashing_vms,
        }
    }
}

/// Refaults at least this share (percent) of the pages reclaimed in a
/// window make a VM thrashing.
const THRASH_PCT: u64 = 50;
/// ... once that many pages were reclaimed in the window.
const THRASH_MIN_PAGES: u64 = 256;

/// One VM's reclaim state.
#[derive(Debug)]
pub struct VmReclaim {
    pages: u64,
    enabled: bool,
    limit_pages: Option<u64>,
    /// Its table when it was made: where each page's bytes were then. A
    /// page it holds that equals its entry here (an image, a frozen
    /// template, zeroes: sources that never change) is dropped back to
    /// it rather than swapped. Shares its chunks with the live table
    /// until they differ. None for a VM taken back after a restart.
    origin: Option<PageTable>,
    /// Its `Swap` source, once a page of it was swapped.
    pub(super) swap_src: Option<SourceId>,
    /// Where the next pass starts looking (a clock hand over its pages).
    pub(super) hand: u64,
    /// Pages reclaimed in this window (bound 0 until the first).
    recent: PageSet,
    /// Pages that came back in this window or the one before.
    hot: PageSet,
    hot_before: PageSet,
    /// Pages that came back from the swap store: their frames are freed
    /// by the next tick (if no other table names them).
    pub(super) swapped_in: Vec<u64>,
    dropped: u64,
    swapped_out: u64,
    refaults: u64,
    window_reclaimed: u64,
    window_refaults: u64,
    thrashing: bool,
    /// Its fault count at the last tick, and ticks since it changed.
    pub(super) last_faults: u64,
    pub(super) idle_ticks: u64,
}

impl VmReclaim {
    /// A VM of `pages` pages with `policy` (the server's default if
    /// none) whose table starts as `origin` (None: not known).
    pub fn new(
        policy: Option<&proto::api::ReclaimPolicy>,
        pages: u64,
        origin: Option<&PageTable>,
    ) -> Self {
        let p = policy.cloned().unwrap_or_default();
        VmReclaim {
            pages,
            enabled: p.enabled,
            limit_pages: p.limit_mib.map(|m| m.saturating_mul((1 << 20) / PAGE_SIZE)),
            origin: origin.map(PageTable::fork),
            swap_src: None,
            hand: 0,
            recent: PageSet::new(0),
            hot: PageSet::new(0),
            hot_before: PageSet::new(0),
            swapped_in: Vec::new(),
            dropped: 0,
            swapped_out: 0,
            refaults: 0,
            window_reclaimed: 0,
            window_refaults: 0,
            thrashing: false,
            last_faults: 0,
            idle_ticks: 0,
        }
    }

    /// Its policy, as a create gives it.
    pub fn policy(&self) -> proto::api::ReclaimPolicy {
        proto::api::ReclaimPolicy {
            enabled: self.enabled,
            limit_mib: self.limit_pages.map(|p| p.saturating_mul(PAGE_SIZE) >> 20),
        }
    }

    /// It may be reclaimed.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Its `Swap` source, once a page of it was swapped.
    pub fn swap_src(&self) -> Option<SourceId> {
        self.swap_src
    }

    /// Its own limit, in pages.
    pub fn limit_pages(&self) -> Option<u64> {
        self.limit_pages
    }

    /// Whether `src` is where some of its pages came from when it was
    /// made: the source stays open while the VM lives, so a page equal to
    /// it can be dropped back to it.
    pub fn names(&self, src: SourceId) -> bool {
        self.origin.as_ref().is_some_and(|t| t.count_of(src) > 0)
    }

    /// The source page `p` came from when the VM was made.
    pub(super) fn origin_of(&self, p: u64) -> Option<SourceId> {
        self.origin.as_ref().map(|t| t.get(p))
    }

    /// Pages `[lo, lo + n)` were installed from `from`: a fault on a page
    /// reclaimed before is a refault. The fault path's one cost while
    /// nothing was reclaimed: two compares.
    #[inline]
    pub fn installed(&mut self, lo: u64, n: u64, from: SourceId) {
        if self.swap_src == Some(from) {
            self.swapped_in.extend(lo..lo + n);
            self.count_refaults(lo, n, n);
        } else if !self.recent.is_empty() {
            let back = (lo..lo + n).filter(|p| self.recent.contains(*p)).count() as u64;
            self.count_refaults(lo, n, back);
        }
    }

    fn count_refaults(&mut self, lo: u64, n: u64, back: u64) {
        if back == 0 {
            return;
        }
        self.refaults += back;
        self.window_refaults += back;
        if self.hot.pages() != self.pages {
            self.hot = PageSet::new(self.pages);
        }
        for p in lo..lo + n {
            self.recent.remove(p);
            self.hot.insert(p);
        }
    }

    /// Page `p` was reclaimed now (`swapped`: into the store, else
    /// dropped back to its source).
    pub(super) fn reclaimed(&mut self, p: u64, swapped: bool) {
        if self.recent.pages() != self.pages {
            self.recent = PageSet::new(self.pages);
        }
        self.recent.insert(p);
        self.window_reclaimed += 1;
        if swapped {
            self.swapped_out += 1;
        } else {
            self.dropped += 1;
        }
    }

    /// Page `p` came back after it was reclaimed, in this window or the
    /// one before: the next passes leave it alone (it is hot).
    pub(super) fn hot(&self, p: u64) -> bool {
        self.hot.contains(p) || self.hot_before.contains(p)
    }

    /// End a window: judge thrashing, forget what was reclaimed in it.
    pub(super) fn end_window(&mut self) -> bool {
        let was = self.thrashing;
        self.thrashing = self.window_reclaimed >= THRASH_MIN_PAGES
            && self.window_refaults * 100 >= self.window_reclaimed * THRASH_PCT;
        self.window_reclaimed = 0;
        self.window_refaults = 0;
        self.recent = PageSet::new(0);
        // A page hot in the window before and not since cools down.
        self.hot_before = std::mem::replace(&mut self.hot, PageSet::new(0));
        self.thrashing && !was
    }

    /// It faults back what is reclaimed from it.
    pub fn thrashing(&self) -> bool {
        self.thrashing
    }

    /// As `GET /v1/vms/{id}` shows it; `swapped` pages of it are in the
    /// store now.
    pub fn to_api(&self, swapped: u64) -> proto::api::VmReclaim {
        proto::api::VmReclaim {
            enabled: self.enabled,
            limit_bytes: self.limit_pages.map(|p| p * PAGE_SIZE),
            dropped_pages: self.dropped,
            swapped_pages: swapped,
            swapped_out_total: self.swapped_out,
            refaults: self.refaults,
            thrashing: self.thrashing,
        }
    }
}
