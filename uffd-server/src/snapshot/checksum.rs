//! File checksums: a hash per 1 MiB chunk, and a hash over the chunk
//! digests for the whole file; XXH3-128 for new snapshots, BLAKE3 and
//! SHA-256 read from format-2 and format-1 snapshots (see
//! [`WRITE_ALGORITHM`]). Holes are hashed as the zeroes they read as,
//! without reading or hashing them (an all-hole chunk has a known digest),
//! and a snapshot written over its parent's reflinked image reuses the
//! parent's digests of the chunks it did not touch: checksumming costs
//! what was written, not the size of guest memory. The chunks a snapshot
//! writes whole are digested from the writer's own buffers as it writes
//! them ([`StreamSums`]), so only chunks it wrote in part are read back.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use super::image::data_ranges;
pub use proto::snapshot::Algorithm;
use proto::snapshot::FileSum;

/// Bytes per checksummed chunk.
pub const CHUNK_BYTES: u64 = 1 << 20;

/// What new snapshots are checksummed with. BLAKE3 hashed a 1 MiB chunk
/// ~3.6 times faster than SHA-256 on one core of this kind of host, yet at
/// ~0.2 ms per MiB it still took as much CPU as reading the pages and
/// competed with the writer for the second core of a small snapshot;
/// XXH3-128 takes under a tenth of a millisecond per MiB (~12 GB/s a
/// core, built for plain x86-64: SSE2). The
/// checksums detect torn and damaged files, which a 128-bit
/// non-cryptographic hash does (see [`Algorithm::Xxh3`]).
pub const WRITE_ALGORITHM: Algorithm = Algorithm::Xxh3;

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect()
}

/// The digest of `bytes` with `alg`, as hex.
fn digest(alg: Algorithm, bytes: &[u8]) -> String {
    match alg {
        Algorithm::Sha256 => hex(&Sha256::digest(bytes)),
        Algorithm::Blake3 => blake3::hash(bytes).to_hex().to_string(),
        Algorithm::Xxh3 => hex128(xxh3_128(bytes)),
    }
}

/// A 128-bit XXH3 digest as hex, in its canonical (big-endian) order.
fn hex128(d: u128) -> String {
    format!("{d:032x}")
}

/// The digest of `n` zero bytes (cached for a whole chunk).
fn zero_digest(alg: Algorithm, n: u64) -> String {
    static WHOLE: [OnceLock<String>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let compute = |n: u64| digest(alg, &vec![0u8; shared::geometry::usize_of(n)]);
    if n == CHUNK_BYTES {
        let slot = match alg {
            Algorithm::Sha256 => 0,
            Algorithm::Blake3 => 1,
            Algorithm::Xxh3 => 2,
        };
        WHOLE[slot].get_or_init(|| compute(CHUNK_BYTES)).clone()
    } else {
        compute(n)
    }
}

/// An incremental hash of one chunk.
enum Hasher {
    Sha256(Sha256),
    Blake3(Box<blake3::Hasher>),
    Xxh3(Box<Xxh3>),
}

impl Hasher {
    fn new(alg: Algorithm) -> Self {
        match alg {
            Algorithm::Sha256 => Self::Sha256(Sha256::new()),
            Algorithm::Blake3 => Self::Blake3(Box::default()),
            Algorithm::Xxh3 => Self::Xxh3(Box::default()),
        }
    }

    fn update(&mut self, bytes: &[u8]) {
        match self {
            Self::Sha256(h) => h.update(bytes),
            Self::Blake3(h) => {
                h.update(bytes);
            }
            Self::Xxh3(h) => h.update(bytes),
        }
    }

    fn finish(self) -> String {
        match self {
            Self::Sha256(h) => hex(&h.finalize()),
            Self::Blake3(h) => h.finalize().to_hex().to_string(),
            Self::Xxh3(h) => hex128(h.digest128()),
        }
    }
}

/// What a write put into the file: bytes, or zeroes (a hole).
#[derive(Debug, Clone, Copy)]
pub enum Piece<'a> {
    Bytes(&'a [u8]),
    Zeroes(u64),
}

impl Piece<'_> {
    fn len(&self) -> u64 {
        match self {
            Piece::Bytes(b) => b.len() as u64,
            Piece::Zeroes(n) => *n,
        }
    }
}

/// Chunk digests taken from the writes themselves, in the order they were
/// made, so that the chunks a snapshot wrote whole need not be read back.
///
/// A chunk is digested when writes cover it from its first byte to its
/// last, each starting where the one before ended; any other write into
/// it (a gap, a rewrite, a write after it was complete) drops what is
/// known of it, and the file's own bytes decide its digest
/// ([`sum_file_reusing`]). So a digest given here is always that of the
/// chunk's final contents, whatever order the writes came in.
pub struct StreamSums {
    alg: Algorithm,
    len: u64,
    /// The chunk being digested: its index, the next byte expected, and
    /// the hash so far.
    open: Option<(u64, u64, Hasher)>,
    done: std::collections::BTreeMap<u64, String>,
}

