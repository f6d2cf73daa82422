//! What reclaim under memory pressure needs below the core: the memory
//! limits that apply to the server ([`cgroup`]) and the store of guest
//! pages compressed out of memory ([`store`]).

pub mod cgroup;
/// The swap store (its own crate, so the fuzzer builds it alone).
pub use swapstore as store;
