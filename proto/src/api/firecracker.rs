//! Listeners serving Firecracker's Uffd memory backend.

use serde::{Deserialize, Serialize};

use super::vms::MemorySource;

/// `POST /v1/firecracker/listeners`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateListener {
    /// Path of the Unix socket to listen on (Firecracker's
    /// `mem_backend.backend_path`); must not exist yet.
    pub socket: String,
    /// The memory snapshot file served to every client.
    pub memory_source: MemorySource,
    /// Fault-around block in KiB (0 = one page per fault); server default
    /// if absent.
    #[serde(default)]
    pub fault_around_kib: Option<u64>,
    /// Largest readahead window in KiB (0 = off); server default if absent.
    #[serde(default)]
    pub readahead_kib: Option<u64>,
    /// Record the first client's working set and prefetch it for later
    /// clients.
    #[serde(default)]
    pub working_set: bool,
}

/// A listener as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ListenerInfo {
    /// `fc-N`.
    pub id: String,
    pub socket: String,
    pub memory_source: MemorySource,
    pub fault_around_kib: u64,
    pub readahead_kib: u64,
    pub working_set: bool,
    /// Pages of the recorded working set (0 until recorded).
    pub recorded_pages: u64,
    /// Handshakes accepted and refused.
    pub accepted: u64,
    pub refused: u64,
    /// Why the last handshake was refused.
    pub last_refusal: Option<String>,
    /// Firecracker VMs connected now.
    pub vms: Vec<String>,
}

/// `GET /v1/firecracker/listeners`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ListenerList {
    pub listeners: Vec<ListenerInfo>,
}

/// `DELETE /v1/firecracker/listeners/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ListenerDeleted {
    pub id: String,
    pub deleted: bool,
}
