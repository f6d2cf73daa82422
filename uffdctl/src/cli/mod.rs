//! `uffdctl` commands: thin wrappers over the control API that print
//! readable tables (or the raw JSON with `--json`).

pub mod demo;
pub mod firecracker;
pub mod image;
pub mod inspect;
pub mod map;
pub mod observe;
pub mod qcow2;
pub mod remote;
pub mod server;
pub mod snapshot;
pub mod table;
pub mod top;
pub mod vm;
pub mod volume;

/// A request body from its `proto::api` type.
pub fn body<T: serde::Serialize>(req: &T) -> serde_json::Value {
    // Plain data types always encode.
    serde_json::to_value(req).unwrap_or_default()
}
