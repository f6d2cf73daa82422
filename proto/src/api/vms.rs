//! VMs: create, inspect, drive the guest agent, fork.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use shared::pattern::MAX_SECTORS_PER_IO;
use shared::GuestOp;

/// `POST /v1/vms` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateVm {
    /// Guest RAM in MiB. With `from_snapshot` it comes from the snapshot:
    /// leave it out (any value given must match the snapshot's).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub memory_mib: u64,
    /// Start from this VM snapshot: its memory, vCPU and device state
    /// (and a reflink of its volume snapshot, if it has one). `remote:NAME`
    /// names a snapshot in the server's object store (`--remote`): the VM
    /// starts before its memory is here, each chunk fetched when first
    /// needed (its recorded working set ahead of the guest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// Number of vCPUs (default 1).
    #[serde(default = "default_vcpus")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 32))]
    pub vcpus: u8,
    /// Where the initial memory comes from; `null` is all zeroes.
    #[serde(default)]
    pub memory_source: Option<MemorySource>,
    /// Name of a disk volume to attach.
    #[serde(default)]
    pub volume: Option<String>,
    /// Fault-around block for image-backed faults in KiB (0 = one page per
    /// fault); the server's default if absent.
    #[serde(default)]
    pub fault_around_kib: Option<u64>,
    /// Largest readahead window in KiB for sequential faults on an image
    /// (0 = off); the server's default if absent.
    #[serde(default)]
    pub readahead_kib: Option<u64>,
    /// Install every page before the guest starts (no faults at all),
    /// into the VM's own memory: such a VM shares no base.
    #[serde(default)]
    pub prefetch: bool,
    /// Back guest RAM with 2 MiB hugetlb pages (`memory_mib` a multiple
    /// of 2; huge pages reserved on the host in
    /// `/proc/sys/vm/nr_hugepages`); the server's default if absent.
    /// Served, forked and snapshotted like 4 KiB memory, in 2 MiB blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugepages: Option<bool>,
    /// How the server may give this VM's memory back under memory
    /// pressure; the server's default (reclaimed when it must, no limit of
    /// its own) if absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reclaim: Option<ReclaimPolicy>,
}

/// How the server may give a VM's memory back (`CreateVm::reclaim`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReclaimPolicy {
    /// `false`: never reclaimed, whatever the pressure (a latency-critical
    /// VM); its pages count against the others'.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Resident guest memory this VM may hold at most, in MiB; beyond it
    /// its coldest pages are given back even without pressure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_mib: Option<u64>,
}

impl Default for ReclaimPolicy {
    fn default() -> Self {
        ReclaimPolicy {
            enabled: true,
            limit_mib: None,
        }
    }
}

fn yes() -> bool {
    true
}

/// What reclaim did to a VM (`VmInfo::reclaim`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VmReclaim {
    /// The server may reclaim its pages (`false`: opted out).
    pub enabled: bool,
    /// Its own limit of resident guest memory, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_bytes: Option<u64>,
    /// Pages given back because their source holds the same bytes (zero
    /// pages, image pages), since it was made.
    pub dropped_pages: u64,
    /// Pages whose bytes are in the server's swap store now.
    pub swapped_pages: u64,
    /// Pages it wrote that went to the swap store, since it was made.
    pub swapped_out_total: u64,
    /// Faults on pages reclaimed before (served again from their source
    /// or the swap store).
    pub refaults: u64,
    /// It faults back the pages reclaimed from it soon after, over and
    /// over: more memory would serve it better.
    pub thrashing: bool,
}

/// `POST /v1/vms/{id}/reclaim` answer: what was given back now.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VmReclaimed {
    pub vm: String,
    /// Pages dropped because their source holds the same bytes.
    pub dropped_pages: u64,
    /// Pages compressed into the swap store and dropped.
    pub swapped_pages: u64,
    /// Pages kept: read by other VMs, or the swap store is full.
    pub kept_pages: u64,
    /// Bytes of memory given back.
    pub freed_bytes: u64,
}

fn default_vcpus() -> u8 {
    1
}

