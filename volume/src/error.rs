//! Errors of the volume engine.

use std::io;
use std::path::PathBuf;

use crate::name::NameError;

/// Result alias of the volume engine.
pub type Result<T> = std::result::Result<T, VolumeError>;

/// What went wrong in a volume operation. I/O variants are named after the
/// operation that failed; the others say what to change in the request.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("invalid name {name:?}: {reason}")]
    InvalidName { name: String, reason: NameError },
    #[error("invalid size {size} bytes: {reason}")]
    InvalidSize { size: u64, reason: &'static str },
    #[error("the name {name:?} is already used by {holder}; volume and snapshot names share one namespace, pick another")]
    NameTaken { name: String, holder: String },
    #[error("no volume named {0:?}")]
    VolumeNotFound(String),
    #[error("volume {name:?} is attached to {holder}; delete that VM first (its disk would change or vanish underneath it)")]
    InUse { name: String, holder: String },
    #[error("no snapshot named {0:?}")]
    SnapshotNotFound(String),
    #[error("no volume or snapshot named {0:?}")]
    SourceNotFound(String),
    #[error("snapshot {snapshot:?} belongs to volume {owner:?}, not {volume:?}; clone it into a new volume instead")]
    NotSnapshotOf {
        snapshot: String,
        volume: String,
        owner: String,
    },
    #[error(
        "cannot shrink volume {name:?} from {current} to {requested} bytes; volumes only grow"
    )]
    Shrink {
        name: String,
        current: u64,
        requested: u64,
    },
    #[error("volumes are unavailable: cannot reflink in {}: it is on {fs}; use XFS with reflink=1 or btrfs for the state directory", root.display())]
    ReflinkUnsupported { root: PathBuf, fs: String },
    #[error("cannot prepare the volume directory {}; check that it exists and is writable", path.display())]
    OpenRoot { path: PathBuf, source: io::Error },
    #[error("cannot probe reflink support in {}; check that it is writable", path.display())]
    Probe { path: PathBuf, source: io::Error },
    #[error("cannot scan {} to rebuild the volume index", path.display())]
    Scan { path: PathBuf, source: io::Error },
    #[error("cannot create volume {name:?}")]
    Create { name: String, source: io::Error },
    #[error("cannot grow volume {name:?}")]
    Grow { name: String, source: io::Error },
    #[error("cannot delete volume {name:?}")]
    Delete { name: String, source: io::Error },
    #[error("cannot snapshot {from:?} as {name:?}")]
    Snapshot {
        from: String,
        name: String,
        source: io::Error,
    },
    #[error("cannot clone {from:?} into the new volume {name:?}")]
    Clone {
        from: String,
        name: String,
        source: io::Error,
    },
    #[error("cannot delete snapshot {name:?}")]
    DeleteSnapshot { name: String, source: io::Error },
    #[error("cannot roll back volume {name:?} to snapshot {snapshot:?}; the volume is unchanged")]
    Rollback {
        name: String,
        snapshot: String,
        source: io::Error,
    },
    #[error("cannot read the size and extents of {name:?}")]
    Inspect { name: String, source: io::Error },
    #[error("cannot open volume {name:?} for a VM")]
    OpenForVm { name: String, source: io::Error },
    #[error("cannot open {} to import it; give a path the server can read", path.display())]
    ImportOpen { path: PathBuf, source: io::Error },
    #[error("cannot import {}", path.display())]
    ImportFormat { path: PathBuf, source: qcow2::Error },
    #[error("cannot import internal snapshot {snapshot:?} as a volume snapshot: {reason}; pass a snapshot_prefix or rename it with qemu-img")]
    ImportSnapshotName { snapshot: String, reason: String },
    #[error("cannot import {} as volume {name:?}", path.display())]
    Import {
        name: String,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot export to {}: {reason}", path.display())]
    ExportPath { path: PathBuf, reason: &'static str },
    #[error("cannot export to {}: the file exists; remove it or pick another path", path.display())]
    ExportExists { path: PathBuf },
    #[error("cannot export volume {name:?} to {}", path.display())]
    Export {
        name: String,
        path: PathBuf,
        source: io::Error,
    },
    #[error("cannot export volume {name:?} to {}", path.display())]
    ExportFormat {
        name: String,
        path: PathBuf,
        source: qcow2::Error,
    },
}

/// The class of an error, for callers that map errors to a protocol (HTTP
/// statuses, exit codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request is malformed: bad name, bad size, wrong snapshot.
    BadRequest,
    /// A named volume or snapshot does not exist.
    NotFound,
    /// The name is taken.
    Conflict,
    /// The state directory cannot host volumes (no reflink).
    Unavailable,
    /// The filesystem failed.
    Io,
}

impl VolumeError {
    /// The class of this error.
    pub fn kind(&self) -> ErrorKind {
        use VolumeError::*;
        match self {
            InvalidName { .. }
            | InvalidSize { .. }
            | NotSnapshotOf { .. }
            | Shrink { .. }
            | ImportOpen { .. }
            | ImportSnapshotName { .. }
            | ExportPath { .. } => ErrorKind::BadRequest,
            ImportFormat { source, .. } | ExportFormat { source, .. } => match source {
                qcow2::Error::Read { .. } | qcow2::Error::Write { .. } | qcow2::Error::Sync(_) => {
                    ErrorKind::Io
                }
                _ => ErrorKind::BadRequest,
            },
            ExportExists { .. } => ErrorKind::Conflict,
            VolumeNotFound(_) | SnapshotNotFound(_) | SourceNotFound(_) => ErrorKind::NotFound,
            NameTaken { .. } | InUse { .. } => ErrorKind::Conflict,
            ReflinkUnsupported { .. } => ErrorKind::Unavailable,
            OpenRoot { .. }
            | Probe { .. }
            | Scan { .. }
            | Create { .. }
            | Grow { .. }
            | Delete { .. }
            | Snapshot { .. }
            | Clone { .. }
            | DeleteSnapshot { .. }
            | Rollback { .. }
            | Inspect { .. }
            | OpenForVm { .. }
            | Import { .. }
            | Export { .. } => ErrorKind::Io,
        }
    }

    /// This error's message followed by its sources' (`a: b: c`), for
    /// callers that show one line.
    pub fn chain(&self) -> String {
        shared::error_chain(self)
    }
}
