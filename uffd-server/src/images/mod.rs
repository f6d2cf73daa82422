//! Memory images a client names: how the server opens them.
//!
//! A path in a request is opened only if it is a regular file, without
//! following a symlink at its last component and without blocking (a FIFO
//! opens at once with `O_NONBLOCK` and is then refused), so a client can
//! neither make the server read a device or a pipe nor, when the server
//! runs as root, read a file through a link it planted. Errors say what is
//! wrong without quoting anything the client could not see itself (such as
//! the file's size).
//!
//! An image must not change under a VM that reads it (a truncated image
//! would read as zeroes, silently). [`pin`] serves a private reflink copy
//! where the state directory's filesystem can make one of the image (it
//! costs microseconds and shares every block), and otherwise records the
//! image's size and modification time, which the resolver checks before
//! each read: a change fails the VM instead of serving other bytes.

pub mod zst;

use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

/// What makes two opens of an image the same image: its device, inode,
/// size and modification time when opened (a file rewritten in place is
/// another image). VMs of the same image share one base (`crate::bases`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Identity {
    pub dev: u64,
    pub ino: u64,
    pub len: u64,
    pub mtime_ns: i128,
}

impl Identity {
    /// The identity of `file` now.
    pub fn of(file: &File) -> std::io::Result<Self> {
        let m = file.metadata()?;
        Ok(Identity {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        })
    }
}

/// What makes two page sources the same bytes, so VMs of either share one
/// base (`crate::bases`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageId {
    /// An image file on this host, as it was when opened.
    File(Identity),
    /// A snapshot in the object store: the XXH3-128 of its memory's chunk
    /// list. Chunks are named by the digest of their bytes, so two
    /// manifests with the same list hold the same memory, whatever their
    /// names.
    Content { digest: u128, memory_bytes: u64 },
}

/// Why an image cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("cannot use {path}: it is a symbolic link; give the path of the image itself")]
    Symlink { path: String },
    #[error("cannot use {path}: it is a {kind}, not a regular file")]
    NotRegular { path: String, kind: &'static str },
    #[error("cannot use {path}: images are served only from under {dir} (--image-dir)")]
    OutsideImageDir { path: String, dir: String },
    #[error("cannot open {path}")]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

fn kind_of(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_dir() {
        "directory"
    } else if ft.is_fifo() {
        "FIFO"
    } else if ft.is_char_device() || ft.is_block_device() {
        "device"
    } else if ft.is_socket() {
        "socket"
    } else {
        "special file"
    }
}

/// Open `path` read-only if it is a regular file (under `confine_to`, if
/// given: a canonical directory); returns it and its size.
pub fn open_regular(path: &Path, confine_to: Option<&Path>) -> Result<(File, u64), ImageError> {
    let shown = || path.display().to_string();
    if let Some(dir) = confine_to {
        // The directory part is resolved (symlinks included); the last
        // component is opened with O_NOFOLLOW below, so the file opened is
        // the one inside.
        let outside = || ImageError::OutsideImageDir {
            path: shown(),
            dir: dir.display().to_string(),
        };
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .ok_or_else(outside)?;
        let real = std::fs::canonicalize(parent).map_err(|_| outside())?;
        if !real.starts_with(dir) || path.file_name().is_none() {
            return Err(outside());
        }
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| match source.raw_os_error() {
            Some(libc::ELOOP) => ImageError::Symlink { path: shown() },
            _ => ImageError::Open {
                path: shown(),
                source,
            },
        })?;
    let meta = file.metadata().map_err(|source| ImageError::Open {
        path: shown(),
        source,
    })?;
    if !meta.is_file() {
        return Err(ImageError::NotRegular {
            path: shown(),
            kind: kind_of(meta.file_type()),
        });
    }
    Ok((file, meta.len()))
}

/// How an open image is kept from changing under the VMs reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pin {
    /// Served from a private, unlinked reflink copy nobody else can reach.
    PrivateClone,
    /// Served from the client's file; what it looked like when opened.
    Stamp(Stamp),
}

/// Size and modification time of an image when it was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    len: u64,
    mtime: (i64, i64),
}

