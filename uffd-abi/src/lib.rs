//! The raw userfaultfd ABI of pagefork, in one place.
//!
//! The `userfaultfd` crate (0.9) creates, registers and reads uffds for us,
//! but it cannot be used for everything:
//! - its `copy()` and `zeropage()` cast the kernel's *signed* result field
//!   to `usize` before looking at it, so a partial install that ends in
//!   EAGAIN or EEXIST loses its byte count (the field is then `-errno`);
//! - it lacks the feature bits `WP_UNPOPULATED` and `WP_HUGETLBFS_SHMEM`,
//!   the copy mode `COPY_MODE_WP`, and the `UFFDIO_POISON` ioctl.
//!
//! Every ioctl number and feature bit the workspace passes to the kernel
//! itself is defined here once ([`abi`]), with the kernel's struct layouts
//! checked at compile time; [`ops`] wraps the ioctls. The server, the VMM
//! and the benchmarks use this crate and nothing else for raw uffd calls.
//!
//! Values are from `include/uapi/linux/userfaultfd.h` of Linux 6.6 or later
//! (older installed headers lack `WP_UNPOPULATED` and `POISON`).

pub mod abi;
pub mod ops;
pub mod pagemap;

pub use abi::{
    CONTINUE_MODE_WP, COPY_MODE_WP, UFFD_FEATURE_EVENT_REMOVE, UFFD_FEATURE_MINOR_HUGETLBFS,
    UFFD_FEATURE_MINOR_SHMEM, UFFD_FEATURE_POISON, UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
    UFFD_FEATURE_WP_UNPOPULATED, WRITEPROTECT_MODE_WP, ZEROPAGE_MODE_DONTWAKE,
};
pub use nix::errno::Errno;
pub use ops::{
    continue_range, copy, poison, wake, write_protect, write_protect_runs, writeprotect, zeropage,
    zeropage_protected, Install,
};
