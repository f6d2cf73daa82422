//! Creating the userfaultfd that hands guest RAM faults to the server.
//!
//! The VMM never reads this uffd: it registers guest RAM MISSING | WP and
//! sends the fd to the server, which resolves every fault (including those
//! KVM takes through get_user_pages, hence `user_mode_only(false)`).
//!
//! Guest RAM mapped private over a shared base ([`MemoryKind::Base`]) is
//! registered MINOR as well: a page the base holds faults MINOR, and the
//! server maps it from the base (UFFDIO_CONTINUE).
//!
//! The control thread changes guest RAM's mapping for the server through a
//! [`RamControl`]. A rollback in place discards pages: guest RAM is
//! registered MINOR as well (from then on), and the reset pages are
//! unmapped with `MADV_DONTNEED` while they stay in the memfd, so the pause
//! does not wait for the kernel to free them; every access to one faults
//! to the server, which drops the stale page and installs the snapshot's.
//! A rebase maps guest RAM private over a new base and registers it again.

use std::ffi::c_void;

use proto::vmm::{MemoryKind, RequestError};
use uffd_abi::{
    UFFD_FEATURE_EVENT_REMOVE, UFFD_FEATURE_MINOR_HUGETLBFS, UFFD_FEATURE_MINOR_SHMEM,
    UFFD_FEATURE_WP_HUGETLBFS_SHMEM, UFFD_FEATURE_WP_UNPOPULATED,
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
const FEATURE_LADDER: [u64; 5] = [
    UFFD_FEATURE_EVENT_REMOVE
        | UFFD_FEATURE_WP_HUGETLBFS_SHMEM
        | UFFD_FEATURE_WP_UNPOPULATED
        | UFFD_FEATURE_MINOR_SHMEM
        | UFFD_FEATURE_MINOR_HUGETLBFS,
    UFFD_FEATURE_EVENT_REMOVE
        | UFFD_FEATURE_WP_HUGETLBFS_SHMEM
        | UFFD_FEATURE_WP_UNPOPULATED
        | UFFD_FEATURE_MINOR_SHMEM,
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
    /// The range [`GuestUffd::register_ahead`] registered.
    ahead: Option<(usize, usize)>,
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
                return Ok(GuestUffd {
                    uffd,
                    features,
                    ahead: None,
                });
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
    /// Register guest RAM of `kind` at `[addr, addr + len)`: MISSING,
    /// plus WP when the kernel can write-protect shmem, plus MINOR over a
    /// base.
    pub fn register(&self, addr: *mut u8, len: usize, kind: MemoryKind) -> Result<()> {
        register(
            &self.uffd,
            self.features,
            addr,
            len,
            kind == MemoryKind::Base,
        )
    }

    /// Register guest RAM mapped before the Welcome (a pooled VMM's),
    /// and remember it: [`Self::registered_ahead`] then tells the start
    /// that this mapping needs no registration.
    pub fn register_ahead(&mut self, addr: *mut u8, len: usize) -> Result<()> {
        self.register(addr, len, MemoryKind::Own)?;
        self.ahead = Some((addr as usize, len));
        Ok(())
    }

    /// Whether `[addr, addr + len)` is the range [`Self::register_ahead`]
    /// registered. Only the same mapping is still registered: a new one
    /// at the same address (MAP_FIXED) is not.
    pub fn registered_ahead(&self, addr: *mut u8, len: usize) -> bool {
        self.ahead == Some((addr as usize, len))
    }

    /// What [`RamControl`] needs: a handle on this uffd (a copy of the
    /// fd) and guest RAM's host ranges, mapped as `kind`.
    pub fn control(
        &self,
        ram: Vec<(*mut u8, usize)>,
        kind: MemoryKind,
    ) -> std::io::Result<RamControl> {
        use std::os::fd::{AsFd, FromRawFd, IntoRawFd};
        let fd = self.uffd.as_fd().try_clone_to_owned()?;
        // SAFETY: `fd` is a fresh copy of this userfaultfd, owned by the
        // new `Uffd` alone from here.
        let uffd = unsafe { Uffd::from_raw_fd(fd.into_raw_fd()) };
        Ok(RamControl {
            uffd,
            features: self.features,
            ram: ram.into_iter().map(|(a, l)| (a as usize, l)).collect(),
            minor: std::sync::atomic::AtomicBool::new(kind == MemoryKind::Base),
        })
    }
}

/// Register `[addr, addr + len)` MISSING, WP when the kernel can
/// write-protect shmem, and MINOR when asked.
fn register(uffd: &Uffd, features: u64, addr: *mut u8, len: usize, minor: bool) -> Result<()> {
    let mut mode = RegisterMode::MISSING;
    if features & UFFD_FEATURE_WP_HUGETLBFS_SHMEM != 0 {
        mode |= RegisterMode::WRITE_PROTECT;
    }
    if minor {
        mode |= RegisterMode::MINOR;
    }
    uffd.register_with_mode(addr.cast::<c_void>(), len, mode)
        .map(|_| ())
        .map_err(|source| UffdError::Register {
            addr: addr as u64,
            len: len as u64,
            source,
        })
}

/// Changes guest RAM's mapping for the server: `Request::Discard` and
/// `Request::Rebase`.
#[derive(Debug)]
pub struct RamControl {
    uffd: Uffd,
    features: u64,
    /// Guest RAM: (host address, bytes) of each region.
    ram: Vec<(usize, usize)>,
    /// Guest RAM is registered MINOR already.
    minor: std::sync::atomic::AtomicBool,
}

impl RamControl {
    /// Unmap `ranges` ((host address, bytes), page-aligned, inside guest
    /// RAM) with `MADV_DONTNEED`, after registering guest RAM MINOR (once):
    /// their pages stay in the memfd, and the next access to each faults
    /// to the server. Each range must lie inside one RAM region.
    pub fn discard(&self, ranges: &[(u64, u64)]) -> std::result::Result<(), RequestError> {
        use std::sync::atomic::Ordering;
        if self.features & UFFD_FEATURE_MINOR_SHMEM == 0 {
            return Err(RequestError::Unsupported(
                "discard: the kernel cannot register shmem MINOR".into(),
            ));
        }
        for &(start, len) in ranges {
            let inside = self.ram.iter().any(|&(a, l)| {
                start >= a as u64 && start.checked_add(len).is_some_and(|e| e <= (a + l) as u64)
            });
            if !inside || start % 4096 != 0 || len % 4096 != 0 {
                return Err(RequestError::InvalidOp(format!(
                    "discard {start:#x}+{len:#x}: not whole pages of guest RAM"
                )));
            }
        }
        if !self.minor.load(Ordering::SeqCst) {
            for &(a, l) in &self.ram {
                // Registering again with the same uffd only adds MINOR; it
                // leaves every page and write protection as they are.
                // hugetlb memory refuses it (MINOR_SHMEM covers shmem only).
                register(&self.uffd, self.features, a as *mut u8, l, true).map_err(|e| {
                    RequestError::Unsupported(format!("discard: {}", shared::error_chain(&e)))
                })?;
            }
            self.minor.store(true, Ordering::SeqCst);
        }
        for &(start, len) in ranges {
            // SAFETY: the range lies inside guest RAM (checked above), a
            // mapping of the memfd: MADV_DONTNEED only drops this process's
            // page table entries (and KVM's, by its notifier) and, over a
            // base, the private pages the guest wrote; the memfd keeps its
            // bytes and nothing here holds a reference into them while the
            // vCPUs are paused.
            let r = unsafe {
                libc::madvise(
                    shared::geometry::usize_of(start) as *mut c_void,
                    shared::geometry::usize_of(len),
                    libc::MADV_DONTNEED,
                )
            };
            if r != 0 {
                return Err(RequestError::Memory(format!(
                    "discard {start:#x}+{len:#x}: {}",
                    std::io::Error::last_os_error()
                )));
            }
        }
        Ok(())
    }

    /// Register guest RAM, just mapped over a new base
    /// (`Request::Rebase`), MISSING | WP | MINOR: the new mapping is not
    /// registered, and nothing may touch it before it is.
    pub fn register_base(&self) -> std::result::Result<(), RequestError> {
        use std::sync::atomic::Ordering;
        if self.features & (UFFD_FEATURE_MINOR_SHMEM | UFFD_FEATURE_MINOR_HUGETLBFS) == 0 {
            return Err(RequestError::Unsupported(
                "rebase: the kernel cannot register memory MINOR".into(),
            ));
        }
        for &(a, l) in &self.ram {
            register(&self.uffd, self.features, a as *mut u8, l, true).map_err(|e| {
                RequestError::Memory(format!("rebase: {}", shared::error_chain(&e)))
            })?;
        }
        self.minor.store(true, Ordering::SeqCst);
        Ok(())
    }
}
