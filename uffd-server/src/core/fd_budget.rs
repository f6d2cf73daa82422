//! File descriptors as an admission resource, as memory is
//! (`Registry::admit`): a create, restore, clone or fork is refused up
//! front, before it allocates anything, when the fds its VMs will hold
//! would not fit under the server's `RLIMIT_NOFILE` with a reserve left.
//!
//! A VM holds a few fds in the server for as long as it lives, counted
//! on a server of this version (`/proc/self/fd` before and after one VM of
//! each kind):
//!
//! | kind | fds held | counted as |
//! |---|---|---|
//! | create | 6 (zero memory, or a volume); 8 from an image, +1 for its first VM (the image) | 10 |
//! | fork child | 6 of a running VM on its own memfd; 7 of a paused template or of a VM on a base (its VMM's pagemap) | 9 |
//! | restore | 8, +1 for a snapshot's first restore (its image) | 10 |
//! | remote restore | 7, +1 for the first (a connection to the store) | 10 |
//! | pooled VMM | 5 while it waits for a VM | 7 |
//!
//! The margin over the count covers what a start holds for a moment (the
//! log and pipes of a spawn, the VMM's socket before its hello). What
//! running VMs and the API open as they go is not admitted per VM: it
//! comes out of the reserve, which admission never hands out. That is a
//! tenth of the limit, at least [`MIN_RESERVE`] and at most
//! [`MAX_RESERVE`]: API connections (256 at most by default), the
//! pagemap and memfd a template takes when it runs again after a fork,
//! a snapshot's files while it is saved or shown, the object store's
//! connections. None of these grows with the number of VMs, so the reserve
//! stops growing at [`MAX_RESERVE`].
//!
//! Fds in use are those open now plus those promised to operations that
//! were admitted and are still starting their VMs ([`FdClaim`]), so two
//! creates admitted at once cannot both count the same room.

use std::cell::Cell;
use std::rc::Rc;

use tracing::warn;

use crate::core::error::{Error, Result};
use crate::observe::fds::{fd_limit, open_fds};

/// The reserve never falls below this many fds.
pub const MIN_RESERVE: u64 = 16;
/// The reserve never grows past this many fds.
pub const MAX_RESERVE: u64 = 1024;

/// What is being started, for the fds each one holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdKind {
    /// A new VM (zero memory, an image, a volume).
    Create,
    /// A VM restored from a local snapshot (a clone's too).
    Restore,
    /// A VM restored from a snapshot in the object store.
    RemoteRestore,
    /// One child of a fork.
    ForkChild,
    /// A VMM started for the warm pool.
    Pooled,
}

impl FdKind {
    /// Fds one of this kind holds in the server, with a margin (see the
    /// module doc for the counts).
    pub const fn per_vm(self) -> u64 {
        match self {
            FdKind::Create | FdKind::Restore | FdKind::RemoteRestore => 10,
            FdKind::ForkChild => 9,
            FdKind::Pooled => 7,
        }
    }
}

/// The fds kept free of admission out of a limit of `limit`.
pub fn reserve(limit: u64) -> u64 {
    (limit / 10).clamp(MIN_RESERVE, MAX_RESERVE)
}

/// The server's fds as admission sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdUse {
    /// Open now plus promised to operations still starting.
    pub in_use: u64,
    /// The soft `RLIMIT_NOFILE`.
    pub limit: u64,
    /// Kept for running VMs and the API.
    pub reserve: u64,
}

impl FdUse {
    /// Whether `need` more fds fit with the reserve left.
    pub fn fits(&self, need: u64) -> bool {
        self.in_use
            .saturating_add(need)
            .saturating_add(self.reserve)
            <= self.limit
    }
}

/// The admission of fds: what admitted operations still starting have
/// been promised, and how many were refused.
#[derive(Debug, Default)]
pub struct FdBudget {
    claimed: Rc<Cell<u64>>,
    refused: Cell<u64>,
}

