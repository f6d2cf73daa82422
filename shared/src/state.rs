//! vCPU and device state captured from a paused VMM.
//!
//! The server never interprets these bytes: it carries them from a parent's
//! VMM to a child's. The VMM encodes the raw KVM structures.

use serde::{Deserialize, Serialize};

/// One vCPU's architectural state as raw KVM structures.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcpuState {
    /// `struct kvm_regs` bytes.
    pub regs: Vec<u8>,
    /// `struct kvm_sregs` bytes.
    pub sregs: Vec<u8>,
    /// `struct kvm_fpu` bytes.
    pub fpu: Vec<u8>,
    /// `struct kvm_xsave` bytes (may be empty).
    pub xsave: Vec<u8>,
    /// `struct kvm_xcrs` bytes (may be empty).
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
    pub devices: Vec<u8>,
}
