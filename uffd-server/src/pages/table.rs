//! The page-source table: one [`SourceId`] per guest page, in fixed chunks
//! held by `Rc`.
//!
//! A fork clones the chunk pointers (O(pages / CHUNK_PAGES)) and shares
//! every chunk; whichever side changes an entry first copies that chunk
//! (`Rc::make_mut`). Each table also keeps its own count of pages per
//! source, so "pages by source" and "does anyone still read from VM X" are
//! answered without a scan.

use std::collections::BTreeMap;
use std::fs::File;
use std::rc::Rc;

use super::mirror::{Mirror, MirrorError, OVER_UNINITIALIZED};
use super::source::{SourceId, UNINITIALIZED};

/// Pages per chunk: 4096 entries, 16 KiB, covering 16 MiB of guest RAM.
pub const CHUNK_PAGES: usize = 4096;

/// A run of pages with the same source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub start: u64,
    pub pages: u64,
    pub source: SourceId,
}

/// One VM's page-source table.
#[derive(Debug)]
pub struct PageTable {
    chunks: Vec<Rc<[SourceId; CHUNK_PAGES]>>,
    pages: u64,
    counts: BTreeMap<SourceId, u64>,
    /// Where every entry set is written too, to outlive the server (see
    /// [`super::mirror`]); a copy of the table has none of its own.
    mirror: Option<Mirror>,
    /// The under `mirror` is an overlay of, if it is one.
    under: Option<Rc<Under>>,
}

/// A table's entries as they were when it was made, shared by the
/// overlays of its copies (a fork's children): a dense mirror, never
/// written again, and the same entries in memory.
#[derive(Debug)]
pub struct Under {
    file: File,
    ino: u64,
    /// The entries (its chunks shared with the table it was made of, so
    /// that a copy's chunks left alone compare by address).
    table: PageTable,
}

impl Under {
    /// A mirror of `table` as it is now, for its copies to overlay.
    pub fn of(table: &PageTable) -> Result<Rc<Under>, MirrorError> {
        let mirror = Mirror::create(table.pages())?;
        table.write_dense(&mirror);
        let (file, ino) = mirror.into_file();
        Ok(Rc::new(Under {
            file,
            ino,
            table: table.clone(),
        }))
    }

    /// The under in `file` (handed back by the fd store) of tables of
    /// `pages` pages.
    pub fn open(file: File, pages: u64) -> Result<Rc<Under>, MirrorError> {
        let mirror = Mirror::open(file, pages)?;
        let table = PageTable::read_mirror(&mirror, None);
        let (file, ino) = mirror.into_file();
        Ok(Rc::new(Under { file, ino, table }))
    }

    /// The memfd, for the fd store.
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.file)
    }

    /// The memfd's inode number.
    pub fn ino(&self) -> u64 {
        self.ino
    }

    /// Number of entries.
    pub fn pages(&self) -> u64 {
        self.table.pages()
    }

    /// Its entries.
    pub fn table(&self) -> &PageTable {
        &self.table
    }
}

impl Clone for PageTable {
    /// The entries and counts; not the mirror, which belongs to one VM.
    fn clone(&self) -> Self {
        PageTable {
            chunks: self.chunks.clone(),
            pages: self.pages,
            counts: self.counts.clone(),
            mirror: None,
            under: None,
        }
    }
}

impl PageTable {
    /// A table of `pages` entries, all `source`.
    pub fn new(pages: u64, source: SourceId) -> Self {
        let nchunks = usize::try_from(pages.div_ceil(CHUNK_PAGES as u64)).unwrap_or(0);
        let chunk = Rc::new([source; CHUNK_PAGES]);
        let mut counts = BTreeMap::new();
        if pages > 0 {
            counts.insert(source, pages);
        }
        PageTable {
            chunks: vec![chunk; nchunks],
            pages,
            counts,
            mirror: None,
            under: None,
        }
    }

