//! Reflinks and extents of files on filesystems that share blocks between
//! files (XFS with reflink=1, btrfs): the layer under both the volume engine
//! (`volume`) and the daemon's VM snapshot images.
//!
//! - [`ficlone`] / [`ficlonerange`] make one file share another's blocks
//!   (a whole file, or a block-aligned range) instead of copying them;
//! - [`fiemap`] lists a file's extents, and [`usage`] sums them into how
//!   many bytes are allocated, shared with other files, and exclusive;
//! - [`probe`] asks once whether a directory's filesystem can reflink at
//!   all, naming the filesystem when it cannot.
//!
//! Invariant: nothing here falls back to copying; a failed clone is the
//! caller's to handle (refuse, or copy knowingly).

mod ffi;
mod probe;
mod usage;

pub use ffi::{
    ficlone, ficlonerange, fiemap, Extent, FIEMAP_EXTENT_NO_IDENTITY, FIEMAP_EXTENT_SHARED,
    FIEMAP_EXTENT_UNWRITTEN,
};
pub use probe::{fs_type_name, probe, Reflink};
pub use usage::{usage, usage_of_extents, Usage};
