//! Why something a server before this one held cannot be taken back: a
//! source, a base, a VM or a Firecracker listener or client. Adoption
//! answers no request, so these map to no HTTP status: a VM's reason is
//! logged and listed in `GET /v1/health` `lost_vms`, with its sources
//! (`shared::error_chain`).

use std::io;

use crate::memory::MemoryError;
use crate::pages::mirror::MirrorError;

#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("the fd store did not hand back {0}")]
    NotHandedBack(String),
    #[error("cannot map {0}")]
    MapMemory(String, #[source] MemoryError),
    #[error("its table's under {name} has {have} pages, not {want}")]
    UnderSize { name: String, have: u64, want: u64 },
    #[error("cannot read the mirror {0} of its table")]
    ReadMirror(String, #[source] MirrorError),
    #[error("cannot read the compressed image {0}")]
    OpenZstd(String, #[source] zst::Error),
    #[error(
        "pages of vm-{0} are in the swap store, and this server has none (it runs with \
         --reclaim off, or cannot open it)"
    )]
    NoSwapStore(u32),
    #[error("it reads the remote snapshot {0}, and this server has no --remote")]
    NoRemote(String),
    /// A source it names was lost: recorded so by the server before, or
    /// not taken back by this one (the reason, as text, shared by every
    /// VM that names it).
    #[error("{0}")]
    SourceLost(String),
    #[error(
        "its table names source {0}, which the journal lacks: an operation on it was cut \
         short by the crash"
    )]
    UnknownSource(u32),
    #[error("its base base-{0} was not handed back")]
    NoBase(u32),
    #[error("the source it serves ({0}) is not in the journal")]
    ListenerSourceMissing(u32),
    #[error("cannot take its listening socket back")]
    ListenerSocket(#[source] io::Error),
    #[error("cannot start its accept thread")]
    StartAcceptThread(#[source] io::Error),
    #[error("cannot make its uffd non-blocking")]
    UffdNonBlocking(#[source] nix::Error),
    #[error("cannot poll its uffd")]
    PollUffd(#[source] io::Error),
    #[error("cannot watch its connection")]
    WatchConnection(#[source] io::Error),
}

pub type Result<T> = std::result::Result<T, AdoptError>;
