//! Writing an image: frames are read and compressed by worker threads a
//! batch at a time and written in order; the table and header go last, and
//! the file appears under its name only when complete (written to a
//! temporary name beside it, fsynced, renamed).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::format::{self, Entry, Header, PAGE_SIZE};

/// The frame size written when none is asked for, in KiB (see
/// `docs/memory-zst.md` for the measurements behind it).
pub const DEFAULT_FRAME_KIB: u64 = 256;
/// The zstd level written when none is asked for.
pub const DEFAULT_LEVEL: i32 = 1;

/// How to compress.
#[derive(Debug, Clone, Copy)]
pub struct CompressOptions {
    /// Pages per frame.
    pub frame_pages: u32,
    /// zstd level (1 = fast; up to 19).
    pub level: i32,
    /// Worker threads (at least 1).
    pub threads: usize,
}

impl Default for CompressOptions {
    fn default() -> Self {
        CompressOptions {
            frame_pages: u32::try_from(DEFAULT_FRAME_KIB * 1024 / PAGE_SIZE).unwrap_or(64),
            level: DEFAULT_LEVEL,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

/// What a compression wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    pub memory_bytes: u64,
    pub file_bytes: u64,
    pub frames: u64,
    pub zero_frames: u64,
}

/// Errors of writing an image.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("cannot read the input")]
    Read(#[source] io::Error),
    #[error("cannot write {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the input is empty")]
    Empty,
    #[error("{0} pages per frame (1 ..= {max})", max = format::MAX_FRAME_PAGES)]
    FramePages(u32),
    #[error("zstd level {0} (1 ..= 22)")]
    Level(i32),
    #[error("zstd cannot compress frame {frame}")]
    Compress {
        frame: u64,
        #[source]
        source: io::Error,
    },
}

/// Whether `len` bytes of `file` at `offset` are a hole (read as zero
/// without reading them).
fn is_hole(file: &File, offset: u64, len: u64) -> bool {
    let Ok(off) = libc::off_t::try_from(offset) else {
        return false;
    };
    // SAFETY: lseek on an fd we own; it only moves the file offset, which
    // nothing here depends on (every read is positioned).
    let data = unsafe { libc::lseek(file.as_raw_fd(), off, libc::SEEK_DATA) };
    if data < 0 {
        // ENXIO: no data at or after `offset`. Anything else: don't know.
        return io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO);
    }
    data.unsigned_abs() >= offset + len
}

/// One frame as a worker leaves it.
enum Frame {
    Zero,
    Data { bytes: Vec<u8>, checksum: u64 },
}

/// Read (or find a hole for) frame `frame` of `input` and compress it.
fn make_frame(
    input: &File,
    input_len: u64,
    header: &Header,
    frame: u64,
    comp: &mut zstd::bulk::Compressor<'_>,
    buf: &mut Vec<u8>,
) -> Result<Frame, WriteError> {
    let pages = header.frame_range(frame);
    let offset = pages.start * PAGE_SIZE;
    let len = (pages.end - pages.start) * PAGE_SIZE;
    if offset >= input_len || is_hole(input, offset, len) {
        return Ok(Frame::Zero);
    }
    buf.clear();
    buf.resize(usize::try_from(len).unwrap_or(usize::MAX), 0);
    let have = usize::try_from(len.min(input_len - offset)).unwrap_or(usize::MAX);
    input
        .read_exact_at(&mut buf[..have], offset)
        .map_err(WriteError::Read)?;
    if buf.iter().all(|b| *b == 0) {
        return Ok(Frame::Zero);
    }
    let bytes = comp
        .compress(buf)
        .map_err(|source| WriteError::Compress { frame, source })?;
    Ok(Frame::Data {
        checksum: xxhash_rust::xxh3::xxh3_64(buf),
        bytes,
    })
}

/// Compress `input` (raw guest memory: page p at byte p * 4096; a last
/// partial page reads as zero-padded) into a new image at `out`.
/// `progress(done, total)` is called with input bytes after each batch.
pub fn compress(
    input: &File,
    out: &Path,
    opts: &CompressOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Summary, WriteError> {
    if opts.frame_pages == 0 || opts.frame_pages > format::MAX_FRAME_PAGES {
        return Err(WriteError::FramePages(opts.frame_pages));
    }
    if !(1..=22).contains(&opts.level) {
        return Err(WriteError::Level(opts.level));
    }
    let input_len = input.metadata().map_err(WriteError::Read)?.len();
    if input_len == 0 {
        return Err(WriteError::Empty);
    }
    let memory_bytes = input_len.div_ceil(PAGE_SIZE) * PAGE_SIZE;
    let mut header = Header::new(memory_bytes, opts.frame_pages);
    let tmp = tmp_path(out);
    let werr = |source| WriteError::Write {
        path: tmp.clone(),
        source,
    };
    let file = File::create(&tmp).map_err(werr)?;
    let result = (|| {
        let threads = opts.threads.max(1);
        let batch = (threads as u64) * 8;
        let mut entries = Vec::with_capacity(usize::try_from(header.frames).unwrap_or(0));
        let mut at = header.data_offset();
        let mut zero_frames = 0;
        let mut first = 0u64;
        while first < header.frames {
            let last = (first + batch).min(header.frames);
            // Worker w compresses frames first+w, first+w+threads, ...
            let done: Vec<Vec<(u64, Result<Frame, WriteError>)>> = std::thread::scope(|s| {
                let workers: Vec<_> = (0..threads as u64)
                    .map(|w| {
                        let header = &header;
                        s.spawn(move || {
                            let mut comp = match zstd::bulk::Compressor::new(opts.level) {
                                Ok(c) => c,
                                Err(source) => {
                                    return vec![(
                                        first + w,
                                        Err(WriteError::Compress {
                                            frame: first + w,
                                            source,
                                        }),
                                    )]
                                }
                            };
                            let mut buf = Vec::new();
                            (first + w..last)
                                .step_by(threads)
                                .map(|f| {
                                    let r = make_frame(
                                        input, input_len, header, f, &mut comp, &mut buf,
                                    );
                                    (f, r)
                                })
                                .collect()
                        })
                    })
                    .collect();
                workers
                    .into_iter()
                    .map(|h| h.join().unwrap_or_default())
                    .collect()
            });
            let mut frames: Vec<(u64, Result<Frame, WriteError>)> =
                done.into_iter().flatten().collect();
            frames.sort_by_key(|(f, _)| *f);
            for (_, frame) in frames {
                match frame? {
                    Frame::Zero => {
                        zero_frames += 1;
                        entries.push(Entry {
                            offset: 0,
                            compressed_len: 0,
                            zero: true,
                            checksum: 0,
                        });
                    }
                    Frame::Data { bytes, checksum } => {
                        file.write_all_at(&bytes, at).map_err(werr)?;
                        entries.push(Entry {
                            offset: at,
                            // A frame is at most 16 MiB; zstd's bound on
                            // its compressed size is far below 4 GiB.
                            compressed_len: u32::try_from(bytes.len()).unwrap_or(u32::MAX),
                            zero: false,
                            checksum,
                        });
                        at += bytes.len() as u64;
                    }
                }
            }
            first = last;
            progress(
                (header.frame_range(last.saturating_sub(1)).end * PAGE_SIZE).min(memory_bytes),
                memory_bytes,
            );
        }
        let (table, sum) = format::encode_table(&entries);
        header.table_checksum = sum;
        file.write_all_at(&table, format::HEADER_LEN)
            .map_err(werr)?;
        file.write_all_at(&header.encode(), 0).map_err(werr)?;
        file.set_len(at).map_err(werr)?;
        file.sync_all().map_err(werr)?;
        Ok(Summary {
            memory_bytes,
            file_bytes: at,
            frames: header.frames,
            zero_frames,
        })
    })();
    match result {
        Ok(summary) => {
            std::fs::rename(&tmp, out).map_err(|source| WriteError::Write {
                path: out.to_owned(),
                source,
            })?;
            if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
                // The rename is durable once the directory is.
                if let Ok(d) = File::open(dir) {
                    let _ = d.sync_all();
                }
            }
            Ok(summary)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// `DIR/.NAME.tmp-PID`: where an image is written before its rename.
fn tmp_path(out: &Path) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "memory.zst".into());
    out.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}