impl std::fmt::Debug for StreamSums {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSums")
            .field("alg", &self.alg)
            .field("len", &self.len)
            .field("open", &self.open.as_ref().map(|(c, next, _)| (c, next)))
            .field("done", &self.done.len())
            .finish()
    }
}

impl StreamSums {
    /// For a file of `len` bytes, hashed with `alg`.
    pub fn new(alg: Algorithm, len: u64) -> Self {
        Self {
            alg,
            len,
            open: None,
            done: Default::default(),
        }
    }

    /// `piece` was written at byte `at`.
    pub fn feed(&mut self, at: u64, piece: Piece<'_>) {
        static ZEROES: [u8; 1 << 16] = [0; 1 << 16];
        let end = at.saturating_add(piece.len()).min(self.len);
        let mut p = at;
        while p < end {
            let c = p / CHUNK_BYTES;
            let (lo, hi) = (c * CHUNK_BYTES, ((c + 1) * CHUNK_BYTES).min(self.len));
            let e = end.min(hi);
            self.done.remove(&c);
            let go_on = matches!(&self.open, Some((oc, next, _)) if *oc == c && *next == p);
            if !go_on {
                self.open = (p == lo).then(|| (c, lo, Hasher::new(self.alg)));
            }
            if let Some((_, next, h)) = self.open.as_mut() {
                match piece {
                    Piece::Bytes(b) => {
                        let k = |x: u64| shared::geometry::usize_of(x - at);
                        h.update(&b[k(p)..k(e)]);
                    }
                    Piece::Zeroes(_) => {
                        let mut q = p;
                        while q < e {
                            let n = (e - q).min(ZEROES.len() as u64);
                            h.update(&ZEROES[..shared::geometry::usize_of(n)]);
                            q += n;
                        }
                    }
                }
                *next = e;
                if e == hi {
                    if let Some((_, _, h)) = self.open.take() {
                        self.done.insert(c, h.finish());
                    }
                }
            }
            p = e;
        }
    }

    /// Bytes `[at, at + len)` were written but cannot be digested: the
    /// chunks they touch are left to be read back.
    pub fn forget(&mut self, at: u64, len: u64) {
        let end = at.saturating_add(len).min(self.len);
        if end <= at {
            return;
        }
        for c in at / CHUNK_BYTES..=(end - 1) / CHUNK_BYTES {
            self.done.remove(&c);
            if matches!(&self.open, Some((oc, _, _)) if *oc == c) {
                self.open = None;
            }
        }
    }

    /// The digests of the chunks the writes covered whole.
    pub fn finish(self) -> std::collections::BTreeMap<u64, String> {
        self.done
    }
}

/// The whole-file digest from the chunk digests.
fn top_digest(alg: Algorithm, chunks: &[String]) -> String {
    let raw: Vec<u8> = chunks
        .iter()
        .flat_map(|c| unhex(c).unwrap_or_default())
        .collect();
    digest(alg, &raw)
}

/// Size and checksums of `file` with `alg`.
pub fn sum_file(file: &File, alg: Algorithm) -> std::io::Result<FileSum> {
    sum_file_reusing(file, alg, &|_| None)
}

