//! The path parameters routes share, each described once for the
//! document (`Path<VmPath>` in a handler's arguments documents `{id}`).

use serde::Deserialize;
use shared::VmId;
use utoipa::IntoParams;

use crate::core::Error;

/// A VM named in the path.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct VmPath {
    /// A VM id (vm-N).
    pub id: String,
}

impl VmPath {
    /// The VM's id, or a 404 that says what ids look like.
    pub fn vm(&self) -> Result<VmId, Error> {
        self.id.parse().map_err(|_| Error::BadVmId(self.id.clone()))
    }
}

/// A page of a VM.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct PagePath {
    /// A VM id (vm-N).
    pub id: String,
    /// A page number (0 is the first page of guest RAM).
    #[param(value_type = u64)]
    pub page: String,
}

impl PagePath {
    /// The VM's id and the page, or what is wrong with them.
    pub fn vm_page(&self) -> Result<(VmId, u64), Error> {
        let vm = VmPath {
            id: self.id.clone(),
        }
        .vm()?;
        let page = self
            .page
            .parse()
            .map_err(|_| Error::BadRequest(format!("page '{}' is not a page number", self.page)))?;
        Ok((vm, page))
    }
}

/// A Firecracker listener named in the path.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct ListenerPath {
    /// A listener id (fc-N).
    pub id: String,
}

impl ListenerPath {
    /// The listener's number, or a 404.
    pub fn listener(&self) -> Result<u32, Error> {
        self.id
            .strip_prefix("fc-")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| Error::NoSuchListener(self.id.clone()))
    }
}

/// A VM snapshot named in the path.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct SnapshotPath {
    /// A snapshot name.
    pub name: String,
}

/// A volume or volume snapshot named in the path.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub struct VolumePath {
    /// A volume or volume snapshot name.
    pub name: String,
}
