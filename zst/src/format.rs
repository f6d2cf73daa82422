//! The bytes of a `memory.zst` header and frame table, and their bounded
//! decoders.
//!
//! ```text
//! offset  size  field (little endian)
//!      0     8  magic "PFMEMZST"
//!      8     4  version (1)
//!     12     4  page size in bytes (4096)
//!     16     8  memory size in bytes (whole pages)
//!     24     4  pages per frame (1 ..= MAX_FRAME_PAGES)
//!     28     4  flags (0; a reader refuses any bit it does not know)
//!     32     8  frame count = ceil(memory pages / pages per frame)
//!     40     8  XXH3-64 of the frame table's bytes
//!     48     8  offset of the first frame's data (end of the table)
//!     56     8  XXH3-64 of bytes 0..56 of this header
//!     64  24*n  frame table, one entry per frame:
//!                 0  8  offset of the frame's zstd data in the file
//!                 8  4  compressed length in bytes (0 for a zero frame)
//!                12  4  flags: bit 0 = every byte of the frame is zero
//!                16  8  XXH3-64 of the frame's uncompressed bytes
//!   then          frame data, each frame one independent zstd frame
//! ```
//!
//! The table sits at a fixed place right after the header, so one `pread`
//! of `64 + 24 * n` bytes gives random access to every frame. The last
//! frame may hold fewer pages than the others (memory need not be a whole
//! number of frames). A decoder never trusts a count or an offset: every
//! length is checked against the file's size before anything is allocated.

use std::ops::Range;

/// The first bytes of every image.
pub const MAGIC: [u8; 8] = *b"PFMEMZST";
/// The version this code writes and reads.
pub const VERSION: u32 = 1;
/// Bytes of the header.
pub const HEADER_LEN: u64 = HEADER_BYTES as u64;
/// Bytes of one frame-table entry.
pub const ENTRY_LEN: u64 = ENTRY_BYTES as u64;
/// [`HEADER_LEN`] as a buffer size.
pub const HEADER_BYTES: usize = 64;
/// [`ENTRY_LEN`] as a buffer size.
pub const ENTRY_BYTES: usize = 24;
/// [`PAGE_SIZE`] as the header stores it.
const PAGE_SIZE_U32: u32 = 4096;
/// The page size images are cut in.
pub const PAGE_SIZE: u64 = 4096;
/// Largest frame: 16 MiB of pages (a decoder allocates at most this).
pub const MAX_FRAME_PAGES: u32 = 4096;
/// Entry flag: the frame is all zero and has no data.
pub const FRAME_ZERO: u32 = 1;

/// Why bytes are not a valid header or frame table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("too short for a header: {0} bytes (needs {HEADER_LEN})")]
    Short(u64),
    #[error("not a memory.zst image (bad magic)")]
    Magic,
    #[error("version {0} (this reader knows {VERSION})")]
    Version(u32),
    #[error("header checksum mismatch")]
    HeaderChecksum,
    #[error("page size {0} (expected {PAGE_SIZE})")]
    PageSize(u32),
    #[error("memory size {0} is zero or not whole pages")]
    MemorySize(u64),
    #[error("{0} pages per frame (1 ..= {MAX_FRAME_PAGES})")]
    FramePages(u32),
    #[error("unknown header flags {0:#x}")]
    Flags(u32),
    #[error("{count} frames do not cover {pages} pages of {per} each")]
    FrameCount { count: u64, pages: u64, per: u32 },
    #[error("the frame table ({bytes} bytes) does not fit in the file ({file} bytes)")]
    TableOutside { bytes: u64, file: u64 },
    #[error("data offset {0} is not the end of the frame table")]
    DataOffset(u64),
    #[error("frame table checksum mismatch")]
    TableChecksum,
    #[error("frame {frame}: data {offset}+{len} is outside the frame data area ..{file}")]
    FrameOutside {
        frame: u64,
        offset: u64,
        len: u32,
        file: u64,
    },
    #[error("frame {frame}: unknown flags {flags:#x}")]
    FrameFlags { frame: u64, flags: u32 },
    #[error("frame {frame}: zero frame with data or data frame without")]
    FrameShape { frame: u64 },
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Bytes of guest memory the image holds.
    pub memory_bytes: u64,
    /// Pages per frame (the last frame may hold fewer).
    pub frame_pages: u32,
    /// Number of frames.
    pub frames: u64,
    /// XXH3-64 of the frame table.
    pub table_checksum: u64,
}

/// One frame-table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// Where the frame's zstd data starts in the file.
    pub offset: u64,
    /// Bytes of zstd data (0 for a zero frame).
    pub compressed_len: u32,
    /// Every byte of the frame is zero; it has no data.
    pub zero: bool,
    /// XXH3-64 of the frame's uncompressed bytes.
    pub checksum: u64,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// Frames needed for `memory_bytes` at `frame_pages` pages each.
pub fn frame_count(memory_bytes: u64, frame_pages: u32) -> u64 {
    (memory_bytes / PAGE_SIZE).div_ceil(u64::from(frame_pages.max(1)))
}