    /// Write every entry into `mirror`, a dense one, from now on,
    /// starting with all of them as they are.
    pub fn attach_mirror(&mut self, mirror: Mirror) {
        debug_assert!(!mirror.is_over());
        // A fresh mirror reads `Uninitialized` everywhere: only the other
        // runs are stored (a VM restored from an image with holes, or made
        // on zeroes, allocates nothing for them).
        self.write_dense(&mirror);
        mirror.written();
        self.mirror = Some(mirror);
        self.under = None;
    }

    /// Write every entry from now on into a new overlay of `under`,
    /// starting with those that differ from it.
    pub fn attach_overlay(&mut self, under: Rc<Under>) -> Result<(), MirrorError> {
        let mirror = Mirror::create_over(under.pages())?;
        self.write_over(&mirror, under.table());
        mirror.written();
        self.mirror = Some(mirror);
        self.under = Some(under);
        Ok(())
    }

    /// Store every entry in `mirror`, a dense one (0s skipped while it is
    /// fresh), a run of equal entries at a time.
    pub(super) fn write_dense(&self, mirror: &Mirror) {
        for (c, chunk) in self.chunks.iter().enumerate() {
            let base = (c * CHUNK_PAGES) as u64;
            let n = shared::geometry::usize_of((self.pages - base).min(CHUNK_PAGES as u64));
            let mut p = base;
            for run in chunk[..n].chunk_by(|a, b| a == b) {
                let end = p + run.len() as u64;
                mirror.set_range(p, end, run[0]);
                p = end;
            }
        }
    }

    /// Store in `mirror`, an overlay of `under`, what differs from it: 0
    /// where this table reads as `under` does. Chunks still shared with
    /// `under` (a fork's child left alone) are skipped while the mirror
    /// is fresh.
    fn write_over(&self, mirror: &Mirror, under: &PageTable) {
        let fresh = mirror.is_fresh();
        for (c, chunk) in self.chunks.iter().enumerate() {
            let base = (c * CHUNK_PAGES) as u64;
            let n = shared::geometry::usize_of((self.pages - base).min(CHUNK_PAGES as u64));
            let theirs = under.chunks.get(c);
            if fresh && theirs.is_some_and(|t| Rc::ptr_eq(t, chunk) || t[..n] == chunk[..n]) {
                continue;
            }
            for (i, &s) in chunk[..n].iter().enumerate() {
                let same = theirs.is_some_and(|t| t[i] == s);
                let raw = match s {
                    _ if same => 0,
                    UNINITIALIZED => OVER_UNINITIALIZED,
                    s => s,
                };
                if raw != 0 || !fresh {
                    mirror.set_raw(base + i as u64, raw);
                }
            }
        }
    }

    /// The table `mirror`, an overlay of `under` if that is given,
    /// holds (not writing into it).
    fn read_mirror(mirror: &Mirror, under: Option<&Under>) -> Self {
        let mut t = match under {
            Some(u) => u.table().clone(),
            None => PageTable::new(mirror.pages(), UNINITIALIZED),
        };
        // Only what is stored differs from that start: a hole reads 0.
        for (first, raw) in mirror.stored_runs() {
            let mut p = first;
            for run in raw.chunk_by(|a, b| a == b) {
                let n = run.len() as u64;
                if let Some(s) = mirror.decode_stored(run[0]) {
                    t.set_range(p, n, s);
                }
                p += n;
            }
        }
        t
    }

    /// The table `mirror` holds (a server's table, read back after it
    /// died), writing into it from now on.
    pub fn from_mirror(mirror: Mirror) -> Self {
        let mut t = Self::read_mirror(&mirror, None);
        t.mirror = Some(mirror);
        t
    }

    /// The table the overlay of `under` in `file` (handed back by the fd
    /// store) holds, writing into it from now on.
    pub fn from_overlay(file: File, under: Rc<Under>) -> Result<Self, MirrorError> {
        let mirror = Mirror::open_over(file, under.pages())?;
        let mut t = Self::read_mirror(&mirror, Some(&under));
        t.mirror = Some(mirror);
        t.under = Some(under);
        Ok(t)
    }

