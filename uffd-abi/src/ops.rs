//! Safe wrappers of the uffd ioctls in [`crate::abi`].
//!
//! The install ioctls (COPY, ZEROPAGE, POISON) report how many bytes they
//! did in a signed field that holds `-errno` when they did none; it is read
//! with its sign and turned into an [`Install`] before anything else.
//! Addresses are in the address space of the process that registered the
//! range, which may be another process than this one.

use std::os::fd::{AsFd, AsRawFd};

use nix::errno::Errno;

use crate::abi::{
    UffdioContinue, UffdioCopy, UffdioPoison, UffdioRange, UffdioWriteprotect, UffdioZeropage,
    UFFDIO_CONTINUE, UFFDIO_COPY, UFFDIO_POISON, UFFDIO_WAKE, UFFDIO_WRITEPROTECT, UFFDIO_ZEROPAGE,
    WRITEPROTECT_MODE_WP, ZEROPAGE_MODE_DONTWAKE,
};

/// What an install ioctl (COPY, ZEROPAGE, CONTINUE, POISON) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Install {
    /// All `len` bytes installed (and the faulting threads woken unless
    /// DONTWAKE).
    Done,
    /// Stopped at a page that already exists after `copied` bytes.
    Exists { copied: u64 },
    /// The address space is changing (a non-cooperative event is pending);
    /// `copied` bytes were installed. Retry after reading events.
    Again { copied: u64 },
    /// The process that registered the range is gone.
    Gone,
    /// Another error.
    Failed(Errno),
}

/// The outcome of an install ioctl from its return value and the kernel's
/// signed result field.
fn outcome(ret: libc::c_int, result: i64, len: u64) -> Install {
    // Negative (-errno) means nothing was installed.
    let copied = u64::try_from(result).unwrap_or(0);
    match Errno::result(ret) {
        Ok(_) if copied >= len => Install::Done,
        Ok(_) => Install::Again { copied },
        Err(Errno::EEXIST) => Install::Exists { copied },
        Err(Errno::EAGAIN) => Install::Again { copied },
        Err(Errno::ESRCH) => Install::Gone,
        Err(e) => Install::Failed(e),
    }
}

/// UFFDIO_COPY `len` bytes from `src` (in this process) to `dst` (in the
/// registered range of the uffd's process) with `mode` (e.g.
/// [`crate::COPY_MODE_WP`]), waking the faulting threads.
///
/// # Safety
/// `src..src+len` must be readable memory of this process for the whole
/// call.
pub unsafe fn copy(uffd: impl AsFd, src: *const u8, dst: u64, len: u64, mode: u64) -> Install {
    let mut arg = UffdioCopy {
        dst,
        src: src as u64,
        len,
        mode,
        copy: 0,
    };
    // SAFETY: `arg` is a live uffdio_copy matching UFFDIO_COPY's size; the
    // kernel reads `len` bytes at `src`, which the caller guarantees, and
    // writes only into the uffd's registered range.
    let ret = unsafe { libc::ioctl(uffd.as_fd().as_raw_fd(), UFFDIO_COPY, &mut arg) };
    outcome(ret, arg.copy, len)
}

/// UFFDIO_ZEROPAGE over `len` bytes at `dst`, waking the faulting threads.
pub fn zeropage(uffd: impl AsFd, dst: u64, len: u64) -> Install {
    let mut arg = UffdioZeropage {
        range: UffdioRange { start: dst, len },
        mode: 0,
        zeropage: 0,
    };
    // SAFETY: `arg` is a live uffdio_zeropage matching UFFDIO_ZEROPAGE's
    // size; the kernel only maps zero pages into the registered range.
    let ret = unsafe { libc::ioctl(uffd.as_fd().as_raw_fd(), UFFDIO_ZEROPAGE, &mut arg) };
    outcome(ret, arg.zeropage, len)
}

/// UFFDIO_ZEROPAGE over `len` bytes at `dst`, write-protected: the zero
/// page goes in without waking the faulting threads, the range it filled
/// is protected, and only then are the threads woken. (A write to a zero
/// page mapped unprotected is a copy on write the kernel does without a
/// userfaultfd event; a thread woken before the protection could make
/// one.) Returns the zeropage's outcome, and whether what it filled is
/// protected: `false` when the protection failed (the address space
/// changing under it, say), and the caller must then count those pages as
/// the process's own, since a write to them raises nothing.
pub fn zeropage_protected(uffd: impl AsFd, dst: u64, len: u64) -> (Install, bool) {
    let mut arg = UffdioZeropage {
        range: UffdioRange { start: dst, len },
        mode: ZEROPAGE_MODE_DONTWAKE,
        zeropage: 0,
    };
    // SAFETY: as in `zeropage`.
    let ret = unsafe { libc::ioctl(uffd.as_fd().as_raw_fd(), UFFDIO_ZEROPAGE, &mut arg) };
    let res = outcome(ret, arg.zeropage, len);
    let filled = match res {
        Install::Done => len,
        Install::Exists { copied } | Install::Again { copied } => copied,
        Install::Gone | Install::Failed(_) => 0,
    };
    let protected = filled == 0 || write_protect(&uffd, dst, filled, true).is_ok();
    // The faulting thread sleeps until this wake, whatever happened above
    // (a partial fill ends at a page present or an event pending: it must
    // retry its access either way).
    match wake(&uffd, dst, len) {
        Err(Errno::ESRCH) => (Install::Gone, protected),
        _ => (res, protected),
    }
}

