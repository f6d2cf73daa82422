//! The start-up probe: can the state directory's filesystem reflink?
//!
//! One FICLONE between two temporary files in the root answers it. This is
//! the only place that asks; the volume engine refuses every operation when
//! the answer is no, naming the filesystem, and never falls back to copying.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use crate::ffi;

/// The outcome of the probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reflink {
    /// FICLONE works on this filesystem.
    Supported,
    /// FICLONE failed; `fs` names the filesystem, `errno` the kernel's answer.
    Unsupported { fs: String, errno: i32 },
}

/// A readable name for the filesystem holding `path` (`statfs` `f_type`).
pub fn fs_type_name(path: &Path) -> String {
    // `f_type`'s width differs between libcs; `i64::from` accepts them all.
    #[allow(clippy::useless_conversion)]
    match nix::sys::statfs::statfs(path) {
        Ok(st) => magic_name(i64::from(st.filesystem_type().0)),
        Err(e) => format!("an unknown filesystem (statfs failed: {e})"),
    }
}

fn magic_name(magic: i64) -> String {
    // `f_type` values of <linux/magic.h>, as the kernel reports them.
    let name = match magic {
        0x5846_5342 => "xfs",
        0x9123_683e => "btrfs",
        0xef53 => "ext4",
        0x0102_1994 => "tmpfs",
        0x794c_7630 => "overlayfs",
        0x6969 => "nfs",
        0xca45_1a4e => "bcachefs",
        0x2fc1_2fc1 => "zfs",
        0x6573_5546 => "fuse",
        0x7461_636f => "ocfs2",
        0xf2f5_2010 => "f2fs",
        _ => return format!("an unknown filesystem (f_type {magic:#x})"),
    };
    name.to_owned()
}

/// Probe `root` with one FICLONE between two temporary files, removed
/// afterwards. Errors are I/O failures of the probe itself (cannot create
/// files in `root`), not a missing reflink capability.
pub fn probe(root: &Path) -> std::io::Result<Reflink> {
    let pid = std::process::id();
    let src_path = root.join(format!(".reflink-probe-{pid}-src"));
    let dst_path = root.join(format!(".reflink-probe-{pid}-dst"));
    let result = probe_between(&src_path, &dst_path);
    // Best effort: the files are hidden and replaced by the next probe.
    let _ = std::fs::remove_file(&src_path);
    let _ = std::fs::remove_file(&dst_path);
    match result? {
        None => Ok(Reflink::Supported),
        Some(errno) => Ok(Reflink::Unsupported {
            fs: fs_type_name(root),
            errno,
        }),
    }
}

/// `Ok(None)` if the clone worked, `Ok(Some(errno))` if FICLONE failed.
fn probe_between(src_path: &Path, dst_path: &Path) -> std::io::Result<Option<i32>> {
    let mut src = create(src_path)?;
    src.write_all(&[0x5a; 4096])?;
    let dst = create(dst_path)?;
    match ffi::ficlone(&dst, &src) {
        Ok(()) => Ok(None),
        Err(e) => Ok(Some(e.raw_os_error().unwrap_or(libc::EOPNOTSUPP))),
    }
}

fn create(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_common_filesystems() {
        assert_eq!(magic_name(0x5846_5342), "xfs");
        assert_eq!(magic_name(0xef53), "ext4");
        assert_eq!(magic_name(0x0102_1994), "tmpfs");
        assert!(magic_name(0x1234).contains("0x1234"));
    }

    #[test]
    fn probe_leaves_no_files_behind() {
        let dir = tempfile::tempdir().unwrap();
        let _ = probe(dir.path()).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
