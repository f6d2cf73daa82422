//! What the journal records: one JSON object per line, each a change to
//! what the server holds. Replayed in order, the last record of each key
//! wins (see `journal::replay`).

use serde::{Deserialize, Serialize};

/// One line of the journal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rec", rename_all = "snake_case")]
pub enum Record {
    /// Source `id` of the arena is `source` (new, or changed in place: a
    /// VM's source frozen).
    Source { id: u32, source: SourceRec },
    /// Source `id` is gone.
    Released { id: u32 },
    /// The pages of `Vm(vm)` are in the memfd stored as `fd`.
    Memory { vm: u32, fd: String, huge: bool },
    /// A shared base.
    Base(BaseRec),
    /// Base `id` is gone.
    BaseGone { id: u32 },
    /// A VM, as it is now.
    Vm(VmRec),
    /// VM `id` is gone.
    VmGone { id: u32 },
    /// A Firecracker listener, as it is now.
    FcListener(FcListenerRec),
    /// Listener `id` is gone (deleted).
    FcListenerGone { id: u32 },
    /// A Firecracker client, as it is now.
    FcVm(FcVmRec),
    /// Firecracker client `id` is gone (it hung up or was deleted).
    FcVmGone { id: u32 },
    /// Source `id`, a layer, is still being filled from `fill`: the pages
    /// the tables name it for that its memfd lacks are still to copy.
    Filling { id: u32, fill: FillRec },
    /// Source `id`'s layer is whole.
    Filled { id: u32 },
}

/// Where a layer still being filled is filled from (see
/// `pages::source::FillOrigin`): the VM it is the pages of, and the
/// process (its VMM's anchor, or the VMM) by pid and start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FillRec {
    pub vm: u32,
    pub pid: u32,
    pub started: u64,
    pub vmm_base: u64,
}

/// An image's identity (see `images::Identity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityRec {
    pub dev: u64,
    pub ino: u64,
    pub len: u64,
    pub mtime_ns: i64,
}

/// How an image file is kept from changing (see `images::Pin`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PinRec {
    /// A private reflinked copy only the server reaches.
    Private,
    /// The client's file, as it was: length, mtime seconds and nanoseconds.
    Stamp { len: u64, sec: i64, nsec: i64 },
}

/// An image file a source reads (its fd is in the store).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileRec {
    pub path: String,
    pub fd: String,
    pub len: u64,
    pub pin: PinRec,
    pub identity: Option<IdentityRec>,
}

/// A page source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SourceRec {
    Vm {
        vm: u32,
    },
    Frozen {
        vm: u32,
        layer: bool,
        fd: String,
        huge: bool,
    },
    File {
        file: FileRec,
    },
    Image {
        snapshot: String,
        file: FileRec,
    },
    Zstd {
        file: FileRec,
        snapshot: Option<String>,
    },
    /// A snapshot in the object store: its manifest, which makes the
    /// image again (its chunks come from the cache or the store).
    Remote {
        manifest: Box<proto::manifest::Manifest>,
    },
    /// Pages of VM `vm` in the swap store, under `key`.
    Swap {
        vm: u32,
        key: u64,
    },
    /// A source a new server cannot open again; the VMs that read it are
    /// failed at adoption, with this reason.
    Lost {
        why: String,
    },
}

/// What a base is the memory of.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum BaseOrigin {
    Template {
        vm: u32,
    },
    Image {
        identity: IdentityRec,
    },
    /// A base of a remote snapshot: its content digest.
    Content {
        digest: String,
        memory_bytes: u64,
    },
}

/// A shared base.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BaseRec {
    pub id: u32,
    pub fd: String,
    pub huge: bool,
    pub origin: BaseOrigin,
    pub what: String,
}

/// A VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmRec {
    pub id: u32,
    pub vcpus: u8,
    /// Its memfd (its own guest RAM, or the memfd it had before it moved
    /// onto a base).
    pub memory: String,
    pub huge: bool,
    pub self_src: u32,
    /// The mirror of its table; empty when it has none or it is an
    /// overlay (`table_over`: a server that cannot read overlays then
    /// fails to adopt the VM rather than reading its table wrong).
    pub table: String,
    /// The mirror of its table as an overlay of one shared with others
    /// (see `pages::mirror`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table_over: Option<TableOver>,
    /// Its VMM's uffd, once the VMM sent it.
    pub uffd: Option<String>,
    pub vmm_base: u64,
    pub pid: Option<u32>,
    pub state: proto::api::RunState,
    pub failure: Option<String>,
    pub volume: Option<String>,
    pub owns_volume: bool,
    pub deleted: bool,
    /// The base its guest RAM maps and the source its table reads it by.
    pub on_base: Option<(u32, u32)>,
    /// The base its own memfd became (a paused template).
    pub frozen_for: Option<u32>,
    pub fault_around_pages: u64,
    pub readahead_pages: u64,
    /// The VM it was forked from.
    #[serde(default)]
    pub parent: Option<u32>,
    /// The snapshot of a rollback under way (paused; its memory may be
    /// the snapshot's in part): a server that takes it back finishes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback_to: Option<String>,
    /// How its memory may be given back (the default if absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reclaim: Option<proto::api::ReclaimPolicy>,
}

