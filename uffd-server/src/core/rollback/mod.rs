//! Rolling a VM back to a snapshot in place ([`reset`] runs the steps,
//! [`fit`] checks the snapshot fits the VM, [`discard`] drops the pages in
//! the pause and scrubs them after).
//!
//! Rollback of VM X to snapshot S (X keeps its id, memfd, VMM and
//! dependents):
//! 0. Check that S fits X (vCPUs, memory size, volume, origin) and open
//!    its image; a snapshot that does not fit is refused here, with X
//!    untouched.
//! 1. Pause X.
//! 2. Hand every page another VM still reads from X to that VM (the
//!    copy-on-write step of a WP fault, done for all of them at once).
//! 3. Drop every page of X's memfd (no stale page may survive) and point
//!    X's table at S's image (holes `Uninitialized`): the next accesses
//!    fault S's bytes in. When S is X's last snapshot and X's dirty log
//!    runs since S, only the pages written since S differ from it: only
//!    those are dropped and pointed at S (cost follows the dirty pages,
//!    not memory), and tracking goes on from S.
//!
//!    On 4 KiB memory the paused VMM discards them (`Request::Discard`):
//!    it registers guest RAM MINOR too and unmaps them from itself and
//!    from KVM, and their bytes stay in the memfd, stale
//!    (`RollbackState::stale`).
//!    A stale page cannot be read: unmapped, its next access is a MINOR
//!    fault, where the server punches it and installs S's bytes; every
//!    install punches the stale pages of its run first; and a scrub task
//!    punches the rest after the resume. The pause thus pays the unmap,
//!    not the freeing of the pages (two thirds of a punch). Where the VMM
//!    cannot (hugetlb memory, no MINOR on shmem), the pause punches.
//! 4. FICLONE S's volume snapshot into X's volume file (same inode: the
//!    VMM's open disk sees it).
//! 5. Load S's vCPU/device state into the paused VMM (`Request::Restore`)
//!    and resume. A failure after step 3 fails X visibly.

pub mod discard;
pub mod error;
pub mod fit;
pub mod reset;
pub mod state;
