//! The floor of a fork's pause: one bare UFFDIO_WRITEPROTECT of the same
//! amount of populated shmem, measured in-process.
//!
//! A memfd of the VM's size is mapped MAP_SHARED, the materialized part is
//! written (so its pages are allocated and mapped writable, as a guest's are
//! after it filled them), the mapping is registered MISSING | WP with a
//! userfaultfd that has `WP_HUGETLBFS_SHMEM`, and each measurement times
//! `write_protect` of that part, then (untimed) removes the protection so
//! the next measurement starts from writable pages again. Nothing touches
//! the mapping while it is registered, so no fault is ever raised.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use uffd_abi::UFFD_FEATURE_WP_HUGETLBFS_SHMEM;
use userfaultfd::{FeatureFlags, RegisterMode, Uffd, UffdBuilder};

use crate::mapping::{Mapping, MappingError};

/// Errors of the write-protect floor.
#[derive(Debug, thiserror::Error)]
pub enum WpError {
    #[error("cannot map the shmem region")]
    Map(#[from] MappingError),
    #[error("cannot create a userfaultfd with WP_HUGETLBFS_SHMEM (kernel 5.19+ and /dev/userfaultfd or vm.unprivileged_userfaultfd needed)")]
    CreateUffd(#[source] userfaultfd::Error),
    #[error("cannot register the region MISSING | WP")]
    Register(#[source] userfaultfd::Error),
    #[error("UFFDIO_WRITEPROTECT failed")]
    WriteProtect(#[source] userfaultfd::Error),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, WpError>;

/// A registered shmem region with a populated prefix to protect.
#[derive(Debug)]
pub struct WpFloor {
    // Field order: the uffd closes (unregistering) before the unmap.
    uffd: Uffd,
    map: Mapping,
    protect_len: usize,
}

impl WpFloor {
    /// A region of `len` bytes whose first `protect_len` bytes are populated.
    pub fn new(len: usize, protect_len: usize) -> Result<WpFloor> {
        Self::over(Mapping::shared_memfd(len)?, protect_len)
    }

    /// The same over 2 MiB hugetlb pages (`len` and `protect_len` are
    /// multiples of 2 MiB; the host's hugepage pool must hold the
    /// populated part, see [`reserve_hugepages`]).
    pub fn new_hugetlb(len: usize, protect_len: usize) -> Result<WpFloor> {
        Self::over(Mapping::shared_hugetlb_memfd(len)?, protect_len)
    }

    fn over(map: Mapping, protect_len: usize) -> Result<WpFloor> {
        let len = map.len();
        map.populate(protect_len);
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(true)
            .require_features(FeatureFlags::from_bits_retain(
                UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
            ))
            .create()
            .map_err(WpError::CreateUffd)?;
        uffd.register_with_mode(
            map.ptr().cast::<c_void>(),
            len,
            RegisterMode::MISSING | RegisterMode::WRITE_PROTECT,
        )
        .map_err(WpError::Register)?;
        Ok(WpFloor {
            uffd,
            map,
            protect_len: protect_len.min(len),
        })
    }

    /// Time one write-protect of the populated prefix (then unprotect it).
    pub fn measure(&self) -> Result<Duration> {
        let start = self.map.ptr().cast::<c_void>();
        let t = Instant::now();
        self.uffd
            .write_protect(start, self.protect_len)
            .map_err(WpError::WriteProtect)?;
        let took = t.elapsed();
        self.uffd
            .remove_write_protection(start, self.protect_len, false)
            .map_err(WpError::WriteProtect)?;
        Ok(took)
    }
}

/// Make sure the host's pool holds at least `pages` free 2 MiB hugepages,
/// growing `vm.nr_hugepages` if needed (root only). Returns whether it
/// does.
pub fn reserve_hugepages(pages: u64) -> bool {
    let free = pagefork_tests::free_hugepages;
    let have = free();
    if have >= pages {
        return true;
    }
    let total: u64 = std::fs::read_to_string("/proc/sys/vm/nr_hugepages")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    let _ = std::fs::write(
        "/proc/sys/vm/nr_hugepages",
        (total + pages - have).to_string(),
    );
    free() >= pages
}
