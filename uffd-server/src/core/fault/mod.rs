//! Serving our VMs' page faults.
//!
//! A VM's VMM registers guest RAM (the memfd the server made) with a
//! userfaultfd and sends it to the server; from then on every first touch
//! of a page the server has not installed, every write to a
//! write-protected page, and every page the guest gives back reaches the
//! core thread as an event on that uffd:
//!
//! - [`install`]: the installer both kinds of client share (ours and
//!   Firecracker's): plan, staging buffer, UFFDIO_COPY in pieces, poison,
//!   wake;
//! - [`resolve`]: one event of one of our VMs, the table's side of it;
//! - [`dependents`]: the copy-on-write step before a page a fork child
//!   still reads is overwritten;
//! - [`materialize`]: pages put in through the server's mapping while no
//!   VMM runs (prefetch).
//!
//! The loop that reads the events is `core/serve.rs`.

pub mod books;
pub mod dependents;
pub mod install;
pub mod materialize;
pub mod resolve;
pub mod serve;
pub mod state;
pub mod trace;
