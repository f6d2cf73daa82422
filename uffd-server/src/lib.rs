//! The pagefork page server: owns guest RAM as memfds, keeps a page-source
//! table per VM, serves the VMs' userfaultfd faults, and exposes a REST
//! control API.

pub mod api;
pub mod bases;
pub mod conn;
pub mod core;
pub mod fdstore;
pub mod images;
pub mod keeper;
pub mod memory;
pub mod observe;
pub mod pages;
pub mod reclaim;
pub mod remote;
pub mod snapshot;

/// A hint to append to an I/O error that means the process ran out of file
/// descriptors (EMFILE, ENFILE); empty otherwise.
pub fn fd_hint(e: &std::io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EMFILE) => {
            "; the server is out of file descriptors: raise its limit (ulimit -n, LimitNOFILE=)"
        }
        Some(libc::ENFILE) => "; the system is out of file descriptors (fs.file-max)",
        _ => "",
    }
}
