//! The KVM side of the VMM: the VM and its memory slots ([`vm`]), vCPU
//! threads ([`vcpu`]), what they report ([`event`]) and the shared
//! pause/command state ([`control`]). `vm` uses `vcpu`, never the reverse.

pub mod control;
pub mod event;
pub mod vcpu;
pub mod vm;

pub use control::Job;
pub use event::VcpuEvent;
pub use vm::{FirstVcpu, Machine, MachineConfig, Prewarmed};
