//! A set of guest pages as a bitmap: the dirty log of a VM and the pages a
//! snapshot still has to save. 1 GiB of guest RAM costs 32 KiB.

/// A set of page numbers below a fixed bound.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PageSet {
    words: Vec<u64>,
    pages: u64,
    len: u64,
}

impl PageSet {
    /// An empty set of pages below `pages`.
    pub fn new(pages: u64) -> Self {
        PageSet {
            words: vec![0; shared::geometry::usize_of(pages.div_ceil(64))],
            pages,
            len: 0,
        }
    }

    /// The bound given to [`PageSet::new`].
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Number of pages in the set.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn at(page: u64) -> (usize, u64) {
        (shared::geometry::usize_of(page / 64), 1 << (page % 64))
    }

    /// Add `page` (ignored past the bound). Returns whether it was new.
    pub fn insert(&mut self, page: u64) -> bool {
        if page >= self.pages {
            return false;
        }
        let (w, bit) = Self::at(page);
        let new = self.words[w] & bit == 0;
        self.words[w] |= bit;
        self.len += u64::from(new);
        new
    }

    /// Add `[first, first + n)`, a word at a time.
    pub fn insert_range(&mut self, first: u64, n: u64) {
        let end = first.saturating_add(n).min(self.pages);
        let mut p = first;
        while p < end {
            let (w, _) = Self::at(p);
            let lo = p % 64;
            let hi = (end - (p - lo)).min(64);
            let mask = if hi - lo == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            let before = self.words[w];
            self.words[w] |= mask;
            self.len += u64::from((self.words[w] ^ before).count_ones());
            p += hi - lo;
        }
    }

    /// Remove `page`. Returns whether it was there.
    pub fn remove(&mut self, page: u64) -> bool {
        if !self.contains(page) {
            return false;
        }
        let (w, bit) = Self::at(page);
        self.words[w] &= !bit;
        self.len -= 1;
        true
    }

    /// Whether `page` is in the set.
    pub fn contains(&self, page: u64) -> bool {
        if page >= self.pages {
            return false;
        }
        let (w, bit) = Self::at(page);
        self.words[w] & bit != 0
    }

    /// The set as sorted, coalesced runs `(first, pages)`.
    pub fn runs(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (i, &w) in self.words.iter().enumerate() {
            if w == 0 {
                continue;
            }
            for b in 0..64u64 {
                if w & (1 << b) == 0 {
                    continue;
                }
                let p = i as u64 * 64 + b;
                match out.last_mut() {
                    Some((f, n)) if *f + *n == p => *n += 1,
                    _ => out.push((p, 1)),
                }
            }
        }
        out
    }

    /// Whether any page of `[lo, hi)` is in the set. Looks only at the
    /// words that cover the range (unlike a [`PageSet::next_from`] that
    /// finds nothing and runs to the end of the set).
    pub fn any_in(&self, lo: u64, hi: u64) -> bool {
        let hi = hi.min(self.pages);
        let mut p = lo;
        while p < hi {
            let (w, _) = Self::at(p);
            let mut word = self.words[w] >> (p % 64);
            let left = hi - p;
            if left < 64 {
                word &= (1u64 << left) - 1;
            }
            if word != 0 {
                return true;
            }
            p = (p / 64 + 1) * 64;
        }
        false
    }

    /// Whether every page of `[lo, hi)` is in the set, a word at a time.
    pub fn all_in(&self, lo: u64, hi: u64) -> bool {
        if lo >= hi {
            return true;
        }
        if hi > self.pages {
            return false;
        }
        let mut p = lo;
        while p < hi {
            let (w, _) = Self::at(p);
            let left = (hi - p).min(64 - p % 64);
            let mask = if left == 64 {
                u64::MAX
            } else {
                ((1u64 << left) - 1) << (p % 64)
            };
            if self.words[w] & mask != mask {
                return false;
            }
            p += left;
        }
        true
    }