/// UFFDIO_CONTINUE over `len` bytes at `dst`: map the pages the backing
/// file (a shared base) holds at that offset, waking the faulting threads.
/// In a `MAP_PRIVATE` mapping they are mapped read-only and shared with
/// every other mapping of the file until the process writes one (then the
/// kernel copies it). `mode` may hold [`crate::CONTINUE_MODE_WP`]. A page
/// the file lacks ends the call with `Failed(EFAULT)` after the pages
/// before it; one already mapped, with `Exists`.
pub fn continue_range(uffd: impl AsFd, dst: u64, len: u64, mode: u64) -> Install {
    let mut arg = UffdioContinue {
        range: UffdioRange { start: dst, len },
        mode,
        mapped: 0,
    };
    // SAFETY: `arg` is a live uffdio_continue matching UFFDIO_CONTINUE's
    // size; the kernel only maps the file's own pages into the registered
    // range.
    let ret = unsafe { libc::ioctl(uffd.as_fd().as_raw_fd(), UFFDIO_CONTINUE, &mut arg) };
    outcome(ret, arg.mapped, len)
}

/// UFFDIO_POISON over `len` bytes at `dst` (Linux 6.6): the pages read as
/// hardware-poisoned (SIGBUS to the process, an error to KVM), so a page
/// that cannot be served fails its reader instead of faulting forever.
/// Wakes the faulting threads.
pub fn poison(uffd: impl AsFd, dst: u64, len: u64) -> Install {
    let mut arg = UffdioPoison {
        range: UffdioRange { start: dst, len },
        mode: 0,
        updated: 0,
    };
    // SAFETY: `arg` is a live uffdio_poison matching UFFDIO_POISON's size;
    // the kernel only installs poison markers into the registered range.
    let ret = unsafe { libc::ioctl(uffd.as_fd().as_raw_fd(), UFFDIO_POISON, &mut arg) };
    outcome(ret, arg.updated, len)
}

/// UFFDIO_WAKE the threads faulting in `[start, start + len)`.
pub fn wake(uffd: impl AsFd, start: u64, len: u64) -> Result<(), Errno> {
    let mut arg = UffdioRange { start, len };
    // SAFETY: `arg` is a live uffdio_range matching UFFDIO_WAKE's size; the
    // kernel only reads it.
    let ret = unsafe { libc::ioctl(uffd.as_fd().as_raw_fd(), UFFDIO_WAKE, &mut arg) };
    Errno::result(ret).map(drop)
}

/// UFFDIO_WRITEPROTECT `[start, start + len)` with an explicit `mode`
/// ([`crate::WRITEPROTECT_MODE_WP`] to protect, 0 to unprotect and wake,
/// plus DONTWAKE if wanted).
pub fn writeprotect(uffd: impl AsFd, start: u64, len: u64, mode: u64) -> Result<(), Errno> {
    let mut arg = UffdioWriteprotect {
        range: UffdioRange { start, len },
        mode,
    };
    // SAFETY: `arg` is a live uffdio_writeprotect matching
    // UFFDIO_WRITEPROTECT's size; the kernel only changes protection in
    // the registered range.
    let ret = unsafe { libc::ioctl(uffd.as_fd().as_raw_fd(), UFFDIO_WRITEPROTECT, &mut arg) };
    Errno::result(ret).map(drop)
}

/// Write-protect `[start, start + len)` (`protect`), or lift the protection
/// and wake the threads waiting on it (`!protect`).
pub fn write_protect(uffd: impl AsFd, start: u64, len: u64, protect: bool) -> Result<(), Errno> {
    let mode = if protect { WRITEPROTECT_MODE_WP } else { 0 };
    writeprotect(uffd, start, len, mode)
}

/// Below this many pages (of the memory's own page size) per thread,
/// [`write_protect_runs`] does not split: a thread's start costs more than
/// the ioctl it would take over. The ioctl's cost follows the page-table
/// entries it rewrites: 64 MiB of 4 KiB pages (~2 ms here); hugetlb
/// memory, with 512 times fewer entries, stays on one thread.
pub const WP_SPLIT_MIN_PAGES: u64 = 16_384;

/// At most this many threads share one [`write_protect_runs`].
pub const WP_THREADS_MAX: usize = 4;

