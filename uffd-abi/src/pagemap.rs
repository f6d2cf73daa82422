//! Which pages of another process's guest RAM are its own: `PAGEMAP_SCAN`
//! (Linux 6.7) on `/proc/<pid>/pagemap`.
//!
//! A VM on a shared base maps the base's pages read-only; on the guest's
//! first write to one the kernel copies it into a private, anonymous page
//! of the VMM, without a userfaultfd event. The server learns which pages
//! a VM holds privately by asking the kernel: a present page that is
//! neither a file page nor the shared zero page is the VM's own. One scan
//! walks only the page tables of the range (measured here: 0.6 ms for a
//! 1 GiB range with 64 MiB mapped, 2.5 ms for 256 MiB all mapped).
//!
//! The kernel's header on this machine's distribution predates the ioctl,
//! so its layout is written out here and checked at compile time.

use std::fs::File;
use std::mem::size_of;
use std::os::fd::AsRawFd;

use nix::errno::Errno;
use nix::sys::ioctl::ioctl_num_type;

/// `PAGE_IS_FILE`: a page of a file (or shared anonymous memory).
pub const PAGE_IS_FILE: u64 = 1 << 2;
/// `PAGE_IS_PRESENT`: mapped.
pub const PAGE_IS_PRESENT: u64 = 1 << 3;
/// `PAGE_IS_PFNZERO`: the shared zero page.
pub const PAGE_IS_PFNZERO: u64 = 1 << 5;

/// `struct page_region`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// `struct pm_scan_arg`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

const _: () = assert!(size_of::<PageRegion>() == 24);
const _: () = assert!(size_of::<PmScanArg>() == 96);

/// `PAGEMAP_SCAN`: `_IOWR('f', 16, struct pm_scan_arg)`.
pub const PAGEMAP_SCAN: ioctl_num_type =
    nix::request_code_readwrite!(b'f', 16, size_of::<PmScanArg>());

/// Regions asked for per ioctl; a scan that fills them goes on from where
/// the kernel stopped.
const REGIONS_PER_CALL: usize = 1024;

/// A process's `/proc/<pid>/pagemap`, opened once.
#[derive(Debug)]
pub struct Pagemap(File);

impl Pagemap {
    /// Open process `pid`'s pagemap (needs the right to read its memory).
    pub fn open(pid: u32) -> std::io::Result<Self> {
        File::open(format!("/proc/{pid}/pagemap")).map(Self)
    }

    /// Whether every page of `[start, start + len)` (addresses in that
    /// process) is mapped now: a plain read of the pagemap's entries (bit
    /// 63), which never faults a page in. Reading a page that is not
    /// mapped out of another process (`process_vm_readv`) would fault it
    /// in through that process's userfaultfd and wait for it to be served.
    pub fn all_present(&self, start: u64, len: u64) -> std::io::Result<bool> {
        use std::os::unix::fs::FileExt;
        const PRESENT: u64 = 1 << 63;
        let (first, pages) = (start / 4096, len.div_ceil(4096));
        let mut buf = vec![0u8; usize::try_from(pages * 8).map_err(std::io::Error::other)?];
        self.0.read_exact_at(&mut buf, first * 8)?;
        Ok(buf.chunks_exact(8).all(|e| {
            let mut w = [0u8; 8];
            w.copy_from_slice(e);
            u64::from_ne_bytes(w) & PRESENT != 0
        }))
    }

    /// The runs of `[start, end)` (addresses in that process) mapped to
    /// its own anonymous pages, as `(address, bytes)` in address order:
    /// present, not a file page, not the zero page.
    pub fn private_runs(&self, start: u64, end: u64) -> Result<Vec<(u64, u64)>, Errno> {
        self.scan(
            start,
            end,
            PAGE_IS_PRESENT | PAGE_IS_FILE | PAGE_IS_PFNZERO,
            PAGE_IS_FILE | PAGE_IS_PFNZERO,
        )
    }

    /// The runs of `[start, end)` mapped to pages of a file (a shared
    /// base's page cache), as [`Self::private_runs`].
    pub fn file_runs(&self, start: u64, end: u64) -> Result<Vec<(u64, u64)>, Errno> {
        self.scan(start, end, PAGE_IS_PRESENT | PAGE_IS_FILE, 0)
    }

