//! Types that both sides of pagefork use: ids, page geometry, guest agent
//! operations and their reference implementations, and the opaque vCPU
//! state that travels from a VMM to the server and on to a fork child.
//!
//! This crate does no I/O.

pub mod error;
pub mod geometry;
pub mod id;
pub mod op;
pub mod pattern;
pub mod state;

pub use error::chain as error_chain;
pub use geometry::{GuestRegion, PAGE_SHIFT, PAGE_SIZE};
pub use id::{ParseVmIdError, VmId};
pub use op::{GuestOp, OpResult};
pub use state::{VcpuState, VmState};
