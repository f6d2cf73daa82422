//! [`Remote`]: a store location and its S3 client, with the requests every
//! operation is made of (HEAD, GET of a range, PUT, LIST, DELETE), each
//! bounded in time and with its failure turned into an [`Error`] that
//! names the endpoint and the object, never a credential.
//!
//! Keys under the location's prefix:
//!
//! ```text
//! PREFIX/chunks/<xxh3-128 hex>      a chunk: one zstd frame
//! PREFIX/manifests/<name>           a snapshot's manifest (JSON)
//! PREFIX/locks/<push|gc>-<id>       a running push or gc (see the crate doc)
//! ```

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as Key;
use object_store::{
    BackoffConfig, ClientOptions, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions,
    PutPayload, RetryConfig,
};

use crate::chunk::{self, ChunkRef};
use crate::config::{RemoteConfig, RemoteUrl, Tuning};
use crate::error::{classify, Error, Kind, Redactor, Result};

pub(crate) const CHUNKS: &str = "chunks";
pub(crate) const MANIFESTS: &str = "manifests";
pub(crate) const LOCKS: &str = "locks";

/// A store location with its client. Cheap to clone; use from any task.
#[derive(Clone)]
pub struct Remote {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) url: RemoteUrl,
    pub(crate) endpoint: String,
    pub(crate) tuning: Tuning,
    pub(crate) redactor: Redactor,
}

impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("url", &self.inner.url.to_string())
            .field("endpoint", &self.inner.endpoint)
            .finish_non_exhaustive()
    }
}

/// A snapshot in the store, as listing shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteSnapshot {
    pub name: String,
    /// When its manifest was written (the push's commit).
    pub committed: SystemTime,
    /// The manifest's size.
    pub manifest_bytes: u64,
}

