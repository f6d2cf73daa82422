//! Whether a snapshot fits a VM for a rollback in place, checked before the
//! pause: a snapshot that does not fit is refused (409) and the VM runs on
//! untouched.
//!
//! A rollback keeps the VM's VMM, memfd and volume file, so the snapshot
//! must have been taken of a VM of the same shape: as many vCPUs (the VMM
//! makes them at launch), the same memory size, a volume exactly when the
//! VM has one and of the same size (the VMM's disk keeps the size it was
//! launched with), and an origin this host can load. What backs memory
//! (2 MiB hugetlb or 4 KiB pages) need not match: the image holds 4 KiB
//! pages either way, and the VM keeps its own backing.

use proto::snapshot::StateFile;
use shared::VmId;
use volume::{VolumeEngine, VolumeError};

use super::error::FitError;
use crate::core::error::{Error, Result};
use crate::core::vm::Vm;

/// What of a VM and of a snapshot must agree for a rollback in place.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Shape {
    vcpus: u8,
    memory_bytes: u64,
    /// Its volume (the VM's: the volume; the snapshot's: its volume
    /// snapshot), by name.
    volume: Option<String>,
}

/// Check that snapshot `name` (its `state`) fits `v` for a rollback in
/// place; reads the volumes' sizes from `volumes` when both have one.
pub(crate) fn check(
    volumes: Option<&VolumeEngine>,
    v: &Vm,
    name: &str,
    state: &StateFile,
) -> Result<()> {
    let vm = v.id;
    if let Some(reason) = crate::snapshot::origin::mismatch(state) {
        return Err(FitError::Origin {
            vm,
            snapshot: name.to_owned(),
            reason,
        }
        .into());
    }
    let have = Shape {
        vcpus: v.vcpus,
        memory_bytes: v.memory.size(),
        volume: v.volume.clone(),
    };
    let want = Shape {
        vcpus: state.vcpus(),
        memory_bytes: state.memory_bytes,
        volume: state.volume_snapshot.clone(),
    };
    compare(vm, name, &have, &want)?;
    if let (Some(vol), Some(vs)) = (&have.volume, &want.volume) {
        let engine = volumes.ok_or(Error::NoVolumes)?;
        let snapshot_bytes = match engine.snapshot_info(vs) {
            Ok(info) => info.size_bytes,
            Err(VolumeError::SnapshotNotFound(_)) => {
                return Err(FitError::VolumeSnapshotGone {
                    vm,
                    snapshot: name.to_owned(),
                    volume_snapshot: vs.clone(),
                }
                .into())
            }
            Err(e) => return Err(e.into()),
        };
        let vm_bytes = engine.show(vol)?.size_bytes;
        volume_sizes(vm, name, vol, vm_bytes, snapshot_bytes)?;
    }
    Ok(())
}

/// Compare the VM's shape (`have`) with the snapshot's (`want`): vCPUs,
/// memory size, a volume on both sides or on neither.
fn compare(
    vm: VmId,
    snapshot: &str,
    have: &Shape,
    want: &Shape,
) -> std::result::Result<(), FitError> {
    let snapshot = snapshot.to_owned();
    if want.vcpus != have.vcpus {
        return Err(FitError::Vcpus {
            vm,
            snapshot,
            snapshot_vcpus: want.vcpus,
            vm_vcpus: have.vcpus,
        });
    }
    if want.memory_bytes != have.memory_bytes {
        return Err(FitError::MemorySize {
            vm,
            snapshot,
            snapshot_bytes: want.memory_bytes,
            vm_bytes: have.memory_bytes,
        });
    }
    match (&have.volume, &want.volume) {
        (None, Some(_)) => Err(FitError::VmHasNoVolume { vm, snapshot }),
        (Some(volume), None) => Err(FitError::SnapshotHasNoVolume {
            vm,
            snapshot,
            volume: volume.clone(),
        }),
        _ => Ok(()),
    }
}

/// The VM's volume `volume` of `vm_bytes` and the snapshot's volume of
/// `snapshot_bytes` must be of one size.
fn volume_sizes(
    vm: VmId,
    snapshot: &str,
    volume: &str,
    vm_bytes: u64,
    snapshot_bytes: u64,
) -> std::result::Result<(), FitError> {
    if vm_bytes == snapshot_bytes {
        return Ok(());
    }
    Err(FitError::VolumeSize {
        vm,
        snapshot: snapshot.to_owned(),
        volume: volume.to_owned(),
        snapshot_bytes,
        vm_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(vcpus: u8, mib: u64, volume: Option<&str>) -> Shape {
        Shape {
            vcpus,
            memory_bytes: mib << 20,
            volume: volume.map(str::to_owned),
        }
    }

    #[test]
    fn a_snapshot_of_the_same_shape_fits() {
        let vm = VmId(3);
        let have = shape(2, 64, Some("disk"));
        assert!(compare(vm, "s", &have, &shape(2, 64, Some("s.disk"))).is_ok());
        assert!(compare(vm, "s", &shape(1, 64, None), &shape(1, 64, None)).is_ok());
        assert!(volume_sizes(vm, "s", "disk", 1 << 20, 1 << 20).is_ok());
    }

    #[test]
    fn each_mismatch_is_refused_with_what_differs_and_what_to_do() {
        let vm = VmId(3);
        let have = shape(1, 64, None);
        let refused = |want: Shape| {
            compare(vm, "s", &have, &want)
                .expect_err("a snapshot of another shape fits")
                .to_string()
        };
        assert_eq!(
            refused(shape(31, 64, None)),
            "cannot roll vm-3 back to snapshot s: it has 31 vCPUs, vm-3 has 1; \
             restore it as a new VM instead"
        );
        assert_eq!(
            refused(shape(1, 128, None)),
            "cannot roll vm-3 back to snapshot s: it has 128 MiB of memory, vm-3 has 64 MiB; \
             restore it as a new VM instead"
        );
        assert!(refused(shape(1, 64, Some("s.disk"))).contains("it has a volume and vm-3 has none"));
        let e = compare(vm, "s", &shape(2, 64, None), &have).unwrap_err();
        assert!(e.to_string().contains("it has 1 vCPU, vm-3 has 2;"), "{e}");
        let e = compare(vm, "s", &shape(1, 64, Some("disk")), &have).unwrap_err();
        assert!(
            e.to_string()
                .contains("it has no volume and vm-3 has volume disk"),
            "{e}"
        );
        let e = volume_sizes(vm, "s", "disk", 2 << 20, 1 << 20).unwrap_err();
        assert!(
            e.to_string()
                .contains("its volume has 1048576 bytes, vm-3's volume disk has 2097152"),
            "{e}"
        );
    }
}