    /// The mirror this table writes into, if any.
    pub fn mirror(&self) -> Option<&Mirror> {
        self.mirror.as_ref()
    }

    /// The under its mirror is an overlay of, if it is one.
    pub fn under(&self) -> Option<&Rc<Under>> {
        self.under.as_ref()
    }

    /// Take `new`'s entries, keeping (and rewriting) this table's mirror.
    pub fn replace(&mut self, new: PageTable) {
        let mirror = self.mirror.take();
        let under = self.under.take();
        *self = new;
        if let Some(m) = mirror {
            match under {
                Some(u) => {
                    self.write_over(&m, u.table());
                    self.mirror = Some(m);
                    self.under = Some(u);
                }
                None => self.attach_mirror(m),
            }
        }
    }

    /// Number of pages.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Share every chunk with a new table (the fork of this one).
    pub fn fork(&self) -> Self {
        self.clone()
    }

    fn split(page: u64) -> (usize, usize) {
        let p = usize::try_from(page).unwrap_or(usize::MAX);
        (p / CHUNK_PAGES, p % CHUNK_PAGES)
    }

    /// The source of `page`; pages past the end read as `Uninitialized`.
    pub fn get(&self, page: u64) -> SourceId {
        if page >= self.pages {
            return UNINITIALIZED;
        }
        let (c, i) = Self::split(page);
        self.chunks[c][i]
    }

    /// Set the source of `page`. Returns the previous source.
    pub fn set(&mut self, page: u64, source: SourceId) -> SourceId {
        assert!(
            page < self.pages,
            "page {page} outside table of {}",
            self.pages
        );
        let (c, i) = Self::split(page);
        let old = self.chunks[c][i];
        if old != source {
            Rc::make_mut(&mut self.chunks[c])[i] = source;
            if let Some(m) = &self.mirror {
                m.set(page, source);
            }
            self.count(old, -1);
            self.count(source, 1);
        }
        old
    }

    /// Set `[start, start + pages)` to `source`: one copy-on-write check
    /// per chunk and one count update per run of equal entries replaced,
    /// not per page. Chunks the range covers whole all take one shared
    /// chunk of `source` instead of a copy each (a restore points a whole
    /// table at its image this way; the first write to one of them copies
    /// it, as after a fork).
    pub fn set_range(&mut self, start: u64, pages: u64, source: SourceId) {
        let end = start.saturating_add(pages).min(self.pages);
        if let Some(m) = &self.mirror {
            m.set_range(start, end, source);
        }
        let mut p = start;
        let mut replaced: Vec<(SourceId, u64)> = Vec::new();
        let mut whole: Option<Rc<[SourceId; CHUNK_PAGES]>> = None;
        while p < end {
            let (c, i) = Self::split(p);
            let n = shared::geometry::usize_of((end - p).min((CHUNK_PAGES - i) as u64));
            let slots = &self.chunks[c][i..i + n];
            if slots.iter().any(|s| *s != source) {
                for run in slots.chunk_by(|a, b| a == b) {
                    let (old, k) = (run[0], run.len() as u64);
                    if old == source {
                        continue;
                    }
                    match replaced.iter_mut().find(|(s, _)| *s == old) {
                        Some((_, sum)) => *sum += k,
                        None => replaced.push((old, k)),
                    }
                }
                if n == CHUNK_PAGES {
                    let chunk = whole.get_or_insert_with(|| Rc::new([source; CHUNK_PAGES]));
                    self.chunks[c] = Rc::clone(chunk);
                } else {
                    Rc::make_mut(&mut self.chunks[c])[i..i + n].fill(source);
                }
            }
            p += n as u64;
        }
        let mut added = 0;
        for (old, k) in replaced {
            let e = self.counts.entry(old).or_insert(0);
            *e = e.saturating_sub(k);
            if *e == 0 {
                self.counts.remove(&old);
            }
            added += k;
        }
        if added > 0 {
            *self.counts.entry(source).or_insert(0) += added;
        }
    }