impl Header {
    /// The header of an image of `memory_bytes` cut in frames of
    /// `frame_pages` pages.
    pub fn new(memory_bytes: u64, frame_pages: u32) -> Self {
        Header {
            memory_bytes,
            frame_pages,
            frames: frame_count(memory_bytes, frame_pages),
            table_checksum: 0,
        }
    }

    /// Bytes of the frame table.
    pub fn table_bytes(&self) -> u64 {
        self.frames.saturating_mul(ENTRY_LEN)
    }

    /// Where frame data starts: right after the table.
    pub fn data_offset(&self) -> u64 {
        HEADER_LEN.saturating_add(self.table_bytes())
    }

    /// Pages of guest memory.
    pub fn pages(&self) -> u64 {
        self.memory_bytes / PAGE_SIZE
    }

    /// The pages frame `frame` holds.
    pub fn frame_range(&self, frame: u64) -> Range<u64> {
        let per = u64::from(self.frame_pages);
        let lo = frame.saturating_mul(per).min(self.pages());
        lo..lo.saturating_add(per).min(self.pages())
    }

    /// The frame holding `page`.
    pub fn frame_of(&self, page: u64) -> u64 {
        page / u64::from(self.frame_pages.max(1))
    }

    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&PAGE_SIZE_U32.to_le_bytes());
        b[16..24].copy_from_slice(&self.memory_bytes.to_le_bytes());
        b[24..28].copy_from_slice(&self.frame_pages.to_le_bytes());
        // 28..32: flags, none defined.
        b[32..40].copy_from_slice(&self.frames.to_le_bytes());
        b[40..48].copy_from_slice(&self.table_checksum.to_le_bytes());
        b[48..56].copy_from_slice(&self.data_offset().to_le_bytes());
        let sum = xxhash_rust::xxh3::xxh3_64(&b[..56]);
        b[56..64].copy_from_slice(&sum.to_le_bytes());
        b
    }

    /// Decode and check a header; `file_len` is the image file's size.
    pub fn decode(b: &[u8], file_len: u64) -> Result<Self, FormatError> {
        if b.len() < HEADER_BYTES {
            return Err(FormatError::Short(b.len() as u64));
        }
        if b[0..8] != MAGIC {
            return Err(FormatError::Magic);
        }
        let version = u32_at(b, 8);
        if version != VERSION {
            return Err(FormatError::Version(version));
        }
        if xxhash_rust::xxh3::xxh3_64(&b[..56]) != u64_at(b, 56) {
            return Err(FormatError::HeaderChecksum);
        }
        let page_size = u32_at(b, 12);
        if u64::from(page_size) != PAGE_SIZE {
            return Err(FormatError::PageSize(page_size));
        }
        let memory_bytes = u64_at(b, 16);
        if memory_bytes == 0 || !memory_bytes.is_multiple_of(PAGE_SIZE) {
            return Err(FormatError::MemorySize(memory_bytes));
        }
        let frame_pages = u32_at(b, 24);
        if frame_pages == 0 || frame_pages > MAX_FRAME_PAGES {
            return Err(FormatError::FramePages(frame_pages));
        }
        let flags = u32_at(b, 28);
        if flags != 0 {
            return Err(FormatError::Flags(flags));
        }
        let h = Header {
            memory_bytes,
            frame_pages,
            frames: u64_at(b, 32),
            table_checksum: u64_at(b, 40),
        };
        if h.frames != frame_count(memory_bytes, frame_pages) {
            return Err(FormatError::FrameCount {
                count: h.frames,
                pages: h.pages(),
                per: frame_pages,
            });
        }
        // Checked before anything of the table's size is allocated.
        if h.data_offset() > file_len {
            return Err(FormatError::TableOutside {
                bytes: h.table_bytes(),
                file: file_len,
            });
        }
        let data_offset = u64_at(b, 48);
        if data_offset != h.data_offset() {
            return Err(FormatError::DataOffset(data_offset));
        }
        Ok(h)
    }
}

impl Entry {
    /// The entry's bytes.
    pub fn encode(&self) -> [u8; ENTRY_BYTES] {
        let mut b = [0u8; ENTRY_BYTES];
        b[0..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..12].copy_from_slice(&self.compressed_len.to_le_bytes());
        let flags = if self.zero { FRAME_ZERO } else { 0 };
        b[12..16].copy_from_slice(&flags.to_le_bytes());
        b[16..24].copy_from_slice(&self.checksum.to_le_bytes());
        b
    }
}

/// The bytes of a frame table and their checksum (for the header).
pub fn encode_table(entries: &[Entry]) -> (Vec<u8>, u64) {
    let table: Vec<u8> = entries.iter().flat_map(Entry::encode).collect();
    let sum = xxhash_rust::xxh3::xxh3_64(&table);
    (table, sum)
}

