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
