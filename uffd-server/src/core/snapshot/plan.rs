//! Before a snapshot's pause: which mode it can take (`dirty` needs the
//! VM's dirty log since a snapshot that is still there, `incremental` its
//! base snapshot, both an image that can be reflinked; else `full`, with
//! the reason), its `memory.img` created (a FICLONE of the parent's) and
//! its `state.json` created empty; and which pages need write protection
//! armed ahead of the pause.

use std::path::Path;
use std::rc::Rc;

use proto::api::SnapshotMode;
use shared::VmId;

use crate::core::error::Result;
use crate::core::state::Core;
use crate::pages::SourceId;
use crate::snapshot::image::{self, ImageWriter};
use crate::snapshot::{catalog, SnapshotError};

/// What a snapshot will write, decided before the pause.
pub(crate) struct Plan {
    pub mode: SnapshotMode,
    pub parent: Option<String>,
    pub fallback_reason: Option<String>,
    pub image: Rc<ImageWriter>,
    /// For `incremental`: the base image's source and its data pages.
    pub base: Option<(SourceId, Vec<(u64, u64)>)>,
    /// `state.json`, created empty (`catalog::create_state`).
    pub state_file: std::fs::File,
}

/// Decide the mode and create the image (a reflink of the parent's
/// for `incremental` and `dirty`), before the pause.
pub(crate) fn plan(core: &Core, vm: VmId, asked: SnapshotMode, tmp: &Path) -> Result<Plan> {
    let reg = core.reg.borrow();
    let v = reg.vm(vm)?;
    let cat = core.snapshots.borrow();
    let size = v.memory.size();
    let fits = |name: &str| cat.get(name).is_ok_and(|s| s.memory_bytes == size);
    let mut reasons: Vec<String> = Vec::new();
    let mut choice: Option<(SnapshotMode, String)> = None;
    if asked == SnapshotMode::Dirty {
        match &v.snapshot.dirty {
            Some(d) if fits(&d.since) => {
                choice = Some((SnapshotMode::Dirty, d.since.clone()));
            }
            Some(d) => reasons.push(format!("{vm}'s last snapshot {} is gone", d.since)),
            None => reasons.push(format!(
                "{vm} has no snapshot since it started (or its last one failed)"
            )),
        }
    }
    if choice.is_none() && asked != SnapshotMode::Full {
        match &v.snapshot.base {
            Some((b, _)) if fits(b) => choice = Some((SnapshotMode::Incremental, b.clone())),
            Some((b, _)) => reasons.push(format!("{vm}'s base snapshot {b} is gone")),
            None => reasons.push(format!("{vm} did not start from a snapshot")),
        }
    }
    let path = tmp.join(crate::snapshot::MEMORY_FILE);
    let mut mode = SnapshotMode::Full;
    let mut parent = None;
    let mut reflinked = None;
    let mut base = None;
    if let Some((m, p)) = choice {
        match ImageWriter::reflink(&path, &cat.image_of(&p), size) {
            Ok(img) => {
                if m == SnapshotMode::Incremental {
                    let (_, src) = v.snapshot.base.clone().unwrap_or_default();
                    let base_source = reg.arena.get(src);
                    let data = match base_source.and_then(|s| s.zstd()) {
                        Some(z) => z.data_pages(),
                        None => base_source
                            .and_then(|s| s.file())
                            .map(|f| image::data_pages(&f.file, f.len))
                            .transpose()
                            .map_err(SnapshotError::io("read the base image of", &path))?
                            .unwrap_or_default(),
                    };
                    base = Some((src, data));
                }
                mode = m;
                parent = Some(p);
                reflinked = Some(img);
            }
            Err(e) => reasons.push(format!(
                "cannot reflink {} on this filesystem ({e}); use XFS with reflink=1 or btrfs",
                cat.image_of(&p).display()
            )),
        }
    }
    let image = match reflinked {
        Some(img) => img,
        None => ImageWriter::create(&path, size)?,
    };
    Ok(Plan {
        mode,
        parent,
        fallback_reason: (mode != asked).then(|| reasons.join("; ")),
        image: Rc::new(image),
        base,
        state_file: catalog::create_state(tmp)?,
    })
}

/// The pages of `vm` that are not write-protected: while tracking
/// runs only those written since the last snapshot (the WP handler
/// marks each one dirty before lifting its protection), else all of
/// RAM (never touched pages get markers, WP_UNPOPULATED).
pub(crate) fn unprotected_runs(core: &Core, vm: VmId) -> Result<Vec<(u64, u64)>> {
    let reg = core.reg.borrow();
    let v = reg.vm(vm)?;
    Ok(match &v.snapshot.dirty {
        Some(d) => d.pages.runs(),
        None => vec![(0, v.memory.pages())],
    })
}
