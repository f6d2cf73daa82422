//! The private region's fixed content: page tables, GDT and agent code.
//!
//! They are the same in every VMM, so they are built when the crate is
//! compiled, into page-aligned read-only data of the binary ([`TABLES`],
//! [`CODE_AND_RAM_PDS`]). [`crate::memory`] maps those pages into the
//! region from the executable file: a host's VMMs share one copy of them in
//! the page cache instead of each holding 24 KiB of its own. The tables
//! identity-map all of `[0, MAX_RAM_END)` (a guest access above its RAM has
//! no KVM slot and stops the VM) with the accessed and dirty bits set
//! ahead, so neither the MMU nor KVM ever writes them.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::sync::{Mutex, OnceLock};

use vm_memory::MmapRegion;

use crate::agent;
use crate::layout::{offset, PRIV_BYTES};
use crate::layout::{
    CODE, CODE_MAX, GDT_ENTRIES, GIB, MAX_RAM_END, PDPT, PD_PRIV, PD_RAM, PRIV_BASE, PRIV_SIZE,
    PTE_ACCESSED, PTE_DIRTY, PTE_HUGE, PTE_PRESENT, PTE_WRITE, TWO_MIB,
};

/// Entries of one page-table page.
const ENTRIES: usize = 512;
/// Pages of agent code.
pub const CODE_PAGES: usize = (CODE_MAX / 0x1000) as usize;
/// Page directories for guest RAM: one per GiB below [`MAX_RAM_END`].
pub const RAM_PDS: usize = (MAX_RAM_END / GIB) as usize;
const _: () = assert!(PD_RAM == CODE + CODE_MAX);
const _: () = assert!(agent::CODE.len() as u64 <= CODE_MAX);

/// Whole pages of private-region content, page-aligned so that they can be
/// mapped from the executable file.
#[repr(C, align(4096))]
pub struct Pages<const N: usize>(pub [[u64; ENTRIES]; N]);

impl<const N: usize> Pages<N> {
    /// The pages as bytes.
    pub fn bytes(&self) -> &[u8] {
        let len = std::mem::size_of::<Self>();
        // SAFETY: `Self` is plain integers with no padding, `len` bytes
        // long and borrowed for the lifetime of the slice.
        unsafe { std::slice::from_raw_parts((self as *const Self).cast::<u8>(), len) }
    }
}

/// The private region from [`PRIV_BASE`]: PML4, PDPT, PD_PRIV and GDT.
pub static TABLES: Pages<4> = tables();

/// The private region from [`CODE`]: the agent code, then [`RAM_PDS`]
/// page directories mapping guest RAM.
pub static CODE_AND_RAM_PDS: Pages<{ CODE_PAGES + RAM_PDS }> = code_and_ram_pds(agent::CODE);

/// Flags of a table entry pointing at the next table.
const TABLE: u64 = PTE_PRESENT | PTE_WRITE | PTE_ACCESSED;
/// Flags of a 2 MiB page entry.
const LEAF: u64 = PTE_PRESENT | PTE_WRITE | PTE_HUGE | PTE_ACCESSED | PTE_DIRTY;

const fn tables() -> Pages<4> {
    let mut p = [[0u64; ENTRIES]; 4];
    let (pml4, pdpt, pd_priv, gdt) = (0, 1, 2, 3);
    p[pml4][0] = PDPT | TABLE;
    let mut g = 0;
    while g < RAM_PDS {
        p[pdpt][g] = (PD_RAM + g as u64 * 0x1000) | TABLE;
        g += 1;
    }
    p[pdpt][(PRIV_BASE / GIB) as usize] = PD_PRIV | TABLE;
    let mut i = 0;
    while i < PRIV_SIZE / TWO_MIB {
        let page = PRIV_BASE + i * TWO_MIB;
        p[pd_priv][((page % GIB) / TWO_MIB) as usize] = page | LEAF;
        i += 1;
    }
    let mut e = 0;
    while e < GDT_ENTRIES.len() {
        p[gdt][e] = GDT_ENTRIES[e];
        e += 1;
    }
    Pages(p)
}

