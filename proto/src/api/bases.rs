//! Shared bases (`GET /v1/bases`): the memory VMs made from one image,
//! restored from one snapshot or forked from one paused VM map instead of
//! copying, one per host.

use serde::{Deserialize, Serialize};

/// One shared base.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BaseInfo {
    /// `base-N`.
    pub id: String,
    /// `template` (a paused VM's memory, frozen when it was forked) or
    /// `image` (an image file's pages, filled as VMs read them).
    pub kind: String,
    /// What it holds the pages of: `vm-3`, `snapshot:gold`, `zstd:/path`.
    pub of: String,
    /// Host memory it holds, in bytes (counted once, whatever the number
    /// of VMs that map it).
    pub bytes: u64,
    /// Its size (the guest RAM of the VMs that map it), in bytes.
    pub size_bytes: u64,
    /// The VMs whose guest RAM maps it.
    pub users: Vec<String>,
}

/// `GET /v1/bases`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BaseList {
    pub bases: Vec<BaseInfo>,
}
