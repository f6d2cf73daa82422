//! A layer being filled (see `layer.rs`): what a fork copies out of its
//! parent's VMM, kept in the parent's fork state so that the parent's
//! writes and discards save a page before it changes.

use std::cell::RefCell;
use std::os::unix::fs::FileExt;
use std::rc::Rc;

use shared::VmId;

use vm_memory::VolatileSlice;

use super::error::LayerError;
use crate::memory::GuestMemory;
use crate::pages::anchor::Anchor;
use crate::pages::process::ProcessPages;
use crate::pages::source::{FillOrigin, LayerFill, LayerLost};
use crate::pages::SourceId;
use crate::snapshot::PageSet;

thread_local! {
    /// Where a layer's pages are read before they are written into it;
    /// grows to the largest step ([`Layering::step`]'s `max`).
    static STAGING: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// A layer being filled from a VM's VMM. Held by the fill's task, by the
/// parent's fork state (so that its writes and discards save a page before
/// it changes) and by the layer's frozen source (so that every read of a
/// page not copied yet copies it first: the children run while it fills).
#[derive(Debug)]
pub struct Layering {
    vm: VmId,
    /// The id the children's tables read the layer by.
    frozen: SourceId,
    layer: Rc<GuestMemory>,
    process: Rc<ProcessPages>,
    /// Keeps the VMM's pages readable until the layer is whole, whatever
    /// becomes of the VMM (see `pages::anchor`).
    anchor: Option<Rc<Anchor>>,
    unit: u64,
    state: RefCell<Fill>,
    /// VMMs of the children, whose OOM score is raised while it fills.
    dependents: RefCell<Vec<u32>>,
}

/// What changes as a layer fills.
#[derive(Debug)]
struct Fill {
    /// Pages still to copy (whole kernel pages); `None` until it is made
    /// after the resume ([`Layering::plan`]): until then a page is to
    /// copy if the layer's memfd lacks it (its readers' tables name the
    /// layer for it, the parent's for the pages it saves), so the pause
    /// makes no set of all of guest RAM.
    pending: Option<PageSet>,
    /// The first failure: every page still pending is lost with it.
    failed: Option<String>,
    /// Pages copied so far.
    copied: u64,
    /// Where the next step looks from: every page before it is copied
    /// (steps go up; reads and saves only take pages away).
    cursor: u64,
}

impl Layering {
    /// A layer `layer` to fill with `pending` (whole kernel pages of
    /// `unit` 4 KiB pages; `None`: what its memfd lacks, see the field)
    /// out of `vm`'s VMM (`process`); the children's tables read it by
    /// `frozen`.
    pub fn new(
        vm: VmId,
        frozen: SourceId,
        layer: Rc<GuestMemory>,
        process: Rc<ProcessPages>,
        pending: Option<PageSet>,
        unit: u64,
    ) -> Self {
        Layering {
            vm,
            frozen,
            layer,
            anchor: process.anchor(),
            process,
            unit,
            state: RefCell::new(Fill {
                pending,
                failed: None,
                copied: 0,
                cursor: 0,
            }),
            dependents: RefCell::new(Vec::new()),
        }
    }

    /// VMM `pid` reads this layer (its OOM score is raised meanwhile).
    pub fn add_dependent(&self, pid: u32) {
        self.dependents.borrow_mut().push(pid);
    }

    /// The VMMs that read this layer while it filled.
    pub fn dependents(&self) -> Vec<u32> {
        self.dependents.borrow().clone()
    }

    /// The VM whose pages these are.
    pub fn vm(&self) -> VmId {
        self.vm
    }

    /// The id the children's tables read the layer by.
    pub fn frozen(&self) -> SourceId {
        self.frozen
    }

    /// The layer's memfd.
    pub fn layer(&self) -> &Rc<GuestMemory> {
        &self.layer
    }

    /// The anchor the pages are read through, if the VMM has one.
    pub fn anchor(&self) -> Option<&Rc<Anchor>> {
        self.anchor.as_ref()
    }

    /// Pages copied so far.
    pub fn copied(&self) -> u64 {
        self.state.borrow().copied
    }

    /// Pages still to copy (0 before [`Self::plan`]).
    pub fn pending(&self) -> u64 {
        self.state.borrow().pending.as_ref().map_or(0, PageSet::len)
    }

    /// Whether the set of pages to copy is made.
    pub fn planned(&self) -> bool {
        self.state.borrow().pending.is_some()
    }

    /// The set of pages to copy, after the resume: `named` (the pages the
    /// tables name the layer for) less those copied meanwhile.
    pub fn plan(&self, mut named: PageSet) {
        let mut st = self.state.borrow_mut();
        if st.pending.is_some() {
            return;
        }
        for (first, n) in self.layer.present_ranges().unwrap_or_default() {
            for p in first..first + n {
                named.remove(p);
            }
        }
        st.pending = Some(named);
    }

    /// The failure that lost the pages still pending, if any.
    pub fn failure(&self) -> Option<String> {
        self.state.borrow().failed.clone()
    }

    /// Before `page` of the VM is written or discarded: copy its unit
    /// into the layer if it is still to be copied.
    pub fn save(&self, page: u64) {
        let _ = self.ensure_range(page, 1);
    }

    /// Copy whichever units of pages `first..first + n` are still to copy.
    fn ensure_range(&self, first: u64, n: u64) -> Result<(), LayerLost> {
        let end = first + n;
        let mut st = self.state.borrow_mut();
        let runs = match &st.pending {
            Some(pending) => {
                let mut runs = Vec::new();
                let mut p = first;
                while let Some(at) = pending.next_from(p).filter(|&at| at < end) {
                    let lo = at / self.unit * self.unit;
                    // The run of pending units from `lo`, up to the range's end.
                    let mut len = self.unit;
                    while lo + len < end && pending.contains(lo + len) {
                        len += self.unit;
                    }
                    runs.push((lo, len));
                    p = lo + len;
                }
                runs
            }
            None => self.holes(first, end),
        };
        for (lo, len) in runs {
            if let Some(why) = &st.failed {
                return Err(LayerLost(why.clone()));
            }
            if let Err(e) = self.copy(&mut st, lo, len) {
                let why = shared::error_chain(&e);
                st.failed.get_or_insert(why.clone());
                return Err(LayerLost(why));
            }
        }
        Ok(())
    }

    /// The runs of pages `first..end` the layer's memfd lacks
    /// (`SEEK_DATA` / `SEEK_HOLE`: a copied page is written whole).
    fn holes(&self, first: u64, end: u64) -> Vec<(u64, u64)> {
        use std::os::fd::AsRawFd;
        let fd = self.layer.memfd().as_raw_fd();
        let page = shared::PAGE_SIZE;
        let mut runs = Vec::new();
        let mut p = first;
        while p < end {
            let at = libc::off_t::try_from(p * page).unwrap_or(libc::off_t::MAX);
            // SAFETY: lseek on the layer's own fd has no memory effects.
            let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
            let data = if data < 0 {
                end
            } else {
                (data.unsigned_abs() / page).min(end)
            };
            if data > p {
                runs.push((p, data - p));
            }
            if data >= end {
                break;
            }
            let from = libc::off_t::try_from(data * page).unwrap_or(libc::off_t::MAX);
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, from, libc::SEEK_HOLE) };
            p = if hole < 0 {
                end
            } else {
                hole.unsigned_abs().div_ceil(page)
            };
        }
        runs
    }

    /// Copy the next run of pending pages (at most `max`). `Ok(false)`
    /// when nothing is left.
    pub fn step(&self, max: u64) -> std::result::Result<bool, LayerError> {
        let mut st = self.state.borrow_mut();
        if let Some(why) = &st.failed {
            return Err(LayerError::Lost {
                vm: self.vm,
                why: why.clone(),
            });
        }
        let Some(pending) = &st.pending else {
            return Err(LayerError::Lost {
                vm: self.vm,
                why: "its pages to copy were never planned".into(),
            });
        };
        let Some(first) = pending.next_from(st.cursor) else {
            return Ok(false);
        };
        let mut n = self.unit;
        while n < max && pending.contains(first + n) {
            n += self.unit;
        }
        st.cursor = first;
        if let Err(e) = self.copy(&mut st, first, n) {
            st.failed.get_or_insert_with(|| shared::error_chain(&e));
            return Err(e);
        }
        Ok(true)
    }

    fn copy(&self, st: &mut Fill, first: u64, n: u64) -> std::result::Result<(), LayerError> {
        let vm = self.vm;
        let end = first + n;
        let write_err = |source| LayerError::Write {
            vm,
            first,
            end,
            source,
        };
        if self.unit == 1 {
            // Through a buffer this thread keeps mapped, then `pwrite`: read
            // straight into the server's mapping of the layer, every page
            // would first fault in there, which costs more than the copy on
            // this kind of host (64 MiB: ~1.4x the time, measured).
            STAGING.with(|buf| {
                let mut buf = buf.borrow_mut();
                let bytes = shared::geometry::usize_of(n * shared::PAGE_SIZE);
                if buf.len() < bytes {
                    buf.resize(bytes, 0);
                }
                let dst = VolatileSlice::from(&mut buf[..bytes]);
                self.process
                    .read(first, &dst)
                    .map_err(|source| LayerError::Read { vm, source })?;
                self.layer
                    .memfd()
                    .write_all_at(&buf[..bytes], first * shared::PAGE_SIZE)
                    .map_err(|e| write_err(crate::memory::MemoryError::Write(e)))
            })?;
        } else {
            // hugetlbfs takes no `write`: into the mapping, blocks
            // allocated first.
            let dst = self.layer.allocated_slice(first, n).map_err(write_err)?;
            self.process
                .read(first, &dst)
                .map_err(|source| LayerError::Read { vm, source })?;
        }
        if let Some(pending) = &mut st.pending {
            for p in first..end {
                pending.remove(p);
            }
        }
        st.copied += n;
        Ok(())
    }
}

impl LayerFill for Layering {
    fn ensure(&self, first: u64, n: u64) -> Result<(), LayerLost> {
        self.ensure_range(first, n)
    }

    fn pending_pages(&self) -> u64 {
        self.pending()
    }

    fn origin(&self) -> FillOrigin {
        let (pid, started) = match &self.anchor {
            Some(a) => (a.pid(), a.started()),
            None => {
                let pid = self.process.pid();
                (pid, crate::pages::anchor::start_time(pid).unwrap_or(0))
            }
        };
        FillOrigin {
            pid,
            started,
            vmm_base: self.process.base(),
        }
    }
}
