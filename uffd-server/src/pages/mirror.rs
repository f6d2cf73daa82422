//! A table's entries kept in shared memory that outlives the server.
//!
//! A [`PageTable`](super::PageTable) with a mirror writes every entry it
//! sets into a memfd too (4 bytes per page, the `SourceId`s, in page
//! order). The memfd is handed to the fd store (see `core::restart`), so
//! when the serving process dies, even by SIGKILL between two faults, the
//! next one maps the same memfd and reads every table exactly as it was:
//! a store into a `MAP_SHARED` page is in the page cache the moment it is
//! made, with nothing to flush.
//!
//! The fault path pays one 4-byte store per entry it sets.
//!
//! A fork's children start with the same table, so a child's mirror is an
//! overlay of an [`Under`](super::table::Under): a mirror of that table, written once and
//! never again, which all of them (and the children of later forks of the
//! same, unchanged parent) share. An overlay's entry 0 reads the under's
//! entry, [`OVER_UNINITIALIZED`] reads `Uninitialized`, any other value
//! is the source itself; a fresh overlay is all zeroes, so a child's
//! mirror allocates only the 4 KiB pages holding entries it changed
//! (the dense copy of a quarter-written 256 MiB parent was 64 KiB per
//! child).

use std::cell::Cell;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;

use vm_memory::mmap::MmapRegion;
use vm_memory::FileOffset;

use super::source::{SourceId, UNINITIALIZED};

/// An overlay's entry for a page whose source is `Uninitialized` (0
/// there means "as the under"). No arena hands out this id.
pub const OVER_UNINITIALIZED: SourceId = SourceId::MAX;

