//! The page resolver both kinds of VM share: which run of pages to install
//! for a fault, and the bytes of pages from their source.
//!
//! Both kinds of VM install the bytes the same way (the fault installer,
//! `core/fault/install/`: read into its staging buffer, then UFFDIO_COPY
//! through the VM's uffd); what to install and what the bytes are is
//! decided here, once, so a new kind of source is added in [`read_pages`]
//! and serves both.

use std::ops::Range;
use std::os::fd::AsRawFd;
use std::path::PathBuf;

use shared::{VmId, PAGE_SIZE};
use vm_memory::VolatileSlice;

use super::process::ProcessReadError;
use super::readahead::Readahead;
use super::source::{
    FileSource, ImageSource, PageSource, RemoteSource, SourceId, VmPages, ZstdSource,
};
use super::table::PageTable;
use crate::memory::MemoryError;

/// Errors of resolving a fault.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("{0} is not a VM of this server")]
    NoSuchVm(VmId),
    #[error("page source id {0} is unknown; the table names a released source")]
    UnknownSource(SourceId),
    #[error("pages {vm} wrote before it forked were lost before they reached its layer: {why}")]
    LayerLost { vm: VmId, why: String },
    #[error("{owner}, the source of page {page}, is gone")]
    SourceGone { owner: VmId, page: u64 },
    #[error("cannot read image {} at byte {offset}", path.display())]
    ReadImage {
        path: PathBuf,
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot serve image {}", path.display())]
    ImageChanged {
        path: PathBuf,
        #[source]
        source: crate::images::Changed,
    },
    #[error("UFFDIO_COPY of pages from {first} failed")]
    Install {
        first: u64,
        #[source]
        errno: uffd_abi::Errno,
    },
    #[error("the destination of pages from {first} is not a whole number of pages")]
    PartialPage { first: u64 },
    #[error(
        "no 2 MiB huge page is free for the block at page {first}: the host's hugetlb pool \
         is used up (raise /proc/sys/vm/nr_hugepages)"
    )]
    HugePagesExhausted { first: u64 },
    #[error("cannot access guest memory")]
    Memory(#[from] MemoryError),
    /// Not an error of the page: frames of a compressed image are being
    /// decoded off this thread. The fault waits for them and is retried
    /// (see [`crate::images::zst`]).
    #[error("frames {frames:?} of {} are not decoded yet", image.path.display())]
    NotDecoded {
        image: std::sync::Arc<crate::images::zst::ZstdImage>,
        frames: Range<u64>,
    },
    #[error("cannot read a page of another VM")]
    Process(#[from] ProcessReadError),
    #[error("cannot decode compressed image {}", path.display())]
    Frame {
        path: PathBuf,
        source: crate::images::zst::FrameError,
    },
    /// Not an error of the page: chunks of a snapshot in the object store
    /// are being fetched off this thread. The fault waits for them and is
    /// retried (see [`crate::remote::chunks`]).
    #[error("chunks {chunks:?} of remote snapshot {} are not here yet", image.snapshot)]
    NotFetched {
        image: std::sync::Arc<crate::remote::image::RemoteImage>,
        chunks: Range<u64>,
    },
    #[error("cannot read page {page} of {vm} back from the swap store")]
    Swap {
        vm: VmId,
        page: u64,
        #[source]
        source: crate::reclaim::store::StoreError,
    },
    #[error("cannot fetch chunk {chunk} of remote snapshot {snapshot}")]
    Chunk {
        snapshot: String,
        chunk: u64,
        source: crate::remote::chunks::ChunkError,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, ResolveError>;

/// A MISSING fault on a page whose source installs runs (an image).
#[derive(Debug, Clone)]
pub struct Fault {
    /// The page that faulted, as the table indexes it.
    pub page: u64,
    /// Pages a run may cover: the VM's memory, or the Firecracker region
    /// the fault is in. Fault-around blocks are aligned to its start.
    pub bounds: Range<u64>,
    /// Fault-around block in pages (1 = off).
    pub block: u64,
    /// Whether this fault feeds readahead (a bulk prefetch does not).
    pub track: bool,
}

/// What to install for a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// First page of the run.
    pub lo: u64,
    /// One past the last page of the run.
    pub hi: u64,
    /// The readahead window this fault used, in pages.
    pub window: u64,
}

/// The run `[lo, hi)` to install for `fault`: the pages around it in its
/// fault-around block (or, for a sequential reader, the readahead window
/// starting at it) that still read from `src`.
pub fn plan_run(table: &PageTable, src: SourceId, fault: &Fault, ra: &Readahead) -> Run {
    let page = fault.page;
    let block = fault.block.max(1);
    let (window, sequential) = ra.window(page, block, fault.track);
    let start = if sequential {
        page
    } else {
        (page - (page - fault.bounds.start) % block).max(fault.bounds.start)
    };
    let end = (start + window).min(fault.bounds.end);
    let mut lo = page;
    while lo > start && table.get(lo - 1) == src {
        lo -= 1;
    }
    let mut hi = page + 1;
    while hi < end && table.get(hi) == src {
        hi += 1;
    }
    Run { lo, hi, window }
}

/// Whether the pages `[lo, hi)` are in the client's memory already for
/// any client of their source (a shared base that holds them): a frame or
/// chunk of such pages is not decoded or fetched ahead.
pub type Held<'a> = dyn Fn(u64, u64) -> bool + 'a;

/// The fault to plan on `source`: a compressed image's run stays inside
/// the frame of the faulting page (the frame is what one decode yields, so
/// fault-around comes with it), and a sequential reader gets the next
/// frames decoded ahead, but for those whose pages are `held`.
pub fn fault_on(source: &PageSource, fault: Fault, ra: &Readahead, held: &Held<'_>) -> Fault {
    if let Some(r) = source.remote() {
        return remote_fault(r, fault, ra, held);
    }
    let Some(z) = source.zstd() else {
        return fault;
    };
    let h = z.header();
    let frame = h.frame_of(fault.page);
    let r = h.frame_range(frame);
    if fault.track && ra.max_pages > 0 && ra.next == fault.page {
        let per = u64::from(h.frame_pages);
        let ahead = (ra.max_pages / per).clamp(1, 8);
        for f in (frame + 1..frame + 1 + ahead).take_while(|f| *f < h.frames) {
            let r = h.frame_range(f);
            if !held(r.start, r.end) {
                crate::images::zst::FramePool::prefetch(z, f..f + 1);
            }
        }
    }
    Fault {
        bounds: r.start.max(fault.bounds.start)..r.end.min(fault.bounds.end),
        block: r.end - r.start,
        ..fault
    }
}

/// The fault to plan on a snapshot in the object store: as for a
/// compressed image, the run stays inside the faulting page's chunk (one
/// fetch brings all of it), and a sequential reader gets the next chunks
/// fetched ahead.
fn remote_fault(
    r: &std::sync::Arc<crate::remote::image::RemoteImage>,
    fault: Fault,
    ra: &Readahead,
    held: &Held<'_>,
) -> Fault {
    let chunk = r.chunk_of(fault.page);
    let pages = r.chunk_pages(chunk);
    if fault.track && ra.max_pages > 0 && ra.next == fault.page {
        let ahead = (ra.max_pages / crate::remote::image::CHUNK_PAGES).clamp(1, 8);
        r.prefetch(
            (chunk + 1..chunk + 1 + ahead).filter(|&c| {
                let p = r.chunk_pages(c);
                !held(p.start, p.end)
            }),
            crate::remote::chunks::Priority::Urgent,
        );
    }
    Fault {
        bounds: pages.start.max(fault.bounds.start)..pages.end.min(fault.bounds.end),
        block: pages.end - pages.start,
        ..fault
    }
}

/// Where the memory of a VM named by a `Vm(id)` source is.
pub type VmMemoryOf<'a> = dyn Fn(VmId) -> Option<VmPages> + 'a;

/// Write the bytes of pages `first..` of `source` into `dst` (a whole
/// number of pages). An image shorter than the pages reads as zeroes past
/// its end. `vm_memory` finds the memory a `Vm(id)` source names.
pub fn read_pages(
    source: &PageSource,
    first: u64,
    dst: &VolatileSlice<'_>,
    vm_memory: &VmMemoryOf<'_>,
) -> Result<()> {
    let len = dst.len();
    if !(len as u64).is_multiple_of(PAGE_SIZE) {
        return Err(ResolveError::PartialPage { first });
    }
    let ptr = dst.ptr_guard_mut().as_ptr();
    match source {
        PageSource::Uninitialized => {
            // SAFETY: `ptr..ptr+len` is the live memory `dst` describes.
            unsafe { std::ptr::write_bytes(ptr, 0, len) };
            Ok(())
        }
        PageSource::Vm(owner) => match vm_memory(*owner) {
            Some(VmPages::Memfd(mem)) => {
                let src = mem.slice(first, len as u64 / PAGE_SIZE)?;
                src.copy_to_volatile_slice(*dst);
                Ok(())
            }
            Some(VmPages::Process(p)) => Ok(p.read(first, dst)?),
            None => Err(ResolveError::SourceGone {
                owner: *owner,
                page: first,
            }),
        },
        PageSource::Swap(w) => {
            let store = w.store.borrow();
            let mut page = [0u8; shared::geometry::usize_of(PAGE_SIZE)];
            for i in 0..len as u64 / PAGE_SIZE {
                store
                    .get(w.owner(), first + i, &mut page)
                    .map_err(|source| ResolveError::Swap {
                        vm: w.vm,
                        page: first + i,
                        source,
                    })?;
                let off = usize::try_from(i * PAGE_SIZE).unwrap_or(usize::MAX);
                dst.subslice(off, page.len())
                    .map_err(|_| ResolveError::PartialPage { first })?
                    .copy_from(&page[..]);
            }
            Ok(())
        }
        PageSource::Frozen(f) => {
            f.ensure(first, len as u64 / PAGE_SIZE)
                .map_err(|lost| ResolveError::LayerLost {
                    vm: f.vm,
                    why: lost.0,
                })?;
            let src = f.memory.slice(first, len as u64 / PAGE_SIZE)?;
            src.copy_to_volatile_slice(*dst);
            Ok(())
        }
        PageSource::File(f) | PageSource::Image(ImageSource { file: f, .. }) => {
            let offset = first * PAGE_SIZE;
            check_unchanged(f)?;
            let mut done = 0usize;
            while done < len {
                let off = libc::off_t::try_from(offset + done as u64).unwrap_or(libc::off_t::MAX);
                // SAFETY: the destination is `len - done` bytes inside the
                // live memory `dst` describes; the kernel writes at most
                // that many.
                let n = unsafe {
                    libc::pread(f.file.as_raw_fd(), ptr.add(done).cast(), len - done, off)
                };
                match n {
                    n if n > 0 => done += n.unsigned_abs(),
                    0 if offset + (done as u64) < f.len => {
                        // Shorter than when it was opened: truncated under
                        // its readers (between the check above and now).
                        return Err(ResolveError::ImageChanged {
                            path: f.path.clone(),
                            source: crate::images::Changed::Modified {
                                was: f.len,
                                now: offset + done as u64,
                            },
                        });
                    }
                    0 => {
                        // Past the end of the image: the rest reads as zero.
                        // SAFETY: same range as above.
                        unsafe { std::ptr::write_bytes(ptr.add(done), 0, len - done) };
                        done = len;
                    }
                    _ => {
                        let err = std::io::Error::last_os_error();
                        if err.kind() == std::io::ErrorKind::Interrupted {
                            continue;
                        }
                        return Err(ResolveError::ReadImage {
                            path: f.path.clone(),
                            offset,
                            source: err,
                        });
                    }
                }
            }
            Ok(())
        }
        PageSource::Zstd(ZstdSource { image: z }) => {
            let pages = len as u64 / PAGE_SIZE;
            let frames = z.frames_of(first..first + pages);
            let h = z.header();
            let mut bytes = Vec::new();
            for f in frames.clone() {
                match z.cached(f) {
                    Ok(Some(b)) => bytes.push((h.frame_range(f), b)),
                    Ok(None) => {
                        return Err(ResolveError::NotDecoded {
                            image: std::sync::Arc::clone(z),
                            frames,
                        })
                    }
                    Err(source) => {
                        return Err(ResolveError::Frame {
                            path: z.path.clone(),
                            source,
                        })
                    }
                }
            }
            copy_frames(&bytes, first, pages, dst);
            Ok(())
        }
        PageSource::Remote(RemoteSource { image: r }) => {
            let pages = len as u64 / PAGE_SIZE;
            let chunks = r.chunks_of(first..first + pages);
            let mut bytes = Vec::new();
            for c in chunks.clone() {
                if r.is_hole(c) {
                    continue;
                }
                match r.cached(c) {
                    Ok(Some(b)) => bytes.push((r.chunk_pages(c), b)),
                    Ok(None) => {
                        return Err(ResolveError::NotFetched {
                            image: std::sync::Arc::clone(r),
                            chunks,
                        })
                    }
                    Err(source) => {
                        return Err(ResolveError::Chunk {
                            snapshot: r.snapshot.clone(),
                            chunk: c,
                            source,
                        })
                    }
                }
            }
            copy_frames(&bytes, first, pages, dst);
            Ok(())
        }
    }
}

/// Fail if the client's image `f` changed since it was opened (a private
/// clone cannot change).
pub fn check_unchanged(f: &FileSource) -> Result<()> {
    if let crate::images::Pin::Stamp(stamp) = &f.pin {
        stamp
            .check(&f.file)
            .map_err(|source| ResolveError::ImageChanged {
                path: f.path.clone(),
                source,
            })?;
    }
    Ok(())
}

/// A page of zeroes.
static ZERO_PAGE: [u8; shared::geometry::usize_of(PAGE_SIZE)] =
    [0; shared::geometry::usize_of(PAGE_SIZE)];

/// Copy pages `first..first + pages` out of decoded frames or fetched
/// chunks (each with the pages it holds) into `dst`; pages in none of them
/// (past the image, a hole) read as zero.
fn copy_frames(
    frames: &[(Range<u64>, std::sync::Arc<[u8]>)],
    first: u64,
    pages: u64,
    dst: &VolatileSlice<'_>,
) {
    let ps = shared::geometry::usize_of(PAGE_SIZE);
    for p in first..first + pages {
        let at = shared::geometry::usize_of((p - first) * PAGE_SIZE);
        let Ok(to) = dst.subslice(at, ps) else { return };
        match frames.iter().find(|(r, _)| r.contains(&p)) {
            Some((r, b)) => {
                let from = shared::geometry::usize_of((p - r.start) * PAGE_SIZE);
                to.copy_from(&b[from..from + ps]);
            }
            None => to.copy_from(&ZERO_PAGE[..]),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use std::rc::Rc;

    use super::*;
    use crate::memory::GuestMemory;
    use crate::pages::FileSource;

    const PAGE: usize = 4096;

    fn no_vms(_: VmId) -> Option<VmPages> {
        None
    }

    fn fault(page: u64, bounds: Range<u64>, block: u64) -> Fault {
        Fault {
            page,
            bounds,
            block,
            track: true,
        }
    }

    #[test]
    fn run_is_the_unresolved_part_of_the_aligned_block() {
        let mut t = PageTable::new(64, 1);
        t.set(17, 2); // already installed
        let run = plan_run(&t, 1, &fault(21, 0..64, 8), &Readahead::new(0));
        assert_eq!((run.lo, run.hi, run.window), (18, 24, 8));
    }

    #[test]
    fn blocks_align_to_the_start_of_the_bounds_and_stop_at_their_end() {
        let t = PageTable::new(64, 1);
        let run = plan_run(&t, 1, &fault(12, 10..20, 8), &Readahead::new(0));
        assert_eq!((run.lo, run.hi), (10, 18));
        let run = plan_run(&t, 1, &fault(19, 10..20, 8), &Readahead::new(0));
        assert_eq!((run.lo, run.hi), (18, 20));
    }

    #[test]
    fn sequential_fault_starts_the_window_at_the_fault() {
        let t = PageTable::new(256, 1);
        let mut ra = Readahead::new(64);
        ra.next = 40;
        ra.window = 16;
        let run = plan_run(&t, 1, &fault(40, 0..256, 16), &ra);
        assert_eq!((run.lo, run.hi, run.window), (40, 72, 32));
    }

    #[test]
    fn fault_around_off_installs_one_page() {
        let t = PageTable::new(8, 1);
        let run = plan_run(&t, 1, &fault(5, 0..8, 1), &Readahead::new(64));
        assert_eq!((run.lo, run.hi), (5, 6));
    }

    #[test]
    fn image_pages_read_exactly_and_zero_past_the_end() {
        let mut f = tempfile::tempfile().unwrap();
        let img: Vec<u8> = [1u8, 2, 3].iter().flat_map(|b| [*b; PAGE]).collect();
        f.write_all(&img).unwrap();
        let pin = crate::images::Pin::Stamp(crate::images::Stamp::of(&f).unwrap());
        let src = PageSource::File(FileSource::new("img".into(), f, img.len() as u64, pin));
        let mut buf = vec![0xeeu8; 3 * PAGE];
        read_pages(&src, 1, &VolatileSlice::from(&mut buf[..]), &no_vms).unwrap();
        assert!(buf[..PAGE].iter().all(|b| *b == 2));
        assert!(buf[PAGE..2 * PAGE].iter().all(|b| *b == 3));
        assert!(buf[2 * PAGE..].iter().all(|b| *b == 0), "past the end");
    }

    #[test]
    fn uninitialized_reads_zero_and_gone_vm_is_an_error() {
        let mut buf = vec![0xeeu8; PAGE];
        let dst = VolatileSlice::from(&mut buf[..]);
        read_pages(&PageSource::Uninitialized, 0, &dst, &no_vms).unwrap();
        assert!(buf.iter().all(|b| *b == 0));
        let dst = VolatileSlice::from(&mut buf[..]);
        let err = read_pages(&PageSource::Vm(VmId(7)), 3, &dst, &no_vms).unwrap_err();
        assert!(
            matches!(err, ResolveError::SourceGone { page: 3, .. }),
            "{err}"
        );
    }

    #[test]
    fn vm_source_copies_from_the_owner_memory() {
        let owner = Rc::new(GuestMemory::create("owner", 4 * PAGE_SIZE).unwrap());
        owner.slice(2, 1).unwrap().copy_from(&[9u8; PAGE]);
        let lookup = |id: VmId| (id == VmId(1)).then(|| VmPages::Memfd(owner.clone()));
        let mut buf = vec![0u8; PAGE];
        let dst = VolatileSlice::from(&mut buf[..]);
        read_pages(&PageSource::Vm(VmId(1)), 2, &dst, &lookup).unwrap();
        assert!(buf.iter().all(|b| *b == 9));
    }

    #[test]
    fn partial_pages_are_refused() {
        let mut buf = [0u8; 100];
        let dst = VolatileSlice::from(&mut buf[..]);
        let err = read_pages(&PageSource::Uninitialized, 0, &dst, &no_vms).unwrap_err();
        assert!(matches!(err, ResolveError::PartialPage { first: 0 }));
    }
}
