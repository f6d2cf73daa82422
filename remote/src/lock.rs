//! Locks in the store that keep a gc from deleting chunks a push relies on
//! (the rule and why it holds: the crate doc, "Pushes and gc").
//!
//! A lock is an object `locks/<push|gc>-<id>`; its kind is in its key, so
//! one LIST shows every lock and its age. Ages are compared on the store's
//! clock: a lock is fresh if its last write is less than the TTL older
//! than the write of the lock being taken, as the same LIST reports both.
//! A holder rewrites its lock every TTL/4 while it works, and notices (on
//! its own monotonic clock) when it went longer than TTL/2 without doing
//! so: from then on it may have been taken for dead, and it stops before
//! doing anything that relied on its lock.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use object_store::path::Path as Key;
use tracing::warn;

use crate::error::{Error, Result};
use crate::store::{Remote, LOCKS};

/// What holds a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockKind {
    Push,
    Gc,
}

impl LockKind {
    fn name(self) -> &'static str {
        match self {
            LockKind::Push => "push",
            LockKind::Gc => "gc",
        }
    }

    /// The kind whose fresh locks keep this one from being taken.
    fn excluded_by(self) -> LockKind {
        match self {
            LockKind::Push => LockKind::Gc,
            LockKind::Gc => LockKind::Push,
        }
    }
}

/// A lock another holder has.
#[derive(Debug, Clone)]
pub(crate) struct OtherLock {
    pub(crate) key: Key,
    pub(crate) kind: Option<LockKind>,
    /// How much older than ours it is on the store's clock.
    pub(crate) age: Duration,
}

impl OtherLock {
    pub(crate) fn fresh(&self, ttl: Duration) -> bool {
        self.age < ttl
    }
}

#[derive(Debug)]
struct Held {
    /// When the last write of the lock that succeeded was sent.
    last_ok: Instant,
    /// The longest the lock went without a write, if that passed TTL/2.
    lost: Option<Duration>,
}

/// A lock this process holds.
#[derive(Debug)]
pub(crate) struct Lock {
    remote: Remote,
    key: Key,
    body: Bytes,
    what: String,
    held: Arc<Mutex<Held>>,
    /// The other locks seen when it was taken.
    pub(crate) others: Vec<OtherLock>,
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

impl Remote {
    /// Take a `kind` lock for `what` (a push of a snapshot, a gc), or say
    /// which fresh locks keep it from being taken.
    pub(crate) async fn try_lock(
        &self,
        kind: LockKind,
        what: &str,
    ) -> Result<std::result::Result<Lock, Vec<OtherLock>>> {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let id = format!("{}-{nanos:x}-{:016x}", kind.name(), rand::random::<u64>());
        let key = self.key(&format!("{LOCKS}/{id}"));
        let body = Bytes::from(
            serde_json::json!({
                "what": what,
                "host": hostname(),
                "pid": std::process::id(),
            })
            .to_string(),
        );
        let sent = Instant::now();
        self.put(&key, body.clone(), false).await?;
        let listed = self.list(LOCKS).await?;
        let Some(mine) = listed.iter().find(|m| m.location == key) else {
            let _ = self.delete_key(&key).await;
            return Err(Error::Store {
                endpoint: self.endpoint().to_owned(),
                op: format!("LIST {}", self.key(LOCKS)),
                message: "a lock just written is not listed: this store's listings are not \
                          consistent with its writes, which gc relies on"
                    .to_owned(),
            });
        };
        let now = mine.last_modified;
        let others: Vec<OtherLock> = listed
            .iter()
            .filter(|m| m.location != key)
            .map(|m| OtherLock {
                key: m.location.clone(),
                kind: self.name_under(LOCKS, &m.location).and_then(|n| {
                    [LockKind::Push, LockKind::Gc]
                        .into_iter()
                        .find(|k| n.starts_with(&format!("{}-", k.name())))
                }),
                age: (now - m.last_modified).to_std().unwrap_or(Duration::ZERO),
            })
            .collect();
        let ttl = self.tuning().lock_ttl;
        let blocking: Vec<OtherLock> = others
            .iter()
            .filter(|o| o.kind == Some(kind.excluded_by()) && o.fresh(ttl))
            .cloned()
            .collect();
        if !blocking.is_empty() {
            if let Err(e) = self.delete_key(&key).await {
                warn!("cannot remove lock {key} that lost to another: {e}");
            }
            return Ok(Err(blocking));
        }
        Ok(Ok(Lock {
            remote: self.clone(),
            key,
            body,
            what: what.to_owned(),
            held: Arc::new(Mutex::new(Held {
                last_ok: sent,
                lost: None,
            })),
            others,
        }))
    }
}

impl Lock {
    /// Run `work` while rewriting the lock every TTL/4.
    pub(crate) async fn hold<T>(
        &self,
        work: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let ttl = self.remote.tuning().lock_ttl;
        let refresh = async {
            loop {
                tokio::time::sleep(ttl / 4).await;
                let sent = Instant::now();
                {
                    let mut h = self
                        .held
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    let gap = sent.duration_since(h.last_ok);
                    if gap > ttl / 2 {
                        h.lost = Some(h.lost.map_or(gap, |g| g.max(gap)));
                    }
                }
                match self.remote.put(&self.key, self.body.clone(), false).await {
                    Ok(_) => {
                        let mut h = self
                            .held
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner);
                        h.last_ok = sent;
                    }
                    Err(e) => warn!("{}: cannot refresh lock {}: {e}", self.what, self.key),
                }
            }
        };
        tokio::select! {
            r = work => r,
            () = refresh => Err(Error::Worker(format!("{}: the lock refresh ended", self.what))),
        }
    }

    /// Whether the lock can still be relied on: an error if it went
    /// longer than TTL/2 without a write at any time, or has now.
    pub(crate) fn check(&self) -> Result<()> {
        let ttl = self.remote.tuning().lock_ttl;
        let h = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let since = h.last_ok.elapsed();
        let stalled = h.lost.map_or(since, |g| g.max(since));
        if stalled > ttl / 2 {
            return Err(Error::LockLost {
                what: self.what.clone(),
                url: self.remote.url().to_string(),
                stalled,
                ttl,
            });
        }
        Ok(())
    }

    /// Remove the lock.
    pub(crate) async fn release(self) {
        if let Err(e) = self.remote.delete_key(&self.key).await {
            warn!(
                "{}: cannot remove lock {} (it goes stale in {:?}): {e}",
                self.what,
                self.key,
                self.remote.tuning().lock_ttl
            );
        }
    }
}
