//! Reference implementations of the guest agent's data patterns and hashes.
//!
//! The VMM generates guest code that computes exactly these functions; tests
//! and benchmarks compute them on the host from image files to check what
//! the guest saw. All folds start at 0 and map all-zero input to 0, so
//! untouched memory checksums as zero.

use crate::geometry::{usize_of, PAGE_SIZE};

/// Multiplier of the fold (odd, from FNV-1a 64).
pub const FOLD_MUL: u64 = 0x0000_0100_0000_01b3;
/// First multiplier of the fill pattern.
pub const PATTERN_MUL_SEED: u64 = 0x9e37_79b9_7f4a_7c15;
/// Second multiplier of the fill pattern.
pub const PATTERN_MUL_PAGE: u64 = 0xbf58_476d_1ce4_e5b9;
/// Salt that separates disk patterns from memory patterns.
pub const DISK_SALT: u64 = 0xd15c_d15c_d15c_d15c;
/// Bytes per disk sector of the guest block device.
pub const SECTOR_SIZE: u64 = 512;
/// Most sectors one guest block device request moves (1 MiB).
pub const MAX_SECTORS_PER_IO: u64 = 2048;

/// Byte offset, inside page `page`, of the word that `checksum` samples and
/// `fill` writes besides word 0.
pub fn sample_offset(page: u64) -> u64 {
    (page % (PAGE_SIZE / 8)) * 8
}

/// The word `fill` writes into page `page` for `seed`.
pub fn pattern_word(seed: u64, page: u64) -> u64 {
    seed.wrapping_mul(PATTERN_MUL_SEED)
        .wrapping_add(page)
        .wrapping_mul(PATTERN_MUL_PAGE)
        | 1
}

/// The word `disk_fill` writes at the start of sector `sector` for `seed`.
pub fn disk_word(seed: u64, sector: u64) -> u64 {
    pattern_word(seed ^ DISK_SALT, sector)
}

/// One step of the fold.
#[inline]
pub fn fold(h: u64, word: u64) -> u64 {
    (h.rotate_left(5) ^ word).wrapping_mul(FOLD_MUL)
}

fn word_at(page_bytes: &[u8], offset: u64) -> u64 {
    let o = usize::try_from(offset).unwrap_or(usize::MAX);
    page_bytes
        .get(o..o.saturating_add(8))
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

/// `checksum` over guest memory laid out in `mem` (page 0 of `mem` is guest
/// page `first_page`), for pages `[start_page, start_page + pages)`.
pub fn checksum(mem: &[u8], first_page: u64, start_page: u64, pages: u64) -> u64 {
    let mut h = 0;
    for p in start_page..start_page + pages {
        let base = (p - first_page) * PAGE_SIZE;
        h = fold(h, word_at(mem, base + sample_offset(p)));
    }
    h
}

/// `digest` (every word of every page) over `mem`, as [`checksum`].
pub fn digest(mem: &[u8], first_page: u64, start_page: u64, pages: u64) -> u64 {
    let mut h = 0;
    for p in start_page..start_page + pages {
        let base = (p - first_page) * PAGE_SIZE;
        h = digest_page(h, &mem[usize_of(base)..usize_of(base + PAGE_SIZE)]);
    }
    h
}

/// Continue a digest over one page's bytes.
pub fn digest_page(mut h: u64, page: &[u8]) -> u64 {
    for w in page.chunks_exact(8) {
        h = fold(
            h,
            u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]),
        );
    }
    h
}

/// Whether page `page` (its bytes) carries the fill pattern of `seed`.
pub fn page_matches(page_bytes: &[u8], page: u64, seed: u64) -> bool {
    let v = pattern_word(seed, page);
    word_at(page_bytes, 0) == v && word_at(page_bytes, sample_offset(page)) == v
}

/// Apply `fill` for `seed` to one page's bytes, as the guest does.
pub fn fill_page(page_bytes: &mut [u8], page: u64, seed: u64) {
    let v = pattern_word(seed, page).to_le_bytes();
    let s = usize::try_from(sample_offset(page)).unwrap_or(0);
    page_bytes[..8].copy_from_slice(&v);
    page_bytes[s..s + 8].copy_from_slice(&v);
}

/// `disk_checksum` over disk bytes `disk` for sectors `[sector, sector+count)`.
pub fn disk_checksum(disk: &[u8], sector: u64, count: u64) -> u64 {
    let mut h = 0;
    for s in sector..sector + count {
        h = fold(h, word_at(disk, s * SECTOR_SIZE));
    }
    h
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;

    #[test]
    fn zero_memory_checksums_to_zero() {
        let mem = vec![0u8; 8 * PAGE_SIZE as usize];
        assert_eq!(checksum(&mem, 0, 0, 8), 0);
        assert_eq!(digest(&mem, 0, 0, 8), 0);
    }

    #[test]
    fn fill_then_match_and_checksum_changes() {
        let mut mem = vec![0u8; 4 * PAGE_SIZE as usize];
        for p in 0..4u64 {
            let b = (p * PAGE_SIZE) as usize;
            fill_page(&mut mem[b..b + PAGE_SIZE as usize], p, 7);
        }
        for p in 0..4u64 {
            let b = (p * PAGE_SIZE) as usize;
            assert!(page_matches(&mem[b..b + PAGE_SIZE as usize], p, 7));
            assert!(!page_matches(&mem[b..b + PAGE_SIZE as usize], p, 8));
        }
        assert_ne!(checksum(&mem, 0, 0, 4), 0);
        assert_ne!(pattern_word(1, 0), pattern_word(2, 0));
    }
}