impl Remote {
    /// A client for `config` (no request is made).
    pub fn new(config: RemoteConfig) -> Result<Self> {
        let endpoint = config.endpoint_name();
        let t = &config.tuning;
        let mut client = ClientOptions::new()
            .with_timeout(t.request_timeout)
            .with_connect_timeout(t.connect_timeout);
        if endpoint.starts_with("http://") {
            client = client.with_allow_http(true);
        }
        let c = &config.credentials;
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(&config.url.bucket)
            .with_region(&config.region)
            .with_access_key_id(c.access_key_id.expose())
            .with_secret_access_key(c.secret_access_key.expose())
            .with_client_options(client)
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(2),
                    base: 2.0,
                },
                max_retries: t.retries,
                retry_timeout: t.retry_timeout,
            });
        if let Some(e) = &config.endpoint {
            b = b.with_endpoint(e);
        }
        if let Some(token) = &c.session_token {
            b = b.with_token(token.expose());
        }
        let redactor = Redactor::new(
            [
                Some(c.access_key_id.expose().to_owned()),
                Some(c.secret_access_key.expose().to_owned()),
                c.session_token.as_ref().map(|s| s.expose().to_owned()),
            ]
            .into_iter()
            .flatten(),
        );
        let store = b.build().map_err(|e| Error::Client {
            endpoint: endpoint.clone(),
            message: redactor.clean(&e.to_string()),
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                store: Arc::new(store),
                url: config.url,
                endpoint,
                tuning: config.tuning,
                redactor,
            }),
        })
    }

    /// The location, `s3://BUCKET[/PREFIX]`.
    pub fn url(&self) -> &RemoteUrl {
        &self.inner.url
    }

    /// The endpoint requests go to.
    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }

    /// The limits this client works with.
    pub fn tuning(&self) -> &Tuning {
        &self.inner.tuning
    }

    /// The key of `rel` under the prefix.
    pub(crate) fn key(&self, rel: &str) -> Key {
        if self.inner.url.prefix.is_empty() {
            Key::from(rel)
        } else {
            Key::from(format!("{}/{rel}", self.inner.url.prefix))
        }
    }

    pub(crate) fn chunk_key(&self, digest: &str) -> Key {
        self.key(&format!("{CHUNKS}/{digest}"))
    }

    pub(crate) fn manifest_key(&self, name: &str) -> Key {
        self.key(&format!("{MANIFESTS}/{name}"))
    }

    /// The last component of `key` if it lies directly under `dir`.
    pub(crate) fn name_under(&self, dir: &str, key: &Key) -> Option<String> {
        let want = self.key(dir);
        let s = key.as_ref();
        let rest = s.strip_prefix(want.as_ref())?.strip_prefix('/')?;
        (!rest.is_empty() && !rest.contains('/')).then(|| rest.to_owned())
    }

    /// `e`, which `op` on `key` met, as this crate's error.
    pub(crate) fn error(&self, op: &str, key: &Key, e: &object_store::Error) -> Error {
        let (kind, message) = classify(e, &self.inner.redactor);
        let endpoint = self.inner.endpoint.clone();
        let op = format!("{op} {key}");
        match kind {
            Kind::Unreachable => Error::Unreachable {
                endpoint,
                op,
                message,
            },
            Kind::Denied => Error::Denied { endpoint, op },
            Kind::NotFound if message.contains("NoSuchBucket") => Error::NoSuchBucket {
                bucket: self.inner.url.bucket.clone(),
                endpoint,
            },
            _ => Error::Store {
                endpoint,
                op,
                message,
            },
        }
    }

    /// `fut`, failing as [`Error::Deadline`] past `after`.
    pub(crate) async fn bounded<T>(
        &self,
        op: &str,
        after: Duration,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        tokio::time::timeout(after, fut)
            .await
            .map_err(|_| Error::Deadline {
                endpoint: self.inner.endpoint.clone(),
                op: op.to_owned(),
                after,
            })?
    }

    /// HEAD `key`: its metadata, `None` if it does not exist.
    pub(crate) async fn head(&self, key: &Key) -> Result<Option<ObjectMeta>> {
        match self.inner.store.head(key).await {
            Ok(m) => Ok(Some(m)),
            Err(e) => match classify(&e, &self.inner.redactor).0 {
                Kind::NotFound if !is_no_such_bucket(&e, &self.inner.redactor) => Ok(None),
                _ => Err(self.error("HEAD", key, &e)),
            },
        }
    }

    /// PUT `bytes` at `key`; with `create`, only if nothing is there
    /// (`Ok(false)` if something was).
    pub(crate) async fn put(&self, key: &Key, bytes: Bytes, create: bool) -> Result<bool> {
        let opts = PutOptions {
            mode: if create {
                PutMode::Create
            } else {
                PutMode::Overwrite
            },
            ..Default::default()
        };
        match self
            .inner
            .store
            .put_opts(key, PutPayload::from_bytes(bytes), opts)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) => match classify(&e, &self.inner.redactor).0 {
                Kind::Exists if create => Ok(false),
                _ => Err(self.error("PUT", key, &e)),
            },
        }
    }

    /// GET bytes `range` of `key`; `None` if it does not exist.
    pub(crate) async fn get_range(&self, key: &Key, range: Range<u64>) -> Result<Option<Bytes>> {
        match self.inner.store.get_range(key, range).await {
            Ok(b) => Ok(Some(b)),
            Err(e) => match classify(&e, &self.inner.redactor).0 {
                Kind::NotFound if !is_no_such_bucket(&e, &self.inner.redactor) => Ok(None),
                _ => Err(self.error("GET", key, &e)),
            },
        }
    }

    /// GET all of `key` if it has at most `limit` bytes; `None` if it does
    /// not exist.
    pub(crate) async fn get_bounded(&self, key: &Key, limit: u64) -> Result<Option<Bytes>> {
        let got = match self.inner.store.get(key).await {
            Ok(g) => g,
            Err(e) => {
                return match classify(&e, &self.inner.redactor).0 {
                    Kind::NotFound if !is_no_such_bucket(&e, &self.inner.redactor) => Ok(None),
                    _ => Err(self.error("GET", key, &e)),
                }
            }
        };
        if got.meta.size > limit {
            return Err(Error::Store {
                endpoint: self.inner.endpoint.clone(),
                op: format!("GET {key}"),
                message: format!("{} bytes, more than the {limit} expected", got.meta.size),
            });
        }
        got.bytes()
            .await
            .map(Some)
            .map_err(|e| self.error("GET", key, &e))
    }

    /// Every object under `rel`/.
    pub(crate) async fn list(&self, rel: &str) -> Result<Vec<ObjectMeta>> {
        let key = self.key(rel);
        self.inner
            .store
            .list(Some(&key))
            .try_collect()
            .await
            .map_err(|e| self.error("LIST", &key, &e))
    }

    /// DELETE `key` (deleting what does not exist succeeds).
    pub(crate) async fn delete_key(&self, key: &Key) -> Result<()> {
        self.inner
            .store
            .delete(key)
            .await
            .or_else(|e| match classify(&e, &self.inner.redactor).0 {
                Kind::NotFound => Ok(()),
                _ => Err(self.error("DELETE", key, &e)),
            })
    }

    /// DELETE many keys (bulk requests where the store has them).
    pub(crate) async fn delete_keys(&self, keys: Vec<Key>) -> Result<()> {
        let first = keys.first().cloned().unwrap_or_else(|| self.key(CHUNKS));
        let stream = futures_util::stream::iter(keys.into_iter().map(Ok)).boxed();
        self.inner
            .store
            .delete_stream(stream)
            .try_for_each(|_| async { Ok(()) })
            .await
            .or_else(|e| match classify(&e, &self.inner.redactor).0 {
                Kind::NotFound => Ok(()),
                _ => Err(self.error("DELETE", &first, &e)),
            })
    }

    /// The snapshots in the store: every committed manifest.
    pub async fn list_snapshots(&self) -> Result<Vec<RemoteSnapshot>> {
        let mut out: Vec<RemoteSnapshot> = self
            .list(MANIFESTS)
            .await?
            .into_iter()
            .filter_map(|m| {
                let name = self.name_under(MANIFESTS, &m.location)?;
                proto::manifest::check_name(&name).ok()?;
                Some(RemoteSnapshot {
                    name,
                    committed: SystemTime::from(m.last_modified),
                    manifest_bytes: m.size,
                })
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// The manifest of snapshot `name`, checked.
    pub async fn manifest(&self, name: &str) -> Result<proto::manifest::Manifest> {
        proto::manifest::check_name(name).map_err(|e| self.bad_manifest(name, e.to_string()))?;
        let key = self.manifest_key(name);
        let bytes = self
            .get_bounded(&key, proto::manifest::MAX_MANIFEST_BYTES as u64)
            .await?
            .ok_or_else(|| Error::NoSuchSnapshot {
                name: name.to_owned(),
                url: self.inner.url.to_string(),
            })?;
        let m = proto::manifest::parse_manifest(&bytes)
            .map_err(|e| self.bad_manifest(name, shared::error_chain(&e)))?;
        if m.name != name {
            return Err(self.bad_manifest(name, format!("it names the snapshot {:?}", m.name)));
        }
        Ok(m)
    }

    pub(crate) fn bad_manifest(&self, name: &str, reason: String) -> Error {
        Error::BadManifest {
            name: name.chars().take(80).collect(),
            url: self.inner.url.to_string(),
            reason,
        }
    }

    /// Delete snapshot `name`'s manifest: the snapshot is no longer listed
    /// and its chunks that no other manifest names go at the next
    /// [`Remote::gc`]. Whether it existed.
    pub async fn delete(&self, name: &str) -> Result<bool> {
        proto::manifest::check_name(name).map_err(|e| self.bad_manifest(name, e.to_string()))?;
        let key = self.manifest_key(name);
        let existed = self.head(&key).await?.is_some();
        if existed {
            self.delete_key(&key).await?;
        }
        Ok(existed)
    }

    /// Fetch chunk `c` with one range GET and check it: its bytes, or an
    /// error ([`Error::ChunkCorrupt`] if they are not the chunk; past
    /// [`Tuning::fetch_deadline`], [`Error::Deadline`]).
    pub async fn fetch_chunk(&self, c: &ChunkRef) -> Result<Bytes> {
        if !proto::manifest::is_digest(&c.digest) {
            return Err(self.corrupt(c, "not a chunk name".to_owned()));
        }
        let key = self.chunk_key(&c.digest);
        let op = format!("GET {key}");
        let stored = self
            .bounded(&op, self.inner.tuning.fetch_deadline, async {
                self.get_range(&key, 0..u64::from(c.stored)).await
            })
            .await?
            .ok_or_else(|| Error::ChunkMissing {
                digest: c.digest.clone(),
                url: self.inner.url.to_string(),
            })?;
        let c2 = c.clone();
        let bytes = tokio::task::spawn_blocking(move || chunk::decode(&c2, &stored))
            .await
            .map_err(|e| Error::Worker(e.to_string()))?
            .map_err(|d| self.corrupt(c, d.to_string()))?;
        Ok(Bytes::from(bytes))
    }

    pub(crate) fn corrupt(&self, c: &ChunkRef, reason: String) -> Error {
        Error::ChunkCorrupt {
            digest: c.digest.clone(),
            url: self.inner.url.to_string(),
            reason,
        }
    }
}

fn is_no_such_bucket(e: &object_store::Error, r: &Redactor) -> bool {
    classify(e, r).1.contains("NoSuchBucket")
}
