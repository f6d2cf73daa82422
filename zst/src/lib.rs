//! `memory.zst`: guest memory cut into frames of a fixed number of pages,
//! each compressed on its own with zstd, behind a frame table that gives
//! random access with one read. All-zero frames are a flag in the table,
//! not data. The byte layout is in [`format`]; the rationale and the
//! frame-size measurements are in `docs/memory-zst.md`.
//!
//! This crate is the format only: [`compress`] writes an image (on worker
//! threads), [`Image`] opens one, decodes a frame into a caller's buffer
//! and verifies checksums. It is shared by the server (which serves faults
//! from images, off its core thread) and `uffdctl image` (offline tools),
//! so neither depends on the other.

pub mod format;
mod write;

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

pub use format::{Entry, FormatError, Header, FRAME_ZERO, MAX_FRAME_PAGES, PAGE_SIZE};
pub use write::{compress, CompressOptions, Summary, WriteError, DEFAULT_FRAME_KIB, DEFAULT_LEVEL};

/// Errors of reading an image.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the image")]
    Io(#[from] io::Error),
    #[error("invalid image")]
    Format(#[from] FormatError),
    #[error("frame {frame} does not exist (the image has {frames})")]
    NoFrame { frame: u64, frames: u64 },
    #[error("frame {frame}: the file ends inside its data (truncated?)")]
    Truncated { frame: u64 },
    #[error("frame {frame}: zstd cannot decode it")]
    Decode {
        frame: u64,
        #[source]
        source: io::Error,
    },
    #[error("frame {frame}: decodes to {got} bytes, expected {want}")]
    Length { frame: u64, got: usize, want: usize },
    #[error("frame {frame}: checksum mismatch (the data is corrupt)")]
    Checksum { frame: u64 },
    #[error("the output buffer holds {got} bytes; frame {frame} needs {want}")]
    Buffer { frame: u64, got: usize, want: usize },
}

/// An open image: its file, header and frame table.
#[derive(Debug)]
pub struct Image {
    file: File,
    file_len: u64,
    header: Header,
    entries: Vec<Entry>,
}

/// What `uffdctl image inspect` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    pub memory_bytes: u64,
    pub file_bytes: u64,
    pub frame_pages: u32,
    pub frames: u64,
    pub zero_frames: u64,
    /// Bytes of compressed frame data (the table and header excluded).
    pub data_bytes: u64,
}

impl Stats {
    /// Memory bytes per file byte.
    pub fn ratio(&self) -> f64 {
        self.memory_bytes as f64 / self.file_bytes.max(1) as f64
    }
}

fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
    file.read_exact_at(buf, offset)
}

impl Image {
    /// Open the image at `path`.
    pub fn open(path: &Path) -> Result<Self, Error> {
        Self::from_file(File::open(path)?)
    }

    /// Read the header and frame table of an open image: two reads.
    pub fn from_file(file: File) -> Result<Self, Error> {
        let file_len = file.metadata()?.len();
        let mut hb = [0u8; format::HEADER_BYTES];
        if file_len < format::HEADER_LEN {
            return Err(FormatError::Short(file_len).into());
        }
        read_exact_at(&file, &mut hb, 0)?;
        let header = Header::decode(&hb, file_len)?;
        // `decode` checked that the table lies inside the file.
        let mut table = vec![0u8; usize::try_from(header.table_bytes()).unwrap_or(usize::MAX)];
        read_exact_at(&file, &mut table, format::HEADER_LEN)?;
        let entries = format::decode_table(&header, &table, file_len)?;
        Ok(Image {
            file,
            file_len,
            header,
            entries,
        })
    }

    /// The header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The frame table.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The open file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Whether frame `frame` is all zero (no data).
    pub fn is_zero(&self, frame: u64) -> bool {
        self.entry(frame).is_ok_and(|e| e.zero)
    }

    fn entry(&self, frame: u64) -> Result<&Entry, Error> {
        usize::try_from(frame)
            .ok()
            .and_then(|i| self.entries.get(i))
            .ok_or(Error::NoFrame {
                frame,
                frames: self.header.frames,
            })
    }

    /// Bytes frame `frame` decodes to.
    pub fn frame_bytes(&self, frame: u64) -> usize {
        let r = self.header.frame_range(frame);
        usize::try_from((r.end - r.start) * PAGE_SIZE).unwrap_or(usize::MAX)
    }

