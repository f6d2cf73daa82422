//! The commit of a snapshot being written (see the commit point in the
//! module doc): once its last page is in `memory.img`, wait for the
//! image's fsync, checksum it (reusing the digests of the chunks streamed
//! as they were written, and the parent's for chunks it did not touch),
//! optionally compress it into `memory.zst`, write `state.json` and rename
//! `.tmp-<name>` to `<name>`. Blocking file I/O, run off the core thread.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::time::Instant;

use proto::snapshot::StateFile;

use super::error::{Result, SnapshotError};
use super::layout::{MEMORY_FILE, ZSTD_FILE};
use super::{catalog, checksum, image, writer};

fn us(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// What the save hands to the commit.
#[derive(Debug)]
pub struct Written {
    /// The image.
    pub image: File,
    /// Its fsync, which the writer started.
    pub synced: writer::Synced,
    /// `state.json`, still empty.
    pub state_file: File,
}

/// After the last page is saved: wait for the image's fsync (the
/// writer's), record its checksums in `state` (`reuse` gives those of
/// chunks the parent's image already has), and commit the snapshot
/// directory. Returns the image's extent count. Blocking file I/O: runs
/// off the core thread.
#[allow(clippy::too_many_arguments)]
pub fn finish_files(
    root: &Path,
    tmp: &Path,
    written: Written,
    state: &mut StateFile,
    reuse: &dyn Fn(u64) -> Option<String>,
    compress: Option<zst::CompressOptions>,
    phases: &mut BTreeMap<String, u64>,
) -> Result<u64> {
    let Written {
        image,
        synced,
        state_file,
    } = written;
    let image = &image;
    let path = tmp.join(MEMORY_FILE);
    let mut t = Instant::now();
    let mut lap = |phases: &mut BTreeMap<String, u64>, name: &str| {
        phases.insert(name.to_owned(), us(t));
        t = Instant::now();
    };
    // The writer fsyncs the image since its last write returned; the
    // checksum reads the image from the page cache meanwhile. Without a
    // compressed copy to make, `state.json` (which holds that checksum) is
    // written and fsynced while the image's fsync may still run: the
    // rename that commits the snapshot waits for both, and at 1 % dirty
    // the fsyncs are most of a snapshot's fixed cost.
    let written = checksum::sum_file_reusing(image, checksum::WRITE_ALGORITHM, reuse)
        .map_err(SnapshotError::io("checksum", &path))
        .and_then(|sum| {
            state.files.insert(MEMORY_FILE.to_owned(), sum);
            match compress {
                None => catalog::write_state(tmp, state_file, state).map(|()| None),
                Some(_) => Ok(Some(state_file)),
            }
        });
    let synced = synced.wait(image);
    synced.map_err(SnapshotError::io("sync", &path))?;
    let state_unwritten = written?;
    lap(phases, "sync_and_checksum");
    if let Some(opts) = compress {
        let zpath = tmp.join(ZSTD_FILE);
        zst::compress(image, &zpath, &opts, &mut |_, _| {}).map_err(|e| match e {
            zst::WriteError::Write { source, .. } => {
                SnapshotError::io("compress into", &zpath)(source)
            }
            e => SnapshotError::io("compress into", &zpath)(std::io::Error::other(
                shared::error_chain(&e),
            )),
        })?;
        let zfile = image::open_read(&zpath)?;
        let zsum = checksum::sum_file(&zfile, checksum::WRITE_ALGORITHM)
            .map_err(SnapshotError::io("checksum", &zpath))?;
        state.files.insert(ZSTD_FILE.to_owned(), zsum);
        lap(phases, "compress");
    }
    let extents = image::extent_count(image);
    if let Some(file) = state_unwritten {
        catalog::write_state(tmp, file, state)?;
    }
    catalog::publish(root, tmp, &state.name)?;
    lap(phases, "commit");
    Ok(extents)
}