const fn code_and_ram_pds(code: &[u8]) -> Pages<{ CODE_PAGES + RAM_PDS }> {
    let mut p = [[0u64; ENTRIES]; CODE_PAGES + RAM_PDS];
    let mut i = 0;
    while i < code.len() {
        let word = i / 8;
        p[word / ENTRIES][word % ENTRIES] |= (code[i] as u64) << ((i % 8) * 8);
        i += 1;
    }
    let mut g = 0;
    while g < RAM_PDS {
        let mut e = 0;
        while e < ENTRIES {
            p[CODE_PAGES + g][e] = (g as u64 * GIB + e as u64 * TWO_MIB) | LEAF;
            e += 1;
        }
        g += 1;
    }
    Pages(p)
}

/// The private region's fixed content: (guest-physical address, bytes).
/// Everything else in the region starts zero.
pub fn fixed_content() -> [(u64, &'static [u8]); 2] {
    [
        (PRIV_BASE, TABLES.bytes()),
        (CODE, CODE_AND_RAM_PDS.bytes()),
    ]
}

/// Where the fixed pages lie in the executable file.
#[derive(Debug)]
struct Source {
    file: File,
    /// File offset of each part of [`fixed_content`].
    offsets: [u64; 2],
}

static SOURCE: OnceLock<Option<Source>> = OnceLock::new();

/// A private region made ahead by [`prepare`].
static PREPARED: Mutex<Option<MmapRegion>> = Mutex::new(None);

fn other(msg: &str) -> io::Error {
    io::Error::other(msg.to_owned())
}

/// Find the fixed pages in the executable file, once per process.
fn source() -> Option<&'static Source> {
    SOURCE
        .get_or_init(|| match locate() {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(
                    "cannot map the private region's fixed pages from the executable ({e}); \
                     each VM gets a copy"
                );
                None
            }
        })
        .as_ref()
}

fn locate() -> io::Result<Source> {
    // The file this process runs, even if its path was replaced since.
    let file = File::open("/proc/self/exe")?;
    let ino = file.metadata()?.ino();
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    let mut offsets = [0; 2];
    for (o, (_, bytes)) in offsets.iter_mut().zip(fixed_content()) {
        *o = file_offset(&maps, bytes.as_ptr() as u64, ino)?;
    }
    Ok(Source { file, offsets })
}

/// The file offset of `addr`, which must lie in a mapping of the file with
/// inode `ino`, from `/proc/self/maps` text.
fn file_offset(maps: &str, addr: u64, ino: u64) -> io::Result<u64> {
    for line in maps.lines() {
        let mut f = line.split_ascii_whitespace();
        let (Some(range), Some(_perms), Some(off), Some(_dev), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            continue;
        };
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let hex = |s| u64::from_str_radix(s, 16);
        let (Ok(start), Ok(end), Ok(off), Ok(inode)) =
            (hex(start), hex(end), hex(off), inode.parse::<u64>())
        else {
            continue;
        };
        if (start..end).contains(&addr) {
            if inode != ino {
                return Err(other("the fixed pages are not mapped from the executable"));
            }
            return Ok(off + (addr - start));
        }
    }
    Err(other("no mapping holds the fixed pages"))
}

/// A fresh private region with the fixed content in place.
pub fn new_region() -> Result<MmapRegion, vm_memory::mmap::MmapRegionError> {
    let region = MmapRegion::new(PRIV_BYTES)?;
    let mapped = source().is_some_and(|s| map_from(s, region.as_ptr()).is_ok());
    if !mapped {
        for (gpa, bytes) in fixed_content() {
            // SAFETY: the region is PRIV_SIZE bytes of fresh memory this
            // function owns; every part of the content lies inside it.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    bytes.as_ptr(),
                    region.as_ptr().add(offset(gpa)),
                    bytes.len(),
                );
            }
        }
    }
    Ok(region)
}

