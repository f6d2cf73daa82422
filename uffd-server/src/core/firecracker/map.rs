//! A read-only shared mapping of a listener's memory source file.
//!
//! Faults no longer read through it: pages of every source are read by
//! [`crate::pages::read_pages`] into a staging buffer and installed from
//! there, so sources that cannot be mapped (compressed images) serve
//! Firecracker the same way. The listener still creates one when it
//! starts (its code is outside the fault path); it can go with that code.

use std::fs::File;

use vm_memory::mmap::MmapRegionError;
use vm_memory::{FileOffset, MmapRegion};

/// Errors of mapping a source file.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("memory source is empty")]
    Empty,
    #[error("cannot duplicate the memory source's fd for its mapping")]
    DupFd(#[source] std::io::Error),
    #[error("cannot map the memory source")]
    Map(#[source] MmapRegionError),
}

/// A read-only shared mapping of a source file (vm-memory's `MmapRegion`,
/// which owns a duplicate of the file's fd and unmaps on drop).
#[derive(Debug)]
pub struct FileMap {
    map: MmapRegion,
}

impl FileMap {
    /// Map `len` bytes of `file` read-only.
    pub fn new(file: &File, len: u64) -> Result<Self, MapError> {
        let len = usize::try_from(len)
            .ok()
            .filter(|l| *l > 0)
            .ok_or(MapError::Empty)?;
        let file = file.try_clone().map_err(MapError::DupFd)?;
        let map = MmapRegion::build(
            Some(FileOffset::new(file, 0)),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
        )
        .map_err(MapError::Map)?;
        Ok(FileMap { map })
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> u64 {
        self.map.size() as u64
    }

    /// Whether the mapping is empty (never: `new` refuses empty sources).
    pub fn is_empty(&self) -> bool {
        self.map.size() == 0
    }
}