    fn count(&mut self, source: SourceId, delta: i64) {
        let e = self.counts.entry(source).or_insert(0);
        *e = e.saturating_add_signed(delta);
        if *e == 0 {
            self.counts.remove(&source);
        }
    }

    /// Pages per source.
    pub fn counts(&self) -> &BTreeMap<SourceId, u64> {
        &self.counts
    }

    /// Pages whose source is `source`.
    pub fn count_of(&self, source: SourceId) -> u64 {
        self.counts.get(&source).copied().unwrap_or(0)
    }

    /// The table as coalesced runs, in page order.
    pub fn extents(&self) -> Vec<Extent> {
        let mut out: Vec<Extent> = Vec::new();
        for (c, chunk) in self.chunks.iter().enumerate() {
            let base = (c * CHUNK_PAGES) as u64;
            let n = shared::geometry::usize_of((self.pages - base).min(CHUNK_PAGES as u64));
            for (i, &s) in chunk[..n].iter().enumerate() {
                let p = base + i as u64;
                match out.last_mut() {
                    Some(e) if e.source == s && e.start + e.pages == p => e.pages += 1,
                    _ => out.push(Extent {
                        start: p,
                        pages: 1,
                        source: s,
                    }),
                }
            }
        }
        out
    }

    /// Runs of pages with source `source` (e.g. the pages to write-protect).
    pub fn ranges_of(&self, source: SourceId) -> Vec<(u64, u64)> {
        self.extents()
            .into_iter()
            .filter(|e| e.source == source)
            .map(|e| (e.start, e.pages))
            .collect()
    }

    /// How many chunks this table shares with `other` (same allocation).
    pub fn shared_chunks(&self, other: &PageTable) -> usize {
        self.chunks
            .iter()
            .zip(&other.chunks)
            .filter(|(a, b)| Rc::ptr_eq(a, b))
            .count()
    }

