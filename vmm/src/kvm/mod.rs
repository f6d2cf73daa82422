//! The KVM side of the VMM: the VM and its memory slots ([`vm`]), vCPU
//! threads ([`vcpu`]) and the shared pause/command state ([`control`]).

pub mod control;
pub mod vcpu;
pub mod vm;

pub use control::Job;
pub use vm::{Machine, MachineConfig, VcpuEvent};
