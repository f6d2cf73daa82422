//! Opening what a VM's table reads: a client's image file (regular files
//! only, confined to `--image-dir`, pinned against change), a compressed
//! image, a snapshot's image. Shared by creating a VM, restoring one,
//! Firecracker listeners and rollback.

use std::path::Path;
use std::sync::Arc;

use crate::core::error::{Error, Result};
use crate::core::settings::Settings;
use crate::core::state::Core;
use crate::images::zst::ZstdImage;
use crate::pages::{FileSource, ImageSource, PageSource, ZstdSource};
use crate::snapshot::{image, SnapshotError};

/// Open a memory image a client named, without following a symlink and
/// without blocking (a FIFO opens at once and is refused); only a regular
/// file covering `size` bytes of guest RAM is accepted. Errors never quote
/// the file's size, so a client learns nothing about a file it could not
/// read itself. The image is pinned (see [`crate::images::pin`]) so it
/// cannot change under the VM.
pub(crate) fn open_image(path: &str, size: u64, settings: &Settings) -> Result<FileSource> {
    let (file, len) =
        crate::images::open_regular(std::path::Path::new(path), settings.image_dir.as_deref())?;
    if len < size {
        return Err(Error::Image {
            path: path.into(),
            reason: format!(
                "it is smaller than the {size} bytes of guest memory asked for; \
                 use a smaller memory_mib or a larger image"
            ),
        });
    }
    let open_err = |source| {
        Error::OpenImageFile(crate::images::ImageError::Open {
            path: path.into(),
            source,
        })
    };
    let identity = crate::images::Identity::of(&file).map_err(open_err)?;
    let (file, pin) = crate::images::pin(file, &settings.state_dir).map_err(open_err)?;
    Ok(FileSource::new(path.into(), file, len, pin).with_identity(identity))
}

/// Open a compressed image a client names (or a snapshot's
/// `memory.zst`, `snapshot` set, trusted: in our state directory) and
/// read its header and frame table.
pub(crate) fn open_zstd(core: &Core, path: &str, snapshot: Option<&str>) -> Result<Arc<ZstdImage>> {
    let p = std::path::Path::new(path);
    let confine = match snapshot {
        Some(_) => None,
        None => core.settings.image_dir.as_deref(),
    };
    let (file, _) = crate::images::open_regular(p, confine)?;
    let open_err = |source| {
        Error::OpenImageFile(crate::images::ImageError::Open {
            path: path.into(),
            source,
        })
    };
    let identity = crate::images::Identity::of(&file).map_err(open_err)?;
    let (file, pin) = match snapshot {
        // Snapshot files never change once committed.
        Some(_) => {
            let stamp = crate::images::Stamp::of(&file).map_err(open_err)?;
            (file, crate::images::Pin::Stamp(stamp))
        }
        None => crate::images::pin(file, &core.settings.state_dir).map_err(open_err)?,
    };
    core.frames
        .open(
            file,
            p.to_owned(),
            pin,
            snapshot.map(str::to_owned),
            Some(identity),
        )
        .map_err(|e| Error::Image {
            path: path.into(),
            reason: format!("not a usable memory.zst image: {}", shared::error_chain(&e)),
        })
}

/// The source a VM restored from snapshot `name` reads (its
/// `memory.zst` if it is `compressed`, else `memory.img` at `path`)
/// and the runs of pages that hold data in it (the rest reads as
/// zero).
pub(crate) fn open_snapshot_memory(
    core: &Core,
    name: &str,
    compressed: bool,
    path: &Path,
) -> Result<(PageSource, Vec<(u64, u64)>)> {
    if compressed {
        let zpath = core
            .snapshots
            .borrow()
            .dir_of(name)
            .join(crate::snapshot::ZSTD_FILE);
        let image = open_zstd(core, &zpath.display().to_string(), Some(name))?;
        let data = image.data_pages();
        return Ok((PageSource::Zstd(ZstdSource { image }), data));
    }
    let file = image::open_read(path)?;
    let len = file
        .metadata()
        .map_err(SnapshotError::io("stat", path))?
        .len();
    let data = image::data_pages(&file, len).map_err(SnapshotError::io("read", path))?;
    let pin = crate::images::Pin::Stamp(
        crate::images::Stamp::of(&file).map_err(SnapshotError::io("stat", path))?,
    );
    let identity = crate::images::Identity::of(&file).map_err(SnapshotError::io("stat", path))?;
    let source = PageSource::Image(ImageSource {
        snapshot: name.to_owned(),
        file: FileSource::new(path.to_owned(), file, len, pin).with_identity(identity),
    });
    Ok((source, data))
}
