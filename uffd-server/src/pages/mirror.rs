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
//! The fault path pays one 4-byte store per entry it sets; a fork copies
//! the parent's mirror into the child's (4 bytes per page, 1 MiB for a
//! 1 GiB guest).

use std::fs::File;
use std::os::fd::AsFd;

use vm_memory::mmap::MmapRegion;
use vm_memory::FileOffset;

use super::source::SourceId;

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
    /// Made by [`Mirror::create`] and not written yet: every entry reads
    /// `Uninitialized` (0) without being stored, so its pages stay
    /// unallocated.
    fresh: std::cell::Cell<bool>,
}

impl Mirror {
    /// A zeroed mirror (every entry `Uninitialized`) for `pages` pages.
    pub fn create(pages: u64) -> Result<Self, MirrorError> {
        let fd = nix::sys::memfd::memfd_create(
            c"pagefork-table",
            nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
        )
        .map_err(|e| MirrorError::Create(e.into()))?;
        let file = File::from(fd);
        file.set_len(Self::bytes(pages))
            .map_err(MirrorError::Create)?;
        let m = Self::map(file, pages)?;
        m.fresh.set(true);
        Ok(m)
    }

    /// The mirror in `file` (handed back by the fd store) of a table of
    /// `pages` pages.
    pub fn open(file: File, pages: u64) -> Result<Self, MirrorError> {
        let have = file.metadata().map_err(MirrorError::Create)?.len();
        let want = Self::bytes(pages);
        if have != want {
            return Err(MirrorError::Size { have, want, pages });
        }
        Self::map(file, pages)
    }

    fn bytes(pages: u64) -> u64 {
        pages.max(1) * std::mem::size_of::<SourceId>() as u64
    }

    fn map(file: File, pages: u64) -> Result<Self, MirrorError> {
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
            fresh: std::cell::Cell::new(false),
        })
    }

    /// The memfd, for the fd store.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
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

    /// Set entry `page`.
    #[inline]
    pub fn set(&self, page: u64, source: SourceId) {
        if let Some(e) = self.entries_mut().get_mut(shared::geometry::usize_of(page)) {
            *e = source;
        }
    }

    /// Set `[start, end)`.
    pub fn set_range(&self, start: u64, end: u64, source: SourceId) {
        if source == 0 && self.fresh.get() {
            return;
        }
        let e = self.entries_mut();
        let end = shared::geometry::usize_of(end.min(self.pages));
        let start = shared::geometry::usize_of(start).min(end);
        e[start..end].fill(source);
    }

    /// Entry `page`.
    pub fn get(&self, page: u64) -> SourceId {
        self.entries()
            .get(shared::geometry::usize_of(page))
            .copied()
            .unwrap_or(0)
    }

    /// Number of entries.
    pub fn pages(&self) -> u64 {
        self.pages
    }
}