/// A memory source for a new VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum MemorySource {
    /// A raw image: guest page p is at byte p * 4096 of the file.
    File { path: String },
    /// A compressed `memory.zst` image (`uffdctl image compress`), decoded
    /// a frame at a time as the guest faults.
    Zstd { path: String },
    /// A pagefork snapshot's memory (its `memory.zst` if it has one):
    /// Firecracker listeners only; a VM starts from a snapshot with
    /// `from_snapshot`.
    Snapshot { name: String },
}

impl MemorySource {
    /// What the source names, for messages: a path or a snapshot.
    pub fn describe(&self) -> String {
        match self {
            MemorySource::File { path } => path.clone(),
            MemorySource::Zstd { path } => format!("zstd:{path}"),
            MemorySource::Snapshot { name } => format!("snapshot:{name}"),
        }
    }
}

/// When the serving process took a VM back, and served it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Adopted {
    /// When it took the VM back, in µs since the Unix epoch.
    pub at_unix_us: u64,
    /// When it served the VM's first fault after that, in µs since the
    /// Unix epoch; none yet if the guest has not faulted since.
    pub first_fault_unix_us: Option<u64>,
}

/// A VM's life-cycle state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// Launched; waiting for the VMM to connect and start its guest.
    Starting,
    Running,
    Paused,
    /// The VMM is gone; memory may still serve dependents.
    Exited,
    /// A page could not be served or the VMM broke its protocol; `failure`
    /// says why. Memory still serves dependents.
    Failed,
    /// Deleted, but kept as a frozen source while other VMs read from it.
    Deleted,
}

impl RunState {
    /// The name as the API shows it.
    pub fn name(self) -> &'static str {
        match self {
            RunState::Starting => "starting",
            RunState::Running => "running",
            RunState::Paused => "paused",
            RunState::Exited => "exited",
            RunState::Failed => "failed",
            RunState::Deleted => "deleted",
        }
    }
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What kind of process runs a VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum VmKind {
    /// pagefork's own `vmm`.
    Pagefork,
    /// A Firecracker process served through a listener.
    Firecracker,
}

/// A VM as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VmInfo {
    pub id: String,
    pub state: RunState,
    pub kind: VmKind,
    pub pid: Option<u32>,
    pub memory_mib: u64,
    pub vcpus: u8,
    /// Guest RAM is backed by 2 MiB hugetlb pages.
    #[serde(default)]
    pub hugepages: bool,
    /// Pages per source kind (`uninitialized`, `vm`, `file`, ...).
    pub pages: BTreeMap<String, u64>,
    /// Pages of guest RAM present in this VM: its own memfd's, or, on a
    /// shared base, the pages its VMM holds privately plus those it maps
    /// from the base (`memory` splits them).
    pub resident_pages: u64,
    /// The name of that memfd, as the server's `/proc/<pid>/fd` and
    /// `maps` show it (`/memfd:NAME (deleted)`): `pagefork-vm-N`, or
    /// `pagefork-pool-N` for RAM made ahead for a pooled VMM. None for a
    /// Firecracker VM, whose RAM is Firecracker's.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub memfd: Option<String>,
    /// Why the VM exited, if it did.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub exit_reason: Option<String>,
    /// Why the VM failed (state `failed`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub failure: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub parent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub volume: Option<String>,
    /// Fault engine counters.
    #[serde(default)]
    pub faults: FaultCounters,
    /// A snapshot of this VM saving its pages now (the guest runs).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub snapshot_saving: Option<SnapshotSaving>,
    /// This process took the VM back from the one before it (a crash or
    /// an upgrade of the server).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub adopted: Option<Adopted>,
    /// The host memory its guest RAM takes: its own pages, and the pages
    /// it maps from a shared base (held once per host by the base).
    #[serde(default)]
    pub memory: VmMemory,
    /// Where its pages that are not its own come from, and where those
    /// bytes live now: none of them lives in another VM's VMM, so no other
    /// VM's exit can take them.
    #[serde(default)]
    pub reads_from: Vec<ReadSource>,
    /// What reclaim under memory pressure took from it.
    #[serde(default)]
    pub reclaim: VmReclaim,
}