    /// Decode frame `frame` into `out` (at least [`Self::frame_bytes`]
    /// long; only that prefix is written) and check its checksum.
    /// `scratch` holds the compressed bytes between calls.
    pub fn decode_frame(
        &self,
        frame: u64,
        dec: &mut zstd::bulk::Decompressor<'_>,
        scratch: &mut Vec<u8>,
        out: &mut [u8],
    ) -> Result<(), Error> {
        let e = *self.entry(frame)?;
        let want = self.frame_bytes(frame);
        let got = out.len();
        let out = out
            .get_mut(..want)
            .ok_or(Error::Buffer { frame, got, want })?;
        if e.zero {
            out.fill(0);
            return Ok(());
        }
        let len = e.compressed_len as usize;
        scratch.resize(len, 0);
        match self.file.read_exact_at(scratch, e.offset) {
            Ok(()) => {}
            Err(err) if err.kind() == io::ErrorKind::UnexpectedEof => {
                return Err(Error::Truncated { frame })
            }
            Err(err) => return Err(err.into()),
        }
        let n = dec
            .decompress_to_buffer(&scratch[..], out)
            .map_err(|source| Error::Decode { frame, source })?;
        if n != want {
            return Err(Error::Length {
                frame,
                got: n,
                want,
            });
        }
        if xxhash_rust::xxh3::xxh3_64(out) != e.checksum {
            return Err(Error::Checksum { frame });
        }
        Ok(())
    }

    /// Size, ratio and frame counts.
    pub fn stats(&self) -> Stats {
        Stats {
            memory_bytes: self.header.memory_bytes,
            file_bytes: self.file_len,
            frame_pages: self.header.frame_pages,
            frames: self.header.frames,
            zero_frames: self.entries.iter().filter(|e| e.zero).count() as u64,
            data_bytes: self
                .entries
                .iter()
                .map(|e| u64::from(e.compressed_len))
                .sum(),
        }
    }

    /// Decode every frame and check its checksum; `progress(done, total)`
    /// is called after each frame. Returns the frames that failed.
    pub fn verify(&self, progress: &mut dyn FnMut(u64, u64)) -> Vec<(u64, Error)> {
        let mut bad = Vec::new();
        let mut dec = match zstd::bulk::Decompressor::new() {
            Ok(d) => d,
            Err(e) => return vec![(0, Error::Io(e))],
        };
        let mut scratch = Vec::new();
        let mut out = vec![0u8; self.frame_bytes(0)];
        for frame in 0..self.header.frames {
            if let Err(e) = self.decode_frame(frame, &mut dec, &mut scratch, &mut out) {
                bad.push((frame, e));
            }
            progress(frame + 1, self.header.frames);
        }
        bad
    }
}

/// Decode a header and frame table from arbitrary bytes twice: as given,
/// and with both checksums made right, so a fuzzer gets past them and
/// exercises every other check. Never panics.
pub fn fuzz_decode(data: &[u8]) {
    let _ = format::decode_all(data);
    let mut b = data.to_vec();
    if b.len() >= format::HEADER_BYTES {
        let frames = u64::from_le_bytes(b[32..40].try_into().unwrap_or_default());
        let table_end = frames
            .checked_mul(format::ENTRY_LEN)
            .and_then(|t| t.checked_add(format::HEADER_LEN));
        if let Some(table) = table_end
            .and_then(|end| usize::try_from(end).ok())
            .and_then(|end| b.get(format::HEADER_BYTES..end))
        {
            let sum = xxhash_rust::xxh3::xxh3_64(table);
            b[40..48].copy_from_slice(&sum.to_le_bytes());
        }
        let sum = xxhash_rust::xxh3::xxh3_64(&b[..56]);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        let _ = format::decode_all(&b);
    }
}

