//! What goes wrong copying a forked parent's pages into its layer (see
//! `layer.rs`): the server's own failure (500), or the parent's VMM gone
//! during the copy (502).

use shared::VmId;

use crate::memory::MemoryError;
use crate::pages::process::ProcessReadError;

/// Why a layer could not be filled.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("cannot make a layer for the pages {vm} holds")]
    Create {
        vm: VmId,
        #[source]
        source: MemoryError,
    },
    #[error("cannot write pages {first}..{end} into {vm}'s layer")]
    Write {
        vm: VmId,
        first: u64,
        end: u64,
        #[source]
        source: MemoryError,
    },
    #[error("pages {vm} wrote before it forked were lost before they reached its layer: {why}")]
    Lost { vm: VmId, why: String },
    #[error("cannot copy pages {vm} holds out of its VMM into its layer (the VMM and its anchor are gone?)")]
    Read {
        vm: VmId,
        #[source]
        source: ProcessReadError,
    },
}
