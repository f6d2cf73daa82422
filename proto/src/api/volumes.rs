//! Disk volumes and their snapshots (reflink copies on XFS or btrfs).

use serde::{Deserialize, Serialize};

/// `POST /v1/volumes`: exactly one of `size_mib` (a new empty volume) and
/// `from_snapshot` (a clone).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateVolume {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
}

/// `POST /v1/volumes/{name}/grow`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GrowVolume {
    pub size_mib: u64,
}

/// `POST /v1/volumes/{name}/snapshots` and
/// `POST /v1/volume-snapshots/{name}/snapshots`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateVolumeSnapshot {
    pub name: String,
}

/// `POST /v1/volumes/{name}/rollback`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RollbackVolume {
    pub snapshot: String,
    /// Delete snapshots newer than the target (otherwise kept).
    #[serde(default)]
    pub delete_newer: bool,
}

/// Space use of one file, from its FIEMAP extents.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Usage {
    /// Bytes in allocated extents (written or preallocated).
    pub allocated_bytes: u64,
    /// Allocated bytes whose blocks other files share.
    pub shared_bytes: u64,
    /// Allocated bytes only this file references.
    pub exclusive_bytes: u64,
}

/// A volume as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VolumeInfo {
    pub name: String,
    /// Logical size.
    pub size_bytes: u64,
    #[serde(flatten)]
    pub usage: Usage,
    /// How many snapshots the volume has.
    pub snapshots: usize,
}

/// A volume snapshot as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VolumeSnapshotInfo {
    pub name: String,
    /// The volume it was taken of (the ultimate ancestor, for a snapshot of
    /// a snapshot).
    pub volume: String,
    /// Whether that volume still exists.
    pub volume_exists: bool,
    /// Creation sequence number (0 for snapshots not made by the engine).
    pub seq: u64,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_unix_ms: i64,
    pub size_bytes: u64,
    #[serde(flatten)]
    pub usage: Usage,
}

/// The answer to a volume rollback.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VolumeRollback {
    pub volume: String,
    pub snapshot: String,
    /// Snapshots newer than the target that were deleted (empty unless
    /// asked for).
    pub deleted_snapshots: Vec<String>,
}

/// The answer to deleting a volume or a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Deleted {
    /// The name deleted.
    pub deleted: String,
}

/// `POST /v1/volumes/import`: make a volume from a qcow2 file the server
/// can read, with one volume snapshot per internal snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ImportVolume {
    /// Name of the new volume.
    pub name: String,
    /// Absolute path of the qcow2 file on the server's host.
    pub path: String,
    /// Prepended to each internal snapshot's name to name its volume
    /// snapshot (names share one namespace).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub snapshot_prefix: String,
}

/// The answer to an import.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImportedVolume {
    pub volume: VolumeInfo,
    /// The volume snapshots made, oldest first.
    pub snapshots: Vec<String>,
}

/// `POST /v1/volumes/{name}/export`: write the volume and its snapshots
/// as a new qcow2 file on the server's host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExportVolume {
    /// Absolute path of the new file: it must not exist, and its name
    /// ends in `.qcow2`.
    pub path: String,
}

/// The answer to an export.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExportedVolume {
    pub volume: String,
    pub path: String,
    /// The internal snapshots written, oldest first.
    pub snapshots: Vec<String>,
    /// The file's size.
    pub size_bytes: u64,
}
