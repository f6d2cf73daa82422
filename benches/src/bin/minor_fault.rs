//! Fault cost on a shared base (issue 39): one page fault served by mapping
//! a page of a shared base memfd (MINOR fault + `UFFDIO_CONTINUE` on a
//! MAP_PRIVATE mapping of the base) next to today's copy (MISSING fault +
//! `UFFDIO_COPY` into the VM's own MAP_SHARED memfd), side by side in one
//! process, no KVM.
//!
//! Each measurement maps a fresh region of 4 KiB pages, registers it with a
//! new userfaultfd (MISSING | WP for a MAP_SHARED memfd, as guest RAM is
//! registered today; MISSING | MINOR | WP for a private mapping of a base),
//! and a toucher thread reads (or writes) one word of every page in order
//! while this thread serves each fault. The toucher's time divided by the
//! pages is the figure: the fault, the event's round trip between the two
//! threads, the install ioctl and the wake.
//!
//! | mode | memory | fault | answer |
//! |---|---|---|---|
//! | `copy_shared` (today) | MAP_SHARED memfd, empty | MISSING | UFFDIO_COPY |
//! | `continue` | MAP_PRIVATE over a base holding every page | MINOR | UFFDIO_CONTINUE |
//! | `copy_private` | MAP_PRIVATE over an empty base | MISSING | UFFDIO_COPY (a private page) |
//!
//! Each mode also answers a fault with the whole aligned block of 16 or
//! 512 pages around it (one ioctl, so one fault per block), and the write
//! row has the toucher write instead of read: a write as first access to a
//! page in the base faults MINOR, and after CONTINUE the kernel copies the
//! page on write into a private one. The last row is the server's side
//! alone: one install ioctl per page with no thread faulting (as when
//! pages are pushed ahead of the guest). Modes run interleaved within each
//! repetition so load on the machine hits them alike.
//!
//! Usage: `minor_fault [--quick]`. Prints JSON rows.

use std::ffi::c_void;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pagefork_benches::mapping::{Mapping, MappingError, PAGE};
use pagefork_benches::{Plan, Row, Stats};
use uffd_abi::{Install, UFFD_FEATURE_MINOR_SHMEM, UFFD_FEATURE_WP_HUGETLBFS_SHMEM};
use userfaultfd::{Event, FaultKind, FeatureFlags, RegisterMode, Uffd, UffdBuilder};

const BENCH: &str = "minor_fault";
const TABLE: &str = "Shared bases: one page fault, mapped vs copied (issue 39)";