#[cfg(test)]
// Test sizes are small: the casts cannot truncate.
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use std::io::Write;

    use proptest::prelude::*;

    use super::*;

    /// Pages that compress somewhat, with runs of zero pages.
    fn memory(pages: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        let mut m = vec![0u8; pages * PAGE_SIZE as usize];
        for (i, page) in m.chunks_mut(PAGE_SIZE as usize).enumerate() {
            if (i as u64 + seed).is_multiple_of(3) {
                continue; // a zero page
            }
            for (j, b) in page.iter_mut().enumerate() {
                if j % 7 == 0 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                }
                *b = (x >> (j % 8)) as u8 & 0x3f;
            }
        }
        m
    }

    fn compressed(input: &[u8], frame_pages: u32) -> (tempfile::NamedTempFile, Summary) {
        let mut raw = tempfile::NamedTempFile::new().unwrap();
        raw.write_all(input).unwrap();
        let out = tempfile::NamedTempFile::new().unwrap();
        let opts = CompressOptions {
            frame_pages,
            level: 1,
            threads: 2,
        };
        let summary = compress(raw.as_file(), out.path(), &opts, &mut |_, _| {}).unwrap();
        (out, summary)
    }

    fn page_of(img: &Image, page: u64) -> Vec<u8> {
        let frame = img.header().frame_of(page);
        let mut dec = zstd::bulk::Decompressor::new().unwrap();
        let mut buf = vec![0u8; img.frame_bytes(frame)];
        img.decode_frame(frame, &mut dec, &mut Vec::new(), &mut buf)
            .unwrap();
        let at = ((page - img.header().frame_range(frame).start) * PAGE_SIZE) as usize;
        buf[at..at + PAGE_SIZE as usize].to_vec()
    }

    #[test]
    fn zero_frames_are_flags_and_the_last_frame_is_partial() {
        let mut m = memory(10, 1);
        m[..4 * PAGE_SIZE as usize].fill(0); // frame 0 all zero
        let (out, summary) = compressed(&m, 4);
        let img = Image::open(out.path()).unwrap();
        let s = img.stats();
        assert_eq!((s.frames, s.zero_frames), (3, 1));
        assert_eq!(summary.zero_frames, 1);
        assert_eq!(img.entries()[0].compressed_len, 0);
        assert_eq!(img.frame_bytes(2), 2 * PAGE_SIZE as usize);
        for p in 0..10 {
            let at = p as usize * PAGE_SIZE as usize;
            assert_eq!(
                page_of(&img, p),
                &m[at..at + PAGE_SIZE as usize],
                "page {p}"
            );
        }
        assert!(img.verify(&mut |_, _| {}).is_empty());
    }

    #[test]
    fn corrupt_and_truncated_frames_are_errors_not_bytes() {
        let m = memory(8, 5);
        let (out, _) = compressed(&m, 4);
        let img = Image::open(out.path()).unwrap();
        let e1 = img.entries()[1];
        // Flip a byte inside frame 1's data.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(out.path())
            .unwrap();
        let mut b = [0u8; 1];
        img.file().read_exact_at(&mut b, e1.offset + 3).unwrap();
        f.write_all_at(&[b[0] ^ 0x40], e1.offset + 3).unwrap();
        let img = Image::open(out.path()).unwrap();
        let bad = img.verify(&mut |_, _| {});
        assert_eq!(bad.len(), 1, "{bad:?}");
        assert_eq!(bad[0].0, 1);
        assert!(
            matches!(
                bad[0].1,
                Error::Checksum { frame: 1 } | Error::Decode { frame: 1, .. }
            ),
            "{:?}",
            bad[0].1
        );
        // Cut the file inside the last frame: the table no longer fits.
        f.set_len(e1.offset + 1).unwrap();
        assert!(matches!(
            Image::open(out.path()),
            Err(Error::Format(FormatError::FrameOutside { .. }))
        ));
    }

    #[test]
    fn the_checked_in_fuzz_seeds_decode_and_a_valid_one_is_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/zst_table");
        let mut valid = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let b = std::fs::read(e.unwrap().path()).unwrap();
            fuzz_decode(&b);
            valid += usize::from(format::decode_all(&b).is_ok());
        }
        assert!(valid > 0, "no valid seed in {}", dir.display());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn any_page_decodes_to_the_input(
            pages in 1usize..70,
            frame_pages in prop::sample::select(vec![1u32, 2, 3, 16, 64, 512]),
            seed in 1u64..1000,
            probes in proptest::collection::vec(0u64..70, 1..8),
        ) {
            let m = memory(pages, seed);
            let (out, _) = compressed(&m, frame_pages);
            let img = Image::open(out.path()).unwrap();
            prop_assert_eq!(img.header().memory_bytes, m.len() as u64);
            for p in probes.into_iter().map(|p| p % pages as u64) {
                let at = p as usize * PAGE_SIZE as usize;
                prop_assert_eq!(page_of(&img, p), m[at..at + PAGE_SIZE as usize].to_vec());
            }
        }
    }
}
