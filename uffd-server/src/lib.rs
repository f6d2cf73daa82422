//! The pagefork page server: owns guest RAM as memfds, keeps a page-source
//! table per VM, serves the VMs' userfaultfd faults, and exposes a REST
//! control API.

pub mod api;
pub mod conn;
pub mod core;
pub mod images;
pub mod memory;
pub mod pages;
pub mod snapshot;
pub mod volume;
