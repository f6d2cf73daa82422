//! What a `uffdctl` command can fail with.

use crate::client::ClientError;

/// A command's failure, printed as one line.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The server answered with an error.
    #[error("{message} (HTTP {status})")]
    Api { status: u16, message: String },
    /// The server's answer does not have the expected shape.
    #[error("unexpected answer from the server: {0}")]
    Answer(String),
    /// The command line asks for something impossible.
    #[error("{0}")]
    Usage(String),
    /// A local step failed (the demo's server, files).
    #[error("cannot {what}")]
    Local {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A qcow2 file could not be read or changed.
    #[error(transparent)]
    Qcow2(#[from] qcow2::Error),
    /// Work the server does in the background failed (a push).
    #[error("{0}")]
    Background(String),
    /// A figure the demo measured is not what pagefork promises.
    #[error("demo check failed: {0}")]
    Check(String),
    /// The demo's server did not come up.
    #[error("the server did not come up at {0}")]
    NoServer(String),
}

/// Result alias of the CLI.
pub type Result<T> = std::result::Result<T, CliError>;
