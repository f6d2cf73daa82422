//! VM snapshots: memory, vCPU/device state and (if attached) the volume,
//! taken from a running VM; restore, rollback in place and clone(n).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// How much of guest memory a snapshot writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SnapshotMode {
    /// Every page of guest RAM (zero pages stay holes).
    #[default]
    Full,
    /// Pages that differ from the VM's base image (the snapshot it was
    /// restored from), written over a reflink of that image.
    Incremental,
    /// Pages written since the VM's last snapshot, written over a reflink
    /// of that snapshot's image.
    Dirty,
}

impl SnapshotMode {
    /// The name as the API shows it.
    pub fn name(self) -> &'static str {
        match self {
            SnapshotMode::Full => "full",
            SnapshotMode::Incremental => "incremental",
            SnapshotMode::Dirty => "dirty",
        }
    }
}

impl std::fmt::Display for SnapshotMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `POST /v1/vms/{id}/snapshots` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    /// Snapshot name: letters, digits, `-`, `_`, `.`; not starting with `.`.
    pub name: String,
    /// `full` if absent. `dirty` and `incremental` degrade to a larger
    /// correct mode when their base is missing; the answer says so.
    #[serde(default)]
    pub mode: SnapshotMode,
    /// Also write `memory.zst`, the image compressed in independent frames
    /// (after the guest resumed, on worker threads). Restores from the
    /// snapshot then serve it; `memory.img` stays as the base of later
    /// incremental and dirty snapshots.
    #[serde(default)]
    pub compress: bool,
}

/// `POST /v1/vms/{id}/snapshots` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotCreated {
    pub name: String,
    /// The VM it was taken from.
    pub vm: String,
    pub mode_requested: SnapshotMode,
    pub mode_used: SnapshotMode,
    /// Why `mode_used` differs from `mode_requested`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_reason: Option<String>,
    /// Guest pages written into the image.
    pub pages_written: u64,
    pub bytes_written: u64,
    /// How long the guest was paused.
    pub pause_us: u64,
    /// Before the pause, while the guest still ran: `plan` (the image
    /// made, a reflink of the parent's, and the empty state file),
    /// `writer` (its threads started), `armed_ahead` (write-protecting
    /// the pages written since the last snapshot, or all of memory for a
    /// first one: the UFFDIO_WRITEPROTECT that opens the copy-on-write
    /// window).
    #[serde(default)]
    pub before_pause_us: BTreeMap<String, u64>,
    /// Where the pause went: `capture` (until the vCPUs are stopped, and
    /// `write_protect` after it: re-protecting the pages the guest wrote
    /// after `armed_ahead`), `arm` (the rest of opening the window),
    /// `volume`, `resume` (sent behind the capture of the vCPUs' state:
    /// both answers).
    #[serde(default)]
    pub phases_us: BTreeMap<String, u64>,
    /// Where the rest of the request went, after the guest resumed:
    /// `save` (pages into the image, until the last write returned),
    /// `handoff` (from there until the commit's thread starts),
    /// `sync_and_checksum` (the image's fsync, which the writer starts
    /// after its last write, and side by side the checksums and the
    /// state file), `compress` (with
    /// `compress`), `commit` (state file, fsyncs and the rename that makes
    /// the snapshot exist).
    #[serde(default)]
    pub after_pause_us: BTreeMap<String, u64>,
    /// The whole request, until the snapshot was committed.
    pub duration_us: u64,
    /// Extents of the image file (FIEMAP).
    pub image_extents: u64,
    /// Pages the guest wrote after the pause before the writer reached
    /// them: their pre-write bytes were saved by the fault handler.
    #[serde(default)]
    pub pages_saved_ahead: u64,
    /// `memory.zst`'s size, with `compress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compressed_bytes: Option<u64>,
}

/// Pages of a snapshot's image by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotPages {
    /// Pages holding data in the image.
    pub data: u64,
    /// Pages that are holes (read as zero).
    pub zero_hole: u64,
}

