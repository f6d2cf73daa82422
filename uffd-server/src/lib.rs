//! The pagefork page server: owns guest RAM as memfds, keeps a page-source
//! table per VM, serves the VMs' userfaultfd faults, and exposes a REST
//! control API.

pub mod client;
pub mod volume;
