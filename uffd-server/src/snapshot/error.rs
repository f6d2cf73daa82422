//! Errors of the snapshot files, and their kind for the HTTP status.

use std::path::PathBuf;

/// What went wrong with a snapshot's files.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("invalid snapshot name '{name}': {source}")]
    BadName {
        name: String,
        #[source]
        source: volume::name::NameError,
    },
    #[error("snapshot {0} exists already (or is being written); pick another name")]
    Exists(String),
    #[error("no snapshot {0}; list them with GET /v1/snapshots")]
    NotFound(String),
    #[error("snapshot {name} is in use by {}; delete those VMs first", vms.join(", "))]
    InUse { name: String, vms: Vec<String> },
    #[error(
        "cannot {what} {}: its filesystem is full; delete snapshots you no longer need \
         (DELETE /v1/snapshots/{{name}}) or free space there, and try again",
        path.display()
    )]
    NoSpace {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot {what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a valid snapshot description: {reason}", path.display())]
    BadState { path: PathBuf, reason: String },
    #[error("snapshot {name} does not verify: {reason}")]
    Corrupt { name: String, reason: String },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, SnapshotError>;

/// The class of an error, for the HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    BadRequest,
    NotFound,
    Conflict,
    /// The filesystem is full (or the quota used up): the client's to
    /// fix, by deleting what it no longer needs.
    NoSpace,
    Io,
}

impl SnapshotError {
    /// The error's class.
    pub fn kind(&self) -> ErrorKind {
        match self {
            SnapshotError::BadName { .. } => ErrorKind::BadRequest,
            SnapshotError::Exists(_) | SnapshotError::InUse { .. } => ErrorKind::Conflict,
            SnapshotError::NotFound(_) => ErrorKind::NotFound,
            SnapshotError::NoSpace { .. } => ErrorKind::NoSpace,
            SnapshotError::Io { .. }
            | SnapshotError::BadState { .. }
            | SnapshotError::Corrupt { .. } => ErrorKind::Io,
        }
    }

    /// A closure building an [`SnapshotError::Io`] for `what` on `path`
    /// ([`SnapshotError::NoSpace`] when the filesystem is full).
    pub fn io(what: &'static str, path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.to_owned();
        move |source| match source.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => SnapshotError::NoSpace { what, path, source },
            _ => SnapshotError::Io { what, path, source },
        }
    }
}