/// Map the fixed content copy-on-write from the executable over the
/// region at `base`, and check that it reads back as built.
fn map_from(s: &Source, base: *mut u8) -> io::Result<()> {
    use nix::sys::mman::{mmap, MapFlags, ProtFlags};
    for ((gpa, bytes), off) in fixed_content().into_iter().zip(s.offsets) {
        // SAFETY: `base` is a fresh PRIV_SIZE mapping owned by the caller;
        // the part replaced lies inside it, and nothing refers to it yet.
        let at = unsafe { base.add(offset(gpa)) };
        let len = std::num::NonZeroUsize::new(bytes.len()).ok_or_else(|| other("empty part"))?;
        // SAFETY: MAP_FIXED replaces only pages of the region (see above).
        unsafe {
            mmap(
                std::num::NonZeroUsize::new(at as usize),
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE | MapFlags::MAP_FIXED,
                &s.file,
                i64::try_from(off).map_err(|_| other("file offset"))?,
            )
        }
        .map_err(io::Error::from)?;
        // The tables and the code must read back as built; the RAM page
        // directories are checked by the inode and offset they share.
        let check = bytes.len().min(CODE_PAGES * 0x1000);
        // SAFETY: `at..at + check` was just mapped readable.
        let got = unsafe { std::slice::from_raw_parts(at, check) };
        if got != &bytes[..check] {
            return Err(other("the executable's pages differ from the running code"));
        }
    }
    Ok(())
}

/// Make this process's first private region ahead of need (a pooled VMM
/// does this before the server's Welcome).
pub fn prepare() {
    match new_region() {
        Ok(r) => *PREPARED.lock().unwrap_or_else(|p| p.into_inner()) = Some(r),
        Err(e) => tracing::warn!("cannot make the private region ahead: {e}"),
    }
}

/// The host address of the region [`prepare`] made, while it is not
/// taken.
pub fn prepared_addr() -> Option<u64> {
    PREPARED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .map(|r| r.as_ptr() as u64)
}

