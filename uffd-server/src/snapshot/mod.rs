//! VM snapshots on disk: the format, the image writer, the commit, the
//! catalog of complete snapshots and their checksums. The core
//! (`core/snapshot/`) decides what to write and when; this module owns the
//! files.
//!
//! # On-disk format
//!
//! ```text
//! STATE/snapshots/
//!   <name>/                  one complete snapshot
//!     memory.img             guest RAM in guest-physical layout: page p at
//!                            byte p * page_size; holes read as zero
//!     memory.zst             optional (`"compress": true`): the same memory
//!                            in independently compressed frames (crate
//!                            `zst`); restores serve it instead of memory.img
//!     state.json             [`StateFile`] (`proto::snapshot`): format version, vCPU and
//!                            device state, memory size, page size, mode,
//!                            parent, volume snapshot, and memory.img's size,
//!                            hash of each 1 MiB chunk and a hash over
//!                            those, named by `algorithm` (XXH3-128 from
//!                            format 3; format 2's BLAKE3 and format 1's
//!                            SHA-256 are still read; [`checksum`])
//!     working-set.json       optional: the pages its first restore touched,
//!                            in that order ([`workset`]); written after the
//!                            commit, not checksummed, prefetched by later
//!                            restores and carried by a push
//!   .tmp-<name>/             a snapshot being written (never listed)
//!   .quarantine/<name>.<t>/  a snapshot that did not verify (never served)
//! ```
//!
//! `incremental` and `dirty` snapshots start `memory.img` as a FICLONE of
//! their parent's image and write only their pages over it, so every image
//! is complete on its own: reading one never chains through parents, and
//! deleting a parent never breaks a child (the filesystem keeps shared
//! extents alive). Such a child takes its parent's digests of the chunks it
//! did not write, so checksumming costs what was written.
//!
//! # Commit point
//!
//! Everything is written under `.tmp-<name>/`: `memory.img` first (written,
//! then fsynced), then `state.json` with the image's checksum (fsynced), then
//! the temporary directory is fsynced, renamed to `<name>`, and
//! `STATE/snapshots/` is fsynced. The rename is the single commit point: a
//! crash before it leaves only a `.tmp-` directory, which the next start
//! removes; after it, the snapshot is complete. At start-up every snapshot
//! is verified against the checksums in its `state.json`; one that does not
//! verify is moved to `.quarantine/` and never served. `state.json` also
//! records the snapshot's [`origin`] (pagefork version, VMM protocol, CPU
//! flags), which a restore checks against the host it runs on: a snapshot
//! may come from another host through the object store.

pub mod catalog;
pub mod checksum;
pub mod commit;
pub mod error;
pub mod image;
pub mod layout;
pub mod origin;
pub mod pageset;
pub mod workset;
pub mod writer;

pub use catalog::Catalog;
pub use error::{ErrorKind, Result, SnapshotError};
pub use layout::{MEMORY_FILE, STATE_FILE, ZSTD_FILE};
pub use pageset::PageSet;
pub use proto::snapshot::{FileSum, StateFile, FORMAT_VERSION};
