//! One VM's page log: for every guest page, how it got into the VM's
//! memory (when, by which event, from which source) and which faults the
//! VM took on it since the access record began (creation, fork, restore,
//! rollback or a reset).
//!
//! Bounded by construction: at most 16 bytes per 4 KiB guest page (0.4% of
//! guest memory), in chunks of [`CHUNK`] pages allocated when a page of
//! theirs is first recorded, so a VM that touches little memory (a fork
//! child of a large template) costs little. Times are milliseconds
//! after the log's origin (u32: 49 days), counts saturate. Written on the
//! fault path by the core thread only: an `Instant::now()` and a few stores
//! per event.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use proto::api::{AccessExtent, FaultKind};

use crate::pages::SourceId;

/// How a page got into a VM's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum By {
    /// The faulting page of a MISSING fault.
    Missing = 1,
    /// A page of the run installed around a MISSING fault.
    FaultAround = 2,
    /// The pre-write copy from the VM it read from, before that VM wrote.
    WpCopy = 3,
    /// Installed before the VM ran.
    Prefetch = 4,
    /// Mapped from the VM's shared base (the run around a fault).
    Shared = 5,
}

impl By {
    fn from_u8(b: u8) -> Option<By> {
        match b {
            1 => Some(By::Missing),
            2 => Some(By::FaultAround),
            3 => Some(By::WpCopy),
            4 => Some(By::Prefetch),
            5 => Some(By::Shared),
            _ => None,
        }
    }

    /// The name as the API shows it.
    pub fn name(self) -> &'static str {
        match self {
            By::Missing => "missing",
            By::FaultAround => "fault-around",
            By::WpCopy => "wp-copy",
            By::Prefetch => "prefetch",
            By::Shared => "shared",
        }
    }
}

fn kind_code(k: FaultKind) -> u8 {
    match k {
        FaultKind::Missing => 1,
        FaultKind::Wp => 2,
        FaultKind::Remove => 3,
        FaultKind::Prefetch => 4,
    }
}

fn kind_of(code: u8) -> Option<FaultKind> {
    match code {
        1 => Some(FaultKind::Missing),
        2 => Some(FaultKind::Wp),
        3 => Some(FaultKind::Remove),
        4 => Some(FaultKind::Prefetch),
        _ => None,
    }
}

/// One page's record (16 bytes).
#[derive(Debug, Clone, Copy, Default)]
struct PageRec {
    /// Installed at this many ms after the origin.
    installed_ms: u32,
    /// The source it was read from.
    from: SourceId,
    /// First fault since the access record began, ms after `since`.
    first_ms: u32,
    /// Faults since the access record began (saturating).
    faults: u16,
    /// [`By`] as a byte; 0: not installed by the server (or removed since).
    by: u8,
    /// The first fault's kind; 0: no fault since the record began.
    first_kind: u8,
}

const _: () = assert!(std::mem::size_of::<PageRec>() == 16);

/// How a page was installed, as [`PageLog::installed`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Install {
    pub unix_ms: u64,
    pub by: By,
    pub from: SourceId,
}

/// A page's access record, as [`PageLog::access`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Access {
    pub first_kind: FaultKind,
    pub first_ms: u64,
    pub faults: u64,
}

/// Pages per chunk of records (8 KiB of records per 2 MiB of guest RAM).
pub const CHUNK: usize = 512;

/// The records of every page, a chunk allocated on its first write; a
/// missing chunk reads as default records.
#[derive(Debug)]
struct Recs {
    pages: usize,
    chunks: Vec<Option<Box<[PageRec; CHUNK]>>>,
}

impl Recs {
    fn new(pages: usize) -> Self {
        Recs {
            pages,
            chunks: std::iter::repeat_with(|| None)
                .take(pages.div_ceil(CHUNK))
                .collect(),
        }
    }

    fn len(&self) -> usize {
        self.pages
    }

    /// Page `p`'s record; `None` past the end.
    fn get(&self, p: usize) -> Option<PageRec> {
        if p >= self.pages {
            return None;
        }
        Some(
            self.chunks[p / CHUNK]
                .as_ref()
                .map_or_else(PageRec::default, |c| c[p % CHUNK]),
        )
    }

    /// Page `p`'s record to write, allocating its chunk.
    fn get_mut(&mut self, p: usize) -> Option<&mut PageRec> {
        if p >= self.pages {
            return None;
        }
        let chunk =
            self.chunks[p / CHUNK].get_or_insert_with(|| Box::new([PageRec::default(); CHUNK]));
        Some(&mut chunk[p % CHUNK])
    }

