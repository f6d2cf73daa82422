//! The userfaultfd feature bits the `userfaultfd` crate (0.9) lacks.
//!
//! Same idea as the vmm's `uffd_ffi` module (not a dependency on it): the
//! crate's builder forwards raw feature bits unchanged to `UFFDIO_API`.
//! Values from `include/uapi/linux/userfaultfd.h`.

use userfaultfd::FeatureFlags;

/// `UFFD_FEATURE_WP_HUGETLBFS_SHMEM`: write-protect shmem and hugetlbfs.
pub const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;

// The bit is really missing from the crate (else use the crate's name).
const _: () = assert!(FeatureFlags::all().bits() & UFFD_FEATURE_WP_HUGETLBFS_SHMEM == 0);
