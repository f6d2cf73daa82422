//! The names of the files in a snapshot's directory (see the on-disk
//! format in the module doc).

pub use proto::snapshot::MEMORY_FILE;

/// The compressed image in a snapshot directory (with `compress`).
pub const ZSTD_FILE: &str = "memory.zst";
/// The description file in a snapshot directory.
pub const STATE_FILE: &str = "state.json";
