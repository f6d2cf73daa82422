//! Serving our VMs' page faults.
//!
//! A VM's VMM registers guest RAM (the memfd the server made) with a
//! userfaultfd and sends it to the server (`VmmMsg::UffdReady`); from then
//! on every first touch of a page the server has not installed, every
//! write to a write-protected page, and every page the guest gives back
//! reaches the core thread as an event on that uffd:
//!
//! ```text
//!   serve::serve_faults ── read_pending (read(2)) ─▶ serve_batch
//!     └─ resolve::handle_event ─┬─ MISSING ─▶ resolve_missing ─▶ install::serve_missing
//!                               │     plan (pages::resolve) ─▶ copy_pages ─▶ uffd_abi::copy
//!                               ├─ WP ─▶ dependents::preserve_for_dependents ─▶ lift WP
//!                               ├─ MINOR ─▶ UFFDIO_CONTINUE, or punch a stale page
//!                               └─ REMOVE ─▶ table back to zero pages
//! ```
//!
//! - [`ahead`]: pages installed before the guest faults on them (a
//!   working set prefetched while it runs);
//! - [`install`]: the installer both kinds of client share (ours and
//!   Firecracker's): plan, staging buffer, UFFDIO_COPY in pieces, poison,
//!   wake;
//! - [`books`]: what an install records in one of our VMs, and what the
//!   loop makes of an outcome;
//! - [`resolve`]: one event of one of our VMs, the table's side of it;
//! - [`dependents`]: the copy-on-write step before a page a fork child
//!   still reads is overwritten;
//! - [`materialize`]: pages put in through the server's mapping while no
//!   VMM runs (prefetch);
//! - [`serve`]: the loop that reads a VM's uffd (and the poll window both
//!   kinds of VM use);
//! - [`trace`]: one event as a line of the live fault trace;
//! - [`state`]: what a VM keeps for all this (`Vm::faults`).

pub mod ahead;
pub mod books;
pub mod dependents;
pub mod install;
pub mod materialize;
pub mod resolve;
pub mod serve;
pub mod state;
pub mod trace;
