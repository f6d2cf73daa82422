//! The anchor: a process that shares this VMM's address space and nothing
//! else, so that the pages the guest wrote stay readable by the server
//! (with `process_vm_readv` and `/proc/PID/pagemap` by the anchor's pid)
//! after this process is gone, by exit, crash or SIGKILL.
//!
//! A VM on a shared base holds what its guest wrote as private pages of
//! its VMM. When such a VM forks, its children read those pages from a
//! layer the server fills in the background; until the layer is whole,
//! the pages must outlive whatever happens to the VMM. An address space
//! lives while any process uses it: `clone(CLONE_VM)` without
//! `CLONE_THREAD` makes one more user that is its own process, which a
//! signal to the VMM does not kill. The server kills it with SIGKILL when
//! it needs the pages no more; if the server never does (it is gone for
//! good), the anchor ends itself [`ORPHAN_SECONDS`] after the VMM went.
//!
//! The anchor runs in this process's memory on a stack of its own, and
//! shares the thread-local storage of the thread that made it (no
//! `CLONE_SETTLS`): it must not run code that touches either the heap or
//! `errno`, so it makes its few system calls with `syscall` instructions
//! of its own rather than through libc (whose wrappers write `errno` on
//! failure). The OOM killer kills every process sharing an address space,
//! so the anchor does not protect against it: the server orders the
//! kernel's choice instead (the VMM holding pages others need gets the
//! lowest `oom_score_adj`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// Seconds the anchor stays after the VMM went without the server killing
/// it (the server gone for good), then ends itself.
const ORPHAN_SECONDS: u64 = 120;

/// Set once the anchor was reported to a server for a VM ([`report`]): an
/// anchor whose VMM went before that (a pooled VMM stopped unused) has
/// nothing anyone needs and ends at once. Read by the anchor in the
/// memory it shares with the VMM.
static REPORTED: AtomicBool = AtomicBool::new(false);

/// The anchor's stack: it makes a few system calls and nothing else.
const STACK_BYTES: usize = 64 << 10;

static ANCHOR: OnceLock<u32> = OnceLock::new();

/// The anchor's process name (`/proc/PID/comm`).
pub const NAME: &[u8; 11] = b"vmm-anchor\0";

/// The anchor's pid, if this VMM made one.
pub fn pid() -> Option<u32> {
    ANCHOR.get().copied()
}

/// The anchor's pid, to tell the server, if this VMM made one: from now
/// on it outlives the VMM until the server lets it go.
pub fn report() -> Option<u32> {
    let pid = pid()?;
    REPORTED.store(true, Ordering::SeqCst);
    Some(pid)
}