/// The image changed since it was opened.
#[derive(Debug, thiserror::Error)]
pub enum Changed {
    #[error("the image changed since it was opened (size {was} -> {now} bytes or modified)")]
    Modified { was: u64, now: u64 },
    #[error("cannot stat the image")]
    Stat(#[source] std::io::Error),
}

impl Stamp {
    /// Length, mtime seconds and nanoseconds (for the restart journal).
    pub fn parts(&self) -> (u64, i64, i64) {
        (self.len, self.mtime.0, self.mtime.1)
    }

    /// The stamp of these [`Self::parts`].
    pub fn from_parts(len: u64, sec: i64, nsec: i64) -> Stamp {
        Stamp {
            len,
            mtime: (sec, nsec),
        }
    }

    /// The stamp of `file` now.
    pub fn of(file: &File) -> std::io::Result<Stamp> {
        let m = file.metadata()?;
        Ok(Stamp {
            len: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
        })
    }

    /// Fail if `file` no longer matches this stamp.
    pub fn check(&self, file: &File) -> Result<(), Changed> {
        let now = Stamp::of(file).map_err(Changed::Stat)?;
        if now == *self {
            Ok(())
        } else {
            Err(Changed::Modified {
                was: self.len,
                now: now.len,
            })
        }
    }
}

/// Keep `file` (an opened image) from changing under its readers: a
/// private reflink copy made in `dir` when the filesystem allows it,
/// otherwise the file itself with its [`Stamp`].
pub fn pin(file: File, dir: &Path) -> std::io::Result<(File, Pin)> {
    match private_clone(&file, dir) {
        Ok(copy) => Ok((copy, Pin::PrivateClone)),
        Err(_) => {
            let stamp = Stamp::of(&file)?;
            Ok((file, Pin::Stamp(stamp)))
        }
    }
}

/// An unlinked (`O_TMPFILE`) file in `dir` sharing all of `file`'s blocks.
fn private_clone(file: &File, dir: &Path) -> std::io::Result<File> {
    let copy = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
        .open(dir)?;
    reflink::ficlone(&copy, file)?;
    Ok(copy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_open() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("img");
        std::fs::write(&img, [0u8; 4096]).unwrap();
        assert_eq!(open_regular(&img, None).unwrap().1, 4096);

        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&img, &link).unwrap();
        assert!(matches!(
            open_regular(&link, None),
            Err(ImageError::Symlink { .. })
        ));

        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let e = open_regular(&fifo, None).unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");

        let e = open_regular(dir.path(), None).unwrap_err();
        assert!(e.to_string().contains("directory"), "{e}");
        let e = open_regular(Path::new("/dev/zero"), None).unwrap_err();
        assert!(e.to_string().contains("device"), "{e}");
    }

    #[test]
    fn image_dir_confines_paths_through_symlinked_directories_too() {
        let root = tempfile::tempdir().unwrap();
        let images = root.path().join("images");
        let other = root.path().join("other");
        std::fs::create_dir_all(&images).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(images.join("a"), [0u8; 4096]).unwrap();
        std::fs::write(other.join("b"), [0u8; 4096]).unwrap();
        std::os::unix::fs::symlink(&other, images.join("escape")).unwrap();
        let dir = std::fs::canonicalize(&images).unwrap();
        assert!(open_regular(&images.join("a"), Some(&dir)).is_ok());
        let e = open_regular(&other.join("b"), Some(&dir)).unwrap_err();
        assert!(matches!(e, ImageError::OutsideImageDir { .. }), "{e}");
        let e = open_regular(&images.join("escape/b"), Some(&dir)).unwrap_err();
        assert!(matches!(e, ImageError::OutsideImageDir { .. }), "{e}");
        let e = open_regular(&images.join("../other/b"), Some(&dir)).unwrap_err();
        assert!(matches!(e, ImageError::OutsideImageDir { .. }), "{e}");
    }

    #[test]
    fn a_stamp_sees_truncation_and_rewrites() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("img");
        std::fs::write(&img, [1u8; 8192]).unwrap();
        let (file, _) = open_regular(&img, None).unwrap();
        let stamp = Stamp::of(&file).unwrap();
        stamp.check(&file).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&img)
            .unwrap()
            .set_len(4096)
            .unwrap();
        let e = stamp.check(&file).unwrap_err();
        assert!(e.to_string().contains("8192 -> 4096"), "{e}");
    }
}
