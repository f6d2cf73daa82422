//! What a rollback refuses before it touches the VM: a snapshot that does
//! not fit it (see `fit.rs`), a client's mistake, 409.

use shared::VmId;

/// Why a snapshot does not fit a VM; each says what to do instead.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    #[error(
        "cannot roll {vm} back to snapshot {snapshot}: {reason}; \
         roll back to a snapshot taken on this host"
    )]
    Origin {
        vm: VmId,
        snapshot: String,
        reason: String,
    },
    #[error(
        "cannot roll {vm} back to snapshot {snapshot}: it has {snapshot_vcpus} vCPU{}, \
         {vm} has {vm_vcpus}; restore it as a new VM instead",
        if *snapshot_vcpus == 1 { "" } else { "s" }
    )]
    Vcpus {
        vm: VmId,
        snapshot: String,
        snapshot_vcpus: u8,
        vm_vcpus: u8,
    },
    #[error(
        "cannot roll {vm} back to snapshot {snapshot}: it has {} MiB of memory, \
         {vm} has {} MiB; restore it as a new VM instead",
        snapshot_bytes >> 20,
        vm_bytes >> 20
    )]
    MemorySize {
        vm: VmId,
        snapshot: String,
        snapshot_bytes: u64,
        vm_bytes: u64,
    },
    #[error(
        "cannot roll {vm} back to snapshot {snapshot}: it has a volume and {vm} has none; \
         restore it as a new VM instead"
    )]
    VmHasNoVolume { vm: VmId, snapshot: String },
    #[error(
        "cannot roll {vm} back to snapshot {snapshot}: it has no volume and {vm} has \
         volume {volume}; roll back to a snapshot taken with a volume, or restore it as \
         a new VM"
    )]
    SnapshotHasNoVolume {
        vm: VmId,
        snapshot: String,
        volume: String,
    },
    #[error(
        "cannot roll {vm} back to snapshot {snapshot}: its volume snapshot {volume_snapshot} \
         is gone; roll back to another snapshot"
    )]
    VolumeSnapshotGone {
        vm: VmId,
        snapshot: String,
        volume_snapshot: String,
    },
    #[error(
        "cannot roll {vm} back to snapshot {snapshot}: its volume has {snapshot_bytes} bytes, \
         {vm}'s volume {volume} has {vm_bytes}; restore it as a new VM instead"
    )]
    VolumeSize {
        vm: VmId,
        snapshot: String,
        volume: String,
        snapshot_bytes: u64,
        vm_bytes: u64,
    },
}
