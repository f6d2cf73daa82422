//! What goes wrong between the core and a VM's VMM process, and the HTTP
//! status of each: the VMM's own failure is 502, a VMM too slow to answer
//! 504, one with too many requests waiting 503.

use std::path::PathBuf;
use std::time::Duration;

use shared::VmId;

/// A failure of a VM's VMM link.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("cannot create the log of {vm} in {}", path.display())]
    CreateLog {
        vm: VmId,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the vmm binary {}; pass --vmm-bin", bin.display())]
    SpawnVmm {
        bin: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{vm}'s vmm failed: {source}")]
    Vmm {
        vm: VmId,
        source: proto::vmm::RequestError,
    },
    #[error("{vm}'s vmm went away")]
    VmmGone { vm: VmId },
    #[error("{vm}'s vmm exited: {reason}")]
    VmmExited { vm: VmId, reason: String },
    #[error("{vm} has {queued} requests waiting for its vmm, which is not answering; retry later")]
    QueueFull { vm: VmId, queued: usize },
    #[error("{vm}'s vmm answered {request} with {reply}")]
    UnexpectedReply {
        vm: VmId,
        request: &'static str,
        reply: String,
    },
    #[error("{vm}'s vmm did not answer within {after:?}")]
    VmmTimeout { vm: VmId, after: Duration },
    #[error("{vm}'s vmm named an anchor the server cannot take: {why}")]
    Anchor { vm: VmId, why: String },
}

impl LinkError {
    /// The HTTP status of this error.
    pub fn status(&self) -> u16 {
        match self {
            LinkError::CreateLog { .. } | LinkError::SpawnVmm { .. } => 500,
            // The VMM checked the op against the VM (sectors past the
            // disk's end, say): the request is at fault, not the VMM.
            LinkError::Vmm {
                source: proto::vmm::RequestError::InvalidOp(_),
                ..
            } => 400,
            LinkError::Vmm { .. }
            | LinkError::VmmGone { .. }
            | LinkError::VmmExited { .. }
            | LinkError::UnexpectedReply { .. }
            | LinkError::Anchor { .. } => 502,
            LinkError::QueueFull { .. } => 503,
            LinkError::VmmTimeout { .. } => 504,
        }
    }
}
