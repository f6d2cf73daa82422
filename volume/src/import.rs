//! Import of a qcow2 image as a reflink volume with its snapshot history.
//!
//! The image's internal snapshots become volume snapshots (named after
//! them, with an optional prefix), oldest first, and the active image
//! becomes the volume. Clusters that qcow2 shares between states stay
//! shared on disk: the oldest state is written in full, each later state
//! starts as a FICLONE of the previous one and only the clusters whose
//! mapping differs are rewritten (whole L2 ranges are skipped when the L1
//! entries match). Uncompressed clusters on block-aligned offsets are
//! themselves reflinked from the qcow2 file when it is on the same
//! filesystem, and copied otherwise.
//!
//! Crash safety: every file is built in `ROOT/staging/` (emptied at
//! start-up), then, under the index's write lock, tagged and renamed into
//! `ROOT/volumes/<name>/`: snapshots first, the volume last. A crash
//! before the volume's rename leaves snapshots of a missing volume, which
//! the start-up scan keeps and reports.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use proto::api::ImportedVolume;
use qcow2::l2::{Mapping, L1_OFFSET_MASK};
use qcow2::{Image, StorageMut, View};

use crate::engine::{reserve, staging_dir, sync_dir, validate, validate_size, VolumeEngine};
use crate::error::{Result, VolumeError};
use crate::index::{mtime_ns, Order, Snap, SEQ_XATTR};
use crate::xattr;

static STAGING_SEQ: AtomicU64 = AtomicU64::new(0);

impl VolumeEngine {
    /// Import the qcow2 file at `path` as volume `name`, with one volume
    /// snapshot per internal snapshot, named `prefix` + its name.
    pub fn import_qcow2(&self, path: &Path, name: &str, prefix: &str) -> Result<ImportedVolume> {
        self.available()?;
        validate(name)?;
        let file = File::open(path).map_err(|source| VolumeError::ImportOpen {
            path: path.to_owned(),
            source,
        })?;
        let fmt = |source| VolumeError::ImportFormat {
            path: path.to_owned(),
            source,
        };
        qcow2::lock::acquire(&file, false).map_err(fmt)?;
        let img = Image::open(&file).map_err(fmt)?;
        let mut names: Vec<String> = Vec::new();
        for s in img.snapshots() {
            let n = format!("{prefix}{}", s.name_str());
            let bad = |reason: String| VolumeError::ImportSnapshotName {
                snapshot: s.name_str(),
                reason,
            };
            validate(&n).map_err(|e| bad(e.to_string()))?;
            if names.contains(&n) || n == name {
                return Err(bad(format!("the name {n:?} would be used twice")));
            }
            validate_size(s.disk_size).map_err(|e| bad(e.to_string()))?;
            names.push(n);
        }
        validate_size(img.header().size)?;
        {
            let index = self.read();
            reserve(&index, name)?;
            for n in &names {
                reserve(&index, n)?;
            }
        }
        let io_err = |source| VolumeError::Import {
            name: name.to_owned(),
            path: path.to_owned(),
            source,
        };
        let stage = staging_dir(&self.root).join(format!(
            "import-{name}-{}-{}",
            std::process::id(),
            STAGING_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&stage).map_err(io_err)?;
        let result = self.import_staged(&img, &file, &stage, name, &names);
        let _ = fs::remove_dir_all(&stage);
        result.map_err(|e| match e {
            StageError::Io(source) => io_err(source),
            StageError::Format(source) => fmt(source),
            StageError::Volume(v) => v,
        })?;
        Ok(ImportedVolume {
            volume: self.show(name)?,
            snapshots: names,
        })
    }

    fn import_staged(
        &self,
        img: &Image<&File>,
        src: &File,
        stage: &Path,
        name: &str,
        names: &[String],
    ) -> std::result::Result<(), StageError> {
        let views: Vec<View> = (0..names.len())
            .map(View::Snapshot)
            .chain(std::iter::once(View::Active))
            .collect();
        let mut files = Vec::new();
        let mut prev: Option<(File, Vec<u64>, u64)> = None;
        for (k, view) in views.iter().enumerate() {
            let path = stage.join(k.to_string());
            let out = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)?;
            let l1 = img.l1_table(*view)?;
            let size = img.size(*view)?;
            if let Some((pf, _, _)) = &prev {
                reflink::ficlone(&out, pf)?;
            }
            out.set_len(size)?;
            write_state(
                img,
                src,
                &out,
                &l1,
                size,
                prev.as_ref().map(|(_, l1, s)| (l1.as_slice(), *s)),
            )?;
            out.sync_all()?;
            prev = Some((out, l1, size));
            files.push(path);
        }
        // Commit: tag and rename under the write lock, snapshots first.
        let mut index = self.write();
        reserve(&index, name)?;
        for n in names {
            reserve(&index, n)?;
        }
        let dir = self.volumes_dir.join(name);
        fs::create_dir(&dir)?;
        let (snap_files, active) = files.split_at(files.len() - 1);
        for (n, f) in names.iter().zip(snap_files) {
            let seq = index.next_seq.max(1);
            let file = File::open(f)?;
            xattr::fsetxattr(&file, SEQ_XATTR, seq.to_string().as_bytes())?;
            let target = dir.join(n);
            fs::rename(f, &target)?;
            let meta = fs::metadata(&target)?;
            index.snapshots.insert(
                n.clone(),
                Snap {
                    volume: name.to_owned(),
                    order: Order {
                        seq,
                        mtime_ns: mtime_ns(&meta),
                    },
                },
            );
            index.next_seq = seq + 1;
        }
        sync_dir(&dir)?;
        fs::rename(&active[0], dir.join(name))?;
        sync_dir(&dir)?;
        sync_dir(&self.volumes_dir)?;
        index.volumes.insert(name.to_owned());
        Ok(())
    }
}

