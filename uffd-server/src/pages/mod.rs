//! Where every guest page's bytes come from: the source arena, the
//! chunked, copy-on-write page-source table, and the resolver that turns a
//! fault into a run of pages and their bytes (shared by our VMs and
//! Firecracker's).

pub mod anchor;
pub mod mirror;
pub mod process;
pub mod readahead;
pub mod resolve;
pub mod source;
pub mod table;

pub use readahead::{FaultAround, FaultAroundError, Readahead, MAX_FAULT_AROUND_KIB};
pub use resolve::{fault_on, plan_run, read_pages, Fault, Held, ResolveError, Run};
pub use source::{
    FileSource, FrozenKind, FrozenSource, ImageSource, PageSource, RemoteSource, SourceArena,
    SourceId, VmPages, ZstdSource, UNINITIALIZED,
};
pub use table::{Extent, PageTable, CHUNK_PAGES};