/// Where a VM's guest RAM is in host memory, read from the kernel.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VmMemory {
    /// Bytes of guest RAM this VM alone holds: the pages of its own
    /// memfd, or, for a VM on a shared base, the private pages of its VMM
    /// (what its guest wrote, and pages copied in for it).
    pub own_bytes: u64,
    /// Bytes of guest RAM it maps from its shared base: the base holds
    /// them once for every VM that maps it (`GET /v1/bases`).
    pub shared_bytes: u64,
    /// The shared base its guest RAM maps (`base-N`), if any.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub base: Option<String>,
}

/// Progress of a snapshot saving pages after its pause.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotSaving {
    pub name: String,
    /// Pages the snapshot writes.
    pub pages_total: u64,
    /// Pages handed to the image writer so far.
    pub pages_saved: u64,
}

/// Fault engine counters of one VM.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FaultCounters {
    pub missing: u64,
    pub write_protect: u64,
    pub pages_installed: u64,
    pub removes: u64,
    /// Installs deferred by EAGAIN until pending events were read.
    #[serde(default)]
    pub deferred: u64,
    /// Faults that waited for a compressed image's frame to be decoded.
    #[serde(default)]
    pub frame_waits: u64,
    /// Faults that waited for a chunk of a snapshot in the object store.
    #[serde(default)]
    pub chunk_waits: u64,
    pub fault_around_kib: u64,
    /// Pre-write copies this VM's writes gave to the VMs reading from it.
    #[serde(default)]
    pub wp_copies: u64,
    /// MINOR faults: accesses to pages a rollback left unmapped, and, for
    /// a VM on a shared base, first accesses to pages the base holds.
    #[serde(default)]
    pub minor: u64,
    /// Pages mapped from the VM's shared base rather than copied.
    #[serde(default)]
    pub pages_shared: u64,
    /// uffd events by the time the server spent on them: entry i counts
    /// those served in [2^i, 2^(i+1)) µs (entry 0 also under 1 µs, the
    /// last everything longer).
    #[serde(default)]
    pub service_us_log2: Vec<u64>,
    /// Where the server's time on this VM's uffd events went, phase by
    /// phase.
    #[serde(default)]
    pub phases: FaultPhases,
}

/// The fault path's time by phase for one VM: from reading the uffd to the
/// wake of the faulting thread (see `docs/architecture.md`). A phase counts
/// once per wake-up of the uffd that spent time in it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FaultPhases {
    /// Reading the pending events from the uffd.
    pub read: PhaseTimes,
    /// Table lookup, plan and reading the bytes of each event.
    pub resolve: PhaseTimes,
    /// The install ioctls (UFFDIO_COPY, ZEROPAGE, WRITEPROTECT, POISON).
    pub install: PhaseTimes,
    /// UFFDIO_WAKE, when the install did not wake the faulting thread.
    pub wake: PhaseTimes,
    /// The serving loop's own work: counters, trace, clean-up, retries.
    pub loop_overhead: PhaseTimes,
    /// The whole time spent on one event.
    pub service: PhaseTimes,
    /// Events found by polling the uffd right after serving a fault.
    pub polled_events: u64,
    /// Events read after the event loop reported the uffd readable.
    pub woken_events: u64,
    /// Time spent polling the uffd without finding an event, µs.
    pub poll_idle_us: u64,
}

/// Median and 99th percentile of one phase, in nanoseconds (within ~10%:
/// read from a histogram with four buckets per power of two).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PhaseTimes {
    pub count: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
}

