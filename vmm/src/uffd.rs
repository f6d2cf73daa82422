//! Creating the userfaultfd that hands guest RAM faults to the server.
//!
//! The VMM never reads this uffd: it registers guest RAM MISSING | WP and
//! sends the fd to the server, which resolves every fault (including those
//! KVM takes through get_user_pages, hence `user_mode_only(false)`).

use std::ffi::c_void;

use uffd_abi::{
    UFFD_FEATURE_EVENT_REMOVE, UFFD_FEATURE_WP_HUGETLBFS_SHMEM, UFFD_FEATURE_WP_UNPOPULATED,
};
use userfaultfd::{FeatureFlags, RegisterMode, Uffd, UffdBuilder};

/// Errors of setting up the userfaultfd.
#[derive(Debug, thiserror::Error)]
pub enum UffdError {
    #[error("cannot create a userfaultfd (check /dev/userfaultfd permissions or vm.unprivileged_userfaultfd)")]
    Create(#[source] userfaultfd::Error),
    #[error("cannot register guest RAM at {addr:#x} ({len:#x} bytes) with the userfaultfd")]
    Register {
        addr: u64,
        len: u64,
        #[source]
        source: userfaultfd::Error,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, UffdError>;

/// Feature sets to try, best first.
const FEATURE_LADDER: [u64; 3] = [
    UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_WP_HUGETLBFS_SHMEM | UFFD_FEATURE_WP_UNPOPULATED,
    UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
    UFFD_FEATURE_EVENT_REMOVE,
];

/// A userfaultfd with guest RAM registered.
#[derive(Debug)]
pub struct GuestUffd {
    /// The uffd.
    pub uffd: Uffd,
    /// Features the kernel granted.
    pub features: u64,
}

/// Create the uffd, trying the feature ladder until the kernel agrees.
pub fn create() -> Result<GuestUffd> {
    let mut last = None;
    for features in FEATURE_LADDER {
        let res = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(false)
            .require_features(FeatureFlags::from_bits_retain(features))
            .create();
        match res {
            Ok(uffd) => {
                if features != FEATURE_LADDER[0] {
                    tracing::warn!(
                        features = format_args!("{features:#x}"),
                        "userfaultfd: reduced feature set"
                    );
                }
                return Ok(GuestUffd { uffd, features });
            }
            Err(e) => {
                tracing::debug!(features = format_args!("{features:#x}"), error = %e, "UFFDIO_API refused");
                last = Some(e);
            }
        }
    }
    Err(UffdError::Create(last.unwrap_or(
        userfaultfd::Error::UnsupportedIoctls(userfaultfd::IoctlFlags::empty()),
    )))
}

impl GuestUffd {
    /// Register `[addr, addr + len)` MISSING, plus WP when the kernel can
    /// write-protect shmem.
    pub fn register(&self, addr: *mut u8, len: usize) -> Result<()> {
        let mut mode = RegisterMode::MISSING;
        if self.features & UFFD_FEATURE_WP_HUGETLBFS_SHMEM != 0 {
            mode |= RegisterMode::WRITE_PROTECT;
        }
        self.uffd
            .register_with_mode(addr.cast::<c_void>(), len, mode)
            .map(|_| ())
            .map_err(|source| UffdError::Register {
                addr: addr as u64,
                len: len as u64,
                source,
            })
    }
}
