//! Baseline page-fault handler: what Firecracker's example on-demand
//! handler does.
//!
//! The guest memory is anonymous MAP_PRIVATE memory registered MISSING with
//! a userfaultfd; the handler maps the memory image MAP_PRIVATE read-only
//! and answers every fault with exactly one UFFDIO_COPY of the one 4 KiB
//! page that faulted (no fault-around, no prefetch). It runs on its own
//! thread, polling the uffd, so each fault costs a real round trip between
//! the faulting thread and the handler, as between Firecracker and its
//! handler process.
//!
//! ```text
//!   client thread                 kernel                 handler thread
//!   read page p ───────────▶ MISSING fault ── event ──▶ poll + read
//!        (blocked)                                       UFFDIO_COPY(p, 4 KiB)
//!   resumes ◀──────────────────── wake ◀─────────────────┘
//! ```

use std::ffi::c_void;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use uffd_abi::{Errno, Install};
use userfaultfd::{Event, Uffd, UffdBuilder};

use crate::mapping::{Mapping, MappingError, PAGE};

/// Errors of the baseline handler.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    #[error("cannot map memory")]
    Map(#[from] MappingError),
    #[error("cannot create a userfaultfd (needs /dev/userfaultfd or vm.unprivileged_userfaultfd)")]
    CreateUffd(#[source] userfaultfd::Error),
    #[error("cannot register the guest memory MISSING")]
    Register(#[source] userfaultfd::Error),
    #[error("cannot read a userfaultfd event")]
    ReadEvent(#[source] userfaultfd::Error),
    #[error("UFFDIO_COPY of page {page} failed")]
    Copy {
        page: usize,
        #[source]
        source: Errno,
    },
    #[error("UFFDIO_COPY of page {page} stopped: the address space is changing")]
    CopyAgain { page: usize },
    #[error("fault at {addr:#x} outside the guest memory")]
    OutOfRange { addr: usize },
    #[error("the handler thread panicked")]
    Panicked,
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, HandlerError>;

/// What the handler did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandlerStats {
    /// Page-fault events read.
    pub faults: u64,
    /// UFFDIO_COPY calls that installed a page.
    pub copies: u64,
    /// How long each UFFDIO_COPY took, in nanoseconds (the kernel's cost
    /// of the install, wake of the faulting thread included).
    pub copy_ns: Vec<u64>,
}

impl HandlerStats {
    /// The `pct` percentile (nearest rank) of the UFFDIO_COPY times, ns.
    pub fn copy_percentile(&self, pct: usize) -> u64 {
        let mut v = self.copy_ns.clone();
        v.sort_unstable();
        v.get((v.len() * pct).div_ceil(100).max(1) - 1)
            .copied()
            .unwrap_or(0)
    }
}

/// A guest-memory region served by the baseline handler.
#[derive(Debug)]
pub struct BaselineVm {
    // Field order: stop the handler (and close the uffd) before unmapping.
    handler: Option<Handler>,
    memory: Mapping,
}

#[derive(Debug)]
struct Handler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Result<HandlerStats>>,
}

impl BaselineVm {
    /// Map `len` bytes of anonymous guest memory, register it with a new
    /// uffd, and start a handler serving it from `image` (at offset 0).
    pub fn start(image: &Path, len: usize) -> Result<BaselineVm> {
        let memory = Mapping::anonymous(len)?;
        let uffd = UffdBuilder::new()
            .close_on_exec(true)
            .non_blocking(true)
            .user_mode_only(true)
            .create()
            .map_err(HandlerError::CreateUffd)?;
        uffd.register(memory.ptr().cast::<c_void>(), len)
            .map_err(HandlerError::Register)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (base, image, flag) = (memory.ptr() as usize, image.to_owned(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("fc-baseline-handler".into())
            .spawn(move || serve(&uffd, &image, base, len, &flag))
            .map_err(|_| HandlerError::Panicked)?;
        Ok(BaselineVm {
            handler: Some(Handler { stop, thread }),
            memory,
        })
    }

    /// The guest memory.
    pub fn memory(&self) -> &Mapping {
        &self.memory
    }

    /// Read the first byte of each page in `order` (page indices); returns
    /// the time taken and the sum of the bytes read.
    pub fn touch(&self, order: &[usize]) -> (Duration, u64) {
        let mut sum = 0u64;
        let t = Instant::now();
        for &p in order {
            let off = p * PAGE;
            assert!(off < self.memory.len(), "page {p} outside the guest memory");
            // SAFETY: off is inside our mapping; a missing page is installed
            // by the handler thread before the read returns.
            sum += u64::from(unsafe { self.memory.ptr().add(off).read_volatile() });
        }
        (t.elapsed(), sum)
    }

    /// [`Self::touch`] timing every read: returns the time taken, the sum,
    /// and the median and 99th percentile of one read in nanoseconds (a
    /// fault's whole round trip for a missing page).
    pub fn touch_latency(&self, order: &[usize]) -> (Duration, u64, u64, u64) {
        let mut sum = 0u64;
        let mut lat = Vec::with_capacity(order.len());
        let t = Instant::now();
        let mut before = t;
        for &p in order {
            let off = p * PAGE;
            assert!(off < self.memory.len(), "page {p} outside the guest memory");
            // SAFETY: as in `touch`.
            sum += u64::from(unsafe { self.memory.ptr().add(off).read_volatile() });
            let after = Instant::now();
            lat.push(u64::try_from((after - before).as_nanos()).unwrap_or(u64::MAX));
            before = after;
        }
        let took = t.elapsed();
        lat.sort_unstable();
        let q = |f: usize| {
            lat.get((lat.len() * f).div_ceil(100).max(1) - 1)
                .copied()
                .unwrap_or(0)
        };
        (took, sum, q(50), q(99))
    }

    /// Stop the handler and return what it did.
    pub fn finish(mut self) -> Result<HandlerStats> {
        let h = self.handler.take().ok_or(HandlerError::Panicked)?;
        h.stop.store(true, Ordering::Relaxed);
        h.thread.join().map_err(|_| HandlerError::Panicked)?
    }
}

impl Drop for BaselineVm {
    fn drop(&mut self) {
        if let Some(h) = self.handler.take() {
            h.stop.store(true, Ordering::Relaxed);
            let _ = h.thread.join();
        }
    }
}

/// The handler loop: one UFFDIO_COPY of one page per fault, from a
/// MAP_PRIVATE mapping of `image` made when serving starts.
fn serve(
    uffd: &Uffd,
    image: &Path,
    base: usize,
    len: usize,
    stop: &AtomicBool,
) -> Result<HandlerStats> {
    let src = Mapping::private_file(image, len)?;
    let mut stats = HandlerStats::default();
    while !stop.load(Ordering::Relaxed) {
        let mut pfd = libc::pollfd {
            fd: uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, 50) };
        if n <= 0 {
            continue;
        }
        while let Some(event) = uffd.read_event().map_err(HandlerError::ReadEvent)? {
            let Event::Pagefault { addr, .. } = event else {
                continue;
            };
            stats.faults += 1;
            let addr = addr as usize;
            if addr < base || addr >= base + len {
                return Err(HandlerError::OutOfRange { addr });
            }
            let offset = (addr - base) & !(PAGE - 1);
            let page = offset / PAGE;
            let t = Instant::now();
            // SAFETY: src covers [0, len) of the image, so the page at
            // `offset` is PAGE readable bytes of our live mapping.
            let copied = unsafe {
                uffd_abi::copy(
                    uffd,
                    src.ptr().add(offset),
                    (base + offset) as u64,
                    PAGE as u64,
                    0,
                )
            };
            stats
                .copy_ns
                .push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
            match copied {
                Install::Done => stats.copies += 1,
                // Already installed (cannot happen with one faulting thread,
                // but the example handler tolerates it): wake the faulter.
                Install::Exists { .. } => {
                    let _ = uffd_abi::wake(uffd, (base + offset) as u64, PAGE as u64);
                }
                // No REMOVE events are registered, so this is unexpected.
                Install::Again { .. } => return Err(HandlerError::CopyAgain { page }),
                Install::Gone => {
                    return Err(HandlerError::Copy {
                        page,
                        source: Errno::ESRCH,
                    })
                }
                Install::Failed(source) => return Err(HandlerError::Copy { page, source }),
            }
        }
    }
    Ok(stats)
}
