//! The qcow2 header (versions 2 and 3) and its extensions.
//!
//! [`Header::decode`] validates everything the rest of the crate relies on:
//! cluster size, table offsets (cluster aligned), table sizes (qemu's limits),
//! refcount width, and the feature bits. Images with a backing file, an
//! external data file, encryption or unknown incompatible features are
//! refused with an error that says so.

use crate::error::{invalid, unsupported, Result};

/// "QFI\xfb".
pub const MAGIC: u32 = 0x5146_49fb;
/// Offset of `nb_snapshots`; with `snapshots_offset` it forms the 12 bytes
/// whose single write commits a snapshot-table change.
pub const SNAPSHOT_FIELDS_OFFSET: u64 = 60;
/// qemu's limit on the L1 table (bytes).
pub const MAX_L1_BYTES: u64 = 32 << 20;
/// qemu's limit on the refcount table (bytes).
pub const MAX_REFTABLE_BYTES: u64 = 8 << 20;
/// qemu's limit on the number of snapshots.
pub const MAX_SNAPSHOTS: u32 = 65536;

/// Incompatible feature bits.
pub mod incompat {
    pub const DIRTY: u64 = 1 << 0;
    pub const CORRUPT: u64 = 1 << 1;
    pub const DATA_FILE: u64 = 1 << 2;
    pub const COMPRESSION: u64 = 1 << 3;
    pub const EXTL2: u64 = 1 << 4;
}

/// Header extension types.
pub mod ext {
    pub const END: u32 = 0;
    pub const BACKING_FORMAT: u32 = 0xe279_2aca;
    pub const FEATURE_TABLE: u32 = 0x6803_f857;
    pub const BITMAPS: u32 = 0x2385_2875;
    pub const CRYPTO: u32 = 0x0537_be77;
    pub const DATA_FILE: u32 = 0x4441_5441;
}

/// How compressed clusters are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Raw deflate (no zlib header), qemu's default.
    Deflate,
    /// zstd frames.
    Zstd,
}

/// A decoded, validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub cluster_bits: u32,
    /// Virtual disk size in bytes.
    pub size: u64,
    pub l1_size: u32,
    pub l1_table_offset: u64,
    pub refcount_table_offset: u64,
    pub refcount_table_clusters: u32,
    pub nb_snapshots: u32,
    pub snapshots_offset: u64,
    pub incompatible: u64,
    pub compatible: u64,
    pub autoclear: u64,
    /// Refcount width is `1 << refcount_order` bits (0..=6).
    pub refcount_order: u32,
    pub header_length: u32,
    pub compression: Compression,
    /// Extension types present, in order (unknown ones included).
    pub extensions: Vec<u32>,
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(a)
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

impl Header {
    /// Bytes to read to be sure to hold the fixed header part.
    pub const PREFIX: usize = 112;