/// Errors of one measurement.
#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error("cannot create the memfd")]
    CreateMemfd(#[source] std::io::Error),
    #[error("cannot fill the base memfd")]
    FillBase(#[source] std::io::Error),
    #[error("cannot map memory")]
    Map(#[from] MappingError),
    #[error("cannot create a userfaultfd with MINOR_SHMEM and WP_HUGETLBFS_SHMEM (Linux 5.19+, /dev/userfaultfd or vm.unprivileged_userfaultfd)")]
    CreateUffd(#[source] userfaultfd::Error),
    #[error("cannot register the region with the userfaultfd")]
    Register(#[source] userfaultfd::Error),
    #[error("cannot read a userfaultfd event")]
    ReadEvent(#[source] userfaultfd::Error),
    #[error("UFFDIO_COPY at page {page}: {outcome:?}")]
    Copy { page: usize, outcome: Install },
    #[error("UFFDIO_CONTINUE at page {page}")]
    Continue {
        page: usize,
        #[source]
        source: userfaultfd::Error,
    },
    #[error("a {kind:?} fault in mode {mode}, which never expects one")]
    UnexpectedFault { mode: &'static str, kind: FaultKind },
    #[error("the toucher thread panicked")]
    Toucher,
}

type Result<T> = std::result::Result<T, BenchError>;

/// What guest RAM is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Memory {
    /// A MAP_SHARED memfd with nothing in it (today's guest RAM).
    Shared,
    /// MAP_PRIVATE over a base memfd that holds every page.
    PrivateOverFullBase,
    /// MAP_PRIVATE over a base memfd that holds no page.
    PrivateOverEmptyBase,
}

/// One configuration measured.
#[derive(Debug, Clone, Copy)]
struct Mode {
    name: &'static str,
    memory: Memory,
    /// Pages installed per fault (an aligned block around the fault).
    block: usize,
    /// The toucher writes (else reads).
    write: bool,
}

impl Mode {
    const fn new(name: &'static str, memory: Memory, block: usize, write: bool) -> Mode {
        Mode {
            name,
            memory,
            block,
            write,
        }
    }
}

const MODES: [Mode; 9] = [
    Mode::new("copy_shared", Memory::Shared, 1, false),
    Mode::new("continue", Memory::PrivateOverFullBase, 1, false),
    Mode::new("copy_private", Memory::PrivateOverEmptyBase, 1, false),
    Mode::new("copy_shared16", Memory::Shared, 16, false),
    Mode::new("continue16", Memory::PrivateOverFullBase, 16, false),
    Mode::new("copy_shared512", Memory::Shared, 512, false),
    Mode::new("continue512", Memory::PrivateOverFullBase, 512, false),
    Mode::new("copy_shared_write", Memory::Shared, 1, true),
    Mode::new("continue_write", Memory::PrivateOverFullBase, 1, true),
];

/// What one run of a mode measured.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// The toucher's time per page, µs.
    us_per_page: f64,
    /// The install ioctl's mean time per fault, µs (wake included).
    ioctl_us: f64,
}

/// `len` bytes that are not all zero (a zero page could be special-cased).
fn pattern(len: usize) -> Vec<u8> {
    (0..=250u8).cycle().take(len).collect()
}

/// A memfd of `len` bytes; with `fill`, every page written (so it is in
/// the page cache, as a base the server filled).
fn memfd(len: usize, fill: bool) -> Result<File> {
    let file = memfd::MemfdOptions::default()
        .close_on_exec(true)
        .create("pagefork-minor-bench")
        .map_err(|e| BenchError::CreateMemfd(std::io::Error::other(e.to_string())))?
        .into_file();
    file.set_len(len as u64).map_err(BenchError::CreateMemfd)?;
    if fill {
        let chunk = pattern(1 << 20);
        for off in (0..len).step_by(chunk.len()) {
            let n = chunk.len().min(len - off);
            file.write_all_at(&chunk[..n], off as u64)
                .map_err(BenchError::FillBase)?;
        }
    }
    Ok(file)
}

/// Touch one word of each of `pages` pages from `base`, in order.
fn touch(base: usize, pages: usize, write: bool) -> Duration {
    let t = Instant::now();
    for p in 0..pages {
        let at = (base + p * PAGE) as *mut u64;
        if write {
            // SAFETY: `at` is inside the registered read-write mapping the
            // caller keeps alive until this thread is joined; a missing page
            // is installed by the serving thread before the access returns.
            unsafe { at.write_volatile(p as u64) };
        } else {
            // SAFETY: as above.
            std::hint::black_box(unsafe { at.read_volatile() });
        }
    }
    t.elapsed()
}

/// Measure `mode` over `pages` pages once.
fn measure(mode: Mode, pages: usize) -> Result<Sample> {
    let len = pages * PAGE;
    let (map, register) = match mode.memory {
        Memory::Shared => (
            Mapping::shared_memfd(len)?,
            RegisterMode::MISSING | RegisterMode::WRITE_PROTECT,
        ),
        Memory::PrivateOverFullBase | Memory::PrivateOverEmptyBase => {
            let base = memfd(len, mode.memory == Memory::PrivateOverFullBase)?;
            (
                Mapping::private_memfd(&base, len)?,
                RegisterMode::MISSING | RegisterMode::MINOR | RegisterMode::WRITE_PROTECT,
            )
        }
    };
    let uffd = new_uffd()?;
    uffd.register_with_mode(map.ptr().cast::<c_void>(), len, register)
        .map_err(BenchError::Register)?;
    // The bytes UFFDIO_COPY installs: one block.
    let src = pattern(mode.block * PAGE);

    let base = map.ptr() as usize;
    let done = Arc::new(AtomicBool::new(false));
    let toucher = {
        let done = done.clone();
        std::thread::spawn(move || {
            let took = touch(base, pages, mode.write);
            done.store(true, Ordering::Release);
            took
        })
    };
    let served = serve(&uffd, mode, base, pages, &src, &done);
    // On a serving error the toucher may still be blocked in a fault:
    // closing the uffd (dropped below, before the mapping) wakes it.
    let (faults, ioctl) = match served {
        Ok(s) => s,
        Err(e) => {
            drop(uffd);
            let _ = toucher.join();
            return Err(e);
        }
    };
    let took = toucher.join().map_err(|_| BenchError::Toucher)?;
    drop(uffd);
    drop(map);
    Ok(Sample {
        us_per_page: took.as_secs_f64() * 1e6 / pages as f64,
        ioctl_us: ioctl.as_secs_f64() * 1e6 / faults.max(1) as f64,
    })
}

/// Install every page of a fresh region with one ioctl per page and no
/// thread faulting: CONTINUE over a full base (`continue_`) or COPY into a
/// MAP_SHARED memfd. Returns µs per page.
fn prefill(continue_: bool, pages: usize) -> Result<f64> {
    let len = pages * PAGE;
    let (map, register) = if continue_ {
        let base = memfd(len, true)?;
        (
            Mapping::private_memfd(&base, len)?,
            RegisterMode::MISSING | RegisterMode::MINOR | RegisterMode::WRITE_PROTECT,
        )
    } else {
        (
            Mapping::shared_memfd(len)?,
            RegisterMode::MISSING | RegisterMode::WRITE_PROTECT,
        )
    };
    let uffd = new_uffd()?;
    uffd.register_with_mode(map.ptr().cast::<c_void>(), len, register)
        .map_err(BenchError::Register)?;
    let src = pattern(PAGE);
    let base = map.ptr() as usize;
    let t = Instant::now();
    for page in 0..pages {
        let at = base + page * PAGE;
        if continue_ {
            uffd.r#continue(at as *mut c_void, PAGE, false)
                .map_err(|source| BenchError::Continue { page, source })?;
        } else {
            // SAFETY: `src` holds PAGE readable bytes for the whole call.
            let outcome = unsafe { uffd_abi::copy(&uffd, src.as_ptr(), at as u64, PAGE as u64, 0) };
            if outcome != Install::Done {
                return Err(BenchError::Copy { page, outcome });
            }
        }
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / pages as f64)
}

/// A userfaultfd that can register shmem MINOR and WP, for faults taken by
/// the kernel too (as KVM's).
fn new_uffd() -> Result<Uffd> {
    UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(false)
        .require_features(FeatureFlags::from_bits_retain(
            UFFD_FEATURE_MINOR_SHMEM | UFFD_FEATURE_WP_HUGETLBFS_SHMEM,
        ))
        .create()
        .map_err(BenchError::CreateUffd)
}

/// Serve faults until the toucher is done; returns the faults served and
/// the time spent in install ioctls.
fn serve(
    uffd: &Uffd,
    mode: Mode,
    base: usize,
    pages: usize,
    src: &[u8],
    done: &AtomicBool,
) -> Result<(u64, Duration)> {
    let mut faults = 0u64;
    let mut ioctl = Duration::ZERO;
    while !done.load(Ordering::Acquire) {
        let mut pfd = libc::pollfd {
            fd: uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        if unsafe { libc::poll(&mut pfd, 1, 20) } <= 0 {
            continue;
        }
        while let Some(event) = uffd.read_event().map_err(BenchError::ReadEvent)? {
            let Event::Pagefault { kind, addr, .. } = event else {
                continue;
            };
            faults += 1;
            let page = (addr as usize - base) / PAGE;
            let first = page / mode.block * mode.block;
            let n = mode.block.min(pages - first);
            let at = base + first * PAGE;
            let t = Instant::now();
            match (mode.memory, kind) {
                (Memory::Shared | Memory::PrivateOverEmptyBase, FaultKind::Missing) => {
                    // SAFETY: `src` holds block * PAGE >= n * PAGE readable
                    // bytes for the whole call.
                    let outcome = unsafe {
                        uffd_abi::copy(uffd, src.as_ptr(), at as u64, (n * PAGE) as u64, 0)
                    };
                    if outcome != Install::Done {
                        return Err(BenchError::Copy { page, outcome });
                    }
                }
                (Memory::PrivateOverFullBase, FaultKind::Minor) => {
                    uffd.r#continue(at as *mut c_void, n * PAGE, true)
                        .map_err(|source| BenchError::Continue { page, source })?;
                }
                (_, kind) => {
                    return Err(BenchError::UnexpectedFault {
                        mode: mode.name,
                        kind,
                    })
                }
            }
            ioctl += t.elapsed();
        }
    }
    Ok((faults, ioctl))
}

fn median(v: &[f64]) -> f64 {
    Stats::of(v).map_or(f64::NAN, |s| s.median)
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    if !pagefork_tests::require_kvm_uffd() {
        eprintln!("{BENCH}: needs /dev/userfaultfd");
        return ExitCode::FAILURE;
    }
    let pages = usize::try_from(plan.minor_mib).unwrap_or(64) * (1 << 20) / PAGE;
    eprintln!("{BENCH}: {pages} pages per run, {} reps", plan.reps);
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); MODES.len()];
    let (mut pre_continue, mut pre_copy) = (Vec::new(), Vec::new());
    for rep in 0..plan.reps {
        for (continue_, out) in [(true, &mut pre_continue), (false, &mut pre_copy)] {
            match prefill(continue_, pages) {
                Ok(us) => out.push(us),
                Err(e) => {
                    eprintln!("{BENCH}: prefill (rep {rep}): {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        for (i, &mode) in MODES.iter().enumerate() {
            match measure(mode, pages) {
                Ok(s) => samples[i].push(s),
                Err(e) => {
                    eprintln!("{BENCH}: {} (rep {rep}): {e}", mode.name);
                    return ExitCode::FAILURE;
                }
            }
        }
    }
    let per_page = |name: &str| -> Vec<f64> {
        MODES
            .iter()
            .position(|m| m.name == name)
            .map(|i| samples[i].iter().map(|s| s.us_per_page).collect())
            .unwrap_or_default()
    };
    let ioctl = |name: &str| -> f64 {
        let v: Vec<f64> = MODES
            .iter()
            .position(|m| m.name == name)
            .map(|i| samples[i].iter().map(|s| s.ioctl_us).collect())
            .unwrap_or_default();
        median(&v)
    };
    for (m, s) in MODES.iter().zip(&samples) {
        let pp: Vec<f64> = s.iter().map(|s| s.us_per_page).collect();
        eprintln!(
            "  {:<18} {:>8.3} µs/page  (install ioctl {:.2} µs per fault)",
            m.name,
            median(&pp),
            ioctl(m.name)
        );
    }
    // `a` and `b` are mode names; the ioctl's time includes waking the
    // toucher.
    eprintln!(
        "  ioctl per page, no faulter: CONTINUE {:.3} µs, COPY {:.3} µs",
        median(&pre_continue),
        median(&pre_copy)
    );
    let note_ioctl = |a: &str, b: &str| {
        format!(
            "the install ioctl alone (wake included), per fault: {:.2} µs ({a}) vs {:.2} µs ({b}); \
             the rest is the fault and the round trip to the serving thread",
            ioctl(a),
            ioctl(b)
        )
    };
    let rows = [
        Row::new(
            BENCH,
            "minor.continue",
            TABLE,
            "read fault on MAP_PRIVATE over a base holding the page: MINOR + UFFDIO_CONTINUE (page shared, not copied)",
            "µs/page",
            &per_page("continue"),
            "MISSING + UFFDIO_COPY into a MAP_SHARED memfd (today)",
            &per_page("copy_shared"),
        )
        .goal("≤ 1")
        .note(note_ioctl("continue", "copy_shared")),
        Row::new(
            BENCH,
            "minor.copy_private",
            TABLE,
            "read fault on MAP_PRIVATE over a base lacking the page: MISSING + UFFDIO_COPY (a private page)",
            "µs/page",
            &per_page("copy_private"),
            "MISSING + UFFDIO_COPY into a MAP_SHARED memfd (today)",
            &per_page("copy_shared"),
        )
        .goal("≈ 1")
        .note(note_ioctl("copy_private", "copy_shared")),
        Row::new(
            BENCH,
            "minor.continue16",
            TABLE,
            "as row 1, one CONTINUE of the aligned 16 pages (64 KiB) per fault",
            "µs/page",
            &per_page("continue16"),
            "one UFFDIO_COPY of 16 pages into a MAP_SHARED memfd per fault",
            &per_page("copy_shared16"),
        )
        .goal("≤ 1")
        .note(note_ioctl("continue16", "copy_shared16")),
        Row::new(
            BENCH,
            "minor.continue512",
            TABLE,
            "as row 1, one CONTINUE of the aligned 512 pages (2 MiB) per fault",
            "µs/page",
            &per_page("continue512"),
            "one UFFDIO_COPY of 512 pages into a MAP_SHARED memfd per fault",
            &per_page("copy_shared512"),
        )
        .goal("≤ 1")
        .note(note_ioctl("continue512", "copy_shared512")),
        Row::new(
            BENCH,
            "minor.continue_write",
            TABLE,
            "write as first access on MAP_PRIVATE over a base: MINOR (write) + UFFDIO_CONTINUE, then the kernel copies on write",
            "µs/page",
            &per_page("continue_write"),
            "MISSING (write) + UFFDIO_COPY into a MAP_SHARED memfd (today)",
            &per_page("copy_shared_write"),
        )
        .goal("report")
        .note(note_ioctl("continue_write", "copy_shared_write")),
        Row::new(
            BENCH,
            "minor.ioctl",
            TABLE,
            "the install alone, no thread faulting: one UFFDIO_CONTINUE per page over a base",
            "µs/page",
            &pre_continue,
            "one UFFDIO_COPY per page into a MAP_SHARED memfd",
            &pre_copy,
        )
        .goal("≤ 1")
        .note("the server's cost per page pushed ahead of the guest; no wake, no round trip"),
    ];
    for r in &rows {
        r.emit();
    }
    ExitCode::SUCCESS
}
