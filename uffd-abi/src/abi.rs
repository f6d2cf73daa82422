//! Kernel constants and `repr(C)` structs of the userfaultfd ioctls.
//!
//! Only what pagefork issues itself or passes to the `userfaultfd` crate as
//! raw bits. Sizes are checked against the kernel's at compile time; the
//! request numbers are checked against the kernel's values in the tests.

use std::mem::size_of;

use nix::sys::ioctl::ioctl_num_type;
use userfaultfd::FeatureFlags;

/// The ioctl type ("magic") of every uffd ioctl.
const UFFDIO: u8 = 0xAA;

const NR_WAKE: u8 = 0x02;
const NR_COPY: u8 = 0x03;
const NR_ZEROPAGE: u8 = 0x04;
const NR_WRITEPROTECT: u8 = 0x06;
const NR_CONTINUE: u8 = 0x07;
const NR_POISON: u8 = 0x08;

/// `UFFD_FEATURE_EVENT_REMOVE`: report `madvise(MADV_DONTNEED)` and friends.
pub const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
/// `UFFD_FEATURE_MINOR_HUGETLBFS` (5.13): register hugetlbfs MINOR.
pub const UFFD_FEATURE_MINOR_HUGETLBFS: u64 = 1 << 9;
/// `UFFD_FEATURE_MINOR_SHMEM` (5.14): register shmem MINOR, so a page
/// present in the memfd but not mapped faults (`UFFDIO_CONTINUE` maps it).
pub const UFFD_FEATURE_MINOR_SHMEM: u64 = 1 << 10;
/// `UFFD_FEATURE_WP_HUGETLBFS_SHMEM` (5.19): write-protect shmem and
/// hugetlbfs.
pub const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
/// `UFFD_FEATURE_WP_UNPOPULATED` (6.4): write-protect never-touched pages
/// too.
pub const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
/// `UFFD_FEATURE_POISON` (6.6): `UFFDIO_POISON` is available.
pub const UFFD_FEATURE_POISON: u64 = 1 << 14;

/// `UFFDIO_COPY_MODE_WP`: install the page write-protected.
pub const COPY_MODE_WP: u64 = 1 << 1;
/// `UFFDIO_CONTINUE_MODE_WP` (6.5): map the page write-protected. A page
/// protected before it was ever mapped loses its protection to a plain
/// CONTINUE, so every CONTINUE into tracked memory uses it.
pub const CONTINUE_MODE_WP: u64 = 1 << 1;
/// `UFFDIO_WRITEPROTECT_MODE_WP`: protect (without it: unprotect and wake).
pub const WRITEPROTECT_MODE_WP: u64 = 1 << 0;
/// `UFFDIO_ZEROPAGE_MODE_DONTWAKE`: map the zero page without waking the
/// faulting threads (UFFDIO_ZEROPAGE has no write-protect mode: a caller
/// that must protect the page protects it first, then wakes).
pub const ZEROPAGE_MODE_DONTWAKE: u64 = 1 << 0;

// The crate agrees with the kernel on the bits it knows, and the bits above
// that it lacks are really missing from it (else use the crate's names).
const _: () = assert!(FeatureFlags::EVENT_REMOVE.bits() == UFFD_FEATURE_EVENT_REMOVE);
const _: () = assert!(FeatureFlags::PAGEFAULT_FLAG_WP.bits() == 1);
const _: () = assert!(
    FeatureFlags::all().bits()
        & (UFFD_FEATURE_MINOR_SHMEM
            | UFFD_FEATURE_MINOR_HUGETLBFS
            | UFFD_FEATURE_WP_HUGETLBFS_SHMEM
            | UFFD_FEATURE_WP_UNPOPULATED
            | UFFD_FEATURE_POISON)
        == 0
);

/// `struct uffdio_range`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioRange {
    pub start: u64,
    pub len: u64,
}

/// `struct uffdio_copy`; `copy` is the kernel's signed result.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioCopy {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
    pub mode: u64,
    pub copy: i64,
}

/// `struct uffdio_zeropage`; `zeropage` is the kernel's signed result.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioZeropage {
    pub range: UffdioRange,
    pub mode: u64,
    pub zeropage: i64,
}

/// `struct uffdio_writeprotect`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioWriteprotect {
    pub range: UffdioRange,
    pub mode: u64,
}

/// `struct uffdio_continue`; `mapped` is the kernel's signed result.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioContinue {
    pub range: UffdioRange,
    pub mode: u64,
    pub mapped: i64,
}

/// `struct uffdio_poison`; `updated` is the kernel's signed result.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct UffdioPoison {
    pub range: UffdioRange,
    pub mode: u64,
    pub updated: i64,
}

const _: () = assert!(size_of::<UffdioRange>() == 16);
const _: () = assert!(size_of::<UffdioCopy>() == 40);
const _: () = assert!(size_of::<UffdioZeropage>() == 32);
const _: () = assert!(size_of::<UffdioWriteprotect>() == 24);
const _: () = assert!(size_of::<UffdioContinue>() == 32);
const _: () = assert!(size_of::<UffdioPoison>() == 32);

/// `UFFDIO_WAKE`: `_IOR` although the kernel reads the range (a historic
/// quirk the kernel header keeps).
pub const UFFDIO_WAKE: ioctl_num_type =
    nix::request_code_read!(UFFDIO, NR_WAKE, size_of::<UffdioRange>());
/// `UFFDIO_COPY`.
pub const UFFDIO_COPY: ioctl_num_type =
    nix::request_code_readwrite!(UFFDIO, NR_COPY, size_of::<UffdioCopy>());
/// `UFFDIO_ZEROPAGE`.
pub const UFFDIO_ZEROPAGE: ioctl_num_type =
    nix::request_code_readwrite!(UFFDIO, NR_ZEROPAGE, size_of::<UffdioZeropage>());
/// `UFFDIO_WRITEPROTECT`.
pub const UFFDIO_WRITEPROTECT: ioctl_num_type =
    nix::request_code_readwrite!(UFFDIO, NR_WRITEPROTECT, size_of::<UffdioWriteprotect>());
/// `UFFDIO_CONTINUE` (Linux 5.13).
pub const UFFDIO_CONTINUE: ioctl_num_type =
    nix::request_code_readwrite!(UFFDIO, NR_CONTINUE, size_of::<UffdioContinue>());
/// `UFFDIO_POISON` (Linux 6.6).
pub const UFFDIO_POISON: ioctl_num_type =
    nix::request_code_readwrite!(UFFDIO, NR_POISON, size_of::<UffdioPoison>());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_numbers_match_the_kernel_header() {
        // The values `_IOR`/`_IOWR` produce on x86-64 and arm64.
        assert_eq!(UFFDIO_WAKE, 0x8010_aa02);
        assert_eq!(UFFDIO_COPY, 0xc028_aa03);
        assert_eq!(UFFDIO_ZEROPAGE, 0xc020_aa04);
        assert_eq!(UFFDIO_WRITEPROTECT, 0xc018_aa06);
        assert_eq!(UFFDIO_CONTINUE, 0xc020_aa07);
        assert_eq!(UFFDIO_POISON, 0xc020_aa08);
    }
}