/// This VMM exits because no server takes it (refused, or none there):
/// nobody will read its pages, so its anchor goes with it.
pub fn end() {
    if let Some(pid) = pid().and_then(|p| libc::pid_t::try_from(p).ok()) {
        // SAFETY: a signal to the anchor this process made (its child, not
        // reaped, so the pid is still its own).
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

/// Make this VMM's anchor (once). Returns its pid.
pub fn make() -> std::io::Result<u32> {
    if let Some(p) = pid() {
        return Ok(p);
    }
    // SAFETY: a fresh anonymous mapping; nothing else uses it. It is
    // never unmapped: the anchor runs on it for as long as it lives.
    let stack = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            STACK_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
            -1,
            0,
        )
    };
    if stack == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the top of the mapping just made, 16-byte aligned (mmap
    // returns page-aligned memory and STACK_BYTES is a multiple of 16).
    let top = unsafe { stack.cast::<u8>().add(STACK_BYTES) };
    // The anchor's argument: this process's pid, its parent-to-be.
    let me = usize::try_from(std::process::id()).unwrap_or(0);
    // SAFETY: `anchor_main` runs on its own stack, touches no memory but
    // that stack, and makes only raw system calls (see the module doc).
    // CLONE_VM shares the address space; without CLONE_THREAD, CLONE_FILES
    // or CLONE_SIGHAND the anchor is a process of its own with its own fd
    // table (which it empties) and signal handlers.
    let child = unsafe {
        libc::clone(
            anchor_main,
            top.cast(),
            libc::CLONE_VM | libc::SIGCHLD,
            me as *mut libc::c_void,
        )
    };
    if child < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let child = child.unsigned_abs();
    let _ = ANCHOR.set(child);
    Ok(child)
}

/// The anchor's whole life: hold no fd, block every signal but SIGKILL,
/// and sleep until its parent (the VMM, whose pid is `arg`) goes, which
/// the kernel tells it by a parent-death signal; then end at once if it
/// was never reported to a server, else [`ORPHAN_SECONDS`] later (the
/// server kills it before, once it needs it no more). No periodic
/// wake-up: a host runs a thousand of these.
extern "C" fn anchor_main(arg: *mut libc::c_void) -> libc::c_int {
    // Every fd, from 0: the anchor must hold neither the server's
    // connection nor the uffd nor any memfd, or their owners would not
    // see them close when the VMM goes.
    raw::syscall3(libc::SYS_close_range, 0, u64::from(u32::MAX), 0);
    let all: u64 = u64::MAX;
    raw::syscall4(
        libc::SYS_rt_sigprocmask,
        libc::SIG_BLOCK as u64,
        std::ptr::addr_of!(all) as u64,
        0,
        8,
    );
    // Named apart from its VMM in `ps` and /proc (it shares the VMM's
    // command line, which lives in the memory they share).
    raw::syscall3(
        libc::SYS_prctl,
        libc::PR_SET_NAME as u64,
        NAME.as_ptr() as u64,
        0,
    );
    let death = libc::SIGUSR2;
    raw::syscall3(
        libc::SYS_prctl,
        libc::PR_SET_PDEATHSIG as u64,
        death.unsigned_abs().into(),
        0,
    );
    let vmm = i64::try_from(arg as usize).unwrap_or(-1);
    // The VMM may have gone before the prctl: then no signal comes.
    if raw::syscall3(libc::SYS_getppid, 0, 0, 0) == vmm {
        let set: u64 = 1 << (death - 1);
        loop {
            let r = raw::syscall4(
                libc::SYS_rt_sigtimedwait,
                std::ptr::addr_of!(set) as u64,
                0,
                0,
                8,
            );
            if r == i64::from(death) {
                break;
            }
        }
    }
    if REPORTED.load(Ordering::SeqCst) {
        let wait = libc::timespec {
            tv_sec: ORPHAN_SECONDS.cast_signed(),
            tv_nsec: 0,
        };
        let mut left = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let mut at = wait;
        // Slept through, however often interrupted.
        while raw::syscall3(
            libc::SYS_nanosleep,
            std::ptr::addr_of!(at) as u64,
            std::ptr::addr_of_mut!(left) as u64,
            0,
        ) == -i64::from(libc::EINTR)
        {
            at = left;
        }
    }
    raw::syscall3(libc::SYS_exit, 0, 0, 0);
    0
}

/// System calls without libc: nothing here writes `errno` or any other
/// thread-local (see the module doc).
mod raw {
    /// A system call of up to three arguments; returns the kernel's
    /// result (a negative errno on failure).
    #[inline(always)]
    pub fn syscall3(n: libc::c_long, a: u64, b: u64, c: u64) -> i64 {
        syscall4(n, a, b, c, 0)
    }

    /// A system call of up to four arguments.
    #[inline(always)]
    pub fn syscall4(n: libc::c_long, a: u64, b: u64, c: u64, d: u64) -> i64 {
        let ret: i64;
        // SAFETY: the x86-64 system call convention; the callers pass
        // only pointers to live memory of their own stack frame.
        unsafe {
            std::arch::asm!(
                "syscall",
                inlateout("rax") n => ret,
                in("rdi") a,
                in("rsi") b,
                in("rdx") c,
                in("r10") d,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret
    }
}