/// Failures while staging, sorted out by the caller.
enum StageError {
    Io(io::Error),
    Format(qcow2::Error),
    Volume(VolumeError),
}

impl From<io::Error> for StageError {
    fn from(e: io::Error) -> Self {
        StageError::Io(e)
    }
}

impl From<qcow2::Error> for StageError {
    fn from(e: qcow2::Error) -> Self {
        StageError::Format(e)
    }
}

impl From<VolumeError> for StageError {
    fn from(e: VolumeError) -> Self {
        StageError::Volume(e)
    }
}

/// Write the clusters of one state into `out`, which already holds the
/// previous state (`prev`: its L1 table and size) or nothing.
fn write_state(
    img: &Image<&File>,
    src: &File,
    out: &File,
    l1: &[u64],
    size: u64,
    prev: Option<(&[u64], u64)>,
) -> std::result::Result<(), StageError> {
    let h = img.header();
    let cs = h.cluster_size();
    let per_l2 = 1u64 << h.l2_bits();
    let mut buf = vec![0u8; usize::try_from(cs).unwrap_or(0)];
    let clusters = size.div_ceil(cs);
    let mut vc = 0;
    while vc < clusters {
        let l1i = usize::try_from(vc / per_l2).unwrap_or(usize::MAX);
        let range_end = ((vc / per_l2) + 1) * per_l2;
        let l2_of = |t: &[u64]| t.get(l1i).map_or(0, |e| e & L1_OFFSET_MASK);
        let skip = match prev {
            // Same L2 table: same mappings, already in the clone.
            Some((pl1, psize)) => l2_of(l1) == l2_of(pl1) && range_end.min(clusters) * cs <= psize,
            // No L2 table in a fresh sparse file: zeroes already.
            None => l2_of(l1) == 0,
        };
        if skip {
            vc = range_end;
            continue;
        }
        let end = range_end.min(clusters);
        while vc < end {
            let at = vc * cs;
            let len = cs.min(size - at);
            let m = img.mapping(l1, vc)?;
            let old = match prev {
                Some((pl1, psize)) if at + len <= psize => Some(img.mapping(pl1, vc)?),
                _ => None,
            };
            if old == Some(m) {
                vc += 1;
                continue;
            }
            match m {
                Mapping::Zero => {
                    if prev.is_some() {
                        out.punch(at, len)?;
                    }
                }
                Mapping::Data { host } if host.is_multiple_of(4096) && len.is_multiple_of(4096) => {
                    if reflink::ficlonerange(out, at, src, host, len).is_err() {
                        copy(img, m, out, at, len, &mut buf)?;
                    }
                }
                _ => copy(img, m, out, at, len, &mut buf)?,
            }
            vc += 1;
        }
    }
    Ok(())
}

fn copy(
    img: &Image<&File>,
    m: Mapping,
    out: &File,
    at: u64,
    len: u64,
    buf: &mut [u8],
) -> std::result::Result<(), StageError> {
    img.read_mapped(m, buf)?;
    let n = usize::try_from(len).unwrap_or(buf.len()).min(buf.len());
    out.write_at(&buf[..n], at)?;
    Ok(())
}
