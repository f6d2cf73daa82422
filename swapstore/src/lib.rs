//! The swap store: guest pages taken out of memory, compressed with zstd
//! into one append-only file the server owns (`<state-dir>/swap/pages`).
//!
//! A page is found by its key, `(owner, page)`; `owner` is opaque here (the
//! caller uses a page-source id). Every write appends a frame; the newest
//! frame of a key wins and the older ones become garbage until
//! [`SwapStore::compact`] copies the live frames to a new file.
//!
//! # Frame layout
//!
//! A frame is a 56-byte header followed by its payload, all little-endian:
//!
//! | offset | size | field                                                  |
//! |-------:|-----:|--------------------------------------------------------|
//! |      0 |    4 | magic `PFSW`                                           |
//! |      4 |    1 | format version, [`FORMAT_VERSION`]                     |
//! |      5 |    1 | flags: bit 0 = payload is zstd, else the raw page      |
//! |      6 |    2 | reserved, zero                                         |
//! |      8 |    8 | owner                                                  |
//! |     16 |    8 | page                                                   |
//! |     24 |    8 | seq                                                    |
//! |     32 |    4 | payload length: 4096 raw, 1..=4095 compressed          |
//! |     36 |    4 | reserved, zero                                         |
//! |     40 |    8 | xxh3-64 of the uncompressed 4096 bytes                 |
//! |     48 |    8 | xxh3-64 of header bytes 0..48                          |
//! |     56 |    … | payload                                                |
//!
//! # Invariants
//!
//! - The file is a gapless sequence of whole frames from offset 0 to the
//!   end kept in memory; every frame is written with one `pwrite` at that
//!   end, and a write that fails is cut off again, so a crash of the server
//!   leaves at most one torn frame, at the tail.
//! - `seq` is store-wide and strictly increasing: a new frame's seq is above
//!   every seq in the file (at open, one above the highest seen), and
//!   compaction keeps seqs. Of several frames of a key, the highest seq
//!   is the page's bytes.
//! - The index names, for each live key, the frame its bytes are in. The
//!   file holds frames the index does not name (garbage); [`SwapStore::remove`]
//!   writes nothing, so after a restart a removed page is back in the index
//!   until the caller drops it with [`SwapStore::retain`]. A caller therefore
//!   marks a page as swapped only after [`SwapStore::put`] returned, and
//!   runs `retain` with its own tables after every open.
//! - `stored_bytes + garbage_bytes == file_bytes` ([`StoreStats`]).
//! - One process uses a store at a time (an exclusive `flock`, taken at
//!   open and kept across compaction).
//! - Reads verify everything: the header's checksum, that it names the key,
//!   seq and length the index expects, and the xxh3 of the decompressed
//!   page. Open verifies headers only, never payloads: a damaged payload
//!   is found, and reported for its key alone, when the page is read.
//! - Nothing is fsynced: the pages are pieces of running VMs' memory, which
//!   does not outlive the host either. What the store survives is a crash
//!   of the server process. The file is created mode 0600.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use shared::geometry::usize_of;
use shared::PAGE_SIZE;
use xxhash_rust::xxh3::xxh3_64;

/// The first four bytes of every frame.
pub const FRAME_MAGIC: [u8; 4] = *b"PFSW";
/// The frame format this server writes and reads.
pub const FORMAT_VERSION: u8 = 1;
/// Bytes in a frame header.
pub const FRAME_HEADER_LEN: usize = 56;
/// The zstd level of [`StoreOptions::default`]: fast, and most of what
/// higher levels get out of a single page.
pub const DEFAULT_LEVEL: i32 = 1;
/// [`SwapStore::wants_compaction`] leaves files up to this size alone.
pub const COMPACT_MIN_FILE_BYTES: u64 = 8 << 20;

const HEADER_BYTES: u64 = 56;
const PAGE: usize = usize_of(PAGE_SIZE);
/// Header bytes covered by the header checksum.
const HEADER_HASHED: usize = 48;
const FLAG_ZSTD: u8 = 1;
/// Read and write buffer of the sequential passes (open, compaction).
const SEQUENTIAL_BUFFER: usize = 1 << 20;

/// What went wrong in the swap store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("a swapped page is {PAGE_SIZE} bytes, not {len}")]
    PageSize { len: usize },
    #[error("cannot {what} {}{}", path.display(), fd_hint(source))]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "swap store {} is in use by another process (a second server with the same \
         state directory?); stop that one, or give each server its own state directory",
        path.display()
    )]
    Locked { path: PathBuf },
    #[error(
        "swap store {} holds a frame of format version {version} at offset {offset}, and \
         this server reads version {FORMAT_VERSION}: run the server that wrote it, or move \
         the file away (the pages in it are lost)",
        path.display()
    )]
    NewerFormat {
        path: PathBuf,
        offset: u64,
        version: u8,
    },
    #[error(
        "{} is not a swap store ({reason}): move it away (whatever pages it held are \
         lost) and start the server again",
        path.display()
    )]
    NotAStore { path: PathBuf, reason: String },
    #[error("cannot set up a zstd compressor at level {level}; use a level from 1 to 19")]
    CreateCompressor {
        level: i32,
        #[source]
        source: io::Error,
    },
    #[error("cannot set up a zstd decompressor (is the host out of memory?)")]
    CreateDecompressor(#[source] io::Error),
    #[error(
        "swap store {} is full at {file_bytes} bytes ({}): free space on its filesystem \
         or raise its size limit; the page stays in memory meanwhile",
        path.display(),
        full_why(*limit, source.as_ref())
    )]
    Full {
        path: PathBuf,
        file_bytes: u64,
        limit: Option<u64>,
        #[source]
        source: Option<io::Error>,
    },
    #[error(
        "page {page} of owner {owner} is not in the swap store: the server's page tables \
         and the store disagree, which is a bug; please report it with the server's log"
    )]
    Missing { owner: u64, page: u64 },
    #[error(
        "page {page} of owner {owner} in the swap store (frame at offset {offset}) is \
         damaged: {reason}; its contents are lost: check the disk under the store (dmesg) \
         and restore the VM from a snapshot"
    )]
    Corrupt {
        owner: u64,
        page: u64,
        offset: u64,
        reason: String,
    },
    #[error("bad swap frame header: {reason}")]
    BadHeader { reason: String },
}

/// A hint to append to an I/O error that means the process ran out of
/// file descriptors; empty otherwise.
fn fd_hint(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EMFILE) => "; the server is out of file descriptors: raise its limit",
        Some(libc::ENFILE) => "; the system is out of file descriptors (fs.file-max)",
        _ => "",
    }
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, StoreError>;

