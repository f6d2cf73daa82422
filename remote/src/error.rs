//! The crate's errors: one enum, variants named after what failed, messages
//! saying what to do. No message carries a credential: store errors are
//! kept as text with every credential of the configuration cut out
//! ([`Redactor`]), never as the client's error value, whose chain could
//! quote a signed request.

use std::path::PathBuf;
use std::time::Duration;

/// The crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong with the store, a snapshot or a local file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("'{url}' is not a store location: {reason} (use s3://BUCKET[/PREFIX])")]
    ParseUrl { url: String, reason: &'static str },
    #[error("no {what}: set {env} or pass it explicitly")]
    MissingSetting {
        what: &'static str,
        env: &'static str,
    },
    #[error("cannot set up the S3 client for {endpoint}: {message}")]
    Client { endpoint: String, message: String },
    #[error("cannot reach the store at {endpoint} ({op}): {message}; is it running? (scripts/ceph.sh start boots a local one)")]
    Unreachable {
        endpoint: String,
        op: String,
        message: String,
    },
    #[error("the store at {endpoint} refused the credentials ({op}): check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")]
    Denied { endpoint: String, op: String },
    #[error(
        "bucket {bucket} does not exist at {endpoint}: create it (e.g. s3cmd mb s3://{bucket})"
    )]
    NoSuchBucket { bucket: String, endpoint: String },
    #[error("{op} on the store at {endpoint} failed: {message}")]
    Store {
        endpoint: String,
        op: String,
        message: String,
    },
    #[error("{op} took more than {after:?}: the store at {endpoint} is slow or down")]
    Deadline {
        endpoint: String,
        op: String,
        after: Duration,
    },
    #[error("no snapshot {name} in {url}")]
    NoSuchSnapshot { name: String, url: String },
    #[error(
        "{url} already holds a snapshot {name}: delete it there first, or push under another name"
    )]
    AlreadyExists { name: String, url: String },
    #[error("the manifest of {name} in {url} is not usable: {reason}; it is damaged or was not written by pagefork")]
    BadManifest {
        name: String,
        url: String,
        reason: String,
    },
    #[error("chunk {digest} is missing from {url}: its snapshot was deleted and collected, or the store lost it; push the snapshot again")]
    ChunkMissing { digest: String, url: String },
    #[error("chunk {digest} from {url} is damaged ({reason}); it was not used: push a snapshot holding it again")]
    ChunkCorrupt {
        digest: String,
        url: String,
        reason: String,
    },
    #[error("snapshot directory {dir}: {reason}")]
    LocalSnapshot { dir: PathBuf, reason: String },
    #[error("cannot {op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{url} is busy: {what}; try again when it ends")]
    Busy { url: String, what: String },
    #[error("{what} stalled for {stalled:?}, longer than its lock on {url} is trusted (half of {ttl:?}), and stopped before relying on it: run it again")]
    LockLost {
        what: String,
        url: String,
        stalled: Duration,
        ttl: Duration,
    },
    #[error("a worker thread failed: {0}")]
    Worker(String),
}

impl Error {
    /// An I/O error on `path`, for `map_err`.
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }

    /// Whether the store could not be reached or did not answer in time
    /// (as opposed to answering "no").
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Error::Unreachable { .. } | Error::Deadline { .. })
    }
}

/// Cuts the configured credentials out of text that may quote them.
#[derive(Clone, Default)]
pub(crate) struct Redactor {
    secrets: Vec<String>,
}

impl std::fmt::Debug for Redactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Redactor({} secrets)", self.secrets.len())
    }
}

impl Redactor {
    pub(crate) fn new(secrets: impl IntoIterator<Item = String>) -> Self {
        Self {
            secrets: secrets.into_iter().filter(|s| s.len() >= 4).collect(),
        }
    }

    pub(crate) fn clean(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for s in &self.secrets {
            out = out.replace(s.as_str(), "<redacted>");
        }
        out
    }
}

/// How an error of the object store client reads to us.
pub(crate) enum Kind {
    NotFound,
    Exists,
    Denied,
    Unreachable,
    Other,
}

/// Classify a client error and render it (credentials cut out).
pub(crate) fn classify(e: &object_store::Error, redactor: &Redactor) -> (Kind, String) {
    use object_store::Error as E;
    let kind = match e {
        E::NotFound { .. } => Kind::NotFound,
        E::AlreadyExists { .. } | E::Precondition { .. } => Kind::Exists,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => Kind::Denied,
        _ if unreachable_cause(e) => Kind::Unreachable,
        _ => Kind::Other,
    };
    // The innermost causes say the most (a refused connection, a timeout);
    // the outer ones add the method and URL.
    let mut text = e.to_string();
    let mut cause: Option<&dyn std::error::Error> = std::error::Error::source(e);
    let mut depth = 0;
    while let Some(c) = cause {
        let s = c.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        cause = c.source();
        depth += 1;
        if depth > 8 {
            break;
        }
    }
    // LIST failures arrive as generic errors: their status is in the text.
    let kind = match kind {
        Kind::Other if text.contains(" 403 Forbidden") || text.contains(" 401 Unauthorized") => {
            Kind::Denied
        }
        Kind::Other if text.contains(" 404 Not Found") => Kind::NotFound,
        k => k,
    };
    (kind, redactor.clean(&text))
}

/// Whether the chain holds a transport failure: no connection, a reset or
/// a timeout (the store is down or not answering), not an answer.
fn unreachable_cause(e: &object_store::Error) -> bool {
    use object_store::client::{HttpError, HttpErrorKind};
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(h) = c.downcast_ref::<HttpError>() {
            return matches!(
                h.kind(),
                HttpErrorKind::Connect
                    | HttpErrorKind::Timeout
                    | HttpErrorKind::Request
                    | HttpErrorKind::Interrupted
            );
        }
        cause = c.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_cuts_every_secret() {
        let r = Redactor::new(["SECRETKEY123".to_owned(), "AKID".to_owned(), "x".to_owned()]);
        let text = r.clean("Credential=AKID/2024 sig SECRETKEY123 and x");
        assert!(!text.contains("SECRETKEY123"));
        assert!(!text.contains("AKID"));
        // Too short to be a credential: left alone (else every "x" goes).
        assert!(text.ends_with(" x"));
    }

    #[test]
    fn messages_say_what_to_do() {
        let e = Error::Unreachable {
            endpoint: "http://127.0.0.1:7480".into(),
            op: "GET chunks/ab".into(),
            message: "connection refused".into(),
        };
        let s = e.to_string();
        assert!(s.starts_with("cannot reach the store at http://127.0.0.1:7480"));
        assert!(s.contains("is it running?"));
        assert!(e.is_unreachable());
    }
}
