//! hugetlb installs: one whole block per fault (from the file's page
//! cache, or read into the staging buffer), and blocks ahead of a
//! sequential reader.

use shared::PAGE_SIZE;
use uffd_abi::{Errno, Install};
use vm_memory::VolatileSlice;

use crate::observe::access::By;
use crate::observe::phases::{self, Phase};
use crate::pages::{read_pages, PageTable, ResolveError, SourceArena};

use super::base::map_block;
use super::target::{Books, How, Page, Request, Target, STAGING};

/// The most hugetlb blocks a sequential fault installs ahead of the
/// reader (8 MiB): enough that the reader waits on one fault per five
/// blocks, few enough that another VM's fault waits at most a few block
/// copies behind it on the core thread.
const BLOCKS_AHEAD_MAX: u64 = 4;

/// Install the hugetlb block holding `req.page`: its pages are read from
/// their sources (a block may mix them: a fork parent's pages beside zero
/// pages, an image's data beside its holes) and go in with one UFFDIO_COPY
/// of the block, which the kernel installs whole.
pub(super) fn install_block(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    req: &Request,
) -> Result<Page, ResolveError> {
    let page = req.page;
    let (lo, hi) = t.units(page, page + 1);
    let src = b.table().get(page);
    if src == b.self_src() {
        return Ok(Page::Present);
    }
    if let Some(on) = t
        .shared
        .filter(|on| (lo..hi).all(|p| b.table().get(p) == on.src))
    {
        return map_block(b, arena, t, on, (page, req.write), lo, hi);
    }
    b.before_install(lo, hi)?;
    let res = copy_block(arena, b.table(), t, lo, hi)?;
    phases::lap(Phase::Install);
    let how = How {
        fault: page,
        by: By::Missing,
        from: src,
    };
    match res {
        Install::Done => {
            b.mark(lo, hi - lo, how);
            if req.blocks_ahead {
                block_ahead(b, arena, t, req, lo, hi);
            }
            Ok(Page::Woken)
        }
        // No page to put there: the kernel says EEXIST (see
        // `hugepages_exhausted`).
        Install::Exists { .. } if crate::memory::hugepages_exhausted() => {
            Err(ResolveError::HugePagesExhausted { first: lo })
        }
        // Present already (the kernel installs hugetlb blocks whole).
        Install::Exists { .. } => {
            b.mark(lo, hi - lo, how);
            Ok(Page::Present)
        }
        Install::Again { .. } => Ok(Page::Again),
        Install::Gone => Ok(Page::Gone),
        Install::Failed(errno) => Err(ResolveError::Install { first: lo, errno }),
    }
}

/// Readahead for hugetlb memory: when the block `[lo, hi)` just installed
/// (its faulting thread already woken) follows the block faulted before
/// it, install the blocks after it too, while the vCPU works through this
/// one. The run ahead doubles with each sequential fault, from one block
/// up to [`BLOCKS_AHEAD_MAX`], so a sequential reader soon faults once per
/// five blocks; any other fault starts again from none. Only blocks that
/// start with image data; off with readahead (`readahead_kib` 0). A
/// failure here is left to the fault that will come for that block.
fn block_ahead(
    b: &mut impl Books,
    arena: &SourceArena,
    t: &Target<'_>,
    req: &Request,
    lo: u64,
    hi: u64,
) {
    let ra = b.readahead_mut();
    let sequential = ra.max_pages > 0 && ra.next == lo;
    ra.next = hi;
    // For hugetlb memory the window counts blocks, not pages.
    ra.window = if sequential {
        (ra.window * 2).clamp(1, BLOCKS_AHEAD_MAX)
    } else {
        0
    };
    let block = hi - lo;
    for _ in 0..b.readahead().window {
        let at = b.readahead().next;
        let end = at + block;
        if end > req.bounds.end {
            return;
        }
        let src = b.table().get(at);
        // Image data only, as for 4 KiB pages: reading ahead from a fork
        // parent or of zero pages would only copy memory early.
        if src == b.self_src() || !arena.get(src).is_some_and(|s| s.fault_around()) {
            return;
        }
        // A block of the client's shared base is mapped from it, as its
        // fault would be; one there already (mapped shared, or written)
        // ends the run: it is not the client's own copy to record.
        if let Some(on) = t
            .shared
            .filter(|on| (at..end).all(|p| b.table().get(p) == on.src))
        {
            match map_block(b, arena, t, on, (lo, false), at, end) {
                Ok(Page::Woken) => {
                    b.readahead_mut().next = end;
                    continue;
                }
                _ => return,
            }
        }
        match copy_block(arena, b.table(), t, at, end) {
            Ok(Install::Done) => {}
            // Present already in a memfd of its own: the kernel installs
            // hugetlb blocks whole, so the block is the client's. Over a
            // base it may be mapped shared: not the client's own.
            Ok(Install::Exists { .. })
                if t.shared.is_none() && !crate::memory::hugepages_exhausted() => {}
            _ => return,
        }
        let how = How {
            fault: lo,
            by: By::FaultAround,
            from: src,
        };
        b.mark(at, block, how);
        b.readahead_mut().next = end;
    }
}