fn full_why(limit: Option<u64>, source: Option<&io::Error>) -> String {
    match (source, limit) {
        (Some(_), _) => "its filesystem has no room left".to_owned(),
        (None, Some(limit)) => format!("the next frame would pass its limit of {limit} bytes"),
        (None, None) => "no room left".to_owned(),
    }
}

/// How a store is set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreOptions {
    /// The file never grows past this many bytes: a write that would
    /// fails with [`StoreError::Full`]. `None`: as far as the filesystem
    /// allows.
    pub max_file_bytes: Option<u64>,
    /// zstd level of new frames.
    pub level: i32,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            max_file_bytes: None,
            level: DEFAULT_LEVEL,
        }
    }
}

/// Where a page's bytes are in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Offset of the frame (its header) in the file.
    pub offset: u64,
    /// Payload bytes: the page's compressed size, or 4096 when stored raw
    /// (the frame is [`FRAME_HEADER_LEN`] bytes more).
    pub stored_bytes: u32,
    /// Whether the payload is zstd.
    pub compressed: bool,
    /// The frame's sequence number.
    pub seq: u64,
}

/// The store's size, in pages and bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Live pages (keys).
    pub pages: u64,
    /// Bytes of the live pages' frames, headers included.
    pub stored_bytes: u64,
    /// Bytes of the file: `stored_bytes + garbage_bytes`.
    pub file_bytes: u64,
    /// Bytes of frames no key names any more.
    pub garbage_bytes: u64,
}

/// What [`SwapStore::open`] found in the file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Whole frames read, garbage included.
    pub frames: u64,
    /// Live pages in the index.
    pub pages: u64,
    /// The bytes cut off the end of the file, if any.
    pub cut: Option<Cut>,
    /// Whether an unfinished compaction's copy was found and removed.
    pub stale_compaction_removed: bool,
}

/// Bytes cut off the end of the file at open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cut {
    /// Where the cut bytes started: the file's length now.
    pub offset: u64,
    /// How many bytes were cut.
    pub bytes: u64,
    /// Why.
    pub kind: CutKind,
    /// What was wrong at `offset`.
    pub reason: String,
}

/// Why bytes were cut off the file at open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CutKind {
    /// The last append did not finish (the server died in it): nothing
    /// that was stored is lost. Also reported for a damaged header when
    /// what follows it is not more than one frame's worth.
    TornTail,
    /// A frame header before the tail does not verify: it and every
    /// frame after it are lost.
    BadFrame,
}

impl fmt::Display for Cut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            CutKind::TornTail => write!(
                f,
                "cut a torn last frame ({} bytes at offset {}: {})",
                self.bytes, self.offset, self.reason
            ),
            CutKind::BadFrame => write!(
                f,
                "dropped {} bytes from offset {} on ({}); the pages only they held are lost",
                self.bytes, self.offset, self.reason
            ),
        }
    }
}

impl fmt::Display for Recovered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} pages in {} frames", self.pages, self.frames)?;
        if let Some(cut) = &self.cut {
            write!(f, "; {cut}")?;
        }
        if self.stale_compaction_removed {
            f.write_str("; removed an unfinished compaction's copy")?;
        }
        Ok(())
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The key's owner.
    pub owner: u64,
    /// The key's page.
    pub page: u64,
    /// Store-wide sequence number; the highest of a key wins.
    pub seq: u64,
    /// Bytes of payload after the header.
    pub payload_len: u32,
    /// Whether the payload is zstd (else the raw page).
    pub compressed: bool,
    /// xxh3-64 of the uncompressed page.
    pub data_hash: u64,
}

impl FrameHeader {
    /// Header plus payload bytes.
    pub fn frame_len(&self) -> u64 {
        HEADER_BYTES + u64::from(self.payload_len)
    }

    /// The header's bytes, checksum included.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[..4].copy_from_slice(&FRAME_MAGIC);
        b[4] = FORMAT_VERSION;
        b[5] = if self.compressed { FLAG_ZSTD } else { 0 };
        b[8..16].copy_from_slice(&self.owner.to_le_bytes());
        b[16..24].copy_from_slice(&self.page.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq.to_le_bytes());
        b[32..36].copy_from_slice(&self.payload_len.to_le_bytes());
        b[40..48].copy_from_slice(&self.data_hash.to_le_bytes());
        let sum = xxh3_64(&b[..HEADER_HASHED]);
        b[48..56].copy_from_slice(&sum.to_le_bytes());
        b
    }
}

/// Decodes and checks the frame header at the start of `bytes`
/// ([`StoreError::BadHeader`] says what is wrong).
pub fn parse_header(bytes: &[u8]) -> Result<FrameHeader> {
    check_header(bytes).map_err(|e| StoreError::BadHeader {
        reason: e.to_string(),
    })
}

fn le_u64(b: &[u8; FRAME_HEADER_LEN], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

/// What is wrong with a frame header.
#[derive(Debug, thiserror::Error)]
enum HeaderError {
    #[error("only {0} bytes, a header is {FRAME_HEADER_LEN}")]
    Short(usize),
    #[error("it does not start with the magic PFSW")]
    Magic,
    #[error("format version {0}, this server reads {FORMAT_VERSION}")]
    Version(u8),
    #[error("its checksum does not match (torn or overwritten)")]
    Checksum,
    #[error("unknown flags {0:#04x}")]
    Flags(u8),
    #[error("its reserved bytes are not zero")]
    Reserved,
    #[error("a payload of {0} bytes (a raw page is {PAGE_SIZE}, a compressed one less)")]
    PayloadLen(u32),
}

/// [`parse_header`], with the reason a human reads.
fn check_header(bytes: &[u8]) -> std::result::Result<FrameHeader, HeaderError> {
    let Some(b) = bytes.first_chunk::<FRAME_HEADER_LEN>() else {
        return Err(HeaderError::Short(bytes.len()));
    };
    if b[..4] != FRAME_MAGIC {
        return Err(HeaderError::Magic);
    }
    if b[4] != FORMAT_VERSION {
        return Err(HeaderError::Version(b[4]));
    }
    if xxh3_64(&b[..HEADER_HASHED]) != le_u64(b, HEADER_HASHED) {
        return Err(HeaderError::Checksum);
    }
    let flags = b[5];
    if flags & !FLAG_ZSTD != 0 {
        return Err(HeaderError::Flags(flags));
    }
    if b[6..8] != [0; 2] || b[36..40] != [0; 4] {
        return Err(HeaderError::Reserved);
    }
    let mut len = [0u8; 4];
    len.copy_from_slice(&b[32..36]);
    let payload_len = u32::from_le_bytes(len);
    let compressed = flags & FLAG_ZSTD != 0;
    let fits = if compressed {
        (1..PAGE_SIZE).contains(&u64::from(payload_len))
    } else {
        u64::from(payload_len) == PAGE_SIZE
    };
    if !fits {
        return Err(HeaderError::PayloadLen(payload_len));
    }
    Ok(FrameHeader {
        owner: le_u64(b, 8),
        page: le_u64(b, 16),
        seq: le_u64(b, 24),
        payload_len,
        compressed,
        data_hash: le_u64(b, 40),
    })
}

type Key = (u64, u64);

/// Where a live key's frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    offset: u64,
    seq: u64,
    payload_len: u32,
    compressed: bool,
}

