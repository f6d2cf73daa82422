//! The fault installer: how a MISSING fault's pages go into a client's
//! memory, written once for both kinds of client (our VMs, whose guest RAM
//! is a memfd their VMM maps, and Firecracker's anonymous memory).
//!
//! ```text
//!   serve_missing ─┬─ 4 KiB: plan (pages::resolve) ─ before_install ─ copy_pages ─▶ stream_rest
//!                  │          the faulting page's piece first:         staging buffer,
//!                  │          its UFFDIO_COPY wakes the thread         UFFDIO_COPY
//!                  └─ hugetlb: copy_block (the file's page cache, or the staging buffer) ─▶ block_ahead
//!   an install that cannot be had ─▶ unservable: fail the VM, UFFDIO_POISON the page
//!   a page present already ─▶ UFFDIO_WAKE its unit
//! ```
//!
//! Every install is a `UFFDIO_COPY` (or `UFFDIO_ZEROPAGE` for a never
//! written page of anonymous memory) through the client's uffd: the kernel
//! makes the page visible whole and wakes every thread waiting in the
//! range copied. Writing the bytes through the server's mapping of a memfd
//! would make a page present at its first byte, and a vCPU that left its
//! fault wait (a signal, such as a fork's pause) could see it half
//! written, or have its write overwritten by the rest of the install.
//! Which pages to install and their bytes come from [`crate::pages`]; how
//! they are read into the one staging buffer and copied is here, so a new
//! way of installing (say, mapping pages of a shared base) is added in one
//! place and serves both.
//!
//! What differs between the clients is behind [`Books`] (the table, the
//! counters, what marking a page present records) and [`Request`] (bounds,
//! fault-around, pieces, zero pages). What a client does about the outcome
//! ([`Served`]) is its own: a pending event (EAGAIN) makes our VMs' loop
//! wake the thread so it faults again, Firecracker's defer the fault.
//!
//! The files: `target.rs` (the types above and the staging buffer),
//! `plan.rs` (which 4 KiB pages a fault installs), `run.rs` (4 KiB copies),
//! `base.rs` (mapping from a shared base), `block.rs` (hugetlb blocks);
//! here, the dispatch and the outcomes (a wake, an unservable page).
//!
//! Invariants: a page is marked present only once an ioctl put it (or
//! found it) in the client's memory; a client's thread is woken only for
//! a page present, poisoned, or about to be retried.

mod base;
mod block;
mod plan;
mod run;
mod target;

use shared::VmId;
use tracing::{error, warn};
use uffd_abi::{Errno, Install};

use crate::core::ratelimit::suppressed_note;
use crate::pages::{ResolveError, SourceArena};

pub use block::read_block;
pub use plan::{plan, Plan};
pub use run::copy_pages;
pub use target::{Books, How, OnBase, Request, Served, Target};

use block::install_block;
use run::install_run;
use target::Page;

/// Serve a MISSING fault on `req.page`: install it (and the run planned
/// around it) from the client's table, or wake it if it is there already;
/// a page that cannot be served fails the VM and is poisoned.
pub fn serve_missing(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    req: &Request,
) -> Served {
    let installed = if t.unit > 1 {
        install_block(b, arena, t, req)
    } else {
        install_run(b, arena, t, req)
    };
    match installed {
        Ok(Page::Woken) => Served::Done,
        Ok(Page::Present) => wake(b, t, req.page),
        Ok(Page::Again) => Served::Again,
        Ok(Page::Gone) => Served::Gone,
        Err(ResolveError::NotDecoded { image, frames }) => {
            b.stats().frame_waits += 1;
            Served::Wait(crate::images::zst::FramePool::wait(&image, frames))
        }
        Err(ResolveError::NotFetched { image, chunks }) => {
            b.stats().chunk_waits += 1;
            Served::Wait(image.wait(chunks))
        }
        Err(e) => unservable(b, Some(t), req.page, &e),
    }
}

/// Wake the thread faulting on `page` (a page present already, or one to
/// retry).
pub fn wake(b: &mut impl Books, t: &Target<'_>, page: u64) -> Served {
    match t.wake(page, 1) {
        Ok(()) => Served::Done,
        Err(e) => errno_outcome(b.id(), "wake", e),
    }
}

/// ESRCH means the client's process is gone; any other failure of an
/// ioctl that only wakes or lifts protection is logged, and the thread
/// will fault again if it must.
pub fn errno_outcome(vm: VmId, what: &str, e: Errno) -> Served {
    if e == Errno::ESRCH {
        return Served::Gone;
    }
    warn!("{vm}: uffd {what} failed: {e}");
    Served::Done
}

/// A fault on `page` cannot be served (its image is unreadable or
/// changed, its source is gone): waking the thread would only make it
/// fault again, for ever. The VM fails instead, with the reason in the
/// API, and the page is poisoned (UFFDIO_POISON), so the access cannot be
/// retried into: KVM turns it into SIGBUS for the vCPU thread, a direct
/// access by the VMM (or Firecracker) gets SIGBUS too, and the process
/// ends. Every fault after the first is only counted, with a rate-limited
/// warning. Without a target (a VM whose VMM is gone) there is nothing to
/// poison.
pub fn unservable(
    b: &mut impl Books,
    t: Option<&Target<'_>>,
    page: u64,
    e: &ResolveError,
) -> Served {
    let vm = b.id();
    let reason = format!("page {page} cannot be served: {}", shared::error_chain(e));
    let first = b.fail(&reason);
    if first {
        error!("{vm}: failed: {reason}; the page is poisoned");
    } else if let Some(n) = b.warnings().allow() {
        warn!("{vm}: {reason}{}", suppressed_note(n));
    }
    let Some(t) = t else {
        return if first {
            Served::Failed(reason)
        } else {
            Served::Done
        };
    };
    match t.poison(page, 1) {
        Install::Done if first => Served::Failed(reason),
        Install::Done => Served::Done,
        Install::Gone => Served::Gone,
        // An event is pending: the client retries as for any install.
        Install::Again { .. } => Served::Again,
        // Installed meanwhile: let the access retry.
        Install::Exists { .. } => wake(b, t, page),
        Install::Failed(errno) => {
            if let Some(n) = b.warnings().allow() {
                warn!(
                    "{vm}: cannot poison page {page}: {errno}{}",
                    suppressed_note(n)
                );
            }
            wake(b, t, page)
        }
    }
}