    /// The runs `(first, pages)` of pages outside the set inside the
    /// aligned chunks of `chunk` pages that the set covers in part (chunks
    /// it covers whole or not at all have none); `None` past `max_runs`.
    pub fn gaps_in_chunks(&self, chunk: u64, max_runs: usize) -> Option<Vec<(u64, u64)>> {
        let mut gaps: Vec<(u64, u64)> = Vec::new();
        let mut from = 0;
        while let Some(p) = self.next_from(from) {
            let lo = p / chunk * chunk;
            let hi = (lo + chunk).min(self.pages);
            from = hi;
            if self.all_in(lo, hi) {
                continue;
            }
            for q in (lo..hi).filter(|q| !self.contains(*q)) {
                match gaps.last_mut() {
                    Some((a, n)) if *a + *n == q => *n += 1,
                    _ => gaps.push((q, 1)),
                }
            }
            if gaps.len() > max_runs {
                return None;
            }
        }
        Some(gaps)
    }

    /// The first page in the set at or after `from`.
    pub fn next_from(&self, from: u64) -> Option<u64> {
        let mut p = from;
        while p < self.pages {
            let (w, _) = Self::at(p);
            let word = self.words[w] >> (p % 64);
            if word != 0 {
                return Some(p + u64::from(word.trailing_zeros()));
            }
            p = (p / 64 + 1) * 64;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn any_in_sees_only_its_range() {
        let mut s = PageSet::new(1000);
        for p in [5, 130, 999] {
            s.insert(p);
        }
        assert!(s.any_in(0, 6));
        assert!(!s.any_in(0, 5));
        assert!(!s.any_in(6, 130));
        assert!(s.any_in(6, 131));
        assert!(s.any_in(129, 131));
        assert!(!s.any_in(131, 999));
        assert!(s.any_in(131, 5000));
        assert!(!s.any_in(7, 7));
    }

    #[test]
    fn runs_are_sorted_and_coalesced() {
        let mut s = PageSet::new(200);
        for p in [5, 6, 7, 63, 64, 65, 199, 300] {
            s.insert(p);
        }
        assert_eq!(s.len(), 7);
        assert_eq!(s.runs(), vec![(5, 3), (63, 3), (199, 1)]);
        assert!(s.remove(64));
        assert!(!s.remove(64));
        assert_eq!(s.runs(), vec![(5, 3), (63, 1), (65, 1), (199, 1)]);
        assert_eq!(s.next_from(8), Some(63));
        assert_eq!(s.next_from(200), None);
    }

    #[test]
    fn gaps_are_found_only_in_chunks_covered_in_part() {
        let mut s = PageSet::new(1000);
        s.insert_range(0, 256); // chunk 0 whole
        s.insert_range(300, 10); // chunk 1 in part
        s.insert(600); // chunk 2 in part
        s.insert_range(768, 232); // chunk 3 (short) whole
        assert_eq!(
            s.gaps_in_chunks(256, 10),
            Some(vec![(256, 44), (310, 290), (601, 167)])
        );
        assert_eq!(s.gaps_in_chunks(256, 2), None);
        assert_eq!(PageSet::new(1000).gaps_in_chunks(256, 10), Some(vec![]));
    }

    proptest! {
        #[test]
        fn matches_a_btreeset(pages in proptest::collection::vec(0u64..500, 0..100)) {
            let mut s = PageSet::new(500);
            let mut m = std::collections::BTreeSet::new();
            for p in &pages {
                prop_assert_eq!(s.insert(*p), m.insert(*p));
            }
            for p in &pages {
                let n = p % 97;
                s.insert_range(*p, n);
                m.extend(*p..(p + n).min(500));
            }
            prop_assert_eq!(s.len(), m.len() as u64);
            let flat: Vec<u64> = s.runs().iter().flat_map(|(f, n)| *f..f + n).collect();
            prop_assert_eq!(flat, m.iter().copied().collect::<Vec<_>>());
            for lo in (0..520).step_by(37) {
                for hi in [lo, lo + 1, lo + 63, lo + 64, lo + 200] {
                    prop_assert_eq!(s.any_in(lo, hi), m.range(lo..hi.max(lo)).next().is_some());
                    prop_assert_eq!(s.all_in(lo, hi), (lo..hi).all(|p| m.contains(&p)));
                }
            }
        }
    }
}
