//! `uffdctl image ...`: compressed memory images (`memory.zst`), offline.
//! These commands work on files and need no server: they use the format
//! crate `zst`, which the server serves from.

use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Subcommand;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::{CliError, Result};

/// Image commands.
#[derive(Debug, Subcommand)]
pub enum ImageCmd {
    /// Compress a raw memory file (or a snapshot's memory.img) into a
    /// memory.zst image served lazily by the server.
    Compress {
        input: PathBuf,
        output: PathBuf,
        /// Uncompressed bytes per frame, in KiB (a multiple of 4): what one
        /// fault decodes and installs.
        #[arg(long, default_value_t = zst::DEFAULT_FRAME_KIB)]
        frame_kib: u64,
        /// zstd level, 1 (fast) to 19 (small).
        #[arg(long, default_value_t = zst::DEFAULT_LEVEL)]
        level: i32,
        /// Compressing threads (default: one per CPU).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// Size, ratio and frame counts of an image.
    Inspect { file: PathBuf },
    /// Decode every frame and check its checksum.
    Verify { file: PathBuf },
}

fn bar(total: u64, what: &str) -> ProgressBar {
    // Drawn on stderr only when it is a terminal.
    let pb = ProgressBar::new(total);
    pb.set_style(
        ProgressStyle::with_template(&format!(
            "{what} [{{bar:40}}] {{bytes}}/{{total_bytes}} {{bytes_per_sec}} eta {{eta}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb
}

fn open(file: &Path) -> Result<zst::Image> {
    zst::Image::open(file)
        .map_err(|e| CliError::Usage(format!("{}: {}", file.display(), shared::error_chain(&e))))
}

const MIB: f64 = 1024.0 * 1024.0;

/// Run an image command.
pub fn run(cmd: ImageCmd, as_json: bool) -> Result<()> {
    match cmd {
        ImageCmd::Compress {
            input,
            output,
            frame_kib,
            level,
            threads,
        } => {
            if frame_kib == 0 || frame_kib % 4 != 0 {
                return Err(CliError::Usage(format!(
                    "--frame-kib {frame_kib}: must be a positive multiple of 4"
                )));
            }
            let frame_pages = u32::try_from(frame_kib / 4)
                .map_err(|_| CliError::Usage(format!("--frame-kib {frame_kib} is too large")))?;
            let file = std::fs::File::open(&input).map_err(|source| CliError::Local {
                what: format!("open {}", input.display()),
                source,
            })?;
            let opts = zst::CompressOptions {
                frame_pages,
                level,
                threads: threads.unwrap_or_else(|| zst::CompressOptions::default().threads),
            };
            let t0 = Instant::now();
            let pb = bar(0, "compressing");
            let summary = zst::compress(&file, &output, &opts, &mut |done, total| {
                pb.set_length(total);
                pb.set_position(done);
            })
            .map_err(|e| CliError::Usage(shared::error_chain(&e)))?;
            pb.finish_and_clear();
            let secs = t0.elapsed().as_secs_f64();
            if as_json {
                let v = json!({
                    "memory_bytes": summary.memory_bytes,
                    "file_bytes": summary.file_bytes,
                    "frames": summary.frames,
                    "zero_frames": summary.zero_frames,
                    "seconds": secs,
                });
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                println!(
                    "{}: {:.1} MiB of memory in {:.1} MiB ({:.2}:1), {} frames of {frame_kib} KiB \
                     ({} zero), {:.2} s ({:.0} MiB/s)",
                    output.display(),
                    summary.memory_bytes as f64 / MIB,
                    summary.file_bytes as f64 / MIB,
                    summary.memory_bytes as f64 / summary.file_bytes.max(1) as f64,
                    summary.frames,
                    summary.zero_frames,
                    secs,
                    summary.memory_bytes as f64 / MIB / secs.max(1e-9),
                );
            }
            Ok(())
        }
        ImageCmd::Inspect { file } => {
            let img = open(&file)?;
            let s = img.stats();
            if as_json {
                let v = json!({
                    "memory_bytes": s.memory_bytes,
                    "file_bytes": s.file_bytes,
                    "frame_kib": u64::from(s.frame_pages) * 4,
                    "frames": s.frames,
                    "zero_frames": s.zero_frames,
                    "data_bytes": s.data_bytes,
                    "ratio": s.ratio(),
                });
                println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
            } else {
                println!("{}", file.display());
                println!("  memory      {:.1} MiB", s.memory_bytes as f64 / MIB);
                println!("  file        {:.1} MiB", s.file_bytes as f64 / MIB);
                println!("  ratio       {:.2}:1", s.ratio());
                println!(
                    "  frames      {} of {} KiB ({} zero, stored as a flag)",
                    s.frames,
                    u64::from(s.frame_pages) * 4,
                    s.zero_frames
                );
            }
            Ok(())
        }
        ImageCmd::Verify { file } => {
            let img = open(&file)?;
            let frames = img.header().frames;
            let pb = ProgressBar::new(frames);
            let bad = img.verify(&mut |done, _| pb.set_position(done));
            pb.finish_and_clear();
            if bad.is_empty() {
                println!(
                    "{}: {frames} frames, every checksum matches",
                    file.display()
                );
                return Ok(());
            }
            for (frame, e) in bad.iter().take(20) {
                eprintln!("frame {frame}: {}", shared::error_chain(e));
            }
            Err(CliError::Usage(format!(
                "{}: {} of {frames} frames are corrupt",
                file.display(),
                bad.len()
            )))
        }
    }
}