    /// Records of pages `[lo, hi)` that are allocated (the others hold
    /// defaults).
    /// Only the chunks that overlap the range are visited: reclaim drops
    /// many short runs of a large VM, and a walk over every chunk per run
    /// made that quadratic.
    fn allocated_mut(&mut self, lo: usize, hi: usize) -> impl Iterator<Item = &mut PageRec> {
        let hi = hi.min(self.pages);
        let lo = lo.min(hi);
        let first = lo / CHUNK;
        let chunks = self
            .chunks
            .get_mut(first..hi.div_ceil(CHUNK))
            .unwrap_or_default();
        chunks
            .iter_mut()
            .enumerate()
            .filter_map(move |(i, c)| c.as_mut().map(|c| ((first + i) * CHUNK, c)))
            // Every chunk visited starts below `hi`.
            .flat_map(move |(base, c)| {
                let from = lo.saturating_sub(base);
                c[from..(hi - base).min(CHUNK)].iter_mut()
            })
    }

    /// Every page's record, in order.
    fn iter(&self) -> impl Iterator<Item = PageRec> + '_ {
        (0..self.pages).map(|p| self.get(p).unwrap_or_default())
    }
}

/// One VM's page log.
#[derive(Debug)]
pub struct PageLog {
    origin: Instant,
    origin_unix_ms: u64,
    since: Instant,
    since_unix_ms: u64,
    recs: Recs,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn ms(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

impl PageLog {
    /// An empty log of `pages` pages; the access record begins now.
    pub fn new(pages: u64) -> Self {
        let now = Instant::now();
        let unix = unix_ms();
        PageLog {
            origin: now,
            origin_unix_ms: unix,
            since: now,
            since_unix_ms: unix,
            recs: Recs::new(shared::geometry::usize_of(pages)),
        }
    }

    /// Pages logged.
    pub fn pages(&self) -> u64 {
        self.recs.len() as u64
    }

    /// When the access record began, in ms since the Unix epoch.
    pub fn since_unix_ms(&self) -> u64 {
        self.since_unix_ms
    }

    /// Pages `[first, first + n)` were installed `by` from `from`; with
    /// `By::Missing`, only `fault` itself is the faulting page, the rest
    /// of the run is fault-around.
    pub fn installed_run(&mut self, first: u64, n: u64, fault: u64, by: By, from: SourceId) {
        let at = ms(self.origin.elapsed());
        for p in first..first.saturating_add(n) {
            let by = if by == By::Missing && p != fault {
                By::FaultAround
            } else {
                by
            };
            if let Some(r) = self.recs.get_mut(shared::geometry::usize_of(p)) {
                r.installed_ms = at;
                r.from = from;
                r.by = by as u8;
            }
        }
    }

    /// A fault of `kind` on `page`.
    pub fn fault(&mut self, page: u64, kind: FaultKind) {
        let at = ms(self.since.elapsed());
        if let Some(r) = self.recs.get_mut(shared::geometry::usize_of(page)) {
            if r.first_kind == 0 {
                r.first_kind = kind_code(kind);
                r.first_ms = at;
            }
            r.faults = r.faults.saturating_add(1);
        }
    }

    /// Pages `[first, first + n)` were dropped (REMOVE, rollback): they
    /// hold nothing the server installed any more.
    pub fn dropped(&mut self, first: u64, n: u64) {
        let lo = shared::geometry::usize_of(first);
        let hi = shared::geometry::usize_of(first.saturating_add(n));
        for r in self.recs.allocated_mut(lo, hi) {
            r.by = 0;
            r.from = 0;
            r.installed_ms = 0;
        }
    }

    /// Begin the access record again (install records stay).
    pub fn reset_access(&mut self) {
        self.since = Instant::now();
        self.since_unix_ms = unix_ms();
        for r in self.recs.allocated_mut(0, usize::MAX) {
            r.first_kind = 0;
            r.first_ms = 0;
            r.faults = 0;
        }
    }

    /// How `page` got into the VM's memory, if the server installed it.
    pub fn installed(&self, page: u64) -> Option<Install> {
        let r = self.recs.get(shared::geometry::usize_of(page))?;
        Some(Install {
            unix_ms: self.origin_unix_ms + u64::from(r.installed_ms),
            by: By::from_u8(r.by)?,
            from: r.from,
        })
    }

    /// `page`'s faults since the access record began, if any.
    pub fn access(&self, page: u64) -> Option<Access> {
        let r = self.recs.get(shared::geometry::usize_of(page))?;
        Some(Access {
            first_kind: kind_of(r.first_kind)?,
            first_ms: u64::from(r.first_ms),
            faults: u64::from(r.faults),
        })
    }

    /// Faults on each page since the access record began.
    pub fn fault_counts(&self) -> impl Iterator<Item = u64> + '_ {
        self.recs.iter().map(|r| u64::from(r.faults))
    }

    /// Runs of touched pages with the same first fault kind; with
    /// `within_ms`, only pages first faulted within that time.
    pub fn extents(&self, within_ms: Option<u64>) -> Vec<AccessExtent> {
        let mut out: Vec<AccessExtent> = Vec::new();
        for (p, r) in self.recs.iter().enumerate() {
            let Some(kind) = kind_of(r.first_kind) else {
                continue;
            };
            let first = u64::from(r.first_ms);
            if within_ms.is_some_and(|w| first > w) {
                continue;
            }
            let p = p as u64;
            let faults = u64::from(r.faults);
            match out.last_mut() {
                Some(e) if e.kind == kind && e.start_page + e.pages == p => {
                    e.pages += 1;
                    e.first_ms = e.first_ms.min(first);
                    e.last_ms = e.last_ms.max(first);
                    e.faults += faults;
                }
                _ => out.push(AccessExtent {
                    start_page: p,
                    pages: 1,
                    kind,
                    first_ms: first,
                    last_ms: first,
                    faults,
                }),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_run_records_the_faulting_page_and_its_neighbours() {
        let mut log = PageLog::new(16);
        log.installed_run(4, 4, 5, By::Missing, 9);
        assert_eq!(
            log.installed(5).map(|i| (i.by, i.from)),
            Some((By::Missing, 9))
        );
        assert_eq!(log.installed(4).map(|i| i.by), Some(By::FaultAround));
        assert_eq!(log.installed(8), None);
        log.dropped(4, 2);
        assert_eq!(log.installed(5), None);
        assert_eq!(log.installed(6).map(|i| i.by), Some(By::FaultAround));
    }

    #[test]
    fn a_drop_clears_exactly_its_range_across_chunks() {
        let pages = 3 * CHUNK as u64 + 5;
        let mut log = PageLog::new(pages);
        log.installed_run(0, pages, 0, By::Missing, 9);
        let (first, n) = (CHUNK as u64 - 3, CHUNK as u64 + 6);
        log.dropped(first, n);
        for p in 0..pages {
            let dropped = (first..first + n).contains(&p);
            assert_eq!(log.installed(p).is_none(), dropped, "page {p}");
        }
        // Empty, past-the-end and overflowing ranges change nothing else.
        log.dropped(7, 0);
        log.dropped(pages, 10);
        log.dropped(pages - 2, u64::MAX);
        assert!(log.installed(7).is_some());
        assert!(log.installed(pages - 3).is_some());
        assert!(log.installed(pages - 2).is_none() && log.installed(pages - 1).is_none());
    }

    #[test]
    fn records_are_allocated_only_for_chunks_written() {
        let mut log = PageLog::new(4 * CHUNK as u64 + 3);
        assert!(log.recs.chunks.iter().all(Option::is_none));
        log.fault(CHUNK as u64 + 7, FaultKind::Missing);
        log.dropped(0, 4 * CHUNK as u64);
        log.reset_access();
        let allocated = log.recs.chunks.iter().filter(|c| c.is_some()).count();
        assert_eq!(allocated, 1);
        assert_eq!(log.access(CHUNK as u64 + 7), None);
        log.fault(4 * CHUNK as u64 + 2, FaultKind::Wp);
        assert_eq!(log.access(4 * CHUNK as u64 + 2).map(|a| a.faults), Some(1));
        assert_eq!(log.access(4 * CHUNK as u64 + 3), None);
        assert_eq!(log.fault_counts().count(), 4 * CHUNK + 3);
    }

    #[test]
    fn extents_join_runs_of_one_first_kind_and_count_every_fault() {
        let mut log = PageLog::new(16);
        for p in [2, 3, 4] {
            log.fault(p, FaultKind::Missing);
        }
        log.fault(3, FaultKind::Wp);
        log.fault(5, FaultKind::Wp);
        let e = log.extents(None);
        assert_eq!(e.len(), 2, "{e:?}");
        assert_eq!((e[0].start_page, e[0].pages, e[0].faults), (2, 3, 4));
        assert_eq!((e[1].start_page, e[1].kind), (5, FaultKind::Wp));
        log.reset_access();
        assert!(log.extents(None).is_empty());
        assert_eq!(log.access(3), None);
    }
}
