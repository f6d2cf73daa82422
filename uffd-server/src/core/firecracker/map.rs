//! A read-only shared mapping of a memory source file, the source of
//! every UFFDIO_COPY into a Firecracker process.

/// A read-only shared mapping of a source file.
#[derive(Debug)]
pub struct FileMap {
    ptr: std::ptr::NonNull<u8>,
    len: u64,
}

impl FileMap {
    /// Map `file` read-only.
    pub fn new(file: &std::fs::File, len: u64) -> Result<Self, String> {
        let n = std::num::NonZeroUsize::new(usize::try_from(len).unwrap_or(0))
            .ok_or("memory source is empty")?;
        // SAFETY: a fresh read-only shared mapping of a file we hold open;
        // no MAP_FIXED, unmapped in Drop.
        let ptr = unsafe {
            nix::sys::mman::mmap(
                None,
                n,
                nix::sys::mman::ProtFlags::PROT_READ,
                nix::sys::mman::MapFlags::MAP_SHARED,
                file,
                0,
            )
        }
        .map_err(|e| format!("cannot map the memory source: {e}"))?;
        Ok(FileMap {
            ptr: ptr.cast(),
            len,
        })
    }

    pub(super) fn at(&self, offset: u64, len: u64) -> Option<*const u8> {
        let end = offset.checked_add(len)?;
        // SAFETY: `offset + len <= self.len`, inside the mapping.
        (end <= self.len).then(|| unsafe {
            self.ptr.as_ptr().add(shared::geometry::usize_of(offset)) as *const u8
        })
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`.
        let _ = unsafe {
            nix::sys::mman::munmap(self.ptr.cast(), shared::geometry::usize_of(self.len))
        };
    }
}
