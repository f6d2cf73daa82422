//! pagefork's wire protocols.
//!
//! - [`frame`]: the length-prefixed frame format with SCM_RIGHTS fds, and
//!   blocking send/receive over a Unix stream socket.
//! - [`vmm`]: the messages a VMM and the server exchange in those frames.
//! - [`api`]: request and response bodies of the REST control API.
//! - [`snapshot`]: `state.json`, the description a snapshot directory holds.
//! - [`manifest`]: a snapshot in an object store, as every host reads it.
//!
//! Decoders never panic on bad bytes: every failure is an error value.

pub mod api;
pub mod firecracker;
pub mod frame;
pub mod fuzz;
pub mod manifest;
pub mod snapshot;
pub mod vmm;
