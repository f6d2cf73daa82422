//! Memory images a client names: how the server opens them.
//!
//! A path in a request is opened only if it is a regular file, without
//! following a symlink at its last component and without blocking (a FIFO
//! opens at once with `O_NONBLOCK` and is then refused), so a client can
//! neither make the server read a device or a pipe nor, when the server
//! runs as root, read a file through a link it planted. Errors say what is
//! wrong without quoting anything the client could not see itself (such as
//! the file's size).

use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Why an image cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("cannot use {path}: it is a symbolic link; give the path of the image itself")]
    Symlink { path: String },
    #[error("cannot use {path}: it is a {kind}, not a regular file")]
    NotRegular { path: String, kind: &'static str },
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

/// Open `path` read-only if it is a regular file; returns it and its size.
pub fn open_regular(path: &Path) -> Result<(File, u64), ImageError> {
    let shown = || path.display().to_string();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_open() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("img");
        std::fs::write(&img, [0u8; 4096]).unwrap();
        assert_eq!(open_regular(&img).unwrap().1, 4096);

        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&img, &link).unwrap();
        assert!(matches!(
            open_regular(&link),
            Err(ImageError::Symlink { .. })
        ));

        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let e = open_regular(&fifo).unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");

        let e = open_regular(dir.path()).unwrap_err();
        assert!(e.to_string().contains("directory"), "{e}");
        let e = open_regular(Path::new("/dev/zero")).unwrap_err();
        assert!(e.to_string().contains("device"), "{e}");
    }
}
