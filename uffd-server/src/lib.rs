//! The pagefork page server: owns guest RAM as memfds, keeps a page-source
//! table per VM, serves the VMs' userfaultfd faults, and exposes a REST
//! control API.

pub mod api;
pub mod cli;
pub mod cli_volume;
pub mod client;
pub mod core;
pub mod firecracker;
pub mod memory;
pub mod pages;
pub mod vmm_conn;
pub mod volume;
