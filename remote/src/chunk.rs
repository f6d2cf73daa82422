//! One chunk as the store keeps it: its bytes compressed into a single
//! zstd frame, named by the XXH3-128 of the uncompressed bytes (the same
//! digest a snapshot's `state.json` records for that MiB of `memory.img`).
//! Decoding is bounded by the length the manifest gives, and a chunk is
//! only ever handed out after its digest matched.

use std::sync::OnceLock;

use xxhash_rust::xxh3::{xxh3_128, Xxh3};

pub use proto::manifest::CHUNK_BYTES;

/// A chunk to fetch: what a manifest says of it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ChunkRef {
    /// XXH3-128 of its bytes, lowercase hex: its key.
    pub digest: String,
    /// Its uncompressed length.
    pub len: u64,
    /// Its stored (compressed) length.
    pub stored: u32,
}

impl ChunkRef {
    /// The chunk to fetch of manifest chunk `c`, `None` for a hole.
    pub fn of(c: &proto::manifest::Chunk<'_>) -> Option<Self> {
        c.stored.map(|stored| ChunkRef {
            digest: c.digest.to_owned(),
            len: c.len,
            stored,
        })
    }
}

/// XXH3-128 of `bytes` as lowercase hex (the snapshot checksums' form).
pub fn digest(bytes: &[u8]) -> String {
    format!("{:032x}", xxh3_128(bytes))
}

/// The digest of `n` zero bytes (a hole of that length), cached for a
/// whole chunk.
pub fn zero_digest(n: u64) -> String {
    static WHOLE: OnceLock<String> = OnceLock::new();
    let compute = |n: u64| {
        static ZEROES: [u8; 1 << 16] = [0; 1 << 16];
        let mut h = Xxh3::new();
        let mut left = n;
        while left > 0 {
            let k = left.min(ZEROES.len() as u64);
            h.update(&ZEROES[..shared::geometry::usize_of(k)]);
            left -= k;
        }
        format!("{:032x}", h.digest128())
    };
    if n == CHUNK_BYTES {
        WHOLE.get_or_init(|| compute(CHUNK_BYTES)).clone()
    } else {
        compute(n)
    }
}

/// The whole-file digest from the chunk digests: XXH3-128 over their raw
/// bytes, as `state.json` has it.
pub fn file_digest(chunks: &[String]) -> String {
    let raw: Vec<u8> = chunks
        .iter()
        .flat_map(|c| {
            (0..c.len())
                .step_by(2)
                .filter_map(|i| c.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
                .collect::<Vec<_>>()
        })
        .collect();
    digest(&raw)
}

/// The stored form of `bytes`: one zstd frame at `level`.
pub fn encode(bytes: &[u8], level: i32) -> std::io::Result<Vec<u8>> {
    zstd::bulk::compress(bytes, level)
}

/// Why stored bytes are not the chunk they should be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Damage {
    #[error("{got} stored bytes, the manifest says {want}")]
    StoredLength { got: usize, want: u32 },
    #[error("not a zstd frame of at most {limit} bytes: {reason}")]
    Decode { limit: u64, reason: String },
    #[error("decodes to {got} bytes, the chunk has {want}")]
    Length { got: usize, want: u64 },
    #[error("its bytes hash to {got}, not to its name")]
    Checksum { got: String },
}

/// The chunk `c` from its stored bytes, checked: exactly `c.stored` bytes
/// that decode to exactly `c.len` bytes whose digest is `c.digest`.
pub fn decode(c: &ChunkRef, stored: &[u8]) -> Result<Vec<u8>, Damage> {
    if stored.len() != c.stored as usize {
        return Err(Damage::StoredLength {
            got: stored.len(),
            want: c.stored,
        });
    }
    // The capacity bounds the output: a frame that claims or decodes to
    // more fails instead of allocating it.
    let bytes = zstd::bulk::decompress(stored, shared::geometry::usize_of(c.len)).map_err(|e| {
        Damage::Decode {
            limit: c.len,
            reason: e.to_string(),
        }
    })?;
    if bytes.len() as u64 != c.len {
        return Err(Damage::Length {
            got: bytes.len(),
            want: c.len,
        });
    }
    let got = digest(&bytes);
    if got != c.digest {
        return Err(Damage::Checksum { got });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_those_of_state_json() {
        // The value uffd-server's checksum tests pin for "abc".
        assert_eq!(digest(b"abc"), "06b05ab6733a618578af5f94892f3950");
        let zeroes = vec![0u8; shared::geometry::usize_of(CHUNK_BYTES)];
        assert_eq!(zero_digest(CHUNK_BYTES), digest(&zeroes));
        assert_eq!(zero_digest(4096), digest(&zeroes[..4096]));
        let d = digest(b"abc");
        let raw = 0x06b05ab6733a618578af5f94892f3950u128.to_be_bytes();
        assert_eq!(file_digest(&[d]), digest(&raw));
    }

    #[test]
    fn chunks_round_trip_and_damage_is_named() {
        let bytes: Vec<u8> = (0..CHUNK_BYTES)
            .map(|i| (i / 4096).to_le_bytes()[0] ^ (i % 7).to_le_bytes()[0])
            .collect();
        let stored = encode(&bytes, 3).unwrap();
        assert!(stored.len() < bytes.len() / 4, "{}", stored.len());
        let c = ChunkRef {
            digest: digest(&bytes),
            len: CHUNK_BYTES,
            stored: u32::try_from(stored.len()).unwrap(),
        };
        assert_eq!(decode(&c, &stored).unwrap(), bytes);

        let mut flipped = stored.clone();
        let mid = flipped.len() / 2;
        flipped[mid] ^= 0x40;
        assert!(decode(&c, &flipped).is_err());
        assert!(matches!(
            decode(&c, &stored[..stored.len() - 1]),
            Err(Damage::StoredLength { .. })
        ));
        let short = ChunkRef {
            len: 4096,
            ..c.clone()
        };
        assert!(matches!(
            decode(&short, &stored),
            Err(Damage::Decode { .. })
        ));
        let other = ChunkRef {
            digest: digest(b"other"),
            ..c
        };
        assert!(matches!(
            decode(&other, &stored),
            Err(Damage::Checksum { .. })
        ));
    }
}