impl Entry {
    fn frame_len(&self) -> u64 {
        HEADER_BYTES + u64::from(self.payload_len)
    }

    fn location(&self) -> Location {
        Location {
            offset: self.offset,
            stored_bytes: self.payload_len,
            compressed: self.compressed,
            seq: self.seq,
        }
    }
}

/// The index rebuilt from a file's frames.
#[derive(Debug, Default)]
struct Scan {
    index: BTreeMap<Key, Entry>,
    live_bytes: u64,
    next_seq: u64,
    frames: u64,
    /// End of the last whole frame.
    end: u64,
    cut: Option<Cut>,
}

/// Reads frames from offset 0 of a file of `file_len` bytes, up to its end
/// or the first frame that is not whole and sound.
fn scan(mut r: impl Read, file_len: u64, path: &Path) -> Result<Scan> {
    let mut s = Scan::default();
    let mut header = [0u8; FRAME_HEADER_LEN];
    let mut payload = vec![0u8; PAGE];
    let read_error = |source| StoreError::Io {
        what: "read swap store",
        path: path.to_owned(),
        source,
    };
    loop {
        let offset = s.end;
        let left = file_len - offset;
        if left == 0 {
            break;
        }
        let cut = |kind, reason| {
            Some(Cut {
                offset,
                bytes: left,
                kind,
                reason,
            })
        };
        if left < HEADER_BYTES {
            s.cut = cut(
                CutKind::TornTail,
                format!("{left} bytes, less than a frame header"),
            );
            break;
        }
        r.read_exact(&mut header).map_err(read_error)?;
        if header[..4] == FRAME_MAGIC && header[4] > FORMAT_VERSION {
            return Err(StoreError::NewerFormat {
                path: path.to_owned(),
                offset,
                version: header[4],
            });
        }
        let h = match check_header(&header) {
            Ok(h) => h,
            Err(reason) => {
                let could_be_last = left < HEADER_BYTES + PAGE_SIZE;
                if offset == 0 && !could_be_last {
                    return Err(StoreError::NotAStore {
                        path: path.to_owned(),
                        reason: format!("its first frame header: {reason}"),
                    });
                }
                let kind = if could_be_last {
                    CutKind::TornTail
                } else {
                    CutKind::BadFrame
                };
                s.cut = cut(kind, format!("bad frame header: {reason}"));
                break;
            }
        };
        let frame_len = h.frame_len();
        if frame_len > left {
            s.cut = cut(
                CutKind::TornTail,
                format!("a frame of {frame_len} bytes with only {left} written"),
            );
            break;
        }
        r.read_exact(&mut payload[..usize_of(u64::from(h.payload_len))])
            .map_err(read_error)?;
        s.frames += 1;
        s.next_seq = s.next_seq.max(h.seq.saturating_add(1));
        let entry = Entry {
            offset,
            seq: h.seq,
            payload_len: h.payload_len,
            compressed: h.compressed,
        };
        let newest = s
            .index
            .get(&(h.owner, h.page))
            .is_none_or(|old| h.seq >= old.seq);
        if newest {
            if let Some(old) = s.index.insert((h.owner, h.page), entry) {
                s.live_bytes -= old.frame_len();
            }
            s.live_bytes += frame_len;
        }
        s.end += frame_len;
    }
    Ok(s)
}

thread_local! {
    /// Each reading thread's zstd context.
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// Decompresses `src` into `out` with this thread's decompressor: the
/// outer error is a failure to set one up, the inner one zstd's verdict
/// on `src`.
fn decompress(src: &[u8], out: &mut [u8]) -> Result<io::Result<usize>> {
    DECOMPRESSOR.with(|d| {
        let mut d = d.borrow_mut();
        let dec = match &mut *d {
            Some(dec) => dec,
            slot @ None => slot
                .insert(zstd::bulk::Decompressor::new().map_err(StoreError::CreateDecompressor)?),
        };
        Ok(dec.decompress_to_buffer(src, out))
    })
}

/// `<path>.compact`: where a compaction writes its copy.
fn compact_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".compact");
    PathBuf::from(s)
}

fn io_error(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> StoreError {
    let path = path.to_owned();
    move |source| StoreError::Io { what, path, source }
}

/// Opens (creating, mode 0600) `path` for reading and writing, and locks it.
fn open_locked(path: &Path, truncate: bool) -> Result<Flock<File>> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(truncate)
        .mode(0o600)
        .open(path)
        .map_err(io_error("open swap store", path))?;
    Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| match errno {
        Errno::EWOULDBLOCK => StoreError::Locked {
            path: path.to_owned(),
        },
        e => StoreError::Io {
            what: "lock swap store",
            path: path.to_owned(),
            source: e.into(),
        },
    })
}

/// Removes what a compaction that did not finish left; whether there was
/// one.
fn remove_stale_copy(path: &Path) -> Result<bool> {
    let tmp = compact_path(path);
    match fs::remove_file(&tmp) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_error("remove the unfinished compaction", &tmp)(e)),
    }
}

/// A compaction's copy of the live frames.
struct CompactCopy {
    /// The copy, locked.
    file: Flock<File>,
    /// Each live key's frame offset in the copy.
    moved: Vec<(Key, u64)>,
    /// The copy's length.
    len: u64,
}

/// The swap store of one server: an append-only file of frames and the
/// index of its live pages.
pub struct SwapStore {
    path: PathBuf,
    file: Flock<File>,
    opts: StoreOptions,
    index: BTreeMap<Key, Entry>,
    /// End of the last frame: where the next one goes.
    end: u64,
    /// Bytes of the frames `index` names.
    live_bytes: u64,
    next_seq: u64,
    compressor: zstd::bulk::Compressor<'static>,
    /// The frame being written.
    frame: Vec<u8>,
}

impl fmt::Debug for SwapStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SwapStore")
            .field("path", &self.path)
            .field("opts", &self.opts)
            .field("pages", &self.index.len())
            .field("end", &self.end)
            .field("live_bytes", &self.live_bytes)
            .field("next_seq", &self.next_seq)
            .finish_non_exhaustive()
    }
}

