//! Serving Firecracker processes: listeners bound to a memory source
//! ([`listener`]), and the VMs that connect to them ([`client`], [`vm`],
//! [`serve`]).
//!
//! Firecracker's guest memory is anonymous and lives in its own process, so
//! pages are installed with UFFDIO_COPY from the installer's staging buffer
//! (`core/fault/install/`, which our own VMs use too) and
//! UFFDIO_ZEROPAGE. The table indexes pages by their
//! offset in the source file; `Vm(self)` means "installed in Firecracker".
//!
//! - Fault-around: a fault on an image page installs the run of
//!   not-yet-installed image pages around it within its aligned block;
//!   readahead doubles that window for sequential faults, up to a limit.
//! - Working set: with `working_set` on, the pages the first VM of a listener
//!   was given are recorded in order; later VMs get them installed in bulk
//!   right after the handshake, while faults keep being served.
//! - REMOVE (balloon, `MADV_DONTNEED`): the range becomes `Uninitialized`, so
//!   the next fault installs zeroes. EAGAIN from an install means such an
//!   event is pending: the fault is deferred and retried after the events.

pub mod client;
pub mod listener;
pub mod serve;
pub mod state;
pub mod vm;
