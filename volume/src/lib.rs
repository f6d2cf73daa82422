//! Reflink volumes: disk images for VMs whose snapshots, clones, rollbacks
//! and fork copies are single FICLONE calls, so each costs the same for a
//! 16 GiB volume as for 1 GiB (the filesystem shares extents; no data is
//! copied). The engine is a library: the daemon serves it over HTTP
//! (`uffd-server`'s `api/volumes.rs`) and attaches volumes to VMs; reflinks
//! and extents are the `reflink` crate's.
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
//!   (qcow2 import and export copy what they must: `import.rs` and
//!   `export.rs`.)

mod engine;
mod error;
mod export;
mod import;
pub mod index;
pub mod name;
mod queries;
mod xattr;

pub use engine::{VolumeEngine, SECTOR};
pub use error::{ErrorKind, Result, VolumeError};
pub use index::Repair;
pub use reflink::Reflink;
