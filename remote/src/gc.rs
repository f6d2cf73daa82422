//! Garbage collection: delete the chunks no manifest names (left by
//! deleted snapshots and by pushes that never committed), and locks of
//! holders that died. It runs only while no push runs (the rule is in the
//! crate doc, "Pushes and gc"):
//!
//! 1. take a gc lock, or fail as busy if a push holds a fresh lock;
//! 2. read every manifest (one that does not parse stops the gc: what it
//!    names is unknown) and gather the chunks they name;
//! 3. list every chunk; check the lock still holds; delete the others;
//! 4. delete stale locks, then the gc lock.

use std::collections::HashSet;

use futures_util::{StreamExt, TryStreamExt};

use crate::error::{Error, Result};
use crate::lock::LockKind;
use crate::store::{Remote, CHUNKS, MANIFESTS};

/// What a gc did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Manifests read.
    pub manifests: u64,
    /// Chunks kept (named by a manifest) and deleted.
    pub chunks_kept: u64,
    pub chunks_deleted: u64,
    /// Stored bytes deleted.
    pub bytes_deleted: u64,
    /// Locks of pushes or gcs that stopped without removing them.
    pub stale_locks_deleted: u64,
}

impl Remote {
    /// Delete every chunk no manifest names. Fails as [`Error::Busy`]
    /// while a push runs.
    pub async fn gc(&self) -> Result<GcReport> {
        let lock = match self.try_lock(LockKind::Gc, "gc").await? {
            Ok(lock) => lock,
            Err(pushes) => {
                return Err(Error::Busy {
                    url: self.url().to_string(),
                    what: format!(
                        "{} push(es) running (the oldest lock: {})",
                        pushes.len(),
                        pushes
                            .iter()
                            .max_by_key(|p| p.age)
                            .map(|p| p.key.to_string())
                            .unwrap_or_default()
                    ),
                })
            }
        };
        let result = lock
            .hold(async {
                let mut report = GcReport::default();
                let named = self.named_chunks(&mut report).await?;
                let unnamed: Vec<_> = self
                    .list(CHUNKS)
                    .await?
                    .into_iter()
                    .filter(|m| {
                        let keep = self
                            .name_under(CHUNKS, &m.location)
                            .is_some_and(|d| named.contains(&d));
                        if keep {
                            report.chunks_kept += 1;
                        }
                        !keep
                    })
                    .collect();
                lock.check()?;
                report.chunks_deleted = unnamed.len() as u64;
                report.bytes_deleted = unnamed.iter().map(|m| m.size).sum();
                self.delete_keys(unnamed.into_iter().map(|m| m.location).collect())
                    .await?;
                let ttl = self.tuning().lock_ttl;
                let stale: Vec<_> = lock
                    .others
                    .iter()
                    .filter(|o| !o.fresh(ttl))
                    .map(|o| o.key.clone())
                    .collect();
                report.stale_locks_deleted = stale.len() as u64;
                self.delete_keys(stale).await?;
                Ok(report)
            })
            .await;
        lock.release().await;
        result
    }

    /// Every chunk digest a manifest names.
    async fn named_chunks(&self, report: &mut GcReport) -> Result<HashSet<String>> {
        let names: Vec<String> = self
            .list(MANIFESTS)
            .await?
            .into_iter()
            .map(|m| {
                self.name_under(MANIFESTS, &m.location).ok_or_else(|| {
                    self.bad_manifest(m.location.as_ref(), "not a manifest key".into())
                })
            })
            .collect::<Result<_>>()?;
        report.manifests = names.len() as u64;
        let manifests: Vec<Option<_>> = futures_util::stream::iter(names)
            .map(|n| async move {
                // One deleted since the listing names nothing any more.
                match self.manifest(&n).await {
                    Err(Error::NoSuchSnapshot { .. }) => Ok(None),
                    r => r.map(Some),
                }
            })
            .buffer_unordered(self.tuning().concurrency.max(1))
            .try_collect()
            .await?;
        let mut named = HashSet::new();
        for m in manifests.iter().flatten() {
            for c in m.memory_chunks().iter().chain(m.volume_chunks().iter()) {
                if c.stored.is_some() {
                    named.insert(c.digest.to_owned());
                }
            }
        }
        Ok(named)
    }
}
