//! Memory-source debugging views: where a VM's pages come from, one page,
//! the fork tree, and the table-vs-memfd invariant check.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `GET /v1/vms/{id}/sources`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Sources {
    pub id: String,
    /// Pages in the VM's table.
    pub pages: u64,
    /// Pages per source kind (`uninitialized`, `vm`, `file`, ...).
    pub by_kind: BTreeMap<String, u64>,
    /// Pages per source (`uninitialized`, `vm-3`, `file:/path`).
    pub by_source: BTreeMap<String, u64>,
    /// The table as runs of pages with one source.
    pub extents: Vec<SourceExtent>,
}

/// A run of pages with one source.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SourceExtent {
    pub start_page: u64,
    pub pages: u64,
    pub source: String,
}

/// `GET /v1/vms/{id}/pages/{page}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PageInfo {
    pub id: String,
    pub page: u64,
    /// The page's source (`vm-2`, `file:/path`, `uninitialized`).
    pub source: Option<String>,
    /// The source's kind.
    pub kind: Option<String>,
    /// Whether the page is present: for pagefork VMs the kernel's view of
    /// the memfd, for Firecracker VMs whether it was installed.
    pub present: bool,
    /// Whether the table says the page is present (`Vm(self)`).
    pub table_says_present: bool,
    /// With `?explain=true`: the whole chain of where the bytes come from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub explain: Option<super::observe::PageExplain>,
}

/// `GET /v1/tree`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Tree {
    pub vms: Vec<TreeNode>,
}

/// One VM of the fork tree (deleted-but-frozen VMs included).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TreeNode {
    pub id: String,
    pub parent: Option<String>,
    pub state: super::vms::RunState,
    pub children: Vec<String>,
    /// Pages present in the VM's own memory.
    pub own_pages: u64,
    /// Pages read from each other VM (`vm-N`) and from snapshot images
    /// (`snapshot:NAME`).
    pub reads_from: BTreeMap<String, u64>,
}

/// `GET /v1/debug/invariant`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Invariant {
    pub ok: bool,
    pub pages_checked: u64,
    /// The first violations found (at most 32).
    pub violations: Vec<Violation>,
    /// VMs whose table reads pages from another VM's VMM process (the
    /// private pages of a VM on a shared base), which would die with that
    /// process: `vm-5 reads 300 pages from vm-3's VMM`. Always empty when
    /// the invariant holds.
    #[serde(default)]
    pub reads_from_other_vmms: Vec<String>,
}

/// A page where the table and the memfd disagree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Violation {
    pub id: String,
    pub page: u64,
    pub table_says_present: bool,
    pub present: bool,
}