/// UFFDIO_COPY the hugetlb block `[lo, hi)` to the client. A block that
/// is all data of one image file goes straight from the file's page cache
/// ([`crate::pages::FileSource::mapped`]): the `pread` into the staging
/// buffer was half the copying of a block. Any other block, or one whose
/// copy from the mapping faults (the file changed under it), is read into
/// the staging buffer, which also names what went wrong.
fn copy_block(
    arena: &SourceArena,
    table: &PageTable,
    t: &Target<'_>,
    lo: u64,
    hi: u64,
) -> Result<Install, ResolveError> {
    if let Some(from) = mapped_block(arena, table, lo, hi)? {
        phases::lap(Phase::Resolve);
        let len = (hi - lo) * PAGE_SIZE;
        // SAFETY: `from` is `len` bytes inside a mapping that the source
        // (held by the arena, which this borrows) keeps alive for the
        // call; only the kernel reads it. Mapping the block's page cache
        // first (best effort) spares the copy its slow path, which starts
        // again after a fault on its source.
        let res = unsafe {
            libc::madvise(
                from.cast_mut().cast(),
                shared::geometry::usize_of(len),
                libc::MADV_POPULATE_READ,
            );
            t.copy(from, lo, len)
        };
        // The copy mapped the block's page cache into this process: unmap
        // it again, so the server's own memory does not grow by every
        // image block it serves (the page cache stays).
        // SAFETY: as above; MADV_DONTNEED on a shared file mapping only
        // drops page-table entries.
        unsafe {
            libc::madvise(
                from.cast_mut().cast(),
                shared::geometry::usize_of(len),
                libc::MADV_DONTNEED,
            );
        }
        if !matches!(res, Install::Failed(Errno::EFAULT)) {
            return Ok(res);
        }
    }
    read_block(arena, table, lo, hi, |bytes| {
        // SAFETY: `bytes` is the whole block, borrowed for the call.
        unsafe { t.copy(bytes.as_ptr(), lo, bytes.len() as u64) }
    })
}

/// Where block `[lo, hi)` lies in its image's mapping, if the whole block
/// is data of one `File` or `Image` source inside the file's length and the
/// file can be mapped.
fn mapped_block(
    arena: &SourceArena,
    table: &PageTable,
    lo: u64,
    hi: u64,
) -> Result<Option<*const u8>, ResolveError> {
    let src = table.get(lo);
    if (lo + 1..hi).any(|p| table.get(p) != src) {
        return Ok(None);
    }
    let Some(f) = arena.get(src).and_then(|s| s.file()) else {
        return Ok(None);
    };
    if hi * PAGE_SIZE > f.len {
        return Ok(None);
    }
    crate::pages::resolve::check_unchanged(f)?;
    let Some(map) = f.mapped() else {
        return Ok(None);
    };
    let off = shared::geometry::usize_of(lo * PAGE_SIZE);
    // SAFETY: `off + (hi - lo) * PAGE_SIZE` is within the file's length
    // when opened, which is the mapping's size.
    Ok(Some(unsafe { map.as_ptr().add(off).cast_const() }))
}

/// Read pages `[lo, hi)` as `table` describes them (run by run of one
/// source) into the staging buffer, and call `f` with the bytes.
pub fn read_block<R>(
    arena: &SourceArena,
    table: &PageTable,
    lo: u64,
    hi: u64,
    f: impl FnOnce(&[u8]) -> R,
) -> Result<R, ResolveError> {
    STAGING.with(|buf| {
        let mut buf = buf.borrow_mut();
        let bytes = shared::geometry::usize_of((hi - lo) * PAGE_SIZE);
        if buf.len() < bytes {
            buf.resize(bytes, 0);
        }
        let lookup = |id| arena.memory_of(id);
        let mut p = lo;
        while p < hi {
            let src = table.get(p);
            let mut q = p + 1;
            while q < hi && table.get(q) == src {
                q += 1;
            }
            let source = arena.get(src).ok_or(ResolveError::UnknownSource(src))?;
            let at = shared::geometry::usize_of((p - lo) * PAGE_SIZE);
            let end = shared::geometry::usize_of((q - lo) * PAGE_SIZE);
            let dst = VolatileSlice::from(&mut buf[at..end]);
            read_pages(source, p, &dst, &lookup)?;
            p = q;
        }
        phases::lap(Phase::Resolve);
        Ok(f(&buf[..bytes]))
    })
}
