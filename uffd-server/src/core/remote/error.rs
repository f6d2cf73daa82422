//! What can go wrong with snapshots in the object store, as the API
//! answers it: the store's own errors keep their message (credentials are
//! never in it) and get a status by what they mean.

use pagefork_remote::Error as StoreError;

/// Errors of the object-store feature.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    #[error("this server has no object store: start it with --remote s3://BUCKET[/PREFIX]")]
    NotConfigured,
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(
        "snapshot {name} is being pushed already; wait for that push (GET /v1/snapshots/{name})"
    )]
    PushRunning { name: String },
    #[error("the volume of remote snapshot {name} cannot be written: {reason}")]
    Volume { name: String, reason: String },
    #[error("the store's work stopped before it answered: {0}")]
    Worker(String),
}

impl RemoteError {
    /// The HTTP status of this error.
    pub fn status(&self) -> u16 {
        use StoreError as S;
        match self {
            RemoteError::NotConfigured => 400,
            RemoteError::PushRunning { .. } => 409,
            RemoteError::Volume { .. } | RemoteError::Worker(_) => 500,
            RemoteError::Store(e) => match e {
                S::ParseUrl { .. } | S::MissingSetting { .. } => 400,
                S::LocalSnapshot { .. } => 400,
                S::NoSuchSnapshot { .. } => 404,
                S::AlreadyExists { .. } | S::Busy { .. } => 409,
                S::Unreachable { .. } | S::NoSuchBucket { .. } => 503,
                S::Deadline { .. } => 504,
                S::Denied { .. }
                | S::BadManifest { .. }
                | S::ChunkMissing { .. }
                | S::ChunkCorrupt { .. }
                | S::Store { .. }
                | S::Client { .. } => 502,
                S::Io { .. } | S::LockLost { .. } | S::Worker(_) => 500,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_errors_map_to_what_they_mean() {
        let url = || "s3://b".to_owned();
        for (e, want) in [
            (RemoteError::NotConfigured, 400),
            (
                StoreError::NoSuchSnapshot {
                    name: "s".into(),
                    url: url(),
                }
                .into(),
                404,
            ),
            (
                StoreError::AlreadyExists {
                    name: "s".into(),
                    url: url(),
                }
                .into(),
                409,
            ),
            (
                StoreError::Unreachable {
                    endpoint: "http://x".into(),
                    op: "GET".into(),
                    message: "refused".into(),
                }
                .into(),
                503,
            ),
            (RemoteError::PushRunning { name: "s".into() }, 409),
        ] {
            assert_eq!(e.status(), want, "{e}");
        }
    }
}
