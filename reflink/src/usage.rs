//! Space accounting of one file from its FIEMAP extents: how many bytes are
//! allocated, and how many of those are shared with other files (reflinked
//! by a snapshot, a clone or a fork) versus exclusive to this file.
//!
//! This answers the `zfs list used/refer` question: deleting a file frees
//! about its exclusive bytes; its shared bytes stay as long as another file
//! references them.

use std::fs::File;

use crate::ffi::{self, Extent, FIEMAP_EXTENT_SHARED};

/// Space taken by one file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes of the file's allocated extents.
    pub allocated_bytes: u64,
    /// Of those, bytes whose blocks another file shares (reflinked).
    pub shared_bytes: u64,
    /// Of those, bytes only this file holds: about what deleting it frees.
    pub exclusive_bytes: u64,
}

/// Sum a file's extents into a [`Usage`].
pub fn usage_of_extents(extents: &[Extent]) -> Usage {
    let mut u = Usage::default();
    for e in extents {
        u.allocated_bytes = u.allocated_bytes.saturating_add(e.length);
        if e.flags & FIEMAP_EXTENT_SHARED != 0 {
            u.shared_bytes = u.shared_bytes.saturating_add(e.length);
        }
    }
    u.exclusive_bytes = u.allocated_bytes - u.shared_bytes;
    u
}

/// The [`Usage`] of `file` (flushes its dirty data first).
pub fn usage(file: &File) -> std::io::Result<Usage> {
    Ok(usage_of_extents(&ffi::fiemap(file)?))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn splits_shared_and_exclusive() {
        let ext = |length, flags| Extent {
            logical: 0,
            physical: 0,
            length,
            flags,
        };
        let u = usage_of_extents(&[
            ext(4096, 0),
            ext(8192, FIEMAP_EXTENT_SHARED),
            ext(4096, 0x1),
        ]);
        assert_eq!(
            u,
            Usage {
                allocated_bytes: 16384,
                shared_bytes: 8192,
                exclusive_bytes: 8192
            }
        );
    }

    #[test]
    fn sparse_file_allocates_nothing_and_written_file_allocates() {
        let dir = tempfile::tempdir().unwrap();
        let f = File::create(dir.path().join("f")).unwrap();
        f.set_len(1 << 20).unwrap();
        assert_eq!(usage(&f).unwrap().allocated_bytes, 0);
        (&f).write_all(&[1u8; 65536]).unwrap();
        let u = usage(&f).unwrap();
        assert!(u.allocated_bytes >= 65536, "{u:?}");
        assert_eq!(u.shared_bytes, 0);
    }
}
