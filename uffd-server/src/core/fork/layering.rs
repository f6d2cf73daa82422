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
use crate::pages::process::ProcessPages;
use crate::pages::SourceId;
use crate::snapshot::PageSet;

thread_local! {
    /// Where a layer's pages are read before they are written into it;
    /// grows to the largest step ([`Layering::step`]'s `max`).
    static STAGING: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// A layer being filled from a VM's VMM, kept in the VM (`ForkState`) so
/// that its writes and discards can save a page before it changes.
#[derive(Debug)]
pub struct Layering {
    vm: VmId,
    /// The id the children's tables read the layer by.
    frozen: SourceId,
    layer: Rc<GuestMemory>,
    process: Rc<ProcessPages>,
    /// Pages still to copy (whole kernel pages).
    pending: PageSet,
    unit: u64,
    /// The first failure; the fork fails with it.
    failed: Option<String>,
    /// Pages copied so far.
    copied: u64,
}

impl Layering {
    /// A layer `layer` to fill with `pending` (whole kernel pages of
    /// `unit` 4 KiB pages) out of `vm`'s VMM (`process`); the children's
    /// tables read it by `frozen`.
    pub fn new(
        vm: VmId,
        frozen: SourceId,
        layer: Rc<GuestMemory>,
        process: Rc<ProcessPages>,
        pending: PageSet,
        unit: u64,
    ) -> Self {
        Layering {
            vm,
            frozen,
            layer,
            process,
            pending,
            unit,
            failed: None,
            copied: 0,
        }
    }

    /// The id the children's tables read the layer by.
    pub fn frozen(&self) -> SourceId {
        self.frozen
    }

    /// Pages copied so far.
    pub fn copied(&self) -> u64 {
        self.copied
    }

    /// The first failure of a save, if any (the fork fails with it).
    pub fn take_failure(&mut self) -> Option<String> {
        self.failed.take()
    }

    /// Before `page` of the VM is written or discarded: copy its unit
    /// into the layer if it is still to be copied.
    pub fn save(&mut self, page: u64) {
        if !self.pending.contains(page) {
            return;
        }
        let lo = page / self.unit * self.unit;
        if let Err(e) = self.copy(lo, self.unit) {
            self.failed.get_or_insert_with(|| shared::error_chain(&e));
        }
    }

    /// Copy the next run of pending pages (at most `max`). `Ok(false)`
    /// when nothing is left.
    pub fn step(&mut self, max: u64) -> std::result::Result<bool, LayerError> {
        let Some(first) = self.pending.next_from(0) else {
            return Ok(false);
        };
        let mut n = self.unit;
        while n < max && self.pending.contains(first + n) {
            n += self.unit;
        }
        self.copy(first, n)?;
        Ok(true)
    }

    fn copy(&mut self, first: u64, n: u64) -> std::result::Result<(), LayerError> {
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
        for p in first..end {
            self.pending.remove(p);
        }
        self.copied += n;
        Ok(())
    }
}
