//! `uffdctl` commands: thin wrappers over the control API that print
//! readable tables (or the raw JSON with `--json`).

pub mod demo;
pub mod firecracker;
pub mod inspect;
pub mod table;
pub mod vm;
