//! The few userfaultfd ABI bits the `userfaultfd` crate (0.9) lacks.
//!
//! The crate's `FeatureFlags` stops at Linux 5.x features; write-protect
//! support for shmem (`WP_HUGETLBFS_SHMEM`, 5.19) and for never-populated
//! pages (`WP_UNPOPULATED`, 6.4) are passed to it as raw bits, which its
//! builder forwards unchanged to `UFFDIO_API`. Values from
//! `include/uapi/linux/userfaultfd.h`.

use userfaultfd::FeatureFlags;

/// `UFFD_FEATURE_EVENT_REMOVE`.
pub const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
/// `UFFD_FEATURE_WP_HUGETLBFS_SHMEM`: write-protect shmem and hugetlbfs.
pub const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
/// `UFFD_FEATURE_WP_UNPOPULATED`: write-protect never-touched pages too.
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;

// ABI checks: the crate agrees with the kernel on the bits it knows, and the
// bits above are really missing from it (else use the crate's names).
const _: () = assert!(FeatureFlags::EVENT_REMOVE.bits() == UFFD_FEATURE_EVENT_REMOVE);
const _: () = assert!(FeatureFlags::PAGEFAULT_FLAG_WP.bits() == 1);
const _: () = assert!(
    FeatureFlags::all().bits() & (UFFD_FEATURE_WP_HUGETLBFS_SHMEM | UFFD_FEATURE_WP_UNPOPULATED)
        == 0
);