/// Fds promised to one admitted operation until it is dropped (by then
/// its VMs hold them, or it failed and they were never taken).
#[derive(Debug)]
#[must_use = "the fds are promised only while the claim is held"]
pub struct FdClaim {
    claimed: Rc<Cell<u64>>,
    fds: u64,
}

impl Drop for FdClaim {
    fn drop(&mut self) {
        self.claimed
            .set(self.claimed.get().saturating_sub(self.fds));
    }
}

impl FdBudget {
    /// The fds in use and the limit now; `None` where they cannot be read
    /// (no `/proc`), and admission then lets everything through.
    pub fn usage(&self) -> Option<FdUse> {
        let limit = fd_limit()?;
        let open = open_fds().ok()?;
        Some(FdUse {
            in_use: open.saturating_add(self.claimed.get()),
            limit,
            reserve: reserve(limit),
        })
    }

    /// Operations refused for want of fds since the server started.
    pub fn refused(&self) -> u64 {
        self.refused.get()
    }

    /// Whether `count` of `kind` would be admitted now (nothing is claimed).
    pub fn has_room(&self, kind: FdKind, count: u64) -> bool {
        self.usage()
            .is_none_or(|u| u.fits(count.saturating_mul(kind.per_vm())))
    }

    /// Refuse `count` of `kind` that would not be admitted now, without
    /// promising them anything (each is admitted again as it starts).
    pub fn check(&self, kind: FdKind, count: u64) -> Result<()> {
        self.admit(kind, count).map(drop)
    }

    /// Admit `count` VMs of `kind`, or refuse them with the fds in use,
    /// the limit and what to do; the fds are promised to the caller for
    /// as long as it holds the claim.
    pub fn admit(&self, kind: FdKind, count: u64) -> Result<FdClaim> {
        let need = count.saturating_mul(kind.per_vm());
        if let Some(u) = self.usage().filter(|u| !u.fits(need)) {
            let refused = self.refused.get() + 1;
            self.refused.set(refused);
            let e = Error::OverFdLimit {
                count,
                need,
                in_use: u.in_use,
                reserve: u.reserve,
                limit: u.limit,
            };
            if refused.is_power_of_two() {
                warn!("{e} ({refused} refused so far)");
            }
            return Err(e);
        }
        self.claimed.set(self.claimed.get().saturating_add(need));
        Ok(FdClaim {
            claimed: Rc::clone(&self.claimed),
            fds: need,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_a_tenth_of_the_limit_within_bounds() {
        assert_eq!(reserve(64), MIN_RESERVE);
        assert_eq!(reserve(300), 30);
        assert_eq!(reserve(4096), 409);
        assert_eq!(reserve(20_000), MAX_RESERVE);
        assert_eq!(reserve(1 << 20), MAX_RESERVE);
    }

    #[test]
    fn a_request_fits_only_with_the_reserve_left() {
        let u = FdUse {
            in_use: 200,
            limit: 300,
            reserve: 30,
        };
        assert!(u.fits(70));
        assert!(!u.fits(71));
        assert!(!FdUse { in_use: 290, ..u }.fits(0));
    }

    #[test]
    fn a_claim_counts_until_dropped() {
        let budget = FdBudget::default();
        let claim = budget.admit(FdKind::ForkChild, 2).expect("room for two");
        assert_eq!(budget.claimed.get(), 2 * FdKind::ForkChild.per_vm());
        let other = budget.admit(FdKind::Create, 1).expect("room for one more");
        drop(claim);
        assert_eq!(budget.claimed.get(), FdKind::Create.per_vm());
        drop(other);
        assert_eq!(budget.claimed.get(), 0);
    }

    #[test]
    fn a_refusal_names_the_limit_and_what_to_do() {
        let budget = FdBudget::default();
        let Err(e) = budget.admit(FdKind::Create, u64::MAX / 16) else {
            panic!("admitted more fds than any limit");
        };
        assert_eq!(e.status(), 503);
        let m = e.message();
        assert!(m.contains("RLIMIT_NOFILE"), "{m}");
        assert!(m.contains("ulimit -n"), "{m}");
        assert_eq!(budget.refused(), 1);
        assert_eq!(budget.claimed.get(), 0);
    }
}
