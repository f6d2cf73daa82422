//! What vCPU threads report to the owner of the VM.
//!
//! Its own file because both the VM ([`super::vm`]), which hands a sink to
//! every vCPU, and the vCPU threads ([`super::vcpu`]), which call it, need
//! these types; neither module imports the other for them.

use std::sync::Arc;

/// What vCPU threads report to the VMM's owner.
#[derive(Debug, Clone)]
pub enum VcpuEvent {
    /// vCPU 0 reached its first command wait.
    Ready,
    /// A vCPU failed; the VM cannot go on.
    Fatal(String),
}

/// Receiver of [`VcpuEvent`]s.
pub type EventSink = Arc<dyn Fn(VcpuEvent) + Send + Sync>;
