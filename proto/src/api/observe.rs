//! Seeing a VM's memory at work: the live fault trace (NDJSON lines of
//! [`FaultEvent`] and [`TraceDropped`]), a page's whole story
//! ([`PageExplain`]) and the record of what a VM touched ([`AccessMap`]).

use serde::{Deserialize, Serialize};

/// What happened to a page: the kind of a uffd event, or a page put in
/// place before its VM ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum FaultKind {
    /// A MISSING fault: the page was not in the VM's memory.
    Missing,
    /// A write-protect fault: a write to a protected page (copy-on-write
    /// for the VM's fork children, or a tracked write).
    Wp,
    /// A REMOVE event: the VMM discarded the pages; they read as zero.
    Remove,
    /// Installed before the VM ran (`prefetch` at create).
    Prefetch,
}

impl FaultKind {
    /// The name as the API shows it.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Missing => "missing",
            FaultKind::Wp => "wp",
            FaultKind::Remove => "remove",
            FaultKind::Prefetch => "prefetch",
        }
    }
}

/// A fault kind name that is none of `missing`, `wp`, `remove`, `prefetch`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown fault kind '{0}': use missing, wp, remove or prefetch")]
pub struct UnknownFaultKind(pub String);

impl std::str::FromStr for FaultKind {
    type Err = UnknownFaultKind;
    fn from_str(s: &str) -> Result<Self, UnknownFaultKind> {
        match s.to_ascii_lowercase().as_str() {
            "missing" => Ok(FaultKind::Missing),
            "wp" => Ok(FaultKind::Wp),
            "remove" => Ok(FaultKind::Remove),
            "prefetch" => Ok(FaultKind::Prefetch),
            other => Err(UnknownFaultKind(other.to_string())),
        }
    }
}

/// One line of `GET /v1/vms/{id}/faults?follow=true`: one uffd event of
/// the VM as the server handled it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FaultEvent {
    /// When the server read the event: microseconds since the Unix epoch.
    pub time_us: u64,
    /// The VM (`vm-N`).
    pub vm: String,
    pub kind: FaultKind,
    /// The guest page (for a REMOVE, the first page of the range).
    pub page: u64,
    /// Whether the access was a write.
    pub write: bool,
    /// Where the page's bytes came from (`uninitialized`, `vm-N`,
    /// `snapshot:NAME`, `file:/path`); for a WP fault the VM itself; none
    /// for a REMOVE.
    pub source: Option<String>,
    /// Pages this event put in place: the installed run of a MISSING fault
    /// (fault-around included), the pre-write copies a WP fault gave to the
    /// VM's dependents; for a REMOVE, the pages discarded.
    pub pages: u64,
    /// Time the server spent on the event, in microseconds.
    pub service_us: u64,
}

/// A line of the fault trace saying that `dropped` events were not sent:
/// the reader fell behind (the server never waits for a reader).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TraceDropped {
    pub dropped: u64,
}

/// Query of `GET /v1/vms/{id}/faults`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
pub struct TraceQuery {
    /// Must be `true`: the trace is live (what a VM touched before is
    /// `GET /v1/vms/{id}/access`).
    #[serde(default)]
    pub follow: bool,
    /// Only events of this kind.
    pub kind: Option<FaultKind>,
    /// End the stream after this many events.
    pub limit: Option<u64>,
}

/// Query of `GET /v1/vms/{id}/pages/{page}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
pub struct PageQuery {
    /// Add the whole chain of where the page's bytes come from.
    #[serde(default)]
    pub explain: bool,
}

/// Where a page's bytes come from, step by step: the VM asked about,
/// the VM whose memory holds the bytes, and where that VM got them (a
/// snapshot image or file at an offset, or zero).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PageExplain {
    pub chain: Vec<ExplainStep>,
}