/// A snapshot as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotInfo {
    pub name: String,
    /// The VM it was taken from.
    pub vm: String,
    pub mode: SnapshotMode,
    /// The snapshot whose image this one was reflinked from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    pub memory_mib: u64,
    pub vcpus: u8,
    pub page_size: u64,
    pub pages: SnapshotPages,
    /// Bytes the snapshot's files occupy on disk.
    pub bytes_on_disk: u64,
    /// Bytes of the image no other file shares (FIEMAP).
    pub exclusive_bytes: u64,
    /// Extents of the image file.
    pub image_extents: u64,
    /// The volume snapshot taken with it, if a volume was attached.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_snapshot: Option<String>,
    /// Seconds since the Unix epoch.
    pub created: u64,
    /// VMs reading pages from this snapshot's image now.
    #[serde(default)]
    pub readers: Vec<String>,
    /// Bytes of `memory.zst`, if the snapshot has one (restores serve it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compressed_bytes: Option<u64>,
    /// Pages of the working set recorded on its first restore, in the
    /// order the guest first touched them (0: none recorded yet).
    /// Restores prefetch them, and a push carries them.
    #[serde(default)]
    pub working_set_pages: u64,
    /// Its last push to the object store since the server started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push: Option<crate::api::remote::PushStatus>,
}

/// `GET /v1/snapshots`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotList {
    pub snapshots: Vec<SnapshotInfo>,
    /// Snapshot directories set aside at start-up because they did not
    /// verify (never served).
    #[serde(default)]
    pub quarantined: Vec<String>,
}

/// `DELETE /v1/snapshots/{name}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotDeleted {
    pub name: String,
    pub deleted: bool,
}

/// `POST /v1/vms/{id}/rollback` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RollbackVm {
    /// A snapshot of a VM of this one's shape: as many vCPUs, the same
    /// memory size, and a volume of the same size exactly when this VM
    /// has one (hugepage or 4 KiB memory may differ). Another is refused
    /// with 409 and the VM runs on untouched.
    pub snapshot: String,
}

/// `POST /v1/vms/{id}/rollback` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VmRolledBack {
    pub vm: String,
    pub snapshot: String,
    /// Pages handed to VMs that still read them from this one.
    pub pages_handed_over: u64,
    /// Pages reset by unmapping them in the pause and punching them after
    /// the resume (or at their first access); 0 where the pause punched
    /// them itself (hugetlb memory, a kernel without MINOR on shmem).
    #[serde(default)]
    pub pages_discarded: u64,
    /// How long the guest was paused.
    pub pause_us: u64,
    /// Where the pause went (pause, handover, drop, memory, volume,
    /// restore, resume).
    #[serde(default)]
    pub phases_us: BTreeMap<String, u64>,
}

/// Most clones one request may create.
pub const MAX_CLONE_COUNT: u32 = 256;

/// `POST /v1/vms/{id}/clone` body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CloneVm {
    /// Clones to create, 1 to [`MAX_CLONE_COUNT`].
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 256))]
    pub count: u32,
    /// Clones being created at once at most (default 8).
    #[serde(default = "default_concurrency")]
    pub concurrency: u32,
}

fn default_concurrency() -> u32 {
    8
}

/// `POST /v1/vms/{id}/clone` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClonedVms {
    /// The snapshot the clones start from (taken for this request).
    pub snapshot: String,
    pub clones: Vec<String>,
    pub duration_us: u64,
    /// Time per phase (snapshot, creates).
    #[serde(default)]
    pub phases_us: BTreeMap<String, u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_snapshot_defaults_to_full_and_refuses_unknown_modes() {
        let c: CreateSnapshot = serde_json::from_str(r#"{"name":"a"}"#).unwrap();
        assert_eq!(c.mode, SnapshotMode::Full);
        let c: CreateSnapshot = serde_json::from_str(r#"{"name":"a","mode":"dirty"}"#).unwrap();
        assert_eq!(c.mode, SnapshotMode::Dirty);
        let e = serde_json::from_str::<CreateSnapshot>(r#"{"name":"a","mode":"soft"}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown variant"), "{e}");
    }
}