    /// The runs of `[start, end)` mapped to pages the process shares: a
    /// file's (a base's page cache) or the zero page. A write to one is a
    /// copy on write, which raises no userfaultfd event unless the page is
    /// write-protected.
    pub fn shared_runs(&self, start: u64, end: u64) -> Result<Vec<(u64, u64)>, Errno> {
        self.scan_any(start, end, PAGE_IS_FILE | PAGE_IS_PFNZERO)
    }

    /// The runs of present pages of `[start, end)` with any of the
    /// categories `any`.
    fn scan_any(&self, start: u64, end: u64, any: u64) -> Result<Vec<(u64, u64)>, Errno> {
        self.scan_with(start, end, PAGE_IS_PRESENT, 0, any)
    }

    /// The runs of pages of `[start, end)` whose categories, with
    /// `inverted` flipped, include all of `mask`.
    fn scan(
        &self,
        start: u64,
        end: u64,
        mask: u64,
        inverted: u64,
    ) -> Result<Vec<(u64, u64)>, Errno> {
        self.scan_with(start, end, mask, inverted, 0)
    }

    /// [`Self::scan`], and with any of `any` too (0: no such condition).
    fn scan_with(
        &self,
        start: u64,
        end: u64,
        mask: u64,
        inverted: u64,
        any: u64,
    ) -> Result<Vec<(u64, u64)>, Errno> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut regions = vec![PageRegion::default(); REGIONS_PER_CALL];
        let mut at = start;
        while at < end {
            let mut arg = PmScanArg {
                size: size_of::<PmScanArg>() as u64,
                start: at,
                end,
                vec: regions.as_mut_ptr() as u64,
                vec_len: REGIONS_PER_CALL as u64,
                category_mask: mask,
                category_inverted: inverted,
                category_anyof_mask: any,
                return_mask: PAGE_IS_PRESENT,
                ..PmScanArg::default()
            };
            // SAFETY: `arg` is a live pm_scan_arg of the size the request
            // number says; the kernel writes at most `vec_len` regions into
            // `regions`, which outlives the call.
            let ret = unsafe { libc::ioctl(self.0.as_raw_fd(), PAGEMAP_SCAN, &mut arg) };
            let n = usize::try_from(Errno::result(ret)?).unwrap_or(0);
            for r in regions.iter().take(n) {
                match runs.last_mut() {
                    Some(last) if last.0 + last.1 == r.start => last.1 += r.end - r.start,
                    _ => runs.push((r.start, r.end - r.start)),
                }
            }
            if arg.walk_end <= at {
                break;
            }
            at = arg.walk_end;
        }
        Ok(runs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_number_matches_the_kernel_header() {
        assert_eq!(PAGEMAP_SCAN, 0xc060_6610);
    }

    #[test]
    fn finds_the_pages_a_private_file_mapping_wrote() {
        use std::io::Write;
        // A file mapping read in full, a few pages written: only those are
        // the process's own.
        let mut f = tempfile_in_memory();
        f.write_all(&vec![7u8; 16 * 4096]).unwrap();
        // SAFETY: a fresh private mapping of a file this test owns.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                16 * 4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let base = p as u64;
        for i in 0..16 {
            // SAFETY: inside the mapping made above.
            unsafe { std::ptr::read_volatile((base + i * 4096) as *const u8) };
        }
        for i in [3u64, 4, 9] {
            // SAFETY: inside the mapping made above.
            unsafe { std::ptr::write_volatile((base + i * 4096) as *mut u8, 1) };
        }
        let pm = Pagemap::open(std::process::id()).unwrap();
        let runs = match pm.private_runs(base, base + 16 * 4096) {
            Err(Errno::EINVAL | Errno::ENOTTY) => return, // A kernel before 6.7.
            r => r.unwrap(),
        };
        assert_eq!(
            runs,
            vec![(base + 3 * 4096, 2 * 4096), (base + 9 * 4096, 4096)]
        );
        // What it did not write it shares with the file.
        assert_eq!(
            pm.shared_runs(base, base + 16 * 4096).unwrap(),
            vec![
                (base, 3 * 4096),
                (base + 5 * 4096, 4 * 4096),
                (base + 10 * 4096, 6 * 4096)
            ]
        );
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(p, 16 * 4096) };
    }

    fn tempfile_in_memory() -> File {
        // SAFETY: memfd_create with a valid name and flags.
        let fd = unsafe { libc::memfd_create(c"pagemap-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: `fd` was just created and is owned by the File alone.
        unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) }
    }
}