/// One step of a page's chain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExplainStep {
    /// `vm-N`, `snapshot:NAME`, `file:/path`, `zstd:/path` or `zero`.
    pub at: String,
    /// `vm`, `image`, `file`, `zstd` or `zero`.
    pub kind: String,
    /// For a VM: whether the page is in its memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub present: Option<bool>,
    /// For a VM holding the page: when and by which event it got there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub installed: Option<Installed>,
    /// For an image or file: its path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// For an image or file: the byte offset of the page in it; for a
    /// compressed image: where the compressed frame holding it starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// For a compressed image: the frame holding the page; for the swap
    /// store: the sequence number of the page's frame (its offset is
    /// `offset`, its file `file`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame: Option<u64>,
    /// For a VM on a shared base that reads the page from it: the base
    /// (`base-N`, see `GET /v1/bases`). The page is shared with every VM on
    /// that base until this one writes it (then it is `present`: private).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_from: Option<String>,
    /// Where the bytes of this step live now: a VM's memfd or its VMM's
    /// private memory, a layer or frozen memfd the server keeps (and
    /// whether the VM it came from is gone), a file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lives_in: Option<String>,
}

/// How a page got into a VM's memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Installed {
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// `missing` (the faulting page), `fault-around` (a page of the run
    /// installed around a fault), `wp-copy` (the pre-write copy from the VM
    /// that was about to write it) or `prefetch`.
    pub event: String,
    /// The source it was read from then (`uninitialized`, `vm-N`,
    /// `snapshot:NAME`, `file:/path`).
    pub from: String,
}

/// `GET /v1/vms/{id}/access`: which pages the VM faulted on, and how,
/// since its record began.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AccessMap {
    pub id: String,
    pub pages: u64,
    /// When the record began (creation, fork, restore, rollback or a
    /// reset): milliseconds since the Unix epoch.
    pub since_ms: u64,
    /// Pages with at least one fault.
    pub touched: u64,
    /// Runs of touched pages with the same first fault kind.
    pub extents: Vec<AccessExtent>,
}

/// A run of pages first faulted by the same kind of event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AccessExtent {
    pub start_page: u64,
    pub pages: u64,
    /// The kind of each page's first fault.
    pub kind: FaultKind,
    /// The earliest and latest first fault of the run, in milliseconds
    /// after `since_ms`.
    pub first_ms: u64,
    pub last_ms: u64,
    /// Faults on the run's pages in all.
    pub faults: u64,
}

/// Query of `GET /v1/vms/{id}/access`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
pub struct AccessQuery {
    /// Only pages first faulted within this many milliseconds of the
    /// record's start.
    pub within_ms: Option<u64>,
}

/// `GET /v1/vms/{id}/map`: the VM's page-source table as a grid of cells
/// (what `map.png` draws): one cell per `group` pages, coloured by the
/// source most of its pages read from, present if most of them are in the
/// VM's own memory (the kernel's view of its memfd).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PageMap {
    pub id: String,
    pub pages: u64,
    pub memory_bytes: u64,
    /// Pages per cell (a power of two).
    pub group: u64,
    /// When the map was read: milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// Every source the VM's table names, in drawing order.
    pub legend: Vec<MapLegend>,
    /// Per cell: the index of its source in `legend`.
    pub cells: Vec<u16>,
    /// Per cell: whether its pages are present.
    pub present: Vec<bool>,
}

/// One source of a map.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MapLegend {
    /// `uninitialized`, `vm-N`, `snapshot:NAME`, `file:/path`.
    pub source: String,
    /// `uninitialized`, `vm`, `image`, `file`.
    pub kind: String,
    /// The VM's own memory (`vm-N` is the VM itself).
    pub own: bool,
    /// Pages of the VM that read from it.
    pub pages: u64,
    /// Its colour: the same source has the same colour in every VM's map.
    pub rgb: [u8; 3],
    /// Its colour where the pages are not present.
    pub faded_rgb: [u8; 3],
}

/// Query of `GET /v1/vms/{id}/map` and `map.png`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
pub struct MapQuery {
    /// Cells at most (default 16384, at least 1); pages are grouped by
    /// the smallest power of two that fits.
    pub cells: Option<u64>,
}
