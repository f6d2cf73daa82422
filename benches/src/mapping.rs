//! Owned memory mappings for the in-process baselines: a shared memfd (as
//! pagefork's guest RAM), a private read-write mapping of a memfd (guest
//! RAM over a shared base), anonymous private memory (as Firecracker's
//! guest RAM) and a private read-only file mapping (as Firecracker's example
//! handler maps the snapshot file). Unmapped on drop.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use shared::PAGE_SIZE;

/// Bytes per page as `usize`.
pub const PAGE: usize = 4096;
const _: () = assert!(PAGE as u64 == PAGE_SIZE);

/// Errors of creating a mapping.
#[derive(Debug, thiserror::Error)]
pub enum MappingError {
    #[error("cannot create a memfd of {len} bytes")]
    CreateMemfd {
        len: usize,
        #[source]
        source: io::Error,
    },
    #[error("cannot open {path}")]
    OpenFile {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot duplicate the base memfd's descriptor")]
    DupBase(#[source] io::Error),
    #[error("cannot map {len} bytes")]
    Map {
        len: usize,
        #[source]
        source: io::Error,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, MappingError>;

/// One mmap, unmapped on drop. Keeps its backing file open.
#[derive(Debug)]
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
    _file: Option<File>,
}

// SAFETY: the mapping is plain memory owned by this value; accesses through
// the raw pointer are the caller's responsibility (the benches only read or
// write through `ptr()` from one thread at a time, or via the kernel).
unsafe impl Send for Mapping {}

fn mmap(len: usize, prot: libc::c_int, flags: libc::c_int, fd: libc::c_int) -> Result<*mut u8> {
    // SAFETY: a fresh mapping at a kernel-chosen address; no existing memory
    // is affected. The result is checked against MAP_FAILED.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(MappingError::Map {
            len,
            source: io::Error::last_os_error(),
        });
    }
    Ok(p.cast())
}

impl Mapping {
    /// A memfd of `len` bytes mapped MAP_SHARED read-write (nothing populated).
    pub fn shared_memfd(len: usize) -> Result<Mapping> {
        Self::memfd(len, memfd::MemfdOptions::default(), libc::MAP_SHARED)
    }

    /// A hugetlb memfd (2 MiB pages) of `len` bytes (a multiple of 2 MiB)
    /// mapped MAP_SHARED | MAP_NORESERVE read-write: pages come from the
    /// host's hugepage pool when first touched.
    pub fn shared_hugetlb_memfd(len: usize) -> Result<Mapping> {
        Self::memfd(
            len,
            memfd::MemfdOptions::default().hugetlb(Some(memfd::HugetlbSize::Huge2MB)),
            libc::MAP_SHARED | libc::MAP_NORESERVE,
        )
    }

    /// The first `len` bytes of the memfd `base` mapped MAP_PRIVATE
    /// read-write: reads see the base's pages, writes copy them into
    /// private anonymous pages. Keeps its own handle on `base`.
    pub fn private_memfd(base: &File, len: usize) -> Result<Mapping> {
        let file = base.try_clone().map_err(MappingError::DupBase)?;
        let ptr = mmap(
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE,
            file.as_raw_fd(),
        )?;
        Ok(Mapping {
            ptr,
            len,
            _file: Some(file),
        })
    }

    fn memfd(len: usize, options: memfd::MemfdOptions, flags: libc::c_int) -> Result<Mapping> {
        let memfd = options
            .close_on_exec(true)
            .create("pagefork-bench")
            .map_err(|e| MappingError::CreateMemfd {
                len,
                source: io::Error::other(e.to_string()),
            })?;
        let file = memfd.into_file();
        file.set_len(len as u64)
            .map_err(|source| MappingError::CreateMemfd { len, source })?;
        let ptr = mmap(
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            file.as_raw_fd(),
        )?;
        Ok(Mapping {
            ptr,
            len,
            _file: Some(file),
        })
    }

    /// Anonymous private read-write memory (nothing populated).
    pub fn anonymous(len: usize) -> Result<Mapping> {
        let ptr = mmap(
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
        )?;
        Ok(Mapping {
            ptr,
            len,
            _file: None,
        })
    }

    /// The first `len` bytes of `path`, mapped MAP_PRIVATE read-only.
    pub fn private_file(path: &Path, len: usize) -> Result<Mapping> {
        let file = File::open(path).map_err(|source| MappingError::OpenFile {
            path: path.display().to_string(),
            source,
        })?;
        let ptr = mmap(len, libc::PROT_READ, libc::MAP_PRIVATE, file.as_raw_fd())?;
        Ok(Mapping {
            ptr,
            len,
            _file: Some(file),
        })
    }

    /// Start of the mapping.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never: mmap refuses length 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Write one byte into each page of `[0, bytes)` so every page is
    /// allocated and mapped writable.
    pub fn populate(&self, bytes: usize) {
        for off in (0..bytes.min(self.len)).step_by(PAGE) {
            // SAFETY: off < len, inside our read-write mapping.
            unsafe { self.ptr.add(off).write_volatile(1) };
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned; nothing borrows the
        // memory past the owner's lifetime.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}
