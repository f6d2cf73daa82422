//! vCPU state capture and restore as raw KVM structures
//! ([`shared::VcpuState`]), and the device state blob.
//!
//! The bytes are the kernel's own structs, so a state captured by one VMM
//! restores in another VMM of the same build on the same host.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_sregs, kvm_xcrs, kvm_xsave};
use kvm_ioctls::VcpuFd;
use shared::VcpuState;

/// Errors of capturing or restoring vCPU state.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot get vCPU {what}")]
    Get {
        what: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("cannot set vCPU {what}")]
    Set {
        what: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("saved vCPU {what} has {got} bytes, this VMM expects {want}; was it captured by another build?")]
    Size {
        what: &'static str,
        got: usize,
        want: usize,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, StateError>;

/// KVM structs that are plain bytes.
///
/// # Safety
/// Implementors are `repr(C)`, have no implicit padding (every byte is a
/// field), and every bit pattern is a valid value.
unsafe trait RawKvm: Copy + Default {}

// SAFETY: u64 fields only.
unsafe impl RawKvm for kvm_regs {}
// SAFETY: integer fields and segments whose padding is an explicit field.
unsafe impl RawKvm for kvm_sregs {}
// SAFETY: integer arrays and explicit pad fields.
unsafe impl RawKvm for kvm_fpu {}
// SAFETY: integer fields and an explicit padding array.
unsafe impl RawKvm for kvm_xcrs {}

// The sizes of the kernel ABI; a mismatch means implicit padding or a
// changed binding.
const _: () = assert!(std::mem::size_of::<kvm_regs>() == 144);
const _: () = assert!(std::mem::size_of::<kvm_sregs>() == 312);
const _: () = assert!(std::mem::size_of::<kvm_fpu>() == 416);
const _: () = assert!(std::mem::size_of::<kvm_xsave>() == 4096);
const _: () = assert!(std::mem::size_of::<kvm_xcrs>() == 392);

fn to_bytes<T: RawKvm>(v: &T) -> Vec<u8> {
    // SAFETY: `T: RawKvm` has no padding, so all size_of::<T>() bytes behind
    // the reference are initialized; the slice lives only for this copy.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
        .to_vec()
}

fn xsave_to_bytes(x: &kvm_xsave) -> Vec<u8> {
    x.region.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn xsave_from_bytes(b: &[u8]) -> Result<kvm_xsave> {
    let want = std::mem::size_of::<kvm_xsave>();
    if b.len() != want {
        return Err(StateError::Size {
            what: "xsave",
            got: b.len(),
            want,
        });
    }
    let mut x = kvm_xsave {
        region: [0; 1024],
        extra: Default::default(),
    };
    for (w, c) in x.region.iter_mut().zip(b.chunks_exact(4)) {
        *w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Ok(x)
}

fn from_bytes<T: RawKvm>(what: &'static str, b: &[u8]) -> Result<T> {
    let want = std::mem::size_of::<T>();
    if b.len() != want {
        return Err(StateError::Size {
            what,
            got: b.len(),
            want,
        });
    }
    let mut v = T::default();
    // SAFETY: `b` holds exactly size_of::<T>() bytes and any bit pattern is
    // a valid `T` (RawKvm); `v` is a distinct local.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), (&mut v as *mut T).cast::<u8>(), want) };
    Ok(v)
}

/// Capture a (stopped, I/O-complete) vCPU's state.
pub fn capture(vcpu: &VcpuFd) -> Result<VcpuState> {
    let get = |what| move |source| StateError::Get { what, source };
    Ok(VcpuState {
        regs: to_bytes(&vcpu.get_regs().map_err(get("regs"))?),
        sregs: to_bytes(&vcpu.get_sregs().map_err(get("sregs"))?),
        fpu: to_bytes(&vcpu.get_fpu().map_err(get("fpu"))?),
        xsave: xsave_to_bytes(&vcpu.get_xsave().map_err(get("xsave"))?),
        xcrs: to_bytes(&vcpu.get_xcrs().map_err(get("xcrs"))?),
        msrs: Vec::new(),
    })
}

/// Restore a vCPU's state captured by [`capture`].
pub fn restore(vcpu: &VcpuFd, s: &VcpuState) -> Result<()> {
    let set = |what| move |source| StateError::Set { what, source };
    let sregs: kvm_sregs = from_bytes("sregs", &s.sregs)?;
    vcpu.set_sregs(&sregs).map_err(set("sregs"))?;
    if !s.xcrs.is_empty() {
        vcpu.set_xcrs(&from_bytes::<kvm_xcrs>("xcrs", &s.xcrs)?)
            .map_err(set("xcrs"))?;
    }
    if !s.xsave.is_empty() {
        let xsave = xsave_from_bytes(&s.xsave)?;
        // SAFETY: KVM_CAP_XSAVE2 is never enabled, so KVM_SET_XSAVE reads
        // exactly the 4096-byte legacy `kvm_xsave`, which `xsave` is.
        unsafe { vcpu.set_xsave(&xsave) }.map_err(set("xsave"))?;
    }
    let fpu = from_bytes::<kvm_fpu>("fpu", &s.fpu)?;
    if s.xsave.is_empty() {
        // Otherwise the xsave area's legacy region held the x87 and SSE
        // state that KVM_SET_FPU would set again (an ioctl of ~0.007 ms on
        // the start's path).
        vcpu.set_fpu(&fpu).map_err(set("fpu"))?;
    }
    vcpu.set_regs(&from_bytes::<kvm_regs>("regs", &s.regs)?)
        .map_err(set("regs"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_bytes_round_trip_and_reject_wrong_sizes() {
        let regs = kvm_regs {
            rip: 0x1234,
            rax: 7,
            rflags: 2,
            ..Default::default()
        };
        let b = to_bytes(&regs);
        assert_eq!(b.len(), 144);
        assert_eq!(from_bytes::<kvm_regs>("regs", &b).unwrap(), regs);
        assert!(matches!(
            from_bytes::<kvm_regs>("regs", &b[1..]),
            Err(StateError::Size { .. })
        ));
    }
}