/// Why a mirror cannot be made or opened.
#[derive(Debug, thiserror::Error)]
pub enum MirrorError {
    #[error("cannot make a memfd for a table's mirror")]
    Create(#[source] std::io::Error),
    #[error("cannot map a table's mirror")]
    Map(#[source] vm_memory::mmap::MmapRegionError),
    #[error("a table's mirror holds {have} bytes, not the {want} of its {pages} pages")]
    Size { have: u64, want: u64, pages: u64 },
}

/// The shared copy of one table's entries.
#[derive(Debug)]
pub struct Mirror {
    file: File,
    map: MmapRegion,
    pages: u64,
    /// The memfd's inode number (the fd store names it by it).
    ino: u64,
    /// Made by [`Mirror::create`] or [`Mirror::create_over`] and not
    /// written yet: every entry is 0 without being stored, so its pages
    /// stay unallocated.
    fresh: Cell<bool>,
    /// An overlay (0 stored: "as the under"; the table that owns the
    /// mirror holds the under), not a dense mirror.
    over: bool,
}

fn memfd(pages: u64) -> Result<File, MirrorError> {
    let fd = nix::sys::memfd::memfd_create(
        c"pagefork-table",
        nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
    )
    .map_err(|e| MirrorError::Create(e.into()))?;
    let file = File::from(fd);
    file.set_len(Mirror::bytes(pages))
        .map_err(MirrorError::Create)?;
    Ok(file)
}

impl Mirror {
    /// A zeroed mirror (every entry `Uninitialized`) for `pages` pages.
    pub fn create(pages: u64) -> Result<Self, MirrorError> {
        let m = Self::map(memfd(pages)?, pages, false)?;
        m.fresh.set(true);
        Ok(m)
    }

    /// An overlay of `pages` entries reading exactly as its under does
    /// (every entry 0).
    pub(super) fn create_over(pages: u64) -> Result<Self, MirrorError> {
        let m = Self::map(memfd(pages)?, pages, true)?;
        m.fresh.set(true);
        Ok(m)
    }

    /// The mirror in `file` (handed back by the fd store) of a table of
    /// `pages` pages.
    pub fn open(file: File, pages: u64) -> Result<Self, MirrorError> {
        Self::open_with(file, pages, false)
    }

    /// The overlay of `pages` entries in `file` (handed back by the fd
    /// store).
    pub(super) fn open_over(file: File, pages: u64) -> Result<Self, MirrorError> {
        Self::open_with(file, pages, true)
    }

    fn open_with(file: File, pages: u64, over: bool) -> Result<Self, MirrorError> {
        let have = file.metadata().map_err(MirrorError::Create)?.len();
        let want = Self::bytes(pages);
        if have != want {
            return Err(MirrorError::Size { have, want, pages });
        }
        Self::map(file, pages, over)
    }

    fn bytes(pages: u64) -> u64 {
        pages.max(1) * std::mem::size_of::<SourceId>() as u64
    }

    fn map(file: File, pages: u64, over: bool) -> Result<Self, MirrorError> {
        let ino = file.metadata().map_err(MirrorError::Create)?.ino();
        let len = shared::geometry::usize_of(Self::bytes(pages));
        let dup = file.try_clone().map_err(MirrorError::Create)?;
        let map = MmapRegion::build(
            Some(FileOffset::new(dup, 0)),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
        )
        .map_err(MirrorError::Map)?;
        Ok(Mirror {
            file,
            map,
            pages,
            ino,
            fresh: Cell::new(false),
            over,
        })
    }

    /// The memfd, for the fd store.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The memfd's inode number.
    pub fn ino(&self) -> u64 {
        self.ino
    }

    /// Whether it is an overlay of an under.
    pub fn is_over(&self) -> bool {
        self.over
    }

    /// The memfd and its inode number, the mapping dropped.
    pub(super) fn into_file(self) -> (File, u64) {
        (self.file, self.ino)
    }

    /// Whether nothing was stored in it since it was made.
    pub(super) fn is_fresh(&self) -> bool {
        self.fresh.get()
    }

    /// The entries, as the mapping holds them.
    fn entries(&self) -> &[SourceId] {
        // SAFETY: the mapping is `pages` u32s long (checked at `open`,
        // made so at `create`), page-aligned, and lives as long as `self`.
        unsafe {
            std::slice::from_raw_parts(
                self.map.as_ptr().cast::<SourceId>(),
                shared::geometry::usize_of(self.pages),
            )
        }
    }

    /// The entries, to write. `&self`: the mapping is shared memory that
    /// only the core thread, which owns the table, writes, one call at a
    /// time.
    #[allow(clippy::mut_from_ref)]
    fn entries_mut(&self) -> &mut [SourceId] {
        // SAFETY: as `entries`; no other slice of the mapping is alive
        // while a caller below holds this one (each use is one statement,
        // and `Mirror` is not `Sync`).
        unsafe {
            std::slice::from_raw_parts_mut(
                self.map.as_ptr().cast::<SourceId>(),
                shared::geometry::usize_of(self.pages),
            )
        }
    }

    /// Entries were written: zeroes must be stored from now on.
    pub fn written(&self) {
        self.fresh.set(false);
    }

    /// What is stored for `source`.
    #[inline]
    fn encode(&self, source: SourceId) -> SourceId {
        if source == UNINITIALIZED && self.over {
            OVER_UNINITIALIZED
        } else {
            source
        }
    }

    /// Set entry `page`.
    #[inline]
    pub fn set(&self, page: u64, source: SourceId) {
        let stored = self.encode(source);
        if let Some(e) = self.entries_mut().get_mut(shared::geometry::usize_of(page)) {
            *e = stored;
        }
    }

    /// Store `raw` as entry `page`, as it is (an overlay's 0: "as the
    /// under").
    pub(super) fn set_raw(&self, page: u64, raw: SourceId) {
        if let Some(e) = self.entries_mut().get_mut(shared::geometry::usize_of(page)) {
            *e = raw;
        }
    }

    /// Set `[start, end)`.
    pub fn set_range(&self, start: u64, end: u64, source: SourceId) {
        let stored = self.encode(source);
        if stored == 0 && self.fresh.get() {
            return;
        }
        let e = self.entries_mut();
        let end = shared::geometry::usize_of(end.min(self.pages));
        let start = shared::geometry::usize_of(start).min(end);
        e[start..end].fill(stored);
    }

    /// Entry `page` as stored (in an overlay, 0 is "as the under" and
    /// [`OVER_UNINITIALIZED`] is `Uninitialized`).
    pub fn stored(&self, page: u64) -> SourceId {
        self.entries()
            .get(shared::geometry::usize_of(page))
            .copied()
            .unwrap_or(0)
    }

    /// Runs `(first page, stored entries)` of the entries that may be
    /// other than 0: those in the memfd's data, found with `SEEK_DATA`
    /// and `SEEK_HOLE` (a hole reads 0 and is not read, which would
    /// allocate it); everything if the file cannot tell.
    pub(super) fn stored_runs(&self) -> Vec<(u64, &[SourceId])> {
        use nix::unistd::{lseek, Whence};
        let entries = self.entries();
        let size = i64::try_from(std::mem::size_of::<SourceId>()).unwrap_or(4);
        let len = i64::try_from(entries.len()).unwrap_or(i64::MAX) * size;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.file);
        let mut out = Vec::new();
        let mut at = 0i64;
        while at < len {
            let data = match lseek(fd, at, Whence::SeekData) {
                Ok(d) => d,
                Err(nix::errno::Errno::ENXIO) => break,
                Err(_) => return vec![(0, entries)],
            };
            let hole = lseek(fd, data, Whence::SeekHole).map_or(len, |h| h.min(len));
            let (lo, hi) = (data / size, (hole + size - 1) / size);
            let (lo, hi) = (
                usize::try_from(lo).unwrap_or(usize::MAX).min(entries.len()),
                usize::try_from(hi).unwrap_or(usize::MAX).min(entries.len()),
            );
            if lo < hi {
                out.push((lo as u64, &entries[lo..hi]));
            }
            if hole <= at {
                break;
            }
            at = hole;
        }
        out
    }

    /// The source of an entry stored as `raw` (0 for "as before": the
    /// under's, or `Uninitialized` in a dense mirror).
    pub(super) fn decode_stored(&self, raw: SourceId) -> Option<SourceId> {
        match raw {
            0 => None,
            OVER_UNINITIALIZED if self.over => Some(UNINITIALIZED),
            raw => Some(raw),
        }
    }

    /// Number of entries.
    pub fn pages(&self) -> u64 {
        self.pages
    }
}
