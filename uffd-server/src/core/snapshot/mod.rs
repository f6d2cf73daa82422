//! VM snapshots, the core's side: take one (`full`, `incremental`,
//! `dirty`) with a short pause and a copy-on-write window ([`save`]: the
//! steps, [`plan`], [`arm`], [`pause`], [`window`], [`commit`]); track
//! writes between snapshots ([`track`], [`state`]); list, show and delete
//! them ([`catalog`]); start a VM from one ([`restore`]). The files
//! themselves are the [`crate::snapshot`] module's; this module decides
//! what to write and when. A clone (`core/clone.rs`) is a snapshot and
//! VMs restored from it.
//!
//! Taking a snapshot of VM X:
//! 1. Before the pause: reserve the name, create `memory.img` (a FICLONE of
//!    the parent's image for `incremental` / `dirty`).
//!    Write-protect the pages X wrote since its last snapshot (all of its
//!    RAM for a first one) while X still runs (`snapshot/arm.rs`). A paused X
//!    stays paused throughout: steps 2 and 4 skip the pause and the
//!    resume.
//! 2. Pause X, with the capture of its vCPU/device state queued behind
//!    the pause.
//! 3. Once the vCPUs are stopped: re-protect the pages X wrote since step
//!    1 (now all of X's RAM is protected: dirty tracking is re-armed and
//!    the copy-on-write window open), the pages to save (all data pages,
//!    the pages not read from the base image, or the dirty log), start a
//!    new dirty log, snapshot the volume.
//! 4. Resume X: the resume goes out behind the capture (the VMM answers
//!    in order), so the capture's answer and the resume's share one wait.
//!    Save the pages in order, a run at a time, yielding between
//!    runs. A write by X to a page not yet saved raises a WP fault (or a
//!    MISSING one) first, and the fault handler saves that page's pre-write
//!    bytes before lifting the protection (`track::before_write`).
//!    Both run on the core thread, so a page leaves the pending set
//!    exactly once, with the bytes it had at the pause.
//!    In a save of `pause::COPY_MIN_PAGES` or more, runs of X's own pages
//!    (4 KiB memory) are not read here: the writer thread copies them out
//!    of X's memfd itself, later. Until it reports
//!    a run copied, its pages are in flight: a write to one first saves
//!    the page's bytes again (still those of the pause, as the page is
//!    still protected), queued behind the run, so the image ends with
//!    them whatever the copy took. The saving window closes only once
//!    every copy is done.
//! 5. fsync the image, checksum it (chunks written whole were digested as
//!    they were written; only the others are read back), write
//!    `state.json`, rename: committed.
//!
//! Dirty tracking is the same write protection the fork machinery uses:
//! every WP fault (and every MISSING fault on a write) marks its page in
//! the VM's [`state::DirtyLog`], whoever armed the protection.

pub mod arm;
pub mod catalog;
pub mod commit;
pub mod error;
pub mod pause;
pub mod plan;
pub mod restore;
pub mod save;
pub mod state;
pub mod track;
pub mod window;