/// [`write_protect`] every `(start, len)` of `runs`, spread over several
/// threads when there is much to do.
///
/// Write-protecting populated memory costs ~70 ns per 4 KiB page here,
/// most of it walking and rewriting page tables (and KVM's, when KVM maps
/// the range); the kernel takes only shared locks for it, so disjoint
/// ranges protected from two threads take about half the time (1 GiB of
/// populated shmem: 18 ms on one thread, 10.5 ms on two, measured on a
/// 2-core host). The runs are cut into one share per thread at multiples
/// of `granule` (the memory's page size: hugetlb ranges must stay 2 MiB
/// aligned). The threads are scoped: all are done when this returns. On
/// failure, returns the index in `runs` of a run that failed (what the
/// other threads did stays done) and the error.
pub fn write_protect_runs(
    uffd: impl AsFd,
    runs: &[(u64, u64)],
    granule: u64,
    protect: bool,
) -> Result<(), (usize, Errno)> {
    let fd = uffd.as_fd();
    let total: u64 = runs.iter().map(|&(_, len)| len).sum();
    let entries = total / granule.max(1);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = cores
        .min(WP_THREADS_MAX)
        .min(usize::try_from(entries / WP_SPLIT_MIN_PAGES).unwrap_or(usize::MAX))
        .max(1);
    let protect_all = |share: &[(usize, u64, u64)]| {
        share.iter().try_for_each(|&(i, start, len)| {
            write_protect(fd, start, len, protect).map_err(|e| (i, e))
        })
    };
    let shares = split_runs(runs, granule, threads);
    match shares.as_slice() {
        [] => Ok(()),
        [only] => protect_all(only),
        [first, rest @ ..] => std::thread::scope(|s| {
            let others: Vec<_> = rest
                .iter()
                .map(|share| s.spawn(|| protect_all(share)))
                .collect();
            let mut result = protect_all(first);
            for h in others {
                let theirs = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
                result = result.and(theirs);
            }
            result
        }),
    }
}

/// Cut `runs` into at most `parts` shares of about equal bytes, each a
/// list of `(index in runs, start, len)`, cutting only at multiples of
/// `granule` from a run's start.
fn split_runs(runs: &[(u64, u64)], granule: u64, parts: usize) -> Vec<Vec<(usize, u64, u64)>> {
    let granule = granule.max(1);
    let total: u64 = runs.iter().map(|&(_, len)| len).sum();
    let parts = u64::try_from(parts.max(1)).unwrap_or(1);
    let share = total.div_ceil(parts).div_ceil(granule) * granule;
    let mut out = Vec::new();
    let mut cur = Vec::new();
    let mut room = share;
    for (i, &(mut start, mut len)) in runs.iter().enumerate() {
        while len > 0 {
            let take = len.min(room);
            cur.push((i, start, take));
            start += take;
            len -= take;
            room -= take;
            if room == 0 {
                out.push(std::mem::take(&mut cur));
                room = share;
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const EAGAIN: i64 = -(libc::EAGAIN as i64);

    #[test]
    fn runs_split_into_equal_shares_at_granule_boundaries() {
        let mib = 1 << 20;
        let runs = [(0, 3 * mib), (10 * mib, mib), (20 * mib, 4 * mib)];
        let shares = split_runs(&runs, 2 * mib, 2);
        assert_eq!(
            shares,
            vec![
                vec![(0, 0, 3 * mib), (1, 10 * mib, mib)],
                vec![(2, 20 * mib, 4 * mib)],
            ]
        );
        let shares = split_runs(&runs, 4096, 3);
        let flat: Vec<_> = shares.concat();
        assert_eq!(flat.iter().map(|s| s.2).sum::<u64>(), 8 * mib);
        assert!(shares
            .iter()
            .all(|s| s.iter().map(|p| p.2).sum::<u64>() <= 3 * mib));
        assert_eq!(shares.len(), 3);
        assert!(split_runs(&[], 4096, 2).is_empty());
    }

    #[test]
    fn full_install_is_done() {
        assert_eq!(outcome(0, 8192, 8192), Install::Done);
    }

    #[test]
    fn negative_result_is_never_read_as_a_count() {
        // The kernel's -EAGAIN in the result field must not become a huge
        // unsigned count.
        Errno::EAGAIN.set();
        assert_eq!(outcome(-1, EAGAIN, 8192), Install::Again { copied: 0 });
    }

    #[test]
    fn partial_counts_survive_errors() {
        Errno::EEXIST.set();
        assert_eq!(outcome(-1, 4096, 8192), Install::Exists { copied: 4096 });
        Errno::EAGAIN.set();
        assert_eq!(outcome(-1, 4096, 8192), Install::Again { copied: 4096 });
    }

    #[test]
    fn dead_process_and_other_errors() {
        Errno::ESRCH.set();
        assert_eq!(outcome(-1, -3, 4096), Install::Gone);
        Errno::EINVAL.set();
        assert_eq!(outcome(-1, -22, 4096), Install::Failed(Errno::EINVAL));
    }

    #[test]
    fn short_success_means_retry() {
        assert_eq!(outcome(0, 4096, 8192), Install::Again { copied: 4096 });
    }
}