/// Decode and check the frame table `b` (exactly `header.table_bytes()`
/// bytes) of a file of `file_len` bytes.
pub fn decode_table(header: &Header, b: &[u8], file_len: u64) -> Result<Vec<Entry>, FormatError> {
    if b.len() as u64 != header.table_bytes() {
        return Err(FormatError::TableOutside {
            bytes: header.table_bytes(),
            file: b.len() as u64,
        });
    }
    if xxhash_rust::xxh3::xxh3_64(b) != header.table_checksum {
        return Err(FormatError::TableChecksum);
    }
    let data = header.data_offset();
    let mut out = Vec::with_capacity(b.len() / ENTRY_BYTES);
    for (frame, e) in (0u64..).zip(b.chunks_exact(ENTRY_BYTES)) {
        let flags = u32_at(e, 12);
        if flags & !FRAME_ZERO != 0 {
            return Err(FormatError::FrameFlags { frame, flags });
        }
        let entry = Entry {
            offset: u64_at(e, 0),
            compressed_len: u32_at(e, 8),
            zero: flags & FRAME_ZERO != 0,
            checksum: u64_at(e, 16),
        };
        if entry.zero != (entry.compressed_len == 0) {
            return Err(FormatError::FrameShape { frame });
        }
        if !entry.zero {
            let end = entry.offset.checked_add(u64::from(entry.compressed_len));
            if entry.offset < data || end.is_none_or(|end| end > file_len) {
                return Err(FormatError::FrameOutside {
                    frame,
                    offset: entry.offset,
                    len: entry.compressed_len,
                    file: file_len,
                });
            }
        }
        out.push(entry);
    }
    Ok(out)
}

/// Decode a header and frame table from the first bytes of an image whose
/// whole size is `bytes.len()`: what a fuzzer feeds.
pub fn decode_all(bytes: &[u8]) -> Result<(Header, Vec<Entry>), FormatError> {
    let len = bytes.len() as u64;
    let h = Header::decode(bytes, len)?;
    let table = bytes
        .get(HEADER_BYTES..usize::try_from(h.data_offset()).unwrap_or(usize::MAX))
        .ok_or(FormatError::TableOutside {
            bytes: h.table_bytes(),
            file: len,
        })?;
    let entries = decode_table(&h, table, len)?;
    Ok((h, entries))
}

#[cfg(test)]
// Test sizes are small: the casts cannot truncate.
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn sample() -> (Header, Vec<Entry>) {
        let mut h = Header::new(10 * PAGE_SIZE, 4);
        let data = h.data_offset();
        let entries = vec![
            Entry {
                offset: data,
                compressed_len: 10,
                zero: false,
                checksum: 7,
            },
            Entry {
                offset: 0,
                compressed_len: 0,
                zero: true,
                checksum: 0,
            },
            Entry {
                offset: data + 10,
                compressed_len: 5,
                zero: false,
                checksum: 9,
            },
        ];
        let table: Vec<u8> = entries.iter().flat_map(|e| e.encode()).collect();
        h.table_checksum = xxhash_rust::xxh3::xxh3_64(&table);
        (h, entries)
    }

    fn bytes_of(h: &Header, entries: &[Entry], extra: usize) -> Vec<u8> {
        let mut b = h.encode().to_vec();
        b.extend(entries.iter().flat_map(|e| e.encode()));
        b.extend(std::iter::repeat_n(0xab, extra));
        b
    }

    #[test]
    fn header_and_table_round_trip_with_a_partial_last_frame() {
        let (h, entries) = sample();
        assert_eq!(h.frames, 3);
        assert_eq!(h.frame_range(2), 8..10, "the last frame holds 2 pages");
        let b = bytes_of(&h, &entries, 15);
        assert_eq!(decode_all(&b), Ok((h, entries)));
    }

    #[test]
    fn frames_outside_the_file_and_bad_sums_are_refused() {
        let (h, mut entries) = sample();
        let b = bytes_of(&h, &entries, 14); // one byte short of frame 2's end
        assert!(matches!(
            decode_all(&b),
            Err(FormatError::FrameOutside { frame: 2, .. })
        ));
        entries[0].checksum = 8;
        let b = bytes_of(&h, &entries, 15);
        assert_eq!(decode_all(&b), Err(FormatError::TableChecksum));
        let mut b = bytes_of(&sample().0, &sample().1, 15);
        b[20] ^= 1;
        assert_eq!(decode_all(&b), Err(FormatError::HeaderChecksum));
    }

    #[test]
    fn a_huge_frame_count_is_refused_before_allocating() {
        let mut h = Header::new(1 << 50, 1);
        h.table_checksum = 0;
        let b = h.encode();
        assert!(matches!(
            decode_all(&b),
            Err(FormatError::TableOutside { .. })
        ));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_all(&b);
        }

        #[test]
        fn flipped_bytes_of_a_valid_image_never_panic(at in 0usize..200, bit in 0u8..8) {
            let (h, entries) = sample();
            let mut b = bytes_of(&h, &entries, 15);
            if at < b.len() {
                b[at] ^= 1 << bit;
            }
            let _ = decode_all(&b);
        }
    }
}
