//! vCPU and device state captured from a paused VMM.
//!
//! The server never interprets these bytes: it carries them from a parent's
//! VMM to a child's. The VMM encodes the raw KVM structures.
//!
//! The byte fields go through `serde_bytes`: each start and capture moves
//! ~21 KiB of them between server and VMM, and serde's default encodes a
//! `Vec<u8>` one element at a time. The encoding is the same either way
//! (postcard: a length and the raw bytes; JSON, as in a snapshot's
//! `state.json`: an array of numbers), which a test below holds.

use serde::{Deserialize, Serialize};

/// One vCPU's architectural state as raw KVM structures.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuState {
    /// `struct kvm_regs` bytes.
    #[serde(with = "serde_bytes")]
    pub regs: Vec<u8>,
    /// `struct kvm_sregs` bytes.
    #[serde(with = "serde_bytes")]
    pub sregs: Vec<u8>,
    /// `struct kvm_fpu` bytes.
    #[serde(with = "serde_bytes")]
    pub fpu: Vec<u8>,
    /// `struct kvm_xsave` bytes (may be empty).
    #[serde(with = "serde_bytes")]
    pub xsave: Vec<u8>,
    /// `struct kvm_xcrs` bytes (may be empty).
    #[serde(with = "serde_bytes")]
    pub xcrs: Vec<u8>,
    /// MSR index/value pairs.
    pub msrs: Vec<(u32, u64)>,
}

/// A whole VM's non-memory state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmState {
    /// One entry per vCPU, in vCPU index order.
    pub vcpus: Vec<VcpuState>,
    /// Device state, encoded by the VMM.
    #[serde(with = "serde_bytes")]
    pub devices: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same fields with serde's default encoding of `Vec<u8>`, as
    /// `state.json` files and VMMs wrote them before `serde_bytes`.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct PlainVcpu {
        regs: Vec<u8>,
        sregs: Vec<u8>,
        fpu: Vec<u8>,
        xsave: Vec<u8>,
        xcrs: Vec<u8>,
        msrs: Vec<(u32, u64)>,
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct PlainVm {
        vcpus: Vec<PlainVcpu>,
        devices: Vec<u8>,
    }

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| u8::try_from(i % 251).unwrap_or(0).wrapping_add(seed))
            .collect()
    }

    fn states() -> (VmState, PlainVm) {
        let (regs, sregs, fpu, xsave) =
            (bytes(144, 1), bytes(312, 2), bytes(416, 3), bytes(4096, 4));
        let (xcrs, devices) = (bytes(392, 5), bytes(16388, 6));
        let msrs = vec![(0x10, 7), (0xc000_0080, 0x500)];
        let ours = VmState {
            vcpus: vec![VcpuState {
                regs: regs.clone(),
                sregs: sregs.clone(),
                fpu: fpu.clone(),
                xsave: xsave.clone(),
                xcrs: xcrs.clone(),
                msrs: msrs.clone(),
            }],
            devices: devices.clone(),
        };
        let plain = PlainVm {
            vcpus: vec![PlainVcpu {
                regs,
                sregs,
                fpu,
                xsave,
                xcrs,
                msrs,
            }],
            devices,
        };
        (ours, plain)
    }

    #[test]
    fn byte_fields_encode_as_before_in_postcard_and_json() {
        let (ours, plain) = states();
        let wire = postcard::to_stdvec(&ours).unwrap();
        assert_eq!(wire, postcard::to_stdvec(&plain).unwrap());
        assert_eq!(postcard::from_bytes::<VmState>(&wire).unwrap(), ours);
        let json = serde_json::to_string(&ours).unwrap();
        let old_json = serde_json::to_string(&plain).unwrap();
        assert_eq!(json, old_json);
        assert!(json.contains("\"devices\":[6,"), "{}", &json[..80]);
        assert_eq!(serde_json::from_str::<VmState>(&old_json).unwrap(), ours);
    }
}