impl SwapStore {
    /// Opens the store at `path`, creating it (and its directory) if
    /// missing. An existing file's frames are read to rebuild the index; a
    /// torn or damaged end is cut off and reported in [`Recovered`]. Drop
    /// the keys your tables do not name with [`SwapStore::retain`].
    pub fn open(path: &Path, opts: StoreOptions) -> Result<(SwapStore, Recovered)> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir).map_err(io_error("create the directory", dir))?;
        }
        let compressor = zstd::bulk::Compressor::new(opts.level).map_err(|source| {
            StoreError::CreateCompressor {
                level: opts.level,
                source,
            }
        })?;
        let file = open_locked(path, false)?;
        // Only now, with the lock held, is a copy sure to be stale.
        let stale_compaction_removed = remove_stale_copy(path)?;
        let file_len = file
            .metadata()
            .map_err(io_error("read the size of", path))?
            .len();
        let scan = scan(
            BufReader::with_capacity(SEQUENTIAL_BUFFER, &*file),
            file_len,
            path,
        )?;
        if scan.cut.is_some() {
            file.set_len(scan.end)
                .map_err(io_error("cut the damaged end off", path))?;
        }
        let recovered = Recovered {
            frames: scan.frames,
            pages: scan.index.len() as u64,
            cut: scan.cut,
            stale_compaction_removed,
        };
        let store = SwapStore {
            path: path.to_owned(),
            file,
            opts,
            index: scan.index,
            end: scan.end,
            live_bytes: scan.live_bytes,
            next_seq: scan.next_seq,
            compressor,
            frame: vec![0; FRAME_HEADER_LEN + PAGE],
        };
        Ok((store, recovered))
    }

    /// The store's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stores `data`, one page, as the bytes of `(owner, page)`; an older
    /// frame of the key becomes garbage. On [`StoreError::Full`] (the size
    /// limit, or the filesystem out of space) the file is as it was and the
    /// key keeps its previous frame, if any.
    pub fn put(&mut self, owner: u64, page: u64, data: &[u8]) -> Result<Location> {
        if data.len() != PAGE {
            return Err(StoreError::PageSize { len: data.len() });
        }
        let (head, body) = self.frame.split_at_mut(FRAME_HEADER_LEN);
        // A destination one byte short of a page: zstd fails unless it
        // makes the page smaller, and then the raw page is what we store
        // (as on any other zstd failure: the raw page is always right).
        let (payload_len, compressed) = match self
            .compressor
            .compress_to_buffer(data, &mut body[..PAGE - 1])
        {
            Ok(n) => (n, true),
            Err(_) => {
                body.copy_from_slice(data);
                (PAGE, false)
            }
        };
        let header = FrameHeader {
            owner,
            page,
            seq: self.next_seq,
            payload_len: u32::try_from(payload_len).unwrap_or(u32::MAX),
            compressed,
            data_hash: xxh3_64(data),
        };
        head.copy_from_slice(&header.encode());
        let frame_len = header.frame_len();
        if let Some(limit) = self.opts.max_file_bytes {
            if self.end + frame_len > limit {
                return Err(self.full(None));
            }
        }
        let frame = &self.frame[..FRAME_HEADER_LEN + payload_len];
        if let Err(e) = self.file.write_all_at(frame, self.end) {
            // Leave no partial frame behind. Should this fail too, the next
            // frame overwrites it, or the next open cuts it as a torn tail.
            let _ = self.file.set_len(self.end);
            return Err(match e.raw_os_error() {
                Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => self.full(Some(e)),
                _ => io_error("append a page to swap store", &self.path)(e),
            });
        }
        let entry = Entry {
            offset: self.end,
            seq: header.seq,
            payload_len: header.payload_len,
            compressed,
        };
        if let Some(old) = self.index.insert((owner, page), entry) {
            self.live_bytes -= old.frame_len();
        }
        self.live_bytes += frame_len;
        self.end += frame_len;
        self.next_seq = self.next_seq.saturating_add(1);
        Ok(entry.location())
    }

    fn full(&self, source: Option<io::Error>) -> StoreError {
        StoreError::Full {
            path: self.path.clone(),
            file_bytes: self.end,
            limit: self.opts.max_file_bytes,
            source,
        }
    }

    /// Reads the bytes of `(owner, page)` into `out`, one page, checking
    /// them on the way. On an error `out` holds no meaningful bytes.
    pub fn get(&self, owner: u64, page: u64, out: &mut [u8]) -> Result<()> {
        if out.len() != PAGE {
            return Err(StoreError::PageSize { len: out.len() });
        }
        let key = (owner, page);
        let entry = self
            .index
            .get(&key)
            .ok_or(StoreError::Missing { owner, page })?;
        let mut buf = [0u8; FRAME_HEADER_LEN + PAGE];
        let frame = &mut buf[..usize_of(entry.frame_len())];
        let header = self.read_frame(key, entry, frame)?;
        let corrupt = |reason| StoreError::Corrupt {
            owner,
            page,
            offset: entry.offset,
            reason,
        };
        let payload = &frame[FRAME_HEADER_LEN..];
        if header.compressed {
            let n = decompress(payload, out)?
                .map_err(|e| corrupt(format!("its zstd payload does not decode ({e})")))?;
            if n != PAGE {
                return Err(corrupt(format!(
                    "its payload decodes to {n} bytes, not {PAGE_SIZE}"
                )));
            }
        } else {
            out.copy_from_slice(payload);
        }
        let sum = xxh3_64(out);
        if sum != header.data_hash {
            return Err(corrupt(format!(
                "its bytes do not match their checksum (stored {:#018x}, read {sum:#018x}): \
                 the disk returned bad data or something changed the file",
                header.data_hash
            )));
        }
        Ok(())
    }

    /// Reads the frame of `key` into `frame` (its length) and checks that
    /// its header is sound and the one the index expects.
    fn read_frame(&self, key: Key, entry: &Entry, frame: &mut [u8]) -> Result<FrameHeader> {
        let (owner, page) = key;
        let corrupt = |reason| StoreError::Corrupt {
            owner,
            page,
            offset: entry.offset,
            reason,
        };
        if let Err(e) = self.file.read_exact_at(frame, entry.offset) {
            return Err(match e.kind() {
                io::ErrorKind::UnexpectedEof => corrupt(
                    "the file ends before the frame does: something else truncated it".to_owned(),
                ),
                _ => io_error("read a page from swap store", &self.path)(e),
            });
        }
        let h = check_header(frame).map_err(|r| corrupt(format!("bad frame header: {r}")))?;
        let expected = FrameHeader {
            owner,
            page,
            seq: entry.seq,
            payload_len: entry.payload_len,
            compressed: entry.compressed,
            data_hash: h.data_hash,
        };
        if h != expected {
            return Err(corrupt(format!(
                "the frame there is page {} of owner {} (seq {}, {} bytes), not the one the \
                 index names (seq {}, {} bytes): something else wrote to the file",
                h.page, h.owner, h.seq, h.payload_len, entry.seq, entry.payload_len
            )));
        }
        Ok(h)
    }

    /// Where the bytes of `(owner, page)` are, if stored.
    pub fn location(&self, owner: u64, page: u64) -> Option<Location> {
        self.index.get(&(owner, page)).map(Entry::location)
    }

    /// Whether `(owner, page)` is stored.
    pub fn contains(&self, owner: u64, page: u64) -> bool {
        self.index.contains_key(&(owner, page))
    }

    /// Live pages.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no page is stored.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Forgets `(owner, page)` (its bytes are back in memory): its frame
    /// becomes garbage. Whether it was stored.
    pub fn remove(&mut self, owner: u64, page: u64) -> bool {
        match self.index.remove(&(owner, page)) {
            Some(old) => {
                self.live_bytes -= old.frame_len();
                true
            }
            None => false,
        }
    }

    /// Forgets every page of `owner`; how many there were.
    pub fn remove_owner(&mut self, owner: u64) -> u64 {
        let keys: Vec<Key> = self
            .index
            .range((owner, 0)..=(owner, u64::MAX))
            .map(|(k, _)| *k)
            .collect();
        for &(o, p) in &keys {
            self.remove(o, p);
        }
        keys.len() as u64
    }

    /// Keeps only the pages for which `keep(owner, page)` is true; how many
    /// were dropped.
    pub fn retain(&mut self, mut keep: impl FnMut(u64, u64) -> bool) -> u64 {
        let mut dropped = 0;
        let live_bytes = &mut self.live_bytes;
        self.index.retain(|&(owner, page), e| {
            let k = keep(owner, page);
            if !k {
                *live_bytes -= e.frame_len();
                dropped += 1;
            }
            k
        });
        dropped
    }

    /// Pages and bytes.
    pub fn stats(&self) -> StoreStats {
        StoreStats {
            pages: self.index.len() as u64,
            stored_bytes: self.live_bytes,
            file_bytes: self.end,
            garbage_bytes: self.end - self.live_bytes,
        }
    }

    /// Whether [`SwapStore::compact`] is worth its copy: the file is past
    /// [`COMPACT_MIN_FILE_BYTES`] and more garbage than live pages.
    pub fn wants_compaction(&self) -> bool {
        let s = self.stats();
        s.file_bytes > COMPACT_MIN_FILE_BYTES && s.garbage_bytes > s.stored_bytes
    }

    /// Copies the live frames (seqs kept) to `<path>.compact` and renames
    /// the copy over the file, so that a crash at any point leaves one
    /// whole file. Returns the bytes reclaimed. On [`StoreError::Full`],
    /// and on a live frame whose header is damaged ([`StoreError::Corrupt`]:
    /// that page is lost; [`SwapStore::remove`] it to compact again), the
    /// copy is removed and the store goes on with the old file.
    pub fn compact(&mut self) -> Result<u64> {
        if self.live_bytes == self.end {
            return Ok(0);
        }
        let tmp = compact_path(&self.path);
        let copied = self.write_copy(&tmp).and_then(|copy| {
            fs::rename(&tmp, &self.path)
                .map_err(io_error("rename the compacted copy over", &self.path))?;
            Ok(copy)
        });
        let copy = match copied {
            Ok(copy) => copy,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        // The copy, locked since it was created, is the store now; the old
        // file goes with its lock.
        self.file = copy.file;
        for (key, offset) in copy.moved {
            if let Some(e) = self.index.get_mut(&key) {
                e.offset = offset;
            }
        }
        let reclaimed = self.end - copy.len;
        self.end = copy.len;
        Ok(reclaimed)
    }

    /// Writes the live frames, in file order, to `tmp`.
    fn write_copy(&self, tmp: &Path) -> Result<CompactCopy> {
        let file = open_locked(tmp, true)?;
        let mut live: Vec<(Key, Entry)> = self.index.iter().map(|(k, e)| (*k, *e)).collect();
        live.sort_unstable_by_key(|(_, e)| e.offset);
        let mut moved = Vec::with_capacity(live.len());
        let mut buf = [0u8; FRAME_HEADER_LEN + PAGE];
        let mut at = 0;
        let write_error = |e: io::Error| match e.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => self.full(Some(e)),
            _ => io_error("write the compacted copy", tmp)(e),
        };
        {
            let mut w = BufWriter::with_capacity(SEQUENTIAL_BUFFER, &*file);
            for (key, entry) in live {
                let frame = &mut buf[..usize_of(entry.frame_len())];
                self.read_frame(key, &entry, frame)?;
                w.write_all(frame).map_err(write_error)?;
                moved.push((key, at));
                at += entry.frame_len();
            }
            w.flush().map_err(write_error)?;
        }
        Ok(CompactCopy {
            file,
            moved,
            len: at,
        })
    }
}