    /// Number of chunks.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn entries_are_four_bytes() {
        assert_eq!(std::mem::size_of::<SourceId>(), 4);
        assert_eq!(
            std::mem::size_of::<[SourceId; CHUNK_PAGES]>(),
            4 * CHUNK_PAGES
        );
    }

    #[test]
    fn fork_shares_chunks_until_a_write() {
        let mut a = PageTable::new(3 * CHUNK_PAGES as u64 + 5, 0);
        a.set(10, 1);
        let mut b = a.fork();
        assert_eq!(b.shared_chunks(&a), 4);
        b.set(CHUNK_PAGES as u64 + 1, 2);
        assert_eq!(b.shared_chunks(&a), 3);
        assert_eq!(a.get(CHUNK_PAGES as u64 + 1), 0);
        assert_eq!(b.get(CHUNK_PAGES as u64 + 1), 2);
        assert_eq!(b.get(10), 1);
        assert_eq!(a.count_of(2), 0);
        assert_eq!(b.count_of(2), 1);
    }

    #[test]
    fn a_mirror_reads_back_the_table_it_was_written_by() {
        let n = 2 * CHUNK_PAGES as u64 + 3;
        let mut t = PageTable::new(n, 2);
        t.attach_mirror(Mirror::create(n).expect("mirror"));
        t.set(5, 9);
        t.set_range(CHUNK_PAGES as u64 - 1, 3, 4);
        let copy = t.fork();
        assert!(copy.mirror().is_none());
        let file = t.mirror().map(|m| {
            use std::os::fd::AsFd;
            std::fs::File::from(m.fd().as_fd().try_clone_to_owned().expect("dup"))
        });
        let back = PageTable::from_mirror(Mirror::open(file.expect("file"), n).expect("open"));
        for p in 0..n {
            assert_eq!(back.get(p), t.get(p), "page {p}");
        }
        assert_eq!(back.counts(), t.counts());
        let mut t2 = t;
        t2.replace(PageTable::new(n, 0));
        assert_eq!(t2.mirror().map(|m| m.stored(5)), Some(0));
    }

    fn reopen(m: &Mirror) -> std::fs::File {
        use std::os::fd::AsFd;
        std::fs::File::from(m.fd().as_fd().try_clone_to_owned().expect("dup"))
    }

    #[test]
    fn overlays_store_only_what_differs_from_their_under() {
        let n = 3 * CHUNK_PAGES as u64 + 7;
        let mut parent = PageTable::new(n, 0);
        parent.set_range(0, CHUNK_PAGES as u64 + 10, 3);
        parent.set(2 * CHUNK_PAGES as u64 + 1, 4);
        let under = Under::of(&parent).expect("under");
        assert_eq!(under.pages(), n);
        let mut kids: Vec<PageTable> = (0..3).map(|_| parent.fork()).collect();
        for k in &mut kids {
            k.attach_overlay(Rc::clone(&under)).expect("overlay");
        }
        // A child left alone stores nothing: its memfd is all holes.
        let m = kids[0].mirror().expect("mirror");
        assert!(m.stored_runs().is_empty(), "{:?}", m.stored_runs().len());
        // Entries set after: a source, back to Uninitialized, and the
        // under's own value.
        kids[1].set(5, 9);
        kids[1].set(6, 0);
        kids[1].set_range(CHUNK_PAGES as u64, 20, 0);
        kids[1].set(2 * CHUNK_PAGES as u64 + 1, 4);
        kids[2].set(n - 1, 7);
        for k in &kids {
            let m = k.mirror().expect("mirror");
            let back = PageTable::from_overlay(reopen(m), Rc::clone(&under)).expect("open");
            for p in 0..n {
                assert_eq!(back.get(p), k.get(p), "page {p}");
            }
            assert_eq!(back.counts(), k.counts());
        }
        // The under reads back as the parent was.
        let u2 = Under::open(reopen_under(&under), n).expect("open under");
        for p in 0..n {
            assert_eq!(u2.table().get(p), parent.get(p), "page {p}");
        }
        // A table made before its overlay differs where it was written.
        let mut late = parent.fork();
        late.set(1, 0);
        late.set(CHUNK_PAGES as u64 * 3, 5);
        late.attach_overlay(Rc::clone(&under)).expect("overlay");
        let back = PageTable::from_overlay(reopen(late.mirror().expect("m")), Rc::clone(&under))
            .expect("open");
        for p in 0..n {
            assert_eq!(back.get(p), late.get(p), "page {p}");
        }
        // Replaced whole: every entry rewritten.
        let mut whole = late;
        let mut new = PageTable::new(n, 0);
        new.set_range(10, 3, 8);
        whole.replace(new.clone());
        let back = PageTable::from_overlay(reopen(whole.mirror().expect("m")), Rc::clone(&under))
            .expect("open");
        for p in 0..n {
            assert_eq!(back.get(p), new.get(p), "page {p}");
        }
    }

    fn reopen_under(u: &Under) -> std::fs::File {
        use std::os::fd::AsFd;
        std::fs::File::from(u.fd().as_fd().try_clone_to_owned().expect("dup"))
    }

    #[test]
    fn a_dense_mirror_reads_back_from_its_data_only() {
        let n = 5 * CHUNK_PAGES as u64;
        let mut t = PageTable::new(n, 0);
        t.attach_mirror(Mirror::create(n).expect("mirror"));
        assert!(t.mirror().expect("m").stored_runs().is_empty());
        t.set(4 * CHUNK_PAGES as u64 + 3, 2);
        t.set_range(100, 5000, 6);
        let runs = t.mirror().expect("m").stored_runs();
        assert!(!runs.is_empty());
        let stored: u64 = runs.iter().map(|(_, r)| r.len() as u64).sum();
        assert!(stored < n, "holes are not read: {stored} of {n}");
        let back =
            PageTable::from_mirror(Mirror::open(reopen(t.mirror().expect("m")), n).expect("open"));
        for p in 0..n {
            assert_eq!(back.get(p), t.get(p), "page {p}");
        }
        assert_eq!(back.counts(), t.counts());
    }

    #[test]
    fn extents_coalesce_across_chunks() {
        let n = 2 * CHUNK_PAGES as u64;
        let mut t = PageTable::new(n, 0);
        t.set_range(CHUNK_PAGES as u64 - 2, 4, 7);
        assert_eq!(
            t.extents(),
            vec![
                Extent {
                    start: 0,
                    pages: CHUNK_PAGES as u64 - 2,
                    source: 0
                },
                Extent {
                    start: CHUNK_PAGES as u64 - 2,
                    pages: 4,
                    source: 7
                },
                Extent {
                    start: CHUNK_PAGES as u64 + 2,
                    pages: CHUNK_PAGES as u64 - 2,
                    source: 0
                },
            ]
        );
        assert_eq!(t.ranges_of(7), vec![(CHUNK_PAGES as u64 - 2, 4)]);
    }

    proptest! {
        #[test]
        fn set_range_matches_setting_each_page(
            pages in 1u64..14_000,
            ranges in proptest::collection::vec((0u64..14_000, 0u64..10_000, 0u32..4), 0..20),
            writes in proptest::collection::vec((0u64..14_000, 0u32..4), 0..20),
        ) {
            let mut fast = PageTable::new(pages, 0);
            let mut slow = PageTable::new(pages, 0);
            let shared = fast.fork();
            for (start, n, src) in &ranges {
                fast.set_range(*start, *n, *src);
                for p in *start..start.saturating_add(*n).min(pages) {
                    slow.set(p, *src);
                }
            }
            // Chunks set whole share one allocation: a later write to
            // one of them changes that page alone.
            for (p, src) in &writes {
                let p = p % pages;
                fast.set(p, *src);
                slow.set(p, *src);
            }
            for p in 0..pages {
                prop_assert_eq!(fast.get(p), slow.get(p));
                prop_assert_eq!(shared.get(p), 0);
            }
            prop_assert_eq!(fast.counts(), slow.counts());
        }

        #[test]
        fn table_matches_a_plain_vector(
            pages in 1u64..10_000,
            writes in proptest::collection::vec((0u64..10_000, 0u32..4), 0..200),
            fork_at in 0usize..200,
        ) {
            let mut t = PageTable::new(pages, 0);
            let mut model = vec![0u32; shared::geometry::usize_of(pages)];
            let mut forked: Option<(PageTable, Vec<u32>)> = None;
            for (i, (p, s)) in writes.iter().enumerate() {
                if i == fork_at {
                    forked = Some((t.fork(), model.clone()));
                }
                let p = p % pages;
                t.set(p, *s);
                model[shared::geometry::usize_of(p)] = *s;
            }
            for p in 0..pages {
                prop_assert_eq!(t.get(p), model[shared::geometry::usize_of(p)]);
            }
            // Counts agree with the model.
            for s in 0..4u32 {
                prop_assert_eq!(t.count_of(s), model.iter().filter(|x| **x == s).count() as u64);
            }
            // Extents cover every page exactly once, in order, coalesced.
            let ex = t.extents();
            let mut next = 0;
            for w in ex.windows(2) {
                prop_assert!(w[0].source != w[1].source);
            }
            for e in &ex {
                prop_assert_eq!(e.start, next);
                next += e.pages;
            }
            prop_assert_eq!(next, pages);
            // A fork taken earlier is unaffected by later writes.
            if let Some((f, m)) = forked {
                for p in 0..pages {
                    prop_assert_eq!(f.get(p), m[shared::geometry::usize_of(p)]);
                }
            }
        }
    }
}
