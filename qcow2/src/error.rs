//! Errors of the qcow2 crate: one enum, named after what failed.

use std::io;

/// What went wrong reading or changing a qcow2 image.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading the image failed at the OS level.
    #[error("cannot read the {what} at byte {offset}")]
    Read {
        what: &'static str,
        offset: u64,
        #[source]
        source: io::Error,
    },
    /// Writing the image failed at the OS level.
    #[error("cannot write the {what} at byte {offset}")]
    Write {
        what: &'static str,
        offset: u64,
        #[source]
        source: io::Error,
    },
    /// fsync (or hole punching) failed.
    #[error("cannot make the image's changes durable")]
    Sync(#[source] io::Error),
    /// The bytes are not a well-formed qcow2 image.
    #[error("not a valid qcow2 image: {0}")]
    Invalid(String),
    /// A well-formed image uses something this implementation refuses.
    #[error("unsupported qcow2 image: {0}")]
    Unsupported(String),
    /// No snapshot has this id or name.
    #[error("no snapshot {0:?} in the image (see `uffdctl qcow2 snapshot -l`)")]
    NoSnapshot(String),
    /// The request itself is unusable (e.g. an empty snapshot name).
    #[error("{0}")]
    BadRequest(String),
    /// A test hook stopped the operation after a write group (crash tests).
    #[error("operation stopped by the failure hook after {0:?}")]
    Injected(crate::stage::Stage),
}

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Shorthand for [`Error::Invalid`].
pub(crate) fn invalid<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::Invalid(msg.into()))
}

/// Shorthand for [`Error::Unsupported`].
pub(crate) fn unsupported<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::Unsupported(msg.into()))
}
