//! Write protection armed ahead of a pause, shared by fork and snapshot.
//!
//! Both need a set of the VM's pages write-protected at the instant it
//! pauses: a fork its materialized pages (a later write must hand the
//! pre-image to the children), a snapshot every page (a later write must
//! hand the pre-image to the writer, and mark the page dirty). On
//! KVM-mapped 4 KiB memory the ioctl costs ~0.1 µs a page, so done inside
//! the pause it made the pause grow with the VM: 16 ms for 1 GiB. It runs
//! before the pause instead, while the guest still runs, and the pause
//! re-protects only what the guest wrote in between:
//!
//! 1. `arm_ahead`: start the VM's arming set, then write-protect
//!    the runs. From here every page that loses its protection is in the
//!    set: a WP fault lifts it and a write's MISSING fault installs it, and
//!    both pass through `track::before_write`, which records
//!    the page. Pages installed meanwhile go in protected
//!    (`SnapshotState::tracks_writes`).
//! 2. In the pause, as soon as the vCPUs are stopped,
//!    `ArmedAhead::reprotect`: write-protect the set's pages and start
//!    the set again; at the fork's or snapshot's moment (no await after
//!    it), `ArmedAhead::finish`: write-protect what the set gathered
//!    meanwhile (a fault handled late) and drop the set. Now every page of
//!    the runs, and every page installed since step 1, is protected,
//!    exactly as if the runs had been protected in the pause; what the
//!    guest wrote before the pause is in memory, where the fork or
//!    snapshot reads it.
//! 3. On a failure before the end of step 2, dropping the `ArmedAhead`
//!    drops the set. The protection left behind is harmless: a write
//!    faults once and the fault lifts it.
//!
//! Faults are handled on the core thread, as are these steps, so no fault
//! is half handled when a step runs. A write racing the first ioctl to a
//! page the ioctl has not reached yet lands before the page is protected:
//! it is in memory at the pause like any write before it.

use std::time::Instant;

use shared::VmId;

use super::error::ArmError;
use crate::core::error::Result;
use crate::core::state::Core;
use crate::core::vm::Vm;
use crate::snapshot::pageset::PageSet;

fn us(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Write-protect `runs` (pages) of `v` through its uffd. Returns the
/// ioctls' time in µs.
pub(crate) fn protect(v: &Vm, runs: &[(u64, u64)]) -> Result<u64> {
    let vm = v.id;
    let uffd = v.faults.uffd.clone().ok_or(ArmError::NoUffd { vm })?;
    let t = Instant::now();
    v.write_protect_pages(uffd.get_ref(), runs, true)
        .map_err(|(i, source)| {
            let (start, n) = runs[i];
            ArmError::WriteProtect {
                vm,
                start,
                end: start + n,
                source,
            }
        })?;
    Ok(us(t))
}

/// Protection armed ahead of `vm`'s pause; dropping it before
/// `ArmedAhead::finish` stops the recording (step 3).
#[must_use = "the pause must re-protect what the guest wrote meanwhile"]
pub(crate) struct ArmedAhead<'a> {
    core: &'a Core,
    vm: VmId,
    /// Pages protected ahead.
    pub pages: u64,
    /// The ioctl's time, µs.
    pub us: u64,
}

impl ArmedAhead<'_> {
    /// Step 2, as soon as the VM's vCPUs are stopped: re-protect the
    /// pages it wrote since `arm_ahead`, and go on recording.
    /// Returns how many pages and the ioctl's time in µs.
    pub(crate) fn reprotect(&self) -> Result<(u64, u64)> {
        self.protect_written(true)
    }

    /// Step 2's end, at the fork's or snapshot's moment (no await between
    /// it and what depends on the protection): re-protect what lost its
    /// protection since [`Self::reprotect`] (usually nothing: only a fault
    /// handled late, such as one that waited for a dependent, can) and stop
    /// recording. Returns how many pages and the ioctl's time in µs.
    pub(crate) fn finish(&self) -> Result<(u64, u64)> {
        self.protect_written(false)
    }

    fn protect_written(&self, go_on: bool) -> Result<(u64, u64)> {
        let vm = self.vm;
        let mut reg = self.core.reg.borrow_mut();
        let v = reg.vm_mut(vm)?;
        let written = v.snapshot.arming.take().ok_or(ArmError::NotArmed { vm })?;
        if go_on {
            v.snapshot.arming = Some(PageSet::new(written.pages()));
        }
        if written.is_empty() {
            return Ok((0, 0));
        }
        Ok((written.len(), protect(v, &written.runs())?))
    }
}

impl Drop for ArmedAhead<'_> {
    fn drop(&mut self) {
        // After `finish` the set is gone already; before it, the fork or
        // snapshot failed and nothing needs the recording any more.
        if let Some(v) = self.core.reg.borrow_mut().vms.get_mut(&self.vm) {
            v.snapshot.arming = None;
        }
    }
}

/// Step 1: write-protect `runs` of `vm` (pages) while it runs, and record
/// from now on the pages that lose the protection.
pub(crate) fn arm_ahead<'a>(
    core: &'a Core,
    vm: VmId,
    runs: &[(u64, u64)],
) -> Result<ArmedAhead<'a>> {
    let mut reg = core.reg.borrow_mut();
    let v = reg.vm_mut(vm)?;
    v.snapshot.arming = Some(PageSet::new(v.memory.pages()));
    let took = protect(v, runs);
    if took.is_err() {
        v.snapshot.arming = None;
    }
    Ok(ArmedAhead {
        core,
        vm,
        pages: runs.iter().map(|&(_, n)| n).sum(),
        us: took?,
    })
}
