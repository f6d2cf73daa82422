//! Reflink volumes: disk images for VMs whose snapshots, clones, rollbacks
//! and fork copies are single FICLONE calls (DESIGN §8).
//!
//! Invariants:
//! - `ROOT/volumes/<vol>/<vol>` is a volume; its snapshots are sibling files.
//!   A snapshot of a snapshot goes next to the same volume: no chains, so
//!   deleting any snapshot is one unlink, and a volume can be deleted while
//!   its snapshots live on.
//! - The filesystem is the source of truth; the index is rebuilt from it at
//!   start-up ([`index`] lists the crash rules).
//! - Volume and snapshot names share one namespace, reserved under the
//!   engine's write lock.
//! - Nothing ever copies data: if the filesystem cannot reflink (probed at
//!   start-up), every operation is refused with the filesystem's name.
//!   (qcow2 import and export copy what they must: [`import`] and
//!   [`export`].)

mod engine;
mod error;
mod export;
pub mod extents;
pub(crate) mod ffi;
mod import;
pub mod index;
pub mod name;
pub mod probe;
mod queries;

pub use engine::{VolumeEngine, SECTOR};
pub use error::{ErrorKind, Result, VolumeError};
pub use extents::Usage;
/// Whole-file reflink and extent listing, for the snapshot images.
pub use ffi::{ficlone, fiemap, Extent};
pub use index::Repair;
pub use probe::Reflink;

/// Clone `len` bytes of `src` at `src_offset` into `dst` at `dst_offset`
/// (FICLONERANGE): block-aligned, shares extents instead of copying. For
/// tools that build large test images cheaply.
pub fn clone_range(
    dst: &std::fs::File,
    dst_offset: u64,
    src: &std::fs::File,
    src_offset: u64,
    len: u64,
) -> std::io::Result<()> {
    ffi::ficlonerange(dst, dst_offset, src, src_offset, len)
}
