//! Bodies of the REST control API (JSON over a Unix socket).
//!
//! Every request and response body of the API is a type here, used by the
//! server (which parses requests into them and answers with them), by
//! `uffdctl` and by the tests. Errors are [`ErrorBody`] with a fitting
//! HTTP status: 4xx for the client's mistakes, 5xx for the server's own
//! failures.
//!
//! - [`vms`]: VMs, guest ops, fork.
//! - [`bases`]: shared bases, the memory VMs of one image or template map.
//! - [`volumes`]: disk volumes and their snapshots.
//! - [`firecracker`]: listeners serving Firecracker's Uffd memory backend.
//! - [`debug`]: memory-source debugging (sources, pages, tree, invariant).
//! - [`snapshots`]: VM snapshots, restore, rollback in place, clone(n).
//! - [`observe`]: the live fault trace, a page's chain, access maps.
//! - [`remote`]: snapshots in an S3-compatible object store.

pub mod bases;
pub mod debug;
pub mod firecracker;
pub mod observe;
pub mod remote;
pub mod snapshots;
pub mod vms;
pub mod volumes;

use serde::{Deserialize, Serialize};

pub use bases::*;
pub use debug::*;
pub use firecracker::*;
pub use observe::*;
pub use remote::*;
pub use snapshots::*;
pub use vms::*;
pub use volumes::*;

/// Error body: `{"error": "what went wrong and what to do"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: String,
}

/// `GET /v1/health`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    /// Always `ok` when the server answers.
    pub status: String,
    pub version: String,
    /// The serving process.
    #[serde(default)]
    pub pid: u32,
    /// When it started serving, in ms since the Unix epoch.
    #[serde(default)]
    pub started_unix_ms: u64,
    /// Why it started: `first`, `crash` (the process before it died) or
    /// `upgrade` (the process before it handed over).
    #[serde(default)]
    pub start: String,
    /// Whether a keeper or systemd holds what outlives this process (its
    /// VMs survive its crash and an upgrade).
    #[serde(default)]
    pub kept: bool,
    /// VMs taken back at start.
    #[serde(default)]
    pub adopted_vms: u64,
    /// VMs that could not be taken back, each with why.
    #[serde(default)]
    pub lost_vms: Vec<String>,
    /// From process start to serving the VMs it took back, in ms.
    #[serde(default)]
    pub recovery_ms: Option<f64>,
}

/// `GET /v1/memory`: the memory limit the server keeps its VMs under,
/// and what it gave back to stay there.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MemoryStatus {
    /// Reclaim is on (`--reclaim auto` and a limit applies).
    pub reclaim: bool,
    /// The limit that applies: the lower of the server's memory cgroup's
    /// limit and the host's memory.
    #[serde(default)]
    pub limit_bytes: Option<u64>,
    /// Where the limit comes from (`cgroup v1 /sys/fs/cgroup/memory/x`,
    /// `host`).
    pub limit_source: String,
    /// Reclaim starts above this many bytes in use.
    #[serde(default)]
    pub watermark_bytes: Option<u64>,
    /// Bytes in use now, as the limit counts them (the cgroup's anonymous
    /// and shared memory, or the host's used memory).
    pub usage_bytes: u64,
    /// Resident guest memory of every VM, in bytes.
    pub resident_bytes: u64,
    /// Bytes given back since the server started.
    pub given_back_bytes: u64,
    /// Of those, pages of shared image bases dropped (the image holds the
    /// same bytes; every VM on the base reads them again from there).
    #[serde(default)]
    pub base_pages_dropped: u64,
    /// Reclaim cannot keep usage under the watermark: new VMs are refused
    /// (503) until it can.
    pub behind: bool,
    /// Why, when `behind`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub behind_reason: Option<String>,
    /// The swap store of written pages.
    pub swap: SwapStatus,
    /// OOM kills the kernel counted in the server's memory cgroup.
    #[serde(default)]
    pub oom_kills: Option<u64>,
    /// VMs that fault back what was reclaimed from them, over and over.
    #[serde(default)]
    pub thrashing_vms: Vec<String>,
}

/// The swap store (`MemoryStatus::swap`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SwapStatus {
    /// Its file.
    pub path: String,
    /// Pages in it.
    pub pages: u64,
    /// Bytes those pages take in it (compressed).
    pub stored_bytes: u64,
    /// Bytes of its file (live frames and garbage not compacted yet).
    pub file_bytes: u64,
    /// Its disk is full (or its cap reached): written pages stay in
    /// memory; clean pages are still dropped.
    pub full: bool,
}

/// `POST /v1/server/upgrade`: hand everything to a new server process.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Upgrade {
    /// The binary to start (default: the one the server runs).
    #[serde(default)]
    pub binary: Option<String>,
}

/// The answer to `POST /v1/server/upgrade`: the process handing over
/// exits right after it; `GET /v1/health` names the new one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UpgradeStarted {
    /// The process handing over.
    pub pid: u32,
    /// The binary the next process runs.
    pub binary: String,
    /// VMs handed over.
    pub vms: u64,
}