    /// Decode from the image's first cluster (or as much of it as exists;
    /// `first` shorter than the cluster is zero-extended by the caller or
    /// rejected here when the header itself does not fit).
    pub fn decode(first: &[u8]) -> Result<Header> {
        if first.len() < 72 {
            return invalid("the file is shorter than a qcow2 header");
        }
        if be32(first, 0) != MAGIC {
            return invalid("bad magic (not a qcow2 file)");
        }
        let version = be32(first, 4);
        if version != 2 && version != 3 {
            return unsupported(format!("qcow2 version {version} (only 2 and 3 exist)"));
        }
        let backing_file_offset = be64(first, 8);
        let cluster_bits = be32(first, 20);
        if !(9..=21).contains(&cluster_bits) {
            return invalid(format!("cluster_bits {cluster_bits} outside 9..=21"));
        }
        let cs = 1u64 << cluster_bits;
        let size = be64(first, 24);
        let crypt_method = be32(first, 32);
        let l1_size = be32(first, 36);
        let l1_table_offset = be64(first, 40);
        let refcount_table_offset = be64(first, 48);
        let refcount_table_clusters = be32(first, 56);
        let nb_snapshots = be32(first, 60);
        let snapshots_offset = be64(first, 64);
        let (incompatible, compatible, autoclear, refcount_order, header_length) = if version == 2 {
            (0, 0, 0, 4, 72)
        } else {
            if first.len() < 104 {
                return invalid("the file is shorter than a version 3 header");
            }
            (
                be64(first, 72),
                be64(first, 80),
                be64(first, 88),
                be32(first, 96),
                be32(first, 100),
            )
        };
        if version == 3 && (header_length < 104 || header_length % 8 != 0) {
            return invalid(format!(
                "header_length {header_length} (must be >= 104 and a multiple of 8)"
            ));
        }
        if u64::from(header_length) > cs || header_length as usize > first.len() {
            return invalid("the header is longer than its cluster");
        }
        if incompatible & incompat::CORRUPT != 0 {
            return invalid("the image is marked corrupt; repair it with `qemu-img check -r all`");
        }
        if incompatible & incompat::DIRTY != 0 {
            return unsupported(
                "the image is marked dirty (lazy refcounts); run `qemu-img check -r all` first",
            );
        }
        if incompatible & incompat::DATA_FILE != 0 {
            return unsupported("the image keeps its data in an external data file");
        }
        let known = incompat::DIRTY
            | incompat::CORRUPT
            | incompat::DATA_FILE
            | incompat::COMPRESSION
            | incompat::EXTL2;
        if incompatible & !known != 0 {
            return unsupported(format!(
                "unknown incompatible features {:#x}",
                incompatible & !known
            ));
        }
        if backing_file_offset != 0 {
            return unsupported(
                "the image has a backing file; flatten it first (`qemu-img convert -O qcow2`)",
            );
        }
        if crypt_method != 0 {
            return unsupported("the image is encrypted");
        }
        if refcount_order > 6 {
            return invalid(format!("refcount_order {refcount_order} (at most 6)"));
        }
        let compression_type = if header_length > 104 { first[104] } else { 0 };
        let compression = match compression_type {
            0 => Compression::Deflate,
            1 => Compression::Zstd,
            t => return unsupported(format!("compression type {t}")),
        };
        if (compression_type != 0) != (incompatible & incompat::COMPRESSION != 0) {
            return invalid("the compression-type feature bit disagrees with the compression type");
        }
        let extended = incompatible & incompat::EXTL2 != 0;
        if extended && cluster_bits < 14 {
            return invalid("extended L2 entries need clusters of at least 16 KiB");
        }
        // Tables.
        let entries_per_l2 = cs / if extended { 16 } else { 8 };
        let bytes_per_l2 = u128::from(entries_per_l2) << cluster_bits;
        let needed_l1 = u128::from(size).div_ceil(bytes_per_l2);
        if u64::from(l1_size) * 8 > MAX_L1_BYTES {
            return invalid(format!("the L1 table has {l1_size} entries (too large)"));
        }
        if needed_l1 > u128::from(l1_size) {
            return invalid("the L1 table is too small for the disk size");
        }
        for (what, off) in [
            ("L1 table", l1_table_offset),
            ("refcount table", refcount_table_offset),
            (
                "snapshot table",
                if nb_snapshots > 0 {
                    snapshots_offset
                } else {
                    0
                },
            ),
        ] {
            if off % cs != 0 {
                return invalid(format!("the {what} offset {off:#x} is not cluster aligned"));
            }
            if off >= 1 << 56 {
                return invalid(format!("the {what} offset {off:#x} is out of range"));
            }
        }
        if l1_size > 0 && l1_table_offset == 0 {
            return invalid("the L1 table overlaps the header");
        }
        if refcount_table_clusters == 0 || refcount_table_offset == 0 {
            return invalid("the image has no refcount table");
        }
        if u64::from(refcount_table_clusters) * cs > MAX_REFTABLE_BYTES {
            return invalid("the refcount table is too large");
        }
        if nb_snapshots > MAX_SNAPSHOTS {
            return invalid(format!(
                "{nb_snapshots} snapshots (at most {MAX_SNAPSHOTS})"
            ));
        }
        // Extensions, after the header up to the end of the first cluster.
        let mut extensions = Vec::new();
        let end = first.len().min(usize::try_from(cs).unwrap_or(usize::MAX));
        let mut at = header_length as usize;
        while at + 8 <= end {
            let typ = be32(first, at);
            let len = be32(first, at + 4) as usize;
            at += 8;
            if typ == ext::END {
                break;
            }
            if len > end - at {
                return invalid("a header extension runs past the first cluster");
            }
            match typ {
                ext::DATA_FILE => return unsupported("the image names an external data file"),
                ext::CRYPTO => return unsupported("the image is encrypted"),
                _ => {}
            }
            extensions.push(typ);
            at += len.div_ceil(8) * 8;
        }
        Ok(Header {
            version,
            cluster_bits,
            size,
            l1_size,
            l1_table_offset,
            refcount_table_offset,
            refcount_table_clusters,
            nb_snapshots,
            snapshots_offset,
            incompatible,
            compatible,
            autoclear,
            refcount_order,
            header_length,
            compression,
            extensions,
        })
    }

