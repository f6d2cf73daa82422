//! Where every guest page's bytes come from: the source arena and the
//! chunked, copy-on-write page-source table.

pub mod source;
pub mod table;

pub use source::{FileSource, PageSource, SourceArena, SourceId, UNINITIALIZED};
pub use table::{Extent, PageTable, CHUNK_PAGES};