/// Entry point of the `swap_frame` fuzz target: `data` as a frame header
/// and as a whole store file, as given and with every header checksum
/// along the chain of frames made right, so that a fuzzer gets past them.
/// Never panics; a header that parses encodes back to the same bytes.
pub fn fuzz_frames(data: &[u8]) {
    let path = Path::new("fuzz");
    let _ = parse_header(data);
    let _ = scan(data, data.len() as u64, path);
    let mut b = data.to_vec();
    let mut at = 0;
    while let Some(h) = b.get_mut(at..at + FRAME_HEADER_LEN) {
        let sum = xxh3_64(&h[..HEADER_HASHED]);
        h[HEADER_HASHED..].copy_from_slice(&sum.to_le_bytes());
        let mut len = [0u8; 4];
        len.copy_from_slice(&h[32..36]);
        at += FRAME_HEADER_LEN + usize_of(u64::from(u32::from_le_bytes(len)));
    }
    if let Ok(h) = parse_header(&b) {
        assert_eq!(h.encode()[..], b[..FRAME_HEADER_LEN]);
    }
    let _ = scan(&b[..], b.len() as u64, path);
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use proptest::prelude::*;

    use super::*;

    /// Bytes no compressor shrinks (splitmix64).
    fn random_page(seed: u64) -> Vec<u8> {
        let mut x = seed;
        let mut out = Vec::with_capacity(PAGE);
        while out.len() < PAGE {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
        }
        out
    }

    /// A page that compresses well and differs by seed.
    fn text_page(seed: u64) -> Vec<u8> {
        format!("page {seed} of some guest; ")
            .into_bytes()
            .into_iter()
            .cycle()
            .take(PAGE)
            .collect()
    }

    fn store_path(dir: &tempfile::TempDir) -> PathBuf {
        dir.path().join("swap").join("pages")
    }

    fn open(path: &Path) -> (SwapStore, Recovered) {
        SwapStore::open(path, StoreOptions::default()).unwrap()
    }

    fn read(s: &SwapStore, owner: u64, page: u64) -> Vec<u8> {
        let mut out = vec![0u8; PAGE];
        s.get(owner, page, &mut out).unwrap();
        out
    }

    fn file_len(path: &Path) -> u64 {
        fs::metadata(path).unwrap().len()
    }

    /// Flips one bit of the byte at `offset` of `path`.
    fn flip(path: &Path, offset: u64) {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let mut b = [0u8];
        f.read_exact_at(&mut b, offset).unwrap();
        f.write_all_at(&[b[0] ^ 0x10], offset).unwrap();
    }

    #[test]
    fn random_zero_and_compressible_pages_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, _) = open(&store_path(&dir));
        let random = random_page(1);
        let zero = vec![0u8; PAGE];
        let text = text_page(7);

        let r = s.put(1, 10, &random).unwrap();
        let z = s.put(1, 11, &zero).unwrap();
        let t = s.put(2, 10, &text).unwrap();

        assert!(!r.compressed);
        assert_eq!(u64::from(r.stored_bytes), PAGE_SIZE);
        assert!(z.compressed && z.stored_bytes < 64, "{z:?}");
        assert!(t.compressed && t.stored_bytes < 200, "{t:?}");
        assert!(r.seq < z.seq && z.seq < t.seq);
        assert_eq!(read(&s, 1, 10), random);
        assert_eq!(read(&s, 1, 11), zero);
        assert_eq!(read(&s, 2, 10), text);
        assert_eq!(s.location(2, 10), Some(t));
        assert!(matches!(
            s.get(2, 11, &mut [0u8; PAGE]),
            Err(StoreError::Missing { owner: 2, page: 11 })
        ));
    }

    #[test]
    fn pages_of_the_wrong_size_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, _) = open(&store_path(&dir));
        s.put(1, 1, &text_page(1)).unwrap();

        assert!(matches!(
            s.put(1, 2, &[0u8; 100]),
            Err(StoreError::PageSize { len: 100 })
        ));
        assert!(matches!(
            s.get(1, 1, &mut [0u8; PAGE + 1]),
            Err(StoreError::PageSize { .. })
        ));
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn the_newest_frame_of_a_key_wins_also_after_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(&dir);
        let (mut s, _) = open(&path);
        let first = s.put(3, 4, &random_page(1)).unwrap();
        let second = s.put(3, 4, &text_page(2)).unwrap();

        assert!(second.seq > first.seq && second.offset > first.offset);
        assert_eq!(read(&s, 3, 4), text_page(2));
        assert_eq!(s.len(), 1);
        assert_eq!(s.stats().garbage_bytes, HEADER_BYTES + PAGE_SIZE);

        drop(s);
        let (s, rec) = open(&path);
        assert_eq!((rec.frames, rec.pages), (2, 1));
        assert_eq!(read(&s, 3, 4), text_page(2));
        assert_eq!(s.location(3, 4), Some(second));
    }

    #[test]
    fn reopening_recovers_every_page_and_continues_the_seqs() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(&dir);
        let (mut s, rec) = open(&path);
        assert_eq!(rec, Recovered::default());
        let mut last_seq = 0;
        for p in 0..50u64 {
            let data = if p.is_multiple_of(2) {
                random_page(p)
            } else {
                text_page(p)
            };
            last_seq = s.put(p % 3, p, &data).unwrap().seq;
        }
        let stats = s.stats();
        drop(s);

        let (mut s, rec) = open(&path);

        assert_eq!(rec.frames, 50);
        assert_eq!(rec.pages, 50);
        assert_eq!(rec.cut, None);
        assert_eq!(s.stats(), stats);
        for p in 0..50u64 {
            let want = if p.is_multiple_of(2) {
                random_page(p)
            } else {
                text_page(p)
            };
            assert_eq!(read(&s, p % 3, p), want, "page {p}");
        }
        assert!(s.put(9, 9, &text_page(9)).unwrap().seq > last_seq);
    }

    #[test]
    fn a_partial_header_at_the_tail_is_cut_and_the_rest_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(&dir);
        let (mut s, _) = open(&path);
        for p in 0..3 {
            s.put(1, p, &random_page(p)).unwrap();
        }
        drop(s);
        let whole = file_len(&path);
        let f = OpenOptions::new().append(true).open(&path).unwrap();
        (&f).write_all(&FRAME_MAGIC).unwrap();
        (&f).write_all(&[1; 16]).unwrap();
        drop(f);

        let (mut s, rec) = open(&path);

        let cut = rec.cut.unwrap();
        assert_eq!((cut.offset, cut.bytes), (whole, 20));
        assert_eq!(cut.kind, CutKind::TornTail);
        assert_eq!(file_len(&path), whole);
        assert_eq!(s.len(), 3);
        assert_eq!(read(&s, 1, 2), random_page(2));
        s.put(1, 3, &text_page(3)).unwrap();
        drop(s);
        let (s, rec) = open(&path);
        assert_eq!(rec.cut, None);
        assert_eq!(read(&s, 1, 3), text_page(3));
    }

    #[test]
    fn a_frame_cut_short_at_the_tail_is_dropped_and_the_rest_recovers() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(&dir);
        let (mut s, _) = open(&path);
        s.put(1, 0, &random_page(0)).unwrap();
        s.put(1, 1, &text_page(1)).unwrap();
        let last = s.put(1, 2, &random_page(2)).unwrap();
        drop(s);
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(file_len(&path) - 100).unwrap();
        drop(f);

        let (s, rec) = open(&path);

        let cut = rec.cut.unwrap();
        assert_eq!(cut.kind, CutKind::TornTail);
        assert_eq!(cut.offset, last.offset);
        assert_eq!(cut.bytes, HEADER_BYTES + PAGE_SIZE - 100);
        assert_eq!(file_len(&path), last.offset);
        assert_eq!(s.stats().file_bytes, last.offset);
        assert!(!s.contains(1, 2));
        assert_eq!(read(&s, 1, 0), random_page(0));
        assert_eq!(read(&s, 1, 1), text_page(1));
    }

    #[test]
    fn a_bad_header_before_the_tail_drops_it_and_what_follows() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(&dir);
        let (mut s, _) = open(&path);
        let locs: Vec<Location> = (0..6)
            .map(|p| s.put(5, p, &random_page(p)).unwrap())
            .collect();
        drop(s);
        flip(&path, locs[1].offset + 9);

        let (s, rec) = open(&path);

        let cut = rec.cut.unwrap();
        assert_eq!(cut.kind, CutKind::BadFrame);
        assert_eq!(cut.offset, locs[1].offset);
        assert!(cut.reason.contains("checksum"), "{}", cut.reason);
        assert_eq!(file_len(&path), locs[1].offset);
        assert_eq!(s.len(), 1);
        assert_eq!(read(&s, 5, 0), random_page(0));
    }

    #[test]
    fn a_file_that_is_not_a_store_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pages");
        fs::write(&path, random_page(3).repeat(3)).unwrap();

        let e = SwapStore::open(&path, StoreOptions::default()).unwrap_err();

        assert!(matches!(e, StoreError::NotAStore { .. }), "{e}");
        assert_eq!(file_len(&path), 3 * PAGE_SIZE);
    }

    #[test]
    fn a_frame_of_a_newer_format_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(&dir);
        let (mut s, _) = open(&path);
        s.put(1, 1, &text_page(1)).unwrap();
        let second = s.put(1, 2, &text_page(2)).unwrap();
        drop(s);
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&[FORMAT_VERSION + 1], second.offset + 4)
            .unwrap();
        drop(f);
        let len = file_len(&path);

        let e = SwapStore::open(&path, StoreOptions::default()).unwrap_err();

        assert!(
            matches!(e, StoreError::NewerFormat { offset, version: 2, .. } if offset == second.offset),
            "{e}"
        );
        assert_eq!(file_len(&path), len);
    }

    #[test]
    fn a_flipped_payload_byte_is_corrupt_for_that_page_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(&dir);
        let (mut s, _) = open(&path);
        let raw = s.put(1, 0, &random_page(0)).unwrap();
        let packed = s.put(1, 1, &text_page(1)).unwrap();
        s.put(1, 2, &text_page(2)).unwrap();
        let header = s.put(1, 3, &text_page(3)).unwrap();
        flip(&path, raw.offset + HEADER_BYTES + 100);
        flip(&path, packed.offset + HEADER_BYTES + 20);
        flip(&path, header.offset + 17);

        for (page, loc) in [(0, raw), (1, packed), (3, header)] {
            match s.get(1, page, &mut [0u8; PAGE]) {
                Err(StoreError::Corrupt {
                    owner: 1,
                    page: p,
                    offset,
                    reason,
                }) => {
                    assert_eq!((p, offset), (page, loc.offset));
                    assert!(!reason.is_empty());
                }
                other => panic!("page {page}: {other:?}"),
            }
        }
        assert_eq!(read(&s, 1, 2), text_page(2));
    }

    #[test]
    fn the_size_limit_gives_full_and_the_store_keeps_working() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(&dir);
        let limit = 2 * (HEADER_BYTES + PAGE_SIZE) + 10;
        let opts = StoreOptions {
            max_file_bytes: Some(limit),
            ..StoreOptions::default()
        };
        let (mut s, _) = SwapStore::open(&path, opts).unwrap();
        s.put(1, 0, &random_page(0)).unwrap();
        s.put(1, 1, &random_page(1)).unwrap();
        let before = s.stats();

        let e = s.put(1, 2, &random_page(2)).unwrap_err();

        assert!(
            matches!(e, StoreError::Full { limit: Some(l), source: None, .. } if l == limit),
            "{e}"
        );
        assert!(matches!(
            s.put(1, 0, &[0; PAGE]),
            Err(StoreError::Full { .. })
        ));
        assert_eq!(s.stats(), before);
        assert_eq!(file_len(&path), before.file_bytes);
        assert_eq!(read(&s, 1, 0), random_page(0));
        assert_eq!(read(&s, 1, 1), random_page(1));
        // Room comes back with a compaction.
        assert!(s.remove(1, 1));
        s.compact().unwrap();
        s.put(1, 2, &random_page(2)).unwrap();
        assert_eq!(read(&s, 1, 2), random_page(2));
    }

    #[test]
    fn remove_retain_and_remove_owner_forget_pages() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, _) = open(&store_path(&dir));
        for owner in 1..=3 {
            for p in 0..5 {
                s.put(owner, p, &text_page(owner * 100 + p)).unwrap();
            }
        }

        assert!(s.remove(1, 0));
        assert!(!s.remove(1, 0));
        assert_eq!(s.remove_owner(2), 5);
        assert_eq!(s.remove_owner(2), 0);
        assert_eq!(s.retain(|_, page| page.is_multiple_of(2)), 4);

        let left: Vec<Key> = s.index.keys().copied().collect();
        assert_eq!(left, vec![(1, 2), (1, 4), (3, 0), (3, 2), (3, 4)]);
        assert_eq!(s.len(), 5);
        assert!(!s.contains(1, 0) && !s.contains(2, 2) && s.contains(3, 4));
        assert_eq!(read(&s, 3, 2), text_page(302));
        let st = s.stats();
        assert_eq!(st.pages, 5);
        assert_eq!(st.stored_bytes + st.garbage_bytes, st.file_bytes);
    }

    #[test]
    fn removed_pages_come_back_at_open_until_retain_drops_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(&dir);
        let (mut s, _) = open(&path);
        s.put(1, 0, &text_page(0)).unwrap();
        s.put(1, 1, &text_page(1)).unwrap();
        s.remove(1, 0);
        drop(s);

        let (mut s, rec) = open(&path);
        assert_eq!(rec.pages, 2);
        assert_eq!(s.retain(|owner, page| (owner, page) != (1, 0)), 1);

        assert!(!s.contains(1, 0));
        assert_eq!(read(&s, 1, 1), text_page(1));
    }

    #[test]
    fn compaction_keeps_every_live_page_and_shrinks_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(&dir);
        let (mut s, _) = open(&path);
        let want = |p: u64, round: u64| {
            if p.is_multiple_of(3) {
                random_page(p * 10 + round)
            } else {
                text_page(p * 10 + round)
            }
        };
        for round in 0..3 {
            for p in 0..30 {
                if round == 0 || p < 20 {
                    s.put(7, p, &want(p, round)).unwrap();
                }
            }
        }
        for p in 25..30 {
            s.remove(7, p);
        }
        let seqs: Vec<u64> = (0..25).map(|p| s.location(7, p).unwrap().seq).collect();
        let before = s.stats();

        let reclaimed = s.compact().unwrap();

        let after = s.stats();
        assert_eq!(reclaimed, before.garbage_bytes);
        assert_eq!(after.file_bytes, before.stored_bytes);
        assert_eq!(after.garbage_bytes, 0);
        assert_eq!(file_len(&path), after.file_bytes);
        assert!(!compact_path(&path).exists());
        let check = |s: &SwapStore| {
            for p in 0..25 {
                let round = if p < 20 { 2 } else { 0 };
                assert_eq!(read(s, 7, p), want(p, round), "page {p}");
                assert_eq!(s.location(7, p).unwrap().seq, seqs[usize_of(p)]);
            }
        };
        check(&s);
        assert_eq!(s.compact().unwrap(), 0);
        s.put(7, 40, &text_page(40)).unwrap();
        drop(s);
        let (s, rec) = open(&path);
        assert_eq!(rec.cut, None);
        assert_eq!(rec.pages, 26);
        check(&s);
        assert_eq!(read(&s, 7, 40), text_page(40));
    }

    #[test]
    fn compaction_is_wanted_once_garbage_outweighs_live_pages_in_a_big_file() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, _) = open(&store_path(&dir));
        for p in 0..100 {
            s.put(1, p, &random_page(p)).unwrap();
        }
        assert!(!s.wants_compaction());
        let mut n = 0;
        while !s.wants_compaction() {
            s.put(1, n % 100, &random_page(1000 + n)).unwrap();
            n += 1;
        }
        assert!(s.stats().file_bytes > COMPACT_MIN_FILE_BYTES);

        s.compact().unwrap();

        assert!(!s.wants_compaction());
        assert_eq!(s.len(), 100);
        assert_eq!(read(&s, 1, (n - 1) % 100), random_page(1000 + n - 1));
    }

    #[test]
    fn stats_add_up() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, _) = open(&store_path(&dir));
        for p in 0..20 {
            s.put(p % 4, p, &text_page(p)).unwrap();
            s.put(p % 4, p / 2, &random_page(p)).unwrap();
        }
        s.remove(0, 0);
        s.remove_owner(3);

        let st = s.stats();

        let live: u64 = s
            .index
            .iter()
            .map(|(&(o, p), _)| HEADER_BYTES + u64::from(s.location(o, p).unwrap().stored_bytes))
            .sum();
        assert_eq!(st.pages, s.len() as u64);
        assert_eq!(st.stored_bytes, live);
        assert_eq!(st.stored_bytes + st.garbage_bytes, st.file_bytes);
        assert_eq!(st.file_bytes, file_len(s.path()));
    }

    #[test]
    fn a_second_open_of_the_same_store_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(&dir);
        let (_s, _) = open(&path);

        let e = SwapStore::open(&path, StoreOptions::default()).unwrap_err();

        assert!(matches!(e, StoreError::Locked { .. }), "{e}");
    }

    #[test]
    fn an_unfinished_compaction_copy_is_removed_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = store_path(&dir);
        let (mut s, _) = open(&path);
        s.put(1, 1, &text_page(1)).unwrap();
        drop(s);
        fs::write(compact_path(&path), b"half a copy").unwrap();

        let (s, rec) = open(&path);

        assert!(rec.stale_compaction_removed);
        assert!(!compact_path(&path).exists());
        assert_eq!(read(&s, 1, 1), text_page(1));
    }

    /// Mounts a 64 KiB tmpfs on a temporary directory for as long as it
    /// lives.
    struct TinyTmpfs(tempfile::TempDir);

    impl TinyTmpfs {
        fn mount() -> Option<TinyTmpfs> {
            if !nix::unistd::geteuid().is_root() {
                eprintln!("skipped: mounting a tmpfs needs root");
                return None;
            }
            let dir = tempfile::tempdir().ok()?;
            let ok = Command::new("mount")
                .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
                .arg(dir.path())
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                eprintln!("skipped: cannot mount a tmpfs here");
                return None;
            }
            Some(TinyTmpfs(dir))
        }
    }

    impl Drop for TinyTmpfs {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0.path()).status();
        }
    }

    #[test]
    fn a_full_filesystem_gives_full_and_leaves_the_file_whole() {
        let Some(mnt) = TinyTmpfs::mount() else {
            return;
        };
        let path = mnt.0.path().join("pages");
        let (mut s, _) = open(&path);
        let mut stored = 0;
        let e = loop {
            match s.put(1, stored, &random_page(stored)) {
                Ok(_) => stored += 1,
                Err(e) => break e,
            }
            assert!(stored < 64, "a 64 KiB tmpfs took {stored} pages");
        };

        assert!(
            matches!(
                &e,
                StoreError::Full {
                    source: Some(_),
                    ..
                }
            ),
            "{e}"
        );
        assert!(stored > 0);
        assert_eq!(file_len(&path), s.stats().file_bytes);
        for p in 0..stored {
            assert_eq!(read(&s, 1, p), random_page(p));
        }
        // A compaction has no room for its copy either: it gives up and
        // leaves the store as it was.
        s.remove(1, 0);
        let before = s.stats();
        assert!(matches!(s.compact(), Err(StoreError::Full { .. })));
        assert!(!compact_path(&path).exists());
        assert_eq!(s.stats(), before);
        assert_eq!(read(&s, 1, stored - 1), random_page(stored - 1));
        drop(s);
        let (_, rec) = open(&path);
        assert_eq!(rec.cut, None);
        assert_eq!(rec.frames, stored);
    }

    #[test]
    fn the_checked_in_fuzz_seeds_scan_and_one_is_a_store() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/swap_frame");
        let mut stores = 0;
        for e in fs::read_dir(&dir).unwrap() {
            let b = fs::read(e.unwrap().path()).unwrap();
            fuzz_frames(&b);
            let whole =
                scan(&b[..], b.len() as u64, &dir).is_ok_and(|s| s.cut.is_none() && s.frames > 0);
            stores += usize::from(whole);
        }
        assert!(stores > 0, "no whole store among {}", dir.display());
    }

    proptest! {
        #[test]
        fn any_bytes_parse_or_fail_without_panicking(data in prop::collection::vec(any::<u8>(), 0..400)) {
            fuzz_frames(&data);
        }

        #[test]
        fn a_header_round_trips_and_any_flipped_bit_is_refused(
            owner in any::<u64>(),
            page in any::<u64>(),
            seq in any::<u64>(),
            compressed in any::<bool>(),
            len in 1u32..4096,
            data_hash in any::<u64>(),
            bit in 0usize..FRAME_HEADER_LEN * 8,
        ) {
            let h = FrameHeader {
                owner,
                page,
                seq,
                payload_len: if compressed { len } else { 4096 },
                compressed,
                data_hash,
            };
            let mut b = h.encode();
            prop_assert_eq!(parse_header(&b).unwrap(), h);
            b[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(parse_header(&b).is_err());
        }
    }
}