/// Size and checksums of `file` with `alg`, taking the digest of chunk `c`
/// from `reuse(c)` where it answers (chunks known not to have changed,
/// digested with `alg` too).
pub fn sum_file_reusing(
    file: &File,
    alg: Algorithm,
    reuse: &dyn Fn(u64) -> Option<String>,
) -> std::io::Result<FileSum> {
    let len = file.metadata()?.len();
    let data = data_ranges(file.as_raw_fd(), len)?;
    let nchunks = len.div_ceil(CHUNK_BYTES);
    let mut chunks: Vec<Option<String>> = Vec::with_capacity(shared::geometry::usize_of(nchunks));
    let mut to_read: Vec<(usize, u64, u64)> = Vec::new();
    let mut di = 0;
    for c in 0..nchunks {
        let (lo, hi) = (c * CHUNK_BYTES, ((c + 1) * CHUNK_BYTES).min(len));
        if let Some(d) = reuse(c) {
            chunks.push(Some(d));
            continue;
        }
        while di < data.len() && data[di].1 <= lo {
            di += 1;
        }
        if data.get(di).is_some_and(|(s, _)| *s < hi) {
            to_read.push((chunks.len(), lo, hi));
            chunks.push(None);
        } else {
            chunks.push(Some(zero_digest(alg, hi - lo)));
        }
    }
    // The chunks with data are read and hashed on every core (counted
    // once: the count reads cgroup files each time).
    static CORES: OnceLock<usize> = OnceLock::new();
    let cores = *CORES.get_or_init(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    });
    let workers = cores.min(to_read.len().max(1));
    let per = to_read.len().div_ceil(workers).max(1);
    let hashed: Vec<std::io::Result<Vec<(usize, String)>>> = std::thread::scope(|sc| {
        let handles: Vec<_> = to_read
            .chunks(per)
            .map(|part| {
                sc.spawn(move || {
                    let mut buf = vec![0u8; shared::geometry::usize_of(CHUNK_BYTES)];
                    part.iter()
                        .map(|(i, lo, hi)| {
                            let k = shared::geometry::usize_of(hi - lo);
                            file.read_exact_at(&mut buf[..k], *lo)?;
                            Ok((*i, digest(alg, &buf[..k])))
                        })
                        .collect()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(std::io::Error::other("a checksum thread panicked")))
            })
            .collect()
    });
    for part in hashed {
        for (i, d) in part? {
            chunks[i] = Some(d);
        }
    }
    let chunks: Vec<String> = chunks.into_iter().map(Option::unwrap_or_default).collect();
    Ok(FileSum {
        bytes: len,
        algorithm: alg,
        digest: top_digest(alg, &chunks),
        chunks,
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn holes_hash_as_zeroes() {
        let mut dense = tempfile::tempfile().unwrap();
        let mut data = vec![0u8; 3 << 20];
        data[(2 << 20) + 5] = 7;
        dense.write_all(&data).unwrap();
        let sparse = tempfile::tempfile().unwrap();
        sparse.set_len(3 << 20).unwrap();
        sparse.write_all_at(&[7], (2 << 20) + 5).unwrap();
        for alg in [Algorithm::Sha256, Algorithm::Blake3, Algorithm::Xxh3] {
            let a = sum_file(&dense, alg).unwrap();
            let b = sum_file(&sparse, alg).unwrap();
            assert_eq!(a, b);
            assert_eq!(a.bytes, 3 << 20);
            assert_eq!(a.chunks.len(), 3);
            sparse.write_all_at(&[1], 0).unwrap();
            let c = sum_file(&sparse, alg).unwrap();
            assert_ne!(c, a);
            assert_eq!(c.chunks[1..], a.chunks[1..]);
            sparse.write_all_at(&[0], 0).unwrap();
        }
    }

    #[test]
    fn streamed_digests_are_those_of_the_file() {
        let c = shared::geometry::usize_of(CHUNK_BYTES);
        let len = 3 * CHUNK_BYTES + 4096;
        let f = tempfile::tempfile().unwrap();
        f.set_len(len).unwrap();
        let mut s = StreamSums::new(WRITE_ALGORITHM, len);
        let a = vec![1u8; c];
        // Chunk 0 whole in two writes; chunk 1 with a gap; chunk 2 whole
        // and then rewritten in part; the short last chunk whole, as zeroes.
        for (at, bytes) in [(0, &a[..c / 2]), (c / 2, &a[c / 2..])] {
            f.write_all_at(bytes, at as u64).unwrap();
            s.feed(at as u64, Piece::Bytes(bytes));
        }
        f.write_all_at(&a[..4096], CHUNK_BYTES + 8192).unwrap();
        s.feed(CHUNK_BYTES + 8192, Piece::Bytes(&a[..4096]));
        f.write_all_at(&a, 2 * CHUNK_BYTES).unwrap();
        s.feed(2 * CHUNK_BYTES, Piece::Bytes(&a));
        f.write_all_at(&[9u8; 4096], 2 * CHUNK_BYTES + 4096)
            .unwrap();
        s.feed(2 * CHUNK_BYTES + 4096, Piece::Bytes(&[9u8; 4096]));
        s.feed(3 * CHUNK_BYTES, Piece::Zeroes(4096));
        let streamed = s.finish();
        assert_eq!(streamed.keys().copied().collect::<Vec<_>>(), vec![0, 3]);
        let whole = sum_file(&f, WRITE_ALGORITHM).unwrap();
        assert_eq!(streamed[&0], whole.chunks[0]);
        assert_eq!(streamed[&3], whole.chunks[3]);
        let reusing =
            sum_file_reusing(&f, WRITE_ALGORITHM, &|c| streamed.get(&c).cloned()).unwrap();
        assert_eq!(reusing, whole);
    }

    #[test]
    fn reused_digests_are_taken_as_given() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(2 << 20).unwrap();
        let honest = sum_file(&f, WRITE_ALGORITHM).unwrap();
        let reused =
            sum_file_reusing(&f, WRITE_ALGORITHM, &|c| (c == 1).then(|| "00".repeat(32))).unwrap();
        assert_eq!(reused.chunks[0], honest.chunks[0]);
        assert_ne!(reused.digest, honest.digest);
    }

    #[test]
    fn digests_are_the_published_functions() {
        let f = tempfile::tempfile().unwrap();
        f.write_all_at(b"abc", 0).unwrap();
        let sha = sum_file(&f, Algorithm::Sha256).unwrap();
        assert_eq!(
            sha.chunks[0],
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let b3 = sum_file(&f, Algorithm::Blake3).unwrap();
        assert_eq!(
            b3.chunks[0],
            "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"
        );
        assert_eq!(b3.algorithm, Algorithm::Blake3);
        let x = sum_file(&f, Algorithm::Xxh3).unwrap();
        assert_eq!(x.chunks[0], "06b05ab6733a618578af5f94892f3950");
    }
}
