//! Request bodies from their `proto::api` types, with the defaults the
//! server applies to a field left out.

use std::path::Path;

use proto::api::{CreateListener, CreateVm, MemorySource};
use serde::Serialize;
use serde_json::Value;

/// A request body from its `proto::api` type.
pub fn body<T: Serialize>(req: &T) -> Value {
    serde_json::to_value(req).unwrap_or_else(|e| panic!("cannot encode a request body: {e}"))
}

/// `POST /v1/vms` for `memory_mib` MiB of zeroes, everything else the
/// server's default (the body `{"memory_mib": N}`); change fields with
/// `CreateVm { memory_source: ..., ..new_vm(8) }`.
pub fn new_vm(memory_mib: u64) -> CreateVm {
    CreateVm {
        memory_mib,
        from_snapshot: None,
        vcpus: 1,
        memory_source: None,
        volume: None,
        fault_around_kib: None,
        readahead_kib: None,
        prefetch: false,
        hugepages: None,
        reclaim: None,
    }
}

/// `POST /v1/vms` restoring snapshot `name` (the body `{"from_snapshot": NAME}`).
pub fn from_snapshot(name: &str) -> CreateVm {
    CreateVm {
        from_snapshot: Some(name.to_owned()),
        ..new_vm(0)
    }
}

/// A raw image file as a memory source.
pub fn file_source(path: impl AsRef<Path>) -> MemorySource {
    MemorySource::File {
        path: utf8(path.as_ref()),
    }
}

/// A compressed `memory.zst` image as a memory source.
pub fn zstd_source(path: impl AsRef<Path>) -> MemorySource {
    MemorySource::Zstd {
        path: utf8(path.as_ref()),
    }
}

/// A listener on `socket` serving `memory_source`, everything else the
/// server's default.
pub fn new_listener(socket: impl AsRef<Path>, memory_source: MemorySource) -> CreateListener {
    CreateListener {
        socket: utf8(socket.as_ref()),
        memory_source,
        fault_around_kib: None,
        readahead_kib: None,
        working_set: false,
    }
}

/// The number of VM id `vm-N`.
pub fn vm_num(id: &str) -> u64 {
    id.strip_prefix("vm-")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a VM id: {id}"))
}

fn utf8(path: &Path) -> String {
    path.to_str()
        .unwrap_or_else(|| panic!("{} is not UTF-8", path.display()))
        .to_owned()
}

/// Guest agent ops as [`proto::api::ExecRequest`]s, each over an explicit
/// range.
pub mod op {
    use proto::api::ExecRequest;

    /// `fill` pages `[start, start+pages)` with `seed`'s pattern.
    pub fn fill(start: u64, pages: u64, seed: u64) -> ExecRequest {
        ExecRequest::Fill {
            start_page: Some(start),
            pages: Some(pages),
            seed,
        }
    }

    /// `touch` (read, or rewrite unchanged) pages `[start, start+pages)`.
    pub fn touch(start: u64, pages: u64, write: bool) -> ExecRequest {
        ExecRequest::Touch {
            start_page: Some(start),
            pages: Some(pages),
            write,
        }
    }

    /// `verify` pages `[start, start+pages)` against `seed`'s pattern.
    pub fn verify(start: u64, pages: u64, seed: u64) -> ExecRequest {
        ExecRequest::Verify {
            start_page: Some(start),
            pages: Some(pages),
            seed,
        }
    }

    /// The guest's `checksum` of `[start, start+pages)`.
    pub fn checksum(start: u64, pages: u64) -> ExecRequest {
        ExecRequest::Checksum {
            start_page: Some(start),
            pages: Some(pages),
        }
    }

    /// The VMM's `digest` of `[start, start+pages)`.
    pub fn digest(start: u64, pages: u64) -> ExecRequest {
        ExecRequest::Digest {
            start_page: Some(start),
            pages: Some(pages),
        }
    }

    /// The VM's id, read by the guest from an I/O port.
    pub fn identity() -> ExecRequest {
        ExecRequest::Identity {}
    }

    /// `disk_fill` `count` sectors from `sector` with `seed`'s pattern.
    pub fn disk_fill(sector: u64, count: u64, seed: u64) -> ExecRequest {
        ExecRequest::DiskFill {
            sector,
            count,
            seed,
            sectors_per_io: None,
        }
    }

    /// `disk_checksum` of `count` sectors from `sector`.
    pub fn disk_checksum(sector: u64, count: u64) -> ExecRequest {
        ExecRequest::DiskChecksum {
            sector,
            count,
            sectors_per_io: None,
        }
    }

    /// `disk_write_pages`: guest pages `[start, start+pages)` to the disk
    /// from `sector` on.
    pub fn disk_write_pages(start: u64, pages: u64, sector: u64) -> ExecRequest {
        ExecRequest::DiskWritePages {
            start_page: Some(start),
            pages: Some(pages),
            sector,
            sectors_per_io: None,
        }
    }
}
