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
    /// The mirror of its table.
    pub table: String,
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
