//! qcow2 images: a bounded reader and qemu-identical internal snapshot
//! operations.
//!
//! This crate owns the qcow2 format for pagefork. It is pure format code plus
//! plain file I/O, so both the daemon (volume import and export) and the CLI
//! (`uffdctl qcow2 snapshot`, which works offline on a file) can use it
//! without the CLI linking the daemon.
//!
//! Layers, bottom up:
//! - [`storage`]: where the bytes live (a file, or a byte vector in tests and
//!   fuzzing); reads past the end return zeroes, as qemu's do.
//! - [`header`], [`refcount`], [`l2`], [`snapshot`], [`compress`]: decoders
//!   (and encoders) of the on-disk structures. Every one is bounded: arbitrary
//!   bytes give a value or an [`Error`], never a panic or an allocation larger
//!   than the input justifies.
//! - [`image`]: an opened image: header, active L1, snapshot table, and reads
//!   of the active image or any snapshot's guest view.
//! - [`alloc`]: qemu's refcount and cluster allocator, mirrored decision for
//!   decision, so that metadata lands where qemu would put it.
//! - [`ops`]: internal snapshot create / apply / delete with fsync-separated
//!   write groups ([`stage`] names them) and the header's 12 bytes at offset
//!   60 as the commit point.
//! - [`list`]: `qemu-img snapshot -l`'s table.
//! - [`lock`]: qemu's OFD image locks, taken by the offline commands.
//! - [`writer`]: a new v3 image from states that share clusters (export).
//!
//! The supported subset and the crash-ordering rules are described in
//! `docs/qcow2.md`.

pub mod alloc;
pub mod compress;
pub mod error;
pub mod fuzz;
pub mod header;
pub mod image;
pub mod l2;
pub mod list;
pub mod lock;
pub mod ops;
pub mod refcount;
pub mod snapshot;
pub mod stage;
pub mod storage;
pub mod writer;

pub use error::{Error, Result};
pub use image::{Image, View};
pub use ops::SnapshotTime;
pub use snapshot::Snapshot;
pub use stage::Stage;
pub use storage::{Storage, StorageMut};
