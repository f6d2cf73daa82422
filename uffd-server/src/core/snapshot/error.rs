//! What goes wrong arming write protection ahead of a pause (a fork's or a
//! snapshot's): the server's own failure, 500.

use shared::VmId;

/// A failure of write protection armed ahead of a pause.
#[derive(Debug, thiserror::Error)]
pub enum ArmError {
    #[error("{vm} has no userfaultfd")]
    NoUffd { vm: VmId },
    #[error("cannot write-protect {vm} pages {start}..{end}")]
    WriteProtect {
        vm: VmId,
        start: u64,
        end: u64,
        #[source]
        source: uffd_abi::Errno,
    },
    #[error("{vm}'s pages were not write-protected ahead of its pause")]
    NotArmed { vm: VmId },
}
