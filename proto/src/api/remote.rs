//! Snapshots in an S3-compatible object store (`uffd-server --remote
//! s3://BUCKET[/PREFIX]`): push a local snapshot, list, show, delete,
//! collect garbage, pull one into the local catalog, clone from one, and
//! the store's counters. `POST /v1/vms` with `"from_snapshot":
//! "remote:NAME"` restores a VM from the store lazily.

use serde::{Deserialize, Serialize};

/// The prefix of `from_snapshot` that names a snapshot in the store.
pub const REMOTE_PREFIX: &str = "remote:";

/// Where a push stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum PushState {
    /// Chunks are being sent; the manifest is not written yet.
    Running,
    /// The manifest is written: the snapshot is in the store.
    Done,
    /// It stopped; `error` says why. Nothing was committed.
    Failed,
}

/// A push of a local snapshot to the store, as `GET /v1/snapshots/{name}`
/// shows it (the last one since the server started).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PushStatus {
    pub state: PushState,
    /// Where to, `s3://BUCKET[/PREFIX]`.
    pub url: String,
    /// Distinct chunks holding data handled so far, and in all.
    pub chunks_done: u64,
    pub chunks_total: u64,
    /// Their uncompressed bytes, so far and in all.
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Chunks sent by this push, and their stored (compressed) bytes.
    pub chunks_uploaded: u64,
    pub uploaded_bytes: u64,
    /// Chunks the store had already (another snapshot holds them).
    pub chunks_present: u64,
    /// Seconds since the Unix epoch when it started.
    pub started: u64,
    /// How long it has run, or ran.
    pub elapsed_us: u64,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `POST /v1/remote/snapshots/{name}/pull` body.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PullSnapshot {
    /// The local name (default: the store's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// `POST /v1/remote/snapshots/{name}/pull` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotPulled {
    /// The local snapshot made.
    pub name: String,
    /// The snapshot in the store it came from.
    pub remote: String,
    /// Chunks of memory and volume, holes included.
    pub chunks: u64,
    /// Distinct chunks read (from the store or the local chunk cache),
    /// their stored and uncompressed bytes.
    pub chunks_fetched: u64,
    pub fetched_bytes: u64,
    pub fetched_raw_bytes: u64,
    /// The local volume snapshot made with it, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot: Option<String>,
    pub duration_us: u64,
}

/// A snapshot in the store, as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RemoteSnapshotSummary {
    pub name: String,
    /// Seconds since the Unix epoch when its push committed.
    pub committed: u64,
    /// Its manifest's size.
    pub manifest_bytes: u64,
}

/// `GET /v1/remote/snapshots`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RemoteSnapshotList {
    /// The store, `s3://BUCKET[/PREFIX]`.
    pub url: String,
    pub snapshots: Vec<RemoteSnapshotSummary>,
}

/// `GET /v1/remote/snapshots/{name}`: what its manifest says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RemoteSnapshotInfo {
    pub name: String,
    pub url: String,
    /// Seconds since the Unix epoch when its push committed.
    pub pushed: u64,
    /// The VM it was taken from, on the host that took it.
    pub vm: String,
    pub memory_mib: u64,
    pub vcpus: u8,
    pub hugepages: bool,
    /// Chunks of memory (1 MiB each), and of them holes (not stored).
    pub chunks: u64,
    pub holes: u64,
    /// Stored (compressed) bytes of its memory's chunks.
    pub stored_bytes: u64,
    /// The volume snapshot that travels with it, and its size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot: Option<String>,
    #[serde(default)]
    pub volume_bytes: u64,
    /// Pages of its recorded working set (0: none recorded).
    pub working_set_pages: u64,
    /// The pagefork version that took it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pagefork_version: Option<String>,
}

/// `DELETE /v1/remote/snapshots/{name}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RemoteSnapshotDeleted {
    pub name: String,
    /// Whether it was there.
    pub deleted: bool,
}

/// `POST /v1/remote/gc`: what the garbage collection removed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RemoteGc {
    /// Manifests read.
    pub manifests: u64,
    /// Chunks some manifest names (kept), and the others (deleted).
    pub chunks_kept: u64,
    pub chunks_deleted: u64,
    /// Stored bytes deleted.
    pub bytes_deleted: u64,
    /// Locks of pushes or collections that died, removed.
    pub stale_locks_deleted: u64,
    pub duration_us: u64,
}

/// The local chunk cache on the state directory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ChunkCacheStatus {
    /// Chunks and bytes cached, and the most it keeps.
    pub chunks: u64,
    pub bytes: u64,
    pub capacity_bytes: u64,
    /// Reads served from it, fetches from the store it made, reads that
    /// waited for another's fetch of the same chunk.
    pub hits: u64,
    pub fetches: u64,
    pub waits: u64,
    pub evictions: u64,
    /// Cached files that failed their check (deleted, fetched again).
    pub damaged: u64,
}

/// `GET /v1/remote`: the store and what the server fetched from it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RemoteStatus {
    /// `s3://BUCKET[/PREFIX]`.
    pub url: String,
    /// The S3 endpoint.
    pub endpoint: String,
    /// Chunks fetched from the store (not from the local cache), and
    /// their stored bytes: what went over the network.
    pub fetched_chunks: u64,
    pub fetched_bytes: u64,
    /// Chunk reads that failed (store down or slow past the deadline, a
    /// chunk missing or damaged).
    pub fetch_failures: u64,
    /// Chunks held in memory for faults, their bytes, and the most kept.
    pub memory_chunks: u64,
    pub memory_bytes: u64,
    pub memory_capacity_bytes: u64,
    pub cache: ChunkCacheStatus,
    /// Pushes running now.
    pub pushes_running: u64,
    /// Pulls running now, with their progress.
    #[serde(default)]
    pub pulls: Vec<PullProgress>,
}

/// A pull under way (`POST /v1/remote/snapshots/{name}/pull` answers when
/// it is done; this is how far it is meanwhile).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PullProgress {
    /// The local snapshot being made.
    pub name: String,
    /// The snapshot in the store.
    pub remote: String,
    /// Distinct chunks holding data fetched so far, and in all.
    pub chunks_done: u64,
    pub chunks_total: u64,
    /// Their uncompressed bytes, so far and in all.
    pub bytes_done: u64,
    pub bytes_total: u64,
}
