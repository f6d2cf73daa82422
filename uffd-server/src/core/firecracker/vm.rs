//! One Firecracker VM being served: its regions, table and uffd, and how a
//! fault is resolved (fault-around, readahead, zero pages, EAGAIN).

use std::cell::RefCell;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::rc::Rc;

use proto::firecracker::Region;
use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tracing::warn;
use userfaultfd::Uffd;

use super::map::FileMap;
use crate::core::vm::{FaultStats, Readahead, RunState};
use crate::pages::{PageTable, SourceId, UNINITIALIZED};
use crate::uffd_ffi::{self, Install};

/// A Firecracker VM being served.
#[derive(Debug)]
pub struct FcVm {
    pub id: VmId,
    pub listener: u32,
    pub conn: u64,
    pub pid: u32,
    pub regions: Vec<Region>,
    pub table: PageTable,
    pub self_src: SourceId,
    pub file_src: SourceId,
    pub map: Rc<FileMap>,
    pub uffd: Rc<AsyncFd<Uffd>>,
    pub state: RunState,
    pub stats: FaultStats,
    pub fault_around_pages: u64,
    pub readahead: Readahead,
    /// Source pages installed by faults, in order (for working-set
    /// recording).
    pub fault_order: Vec<u64>,
    pub stream: UnixStream,
    /// Signalled on hang-up: the serving task stops and drops the uffd
    /// (after the process exits its uffd never becomes readable again).
    pub closed: Rc<tokio::sync::Notify>,
}

/// Result of resolving one fault.
pub(super) enum Resolved {
    Ok,
    /// Retry after the pending events.
    Again,
    Gone,
}

impl FcVm {
    fn region_of(&self, addr: u64) -> Option<Region> {
        self.regions
            .iter()
            .copied()
            .find(|r| addr >= r.base && addr < r.base + r.size)
    }

    fn raw_uffd(&self) -> i32 {
        self.uffd.get_ref().as_raw_fd()
    }

    /// Install source pages `[lo, hi)` of region `r`; returns how many pages
    /// from `lo` were installed before an existing page, or the outcome.
    fn install_run(&mut self, r: Region, lo: u64, hi: u64) -> Result<u64, Resolved> {
        let dst = r.base + (lo * PAGE_SIZE - r.offset);
        let len = (hi - lo) * PAGE_SIZE;
        let src_id = self.table.get(lo);
        let res = if src_id == UNINITIALIZED {
            if r.page_size == PAGE_SIZE {
                uffd_ffi::zeropage(self.raw_uffd(), dst, len)
            } else {
                let zeros = zero_buffer(len);
                // SAFETY: `zeros` is a live buffer of at least `len` bytes.
                unsafe { uffd_ffi::copy(self.raw_uffd(), zeros.as_ptr(), dst, len, 0) }
            }
        } else {
            let Some(src) = self.map.at(lo * PAGE_SIZE, len) else {
                return Err(Resolved::Ok);
            };
            // SAFETY: `src..src+len` lies in our live read-only mapping.
            unsafe { uffd_ffi::copy(self.raw_uffd(), src, dst, len, 0) }
        };
        let done = |copied: u64| copied / PAGE_SIZE;
        let n = match res {
            Install::Done => hi - lo,
            Install::Exists { copied } => done(copied),
            Install::Again { copied } => {
                self.mark(lo, done(copied));
                return Err(Resolved::Again);
            }
            Install::Gone => return Err(Resolved::Gone),
            Install::Failed(errno) => {
                warn!(
                    "{}: install of pages {lo}..{hi} failed: errno {errno}",
                    self.id
                );
                return Err(Resolved::Ok);
            }
        };
        self.mark(lo, n);
        Ok(n)
    }

    fn mark(&mut self, lo: u64, n: u64) {
        let me = self.self_src;
        self.table.set_range(lo, n, me);
        self.stats.pages_installed += n;
    }

    pub(super) fn wake(&self, addr: u64, len: u64) {
        let _ = self
            .uffd
            .get_ref()
            .wake(addr as *mut libc::c_void, shared::geometry::usize_of(len));
    }

    /// Resolve a MISSING fault at `addr`.
    pub(super) fn resolve(&mut self, addr: u64, record: bool) -> Resolved {
        let Some(r) = self.region_of(addr) else {
            warn!("{}: fault at {addr:#x} outside every region", self.id);
            return Resolved::Ok;
        };
        let unit = r.page_size / PAGE_SIZE;
        let page = (r.offset + (addr - r.base)) / PAGE_SIZE;
        let first = page - page % unit;
        if self.table.get(first) == self.self_src {
            self.wake(addr & !(r.page_size - 1), r.page_size);
            return Resolved::Ok;
        }
        let (lo, hi) = if unit > 1 || self.table.get(page) != self.file_src {
            (first, first + unit)
        } else {
            // Fault-around: the run of image pages around `page` in its
            // block; a fault where the last install ended (a sequential
            // reader) doubles the window up to the readahead limit.
            let block = self.fault_around_pages.max(1);
            let r_lo = r.offset / PAGE_SIZE;
            let r_hi = r_lo + r.size / PAGE_SIZE;
            let sequential = record && block > 1 && page == self.readahead.next;
            let window = if sequential {
                (self.readahead.window * 2).clamp(block, self.readahead.max_pages.max(block))
            } else {
                block
            };
            self.readahead.window = window;
            let b_lo = if sequential {
                page
            } else {
                (page - (page - r_lo) % block).max(r_lo)
            };
            let b_hi = (b_lo + window).min(r_hi);
            let mut lo = page;
            while lo > b_lo && self.table.get(lo - 1) == self.file_src {
                lo -= 1;
            }
            let mut hi = page + 1;
            while hi < b_hi && self.table.get(hi) == self.file_src {
                hi += 1;
            }
            (lo, hi)
        };
        match self.install_run(r, lo, hi) {
            Ok(n) if lo + n > page => {
                if record {
                    self.readahead.next = lo + n;
                    // The working set is every page this VM was given, in
                    // order, including those installed around the fault.
                    self.fault_order.extend(lo..lo + n);
                }
                Resolved::Ok
            }
            Ok(_) => {
                // Something below `page` already existed: install just it.
                match self.install_run(r, first, first + unit) {
                    Ok(n) => {
                        if record {
                            self.fault_order.extend(first..first + n);
                        }
                        self.wake(addr & !(r.page_size - 1), r.page_size);
                        Resolved::Ok
                    }
                    Err(e) => e,
                }
            }
            Err(e) => e,
        }
    }

    pub(super) fn remove(&mut self, start: u64, end: u64) {
        self.stats.removes += 1;
        for r in self.regions.clone() {
            let s = start.max(r.base);
            let e = end.min(r.base + r.size);
            if s >= e {
                continue;
            }
            let lo = (r.offset + (s - r.base)) / PAGE_SIZE;
            let hi = (r.offset + (e - r.base)).div_ceil(PAGE_SIZE);
            self.table.set_range(lo, hi - lo, UNINITIALIZED);
        }
    }
}

fn zero_buffer(len: u64) -> Rc<Vec<u8>> {
    thread_local! {
        static ZEROS: RefCell<Rc<Vec<u8>>> = RefCell::new(Rc::new(Vec::new()));
    }
    ZEROS.with(|z| {
        let mut z = z.borrow_mut();
        if (z.len() as u64) < len {
            *z = Rc::new(vec![0u8; shared::geometry::usize_of(len)]);
        }
        z.clone()
    })
}