/// `POST /v1/vms/{id}/exec` body: one guest agent op, named by `op`.
///
/// `start_page` defaults to 0 and `pages` to the rest of guest memory;
/// `sector` defaults to 0.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum ExecRequest {
    /// Write a per-page pattern word at word 0 and at a sampled word.
    Fill {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start_page: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pages: Option<u64>,
        seed: u64,
    },
    /// Read (or rewrite unchanged) the first byte of each page.
    Touch {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start_page: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pages: Option<u64>,
        #[serde(default)]
        write: bool,
    },
    /// Fold the sampled word of each page.
    Checksum {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start_page: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pages: Option<u64>,
    },
    /// Count pages whose pattern words differ from `seed`'s.
    Verify {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start_page: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pages: Option<u64>,
        seed: u64,
    },
    /// Fold every word of every page (in the VMM, through the uffd).
    Digest {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start_page: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pages: Option<u64>,
    },
    /// Read the VM's id from an I/O port.
    Identity {},
    /// Write a pattern to `count` 512-byte sectors of the volume.
    DiskFill {
        #[serde(default)]
        sector: u64,
        count: u64,
        seed: u64,
        /// Sectors per block device request (default and most: 2048,
        /// 1 MiB); 1 moves one sector per request, as the first device did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 2048))]
        sectors_per_io: Option<u32>,
    },
    /// Write guest pages to the volume from `sector` on, straight from
    /// guest RAM (8 sectors per page).
    DiskWritePages {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        start_page: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pages: Option<u64>,
        #[serde(default)]
        sector: u64,
        /// As for `disk_fill`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 2048))]
        sectors_per_io: Option<u32>,
    },
    /// Fold `count` sectors of the volume.
    DiskChecksum {
        #[serde(default)]
        sector: u64,
        count: u64,
        /// As for `disk_fill`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 2048))]
        sectors_per_io: Option<u32>,
    },
}

/// Why an [`ExecRequest`] cannot run on a VM.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    #[error("pages {start}..{end} are outside guest memory of {total} pages")]
    OutsideMemory { start: u64, end: u64, total: u64 },
    #[error("sectors_per_io is {0}; use 1 to {MAX_SECTORS_PER_IO}")]
    SectorsPerIo(u64),
}

impl ExecRequest {
    /// Build the guest op for a VM of `total_pages` pages.
    pub fn to_op(&self, total_pages: u64) -> Result<GuestOp, ExecError> {
        let range = |start: Option<u64>, pages: Option<u64>| {
            let start_page = start.unwrap_or(0);
            (
                start_page,
                pages.unwrap_or(total_pages.saturating_sub(start_page)),
            )
        };
        let op = match *self {
            ExecRequest::Fill {
                start_page,
                pages,
                seed,
            } => {
                let (start_page, pages) = range(start_page, pages);
                GuestOp::Fill {
                    start_page,
                    pages,
                    seed,
                }
            }
            ExecRequest::Touch {
                start_page,
                pages,
                write,
            } => {
                let (start_page, pages) = range(start_page, pages);
                GuestOp::Touch {
                    start_page,
                    pages,
                    write,
                }
            }
            ExecRequest::Checksum { start_page, pages } => {
                let (start_page, pages) = range(start_page, pages);
                GuestOp::Checksum { start_page, pages }
            }
            ExecRequest::Verify {
                start_page,
                pages,
                seed,
            } => {
                let (start_page, pages) = range(start_page, pages);
                GuestOp::Verify {
                    start_page,
                    pages,
                    seed,
                }
            }
            ExecRequest::Digest { start_page, pages } => {
                let (start_page, pages) = range(start_page, pages);
                GuestOp::Digest { start_page, pages }
            }
            ExecRequest::Identity {} => GuestOp::Identity,
            ExecRequest::DiskFill {
                sector,
                count,
                seed,
                sectors_per_io,
            } => GuestOp::DiskFill {
                sector,
                count,
                seed,
                sectors_per_io,
            },
            ExecRequest::DiskChecksum {
                sector,
                count,
                sectors_per_io,
            } => GuestOp::DiskChecksum {
                sector,
                count,
                sectors_per_io,
            },
            ExecRequest::DiskWritePages {
                start_page,
                pages,
                sector,
                sectors_per_io,
            } => {
                let (start_page, pages) = range(start_page, pages);
                GuestOp::DiskWritePages {
                    start_page,
                    pages,
                    sector,
                    sectors_per_io,
                }
            }
        };
        if let Some(n) = op.sectors_per_io() {
            if !(1..=MAX_SECTORS_PER_IO).contains(&n) {
                return Err(ExecError::SectorsPerIo(n));
            }
        }
        if let Some((s, n)) = op.page_range() {
            if s.checked_add(n).is_none_or(|end| end > total_pages) {
                return Err(ExecError::OutsideMemory {
                    start: s,
                    end: s.saturating_add(n),
                    total: total_pages,
                });
            }
        }
        Ok(op)
    }