/// The region [`prepare`] made, or a new one.
pub fn take_region() -> Result<MmapRegion, vm_memory::mmap::MmapRegionError> {
    match PREPARED.lock().unwrap_or_else(|p| p.into_inner()).take() {
        Some(r) => Ok(r),
        None => new_region(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{
        offset, DISK_BUF_END, DISK_READ_BUF, DISK_WRITE_BUF, GDT, MAILBOX, PML4, STACK_TOP,
    };

    fn entry(img: &[u8], gpa: u64) -> u64 {
        let o = offset(gpa);
        u64::from_le_bytes(img[o..o + 8].try_into().unwrap())
    }

    /// Walk the tables in `img` like the MMU does for a 2 MiB mapping.
    fn translate(img: &[u8], va: u64) -> Option<u64> {
        let pml4e = entry(img, PML4 + ((va >> 39) & 511) * 8);
        if pml4e & 1 == 0 {
            return None;
        }
        let pdpte = entry(img, (pml4e & !0xfff) + ((va >> 30) & 511) * 8);
        if pdpte & 1 == 0 {
            return None;
        }
        let pde = entry(img, (pdpte & !0xfff) + ((va >> 21) & 511) * 8);
        if pde & 1 == 0 || pde & PTE_HUGE == 0 {
            return None;
        }
        Some((pde & !(TWO_MIB - 1) & !(1 << 7)) + (va & (TWO_MIB - 1)))
    }

    /// The region's first bytes as the VMM lays them out.
    fn image() -> Vec<u8> {
        let mut img = vec![0u8; offset(PD_RAM) + RAM_PDS * 0x1000];
        for (gpa, bytes) in fixed_content() {
            img[offset(gpa)..offset(gpa) + bytes.len()].copy_from_slice(bytes);
        }
        img
    }

    #[test]
    fn page_tables_identity_map_ram_and_private_region() {
        let img = image();
        for va in [
            0,
            0x1234_5678,
            GIB,
            5 * GIB + 0x10_0000,
            MAX_RAM_END - 8,
            MAILBOX,
            CODE,
            STACK_TOP - 8,
            DISK_WRITE_BUF,
            DISK_READ_BUF + 0x1234,
            DISK_BUF_END - 8,
        ] {
            assert_eq!(translate(&img, va), Some(va), "va {va:#x}");
        }
        assert_eq!(translate(&img, PRIV_BASE + PRIV_SIZE), None);
        assert_eq!(translate(&img, PRIV_BASE + GIB), None);
        // Every entry on the way to the buffers is writable, and none
        // waits for the MMU to set its accessed or dirty bit: the tables
        // stay the binary's shared pages.
        for va in [0, GIB + 0x1000, DISK_WRITE_BUF, DISK_READ_BUF] {
            let pml4e = entry(&img, PML4 + ((va >> 39) & 511) * 8);
            let pdpte = entry(&img, (pml4e & !0xfff) + ((va >> 30) & 511) * 8);
            let pde = entry(&img, (pdpte & !0xfff) + ((va >> 21) & 511) * 8);
            assert!(pml4e & pdpte & pde & PTE_WRITE != 0, "va {va:#x}");
            assert!(pml4e & pdpte & pde & PTE_ACCESSED != 0, "va {va:#x}");
            assert!(pde & PTE_DIRTY != 0, "va {va:#x}");
        }
        let code = crate::agent::CODE;
        assert_eq!(&img[offset(CODE)..offset(CODE) + code.len()], code);
        for (i, e) in GDT_ENTRIES.iter().enumerate() {
            assert_eq!(entry(&img, GDT + i as u64 * 8), *e);
        }
    }

    #[test]
    fn a_new_region_maps_the_fixed_pages_from_the_executable() {
        let region = new_region().unwrap();
        let base = region.as_ptr() as u64;
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        for (gpa, bytes) in fixed_content() {
            let at = base + offset(gpa) as u64;
            // SAFETY: the region is mapped and `at..at + len` lies inside it.
            let got = unsafe { std::slice::from_raw_parts(at as *const u8, bytes.len()) };
            assert!(got == bytes, "part at {gpa:#x} reads back as built");
            let line = maps
                .lines()
                .find(|l| {
                    let (s, e) = l
                        .split_whitespace()
                        .next()
                        .unwrap()
                        .split_once('-')
                        .unwrap();
                    let (s, e) = (
                        u64::from_str_radix(s, 16).unwrap(),
                        u64::from_str_radix(e, 16).unwrap(),
                    );
                    (s..e).contains(&at)
                })
                .unwrap();
            assert!(
                line.ends_with(exe.to_str().unwrap()) && line.contains(" rw-p "),
                "part at {gpa:#x} is a private mapping of the executable: {line}"
            );
        }
        // The mailbox between the parts is the region's own zero memory.
        // SAFETY: as above.
        let mailbox = unsafe {
            std::slice::from_raw_parts((base + offset(MAILBOX) as u64) as *const u8, 0x4000)
        };
        assert!(mailbox.iter().all(|b| *b == 0));
    }

    #[test]
    fn file_offsets_come_from_the_mapping_of_the_executable() {
        let maps = "55d0c000-55d0e000 r--p 00001000 08:01 77 /bin/vmm\n\
                    55d0e000-55d12000 r--p 00005000 08:01 77 /bin/vmm\n\
                    7f000000-7f001000 rw-p 00000000 00:00 0\n";
        assert_eq!(file_offset(maps, 0x55d0_f000, 77).unwrap(), 0x6000);
        assert_eq!(file_offset(maps, 0x55d0_c000, 77).unwrap(), 0x1000);
        assert!(file_offset(maps, 0x55d0_f000, 78).is_err(), "another file");
        assert!(
            file_offset(maps, 0x7f00_0000, 77).is_err(),
            "anonymous memory"
        );
        assert!(file_offset(maps, 0x1000, 77).is_err(), "unmapped");
    }
}
