//! The wrappers against a real userfaultfd in this process: anonymous
//! memory registered here, pages installed, woken, protected and poisoned.
//!
//! Skips with a printed reason where no userfaultfd can be created (fails
//! instead with `CI=true`).

use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::ptr::NonNull;

use nix::sys::mman::{mmap_anonymous, munmap, MapFlags, ProtFlags};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, ForkResult};
use uffd_abi::{Errno, Install, COPY_MODE_WP};
use userfaultfd::{FeatureFlags, RegisterMode, Uffd, UffdBuilder};

const PAGE: usize = 4096;
const PAGE_U64: u64 = 4096;

/// Anonymous private memory, unmapped on drop.
struct Anon {
    ptr: NonNull<c_void>,
    len: usize,
}

impl Anon {
    fn new(pages: usize) -> Anon {
        let len = pages * PAGE;
        // SAFETY: a fresh anonymous mapping; nothing is replaced.
        let ptr = unsafe {
            mmap_anonymous(
                None,
                NonZeroUsize::new(len).expect("non-empty"),
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE,
            )
        }
        .expect("mmap");
        Anon { ptr, len }
    }

    fn addr(&self, page: usize) -> u64 {
        (self.ptr.as_ptr() as usize + page * PAGE) as u64
    }

    /// First byte of `page`; the page must be installed (or this blocks).
    fn byte(&self, page: usize) -> u8 {
        // SAFETY: inside the mapping; callers only read installed pages.
        unsafe {
            self.ptr
                .as_ptr()
                .cast::<u8>()
                .add(page * PAGE)
                .read_volatile()
        }
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`.
        let _ = unsafe { munmap(self.ptr, self.len) };
    }
}

/// A uffd with `mem` registered in `mode`, or None (skip) without one.
fn registered(mem: &Anon, mode: RegisterMode, features: FeatureFlags) -> Option<Uffd> {
    let uffd = match UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(true)
        .require_features(features)
        .create()
    {
        Ok(u) => u,
        Err(e) => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "no userfaultfd on CI: {e}"
            );
            eprintln!("skipping: cannot create a userfaultfd: {e}");
            return None;
        }
    };
    uffd.register_with_mode(mem.ptr.as_ptr(), mem.len, mode)
        .expect("register");
    Some(uffd)
}

#[test]
fn copy_installs_a_page_and_reports_an_existing_one() {
    let mem = Anon::new(4);
    let Some(uffd) = registered(&mem, RegisterMode::MISSING, FeatureFlags::empty()) else {
        return;
    };
    let src = vec![0x5au8; 2 * PAGE];
    // SAFETY: `src` is two live pages.
    let res = unsafe { uffd_abi::copy(&uffd, src.as_ptr(), mem.addr(1), 2 * PAGE_U64, 0) };
    assert_eq!(res, Install::Done);
    assert_eq!((mem.byte(1), mem.byte(2)), (0x5a, 0x5a));
    // SAFETY: as above.
    let again = unsafe { uffd_abi::copy(&uffd, src.as_ptr(), mem.addr(2), PAGE_U64, 0) };
    assert_eq!(again, Install::Exists { copied: 0 });
}

#[test]
fn zeropage_installs_zeroes_and_wake_accepts_a_range() {
    let mem = Anon::new(2);
    let Some(uffd) = registered(&mem, RegisterMode::MISSING, FeatureFlags::empty()) else {
        return;
    };
    assert_eq!(
        uffd_abi::zeropage(&uffd, mem.addr(0), PAGE_U64),
        Install::Done
    );
    assert_eq!(mem.byte(0), 0);
    assert_eq!(uffd_abi::wake(&uffd, mem.addr(0), 2 * PAGE_U64), Ok(()));
    assert_eq!(
        uffd_abi::zeropage(&uffd, mem.addr(0) + 1, PAGE_U64),
        Install::Failed(Errno::EINVAL),
        "an unaligned range is refused"
    );
}

#[test]
fn copy_mode_wp_and_writeprotect_toggle_protection() {
    let mem = Anon::new(2);
    let mode = RegisterMode::MISSING | RegisterMode::WRITE_PROTECT;
    let Some(uffd) = registered(&mem, mode, FeatureFlags::PAGEFAULT_FLAG_WP) else {
        return;
    };
    let src = vec![7u8; PAGE];
    // SAFETY: `src` is one live page.
    let res = unsafe { uffd_abi::copy(&uffd, src.as_ptr(), mem.addr(0), PAGE_U64, COPY_MODE_WP) };
    assert_eq!(res, Install::Done);
    assert_eq!(mem.byte(0), 7, "a protected page still reads");
    assert_eq!(
        uffd_abi::write_protect(&uffd, mem.addr(0), PAGE_U64, false),
        Ok(())
    );
    // Unprotected: this write must not fault.
    // SAFETY: page 0 is installed and writable now.
    unsafe { mem.ptr.as_ptr().cast::<u8>().write_volatile(8) };
    assert_eq!(mem.byte(0), 8);
    assert_eq!(
        uffd_abi::write_protect(&uffd, mem.addr(0), PAGE_U64, true),
        Ok(())
    );
}

#[test]
fn poison_fails_the_page_for_its_reader() {
    let mem = Anon::new(2);
    let Some(uffd) = registered(&mem, RegisterMode::MISSING, FeatureFlags::empty()) else {
        return;
    };
    match uffd_abi::poison(&uffd, mem.addr(1), PAGE_U64) {
        Install::Done => {}
        Install::Failed(Errno::EINVAL | Errno::ENOTTY) => {
            eprintln!("skipping: this kernel has no UFFDIO_POISON (Linux 6.6+)");
            return;
        }
        other => panic!("UFFDIO_POISON: {other:?}"),
    }
    // Reading the page raises SIGBUS: do it in a child, which inherits the
    // poison marker of this private mapping.
    // SAFETY: the child only reads memory and exits, both async-signal-safe.
    match unsafe { fork() }.expect("fork") {
        ForkResult::Child => {
            let _ = mem.byte(1);
            // SAFETY: leave the child without running the test harness.
            unsafe { libc::_exit(0) }
        }
        ForkResult::Parent { child } => {
            let status = waitpid(child, None).expect("waitpid");
            assert!(
                matches!(
                    status,
                    WaitStatus::Signaled(_, nix::sys::signal::Signal::SIGBUS, _)
                ),
                "reading a poisoned page must raise SIGBUS, got {status:?}"
            );
        }
    }
    drop(uffd);
}

#[test]
fn continue_maps_the_base_pages_and_a_write_stays_private() {
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::os::unix::fs::FileExt;
    // The base: a memfd holding pages 0 and 1; page 2 it lacks.
    // SAFETY: memfd_create with a valid name and flags.
    let fd = unsafe { libc::memfd_create(c"base".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: `fd` was just created; the File owns it alone.
    let base = unsafe { std::fs::File::from_raw_fd(fd) };
    base.set_len(4 * PAGE_U64).expect("size the base");
    base.write_all_at(&[0x11u8; PAGE], 0).expect("page 0");
    base.write_all_at(&[0x22u8; PAGE], PAGE_U64)
        .expect("page 1");
    // SAFETY: a fresh private mapping of the base; nothing is replaced.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4 * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE,
            base.as_raw_fd(),
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    let mem = Anon {
        ptr: NonNull::new(ptr).expect("mapped"),
        len: 4 * PAGE,
    };
    let minor = FeatureFlags::from_bits_retain(uffd_abi::UFFD_FEATURE_MINOR_SHMEM);
    let Some(uffd) = registered(&mem, RegisterMode::MISSING | RegisterMode::MINOR, minor) else {
        return;
    };
    assert_eq!(
        uffd_abi::continue_range(&uffd, mem.addr(0), 2 * PAGE_U64, 0),
        Install::Done
    );
    assert_eq!((mem.byte(0), mem.byte(1)), (0x11, 0x22));
    assert_eq!(
        uffd_abi::continue_range(&uffd, mem.addr(0), PAGE_U64, 0),
        Install::Exists { copied: 0 },
        "a mapped page is not mapped again"
    );
    assert_eq!(
        uffd_abi::continue_range(&uffd, mem.addr(2), PAGE_U64, 0),
        Install::Failed(Errno::EFAULT),
        "a page the base lacks cannot be continued"
    );
    // A write copies the page for this mapping alone.
    // SAFETY: page 0 is mapped (read-only; the kernel copies on write).
    unsafe { mem.ptr.as_ptr().cast::<u8>().write_volatile(0x99) };
    assert_eq!(mem.byte(0), 0x99);
    let mut first = [0u8; 1];
    base.read_exact_at(&mut first, 0).expect("read the base");
    assert_eq!(first[0], 0x11, "the base keeps its bytes");
}