    /// Whether the op uses the VM's disk.
    pub fn needs_disk(&self) -> bool {
        matches!(
            self,
            ExecRequest::DiskFill { .. }
                | ExecRequest::DiskChecksum { .. }
                | ExecRequest::DiskWritePages { .. }
        )
    }
}

/// `POST /v1/vms/{id}/exec` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExecResponse {
    pub op: String,
    pub result: u64,
    pub elapsed_us: u64,
}

/// `GET /v1/vms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VmList {
    pub vms: Vec<VmInfo>,
}

/// `DELETE /v1/vms/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VmDeleted {
    pub id: String,
    pub deleted: bool,
    /// The VM itself is kept, frozen (state `deleted`), because other VMs
    /// still read pages from its own memfd. False when nothing of it is
    /// kept, or when only its layers are (`kept`).
    pub frozen: bool,
    /// The memory of this VM the server keeps for other VMs that still
    /// read pages it held, one entry per place, each with its readers.
    /// Empty when nothing is kept.
    #[serde(default)]
    pub kept: Vec<KeptMemory>,
}

/// Memory of a VM that the server keeps because other VMs read from it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct KeptMemory {
    /// The source, as tables and explain name it: `vm-3` (its own memfd,
    /// frozen), `vm-3 (layer)` (the pages it had written, copied out of
    /// its VMM when it forked), `vm-3 (frozen)` (a template's memfd, now
    /// its children's base).
    pub source: String,
    /// `memfd`, `layer` or `template`.
    pub kind: String,
    /// The memfd holding the pages (the server's): `pagefork-vm-3`,
    /// `pagefork-vm-3-layer`.
    pub memfd: String,
    /// Bytes of host memory it holds.
    pub bytes: u64,
    /// The VMs that read pages from it, and how many pages each.
    pub readers: Vec<PageReader>,
}

/// A VM that reads pages from another VM's kept memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PageReader {
    pub vm: String,
    pub pages: u64,
}

/// Where a VM's pages that are not its own come from, and where the bytes
/// live now (`GET /v1/vms/{id}`: `reads_from`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReadSource {
    /// The source (`vm-3`, `vm-3 (layer)`, `snapshot:gold`, `file:/path`).
    pub source: String,
    /// Its kind (`vm`, `frozen`, `file`, `image`, `zstd`, `remote`).
    pub kind: String,
    /// Pages of this VM that read from it.
    pub pages: u64,
    /// Where those bytes are: `memfd pagefork-vm-3-layer (server)`,
    /// `memfd pagefork-vm-3 (server; vm-3 is deleted)`, `file /path`.
    pub lives_in: String,
}

/// Most children one fork request may create (admission control still
/// bounds them by the memory budget and `--max-vms`).
pub const MAX_FORK_COUNT: u32 = 1024;

/// `POST /v1/vms/{id}/fork` body (an empty body forks one child).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// Children to create, 1 to [`MAX_FORK_COUNT`].
    #[serde(default = "one")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1024))]
    pub count: u32,
}

impl Default for ForkRequest {
    fn default() -> Self {
        ForkRequest { count: 1 }
    }
}

fn one() -> u32 {
    1
}

/// `POST /v1/vms/{id}/fork` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ForkResponse {
    pub parent: String,
    pub children: Vec<String>,
    /// How long the parent was paused.
    pub pause_us: u64,
    /// The table fork and the children's memory.
    pub fork_us: u64,
    pub phases: ForkPhases,
}

