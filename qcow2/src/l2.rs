//! L1 and L2 entries: what a guest cluster maps to.
//!
//! Standard L2 entries are 64 bits; extended ones add a 64-bit bitmap whose
//! low 32 bits say which of the 32 subclusters are allocated and whose high
//! 32 bits say which read as zeroes. Compressed clusters pack a host offset
//! and a length in 512-byte sectors into the entry.

use crate::error::{invalid, Result};

/// "Refcount is exactly one": the cluster may be written in place.
pub const COPIED: u64 = 1 << 63;
/// The cluster is compressed.
pub const COMPRESSED: u64 = 1 << 62;
/// Standard L2 only: the cluster reads as zeroes.
pub const ZERO: u64 = 1;
/// Host offset bits of L1 entries.
pub const L1_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Host offset bits of (uncompressed) L2 entries.
pub const L2_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// qemu's classification of an L2 entry (the first 64 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Unallocated,
    ZeroPlain,
    ZeroAlloc,
    Normal,
    Compressed,
}

/// Classify the first 64 bits of an L2 entry.
pub fn kind(entry: u64, extended: bool) -> Kind {
    if entry & COMPRESSED != 0 {
        Kind::Compressed
    } else if entry & ZERO != 0 && !extended {
        if entry & L2_OFFSET_MASK != 0 {
            Kind::ZeroAlloc
        } else {
            Kind::ZeroPlain
        }
    } else if entry & L2_OFFSET_MASK == 0 {
        Kind::Unallocated
    } else {
        Kind::Normal
    }
}

/// Host offset and byte length of a compressed cluster's data.
pub fn compressed_range(entry: u64, cluster_bits: u32) -> (u64, u64) {
    let shift = 62 - (cluster_bits - 8);
    let offset = entry & ((1u64 << shift) - 1);
    let sectors = ((entry >> shift) & ((1u64 << (cluster_bits - 8)) - 1)) + 1;
    (offset, sectors * 512 - (offset & 511))
}

/// Where the bytes of one guest cluster come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// Reads as zeroes (unallocated without a backing file, or a zero
    /// cluster).
    Zero,
    /// Stored uncompressed at this host offset.
    Data { host: u64 },
    /// Compressed: `len` bytes at `host` inflate to one cluster.
    Compressed { host: u64, len: u64 },
    /// Extended L2: per subcluster, allocated at `host + i * sub` when bit
    /// i of `alloc` is set, zeroes otherwise.
    Sub { host: u64, alloc: u32 },
}

/// Decode an L2 entry (and its bitmap for extended L2) into a mapping,
/// rejecting what qemu treats as corruption.
pub fn decode(entry: u64, bitmap: u64, cluster_bits: u32, extended: bool) -> Result<Mapping> {
    let cs = 1u64 << cluster_bits;
    match kind(entry, extended) {
        Kind::Compressed => {
            let (host, len) = compressed_range(entry, cluster_bits);
            if host == 0 {
                return invalid("a compressed cluster points at offset 0");
            }
            Ok(Mapping::Compressed { host, len })
        }
        Kind::ZeroPlain | Kind::ZeroAlloc => Ok(Mapping::Zero),
        Kind::Unallocated => {
            #[allow(clippy::cast_possible_truncation)] // low 32 bits
            let alloc = bitmap as u32;
            if extended && alloc != 0 {
                return invalid("an unallocated extended L2 entry has allocated subclusters");
            }
            Ok(Mapping::Zero)
        }
        Kind::Normal => {
            let host = entry & L2_OFFSET_MASK;
            if !host.is_multiple_of(cs) {
                return invalid(format!(
                    "a data cluster at {host:#x} is not cluster aligned"
                ));
            }
            if !extended {
                return Ok(Mapping::Data { host });
            }
            #[allow(clippy::cast_possible_truncation)] // low and high halves
            let (alloc, zero) = (bitmap as u32, (bitmap >> 32) as u32);
            if alloc & zero != 0 {
                return invalid("an extended L2 entry marks a subcluster both allocated and zero");
            }
            if alloc == u32::MAX {
                Ok(Mapping::Data { host })
            } else {
                Ok(Mapping::Sub { host, alloc })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn compressed_entries_round_down_to_their_sector() {
        // 64 KiB clusters: 8 length bits start at bit 54.
        let entry = COMPRESSED | (2u64 << 54) | 0x1_0200;
        assert_eq!(compressed_range(entry, 16), (0x1_0200, 3 * 512));
        let entry = COMPRESSED | 0x1_0300;
        assert_eq!(compressed_range(entry, 16), (0x1_0300, 256));
    }

    #[test]
    fn standard_zero_flag_is_a_zero_cluster_but_not_in_extended_l2() {
        assert_eq!(kind(ZERO, false), Kind::ZeroPlain);
        assert_eq!(kind(ZERO | 0x10000, false), Kind::ZeroAlloc);
        assert_eq!(kind(0x10000, true), Kind::Normal);
    }

    proptest! {
        #[test]
        fn decode_never_panics(entry in any::<u64>(), bitmap in any::<u64>(), cb in 9u32..=21, ext in any::<bool>()) {
            let _ = decode(entry, bitmap, cb, ext && cb >= 14);
        }

        #[test]
        fn compressed_ranges_stay_within_two_clusters(entry in any::<u64>(), cb in 9u32..=21) {
            let (off, len) = compressed_range(entry | COMPRESSED, cb);
            prop_assert!(len >= 1 && len <= 2 << cb);
            prop_assert!(off < 1u64 << 62);
        }
    }
}