/// A table's mirror that is an overlay: its own entries where they differ
/// from the under's, which it shares with others.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableOver {
    /// The overlay's memfd in the store.
    pub table: String,
    /// The under's memfd in the store.
    pub under: String,
}

/// A Firecracker listener (its listening socket is in the store).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FcListenerRec {
    pub id: u32,
    /// The socket's path (kept bound: the store holds the socket).
    pub socket: String,
    /// The listening socket's fd in the store.
    pub fd: String,
    /// What it serves, as asked.
    pub memory_source: proto::api::MemorySource,
    /// The arena source it serves.
    pub source: u32,
    /// The guest memory size a handshake's regions may cover.
    pub source_len: u64,
    /// Runs of source pages holding data, as `(first, pages)`.
    pub data: Vec<(u64, u64)>,
    pub fault_around_pages: u64,
    pub readahead_pages: u64,
    pub working_set: bool,
    /// The working set its first client recorded, as runs of source pages
    /// `(first, pages)` in the order they were given.
    #[serde(default)]
    pub recorded: Option<Vec<(u64, u64)>>,
}

/// One region of a Firecracker client's guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionRec {
    pub base: u64,
    pub size: u64,
    pub offset: u64,
    pub page_size: u64,
}

/// A Firecracker client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FcVmRec {
    pub id: u32,
    pub listener: u32,
    pub conn: u64,
    pub pid: u32,
    pub regions: Vec<RegionRec>,
    pub self_src: u32,
    pub file_src: u32,
    /// The mirror of its table.
    pub table: String,
    /// Its uffd.
    pub uffd: String,
    /// Its connection (held open, so Firecracker sees no hang-up).
    pub stream: String,
    pub state: proto::api::RunState,
    #[serde(default)]
    pub failure: Option<String>,
    pub fault_around_pages: u64,
    pub readahead_pages: u64,
    #[serde(default)]
    pub readahead_piece_pages: u64,
}

/// The names (in the fd store) of the fds a record names.
pub(super) trait Fds {
    fn fds(&self) -> impl Iterator<Item = &str>;
}

fn names<const N: usize>(names: [Option<&str>; N]) -> impl Iterator<Item = &str> {
    names.into_iter().flatten().filter(|n| !n.is_empty())
}

impl Fds for SourceRec {
    fn fds(&self) -> impl Iterator<Item = &str> {
        names([match self {
            SourceRec::Frozen { fd, .. } => Some(fd.as_str()),
            SourceRec::File { file }
            | SourceRec::Image { file, .. }
            | SourceRec::Zstd { file, .. } => Some(file.fd.as_str()),
            SourceRec::Vm { .. }
            | SourceRec::Remote { .. }
            | SourceRec::Swap { .. }
            | SourceRec::Lost { .. } => None,
        }])
    }
}

impl Fds for BaseRec {
    fn fds(&self) -> impl Iterator<Item = &str> {
        names([Some(self.fd.as_str())])
    }
}

impl Fds for VmRec {
    fn fds(&self) -> impl Iterator<Item = &str> {
        let over = self.table_over.as_ref();
        names([
            Some(self.memory.as_str()),
            Some(self.table.as_str()),
            over.map(|o| o.table.as_str()),
            over.map(|o| o.under.as_str()),
            self.uffd.as_deref(),
        ])
    }
}

impl Fds for FcListenerRec {
    fn fds(&self) -> impl Iterator<Item = &str> {
        names([Some(self.fd.as_str())])
    }
}

impl Fds for FcVmRec {
    fn fds(&self) -> impl Iterator<Item = &str> {
        names([
            Some(self.table.as_str()),
            Some(self.uffd.as_str()),
            Some(self.stream.as_str()),
        ])
    }
}

/// A VM's memory: `(fd name, huge)`.
impl Fds for (String, bool) {
    fn fds(&self) -> impl Iterator<Item = &str> {
        names([Some(self.0.as_str())])
    }
}

/// A record with the address it was made from.
impl<T: Fds> Fds for (usize, T) {
    fn fds(&self) -> impl Iterator<Item = &str> {
        self.1.fds()
    }
}

/// A record with the device and inode number of the file it names.
impl<T: Fds> Fds for (crate::memory::FileId, T) {
    fn fds(&self) -> impl Iterator<Item = &str> {
        self.1.fds()
    }
}

/// What a VM's record names, by number: compared with the VM as it is
/// without reading (or making) names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct VmFds {
    /// Its memory's device and inode number.
    pub memory: crate::memory::FileId,
    /// Its table's mirror's inode number, and the under's if it is an
    /// overlay.
    pub table: Option<(u64, Option<u64>)>,
    /// Whether its uffd is named.
    pub uffd: bool,
}

impl Fds for (VmFds, VmRec) {
    fn fds(&self) -> impl Iterator<Item = &str> {
        self.1.fds()
    }
}