/// Where a fork's time went: the write-protect armed before the pause,
/// then the pause phase by phase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ForkPhases {
    /// Write-protecting the parent's materialized pages while it still
    /// ran, before the pause (0 for a paused template).
    #[serde(default)]
    pub armed_ahead_us: u64,
    pub pause_and_capture_us: u64,
    /// In the pause: re-protecting the pages the parent wrote since
    /// (a template: protecting its pages, unless already protected).
    pub write_protect_us: u64,
    pub table_fork_us: u64,
    pub volumes_us: u64,
    pub resume_us: u64,
    /// Pages protected for the fork, before and in the pause.
    pub write_protected_pages: Option<u64>,
    /// Pages a parent on a shared base had written (held only in its
    /// VMM), frozen into a layer the server owns for its children and
    /// copied into it in the background after the answer (0: none).
    #[serde(default)]
    pub layer_pages: u64,
    /// How long the answer waited for that copy: 0, as the children start
    /// at once and read a page not copied yet through its parent's VMM's
    /// anchor. (Kept for clients that read it.)
    #[serde(default)]
    pub layer_us: u64,
    /// In the pause: making the layer and freezing the parent's pages
    /// over it (0 when there is no layer).
    #[serde(default)]
    pub layer_begin_us: u64,
    /// In the pause, after the capture (a running parent): protecting
    /// what a late fault lifted.
    #[serde(default)]
    pub late_protect_us: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn exec_request_says_what_is_missing() {
        let e = serde_json::from_str::<ExecRequest>(r#"{"op":"fill","pages":3}"#).unwrap_err();
        assert!(e.to_string().contains("missing field `seed`"), "{e}");
        let e = serde_json::from_str::<ExecRequest>(r#"{"op":"fil"}"#).unwrap_err();
        assert!(e.to_string().contains("unknown variant `fil`"), "{e}");
        let e = serde_json::from_str::<ExecRequest>(r#"{"op":"identity","x":1}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field"), "{e}");
        let r: ExecRequest =
            serde_json::from_str(r#"{"op":"checksum","start_page":8,"pages":3}"#).unwrap();
        assert!(r
            .to_op(10)
            .unwrap_err()
            .to_string()
            .contains("outside guest memory"));
    }

    #[test]
    fn exec_request_defaults_to_the_rest_of_memory() {
        let r: ExecRequest =
            serde_json::from_str(r#"{"op":"verify","start_page":4,"seed":9}"#).unwrap();
        assert_eq!(
            r.to_op(10).unwrap(),
            GuestOp::Verify {
                start_page: 4,
                pages: 6,
                seed: 9
            }
        );
        let r: ExecRequest =
            serde_json::from_str(r#"{"op":"disk_fill","count":2,"seed":1}"#).unwrap();
        assert!(r.needs_disk());
        let r: ExecRequest =
            serde_json::from_str(r#"{"op":"disk_write_pages","start_page":2,"sector":8}"#).unwrap();
        assert!(r.needs_disk());
        assert_eq!(
            r.to_op(10).unwrap(),
            GuestOp::DiskWritePages {
                start_page: 2,
                pages: 8,
                sector: 8,
                sectors_per_io: None
            }
        );
    }

    #[test]
    fn create_vm_defaults() {
        let c: CreateVm = serde_json::from_str(r#"{"memory_mib":256}"#).unwrap();
        assert_eq!(c.vcpus, 1);
        assert_eq!(c.memory_source, None);
        let c: CreateVm =
            serde_json::from_str(r#"{"memory_mib":1,"memory_source":{"kind":"file","path":"/x"}}"#)
                .unwrap();
        assert_eq!(
            c.memory_source,
            Some(MemorySource::File { path: "/x".into() })
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bodies_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = serde_json::from_slice::<CreateVm>(&bytes);
            if let Ok(r) = serde_json::from_slice::<ExecRequest>(&bytes) {
                let _ = r.to_op(1 << 20);
            }
        }

        #[test]
        fn exec_request_round_trips(start in any::<u64>(), pages in any::<u64>(), seed in any::<u64>()) {
            let r = ExecRequest::Verify { start_page: Some(start), pages: Some(pages), seed };
            let s = serde_json::to_string(&r).unwrap();
            prop_assert_eq!(serde_json::from_str::<ExecRequest>(&s).unwrap(), r);
        }
    }
}
