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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    /// Always `ok` when the server answers.
    pub status: String,
    pub version: String,
}