    /// Cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Whether L2 entries are 128-bit with subcluster bitmaps.
    pub fn extended_l2(&self) -> bool {
        self.incompatible & incompat::EXTL2 != 0
    }

    /// Bytes per L2 entry.
    pub fn l2_entry_size(&self) -> u64 {
        if self.extended_l2() {
            16
        } else {
            8
        }
    }

    /// log2 of the entries in one L2 table.
    pub fn l2_bits(&self) -> u32 {
        self.cluster_bits - if self.extended_l2() { 4 } else { 3 }
    }

    /// Refcount width in bits.
    pub fn refcount_bits(&self) -> u32 {
        1 << self.refcount_order
    }

    /// The virtual size as qemu sees it (whole 512-byte sectors).
    pub fn sector_size(&self) -> u64 {
        self.size / 512 * 512
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn v3(cluster_bits: u32) -> Vec<u8> {
        let mut h = vec![0u8; 1 << cluster_bits];
        h[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        h[20..24].copy_from_slice(&cluster_bits.to_be_bytes());
        h[24..32].copy_from_slice(&(1u64 << 20).to_be_bytes());
        h[36..40].copy_from_slice(&1u32.to_be_bytes());
        h[40..48].copy_from_slice(&(3u64 << cluster_bits).to_be_bytes());
        h[48..56].copy_from_slice(&(1u64 << cluster_bits).to_be_bytes());
        h[56..60].copy_from_slice(&1u32.to_be_bytes());
        h[96..100].copy_from_slice(&4u32.to_be_bytes());
        h[100..104].copy_from_slice(&112u32.to_be_bytes());
        h
    }

    #[test]
    fn decodes_a_minimal_v3_header() {
        let h = Header::decode(&v3(16)).unwrap();
        assert_eq!(h.cluster_size(), 65536);
        assert_eq!(h.refcount_bits(), 16);
        assert_eq!(h.compression, Compression::Deflate);
    }

    #[test]
    fn refuses_a_backing_file_with_a_clear_error() {
        let mut h = v3(16);
        h[8..16].copy_from_slice(&200u64.to_be_bytes());
        let e = Header::decode(&h).unwrap_err().to_string();
        assert!(e.contains("backing file"), "{e}");
    }

    #[test]
    fn refuses_an_external_data_file() {
        let mut h = v3(16);
        h[72..80].copy_from_slice(&incompat::DATA_FILE.to_be_bytes());
        assert!(Header::decode(&h)
            .unwrap_err()
            .to_string()
            .contains("external data file"));
    }

    proptest! {
        #[test]
        fn never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Header::decode(&bytes);
        }

        #[test]
        fn never_panics_on_a_mutated_header(at in 0usize..200, val in any::<u8>()) {
            let mut h = v3(12);
            h[at] = val;
            let _ = Header::decode(&h);
        }
    }
}
