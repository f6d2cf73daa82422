//! Memory images and what the guest must report on them: random and
//! realistic images, and the reference `checksum`, `digest` and `fill`
//! from [`shared::pattern`].

use std::io::Write;
use std::path::PathBuf;

use proto::api::{MemorySource, VmInfo};
use rand::{RngCore, SeedableRng};
use shared::PAGE_SIZE;

/// A raw memory image file of random content, and its bytes.
#[derive(Debug)]
pub struct RandomImage {
    pub file: tempfile::NamedTempFile,
    pub bytes: Vec<u8>,
}

impl RandomImage {
    /// An image of `mib` MiB filled from a seeded RNG.
    pub fn new(mib: u64, seed: u64) -> Self {
        let len = usize::try_from(mib << 20).expect("image size fits in usize");
        let mut bytes = vec![0u8; len];
        rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut bytes);
        Self::from_bytes(bytes)
    }

    /// An image holding exactly `bytes`.
    pub fn from_bytes(bytes: Vec<u8>) -> Self {
        let mut file = tempfile::Builder::new()
            .prefix("pagefork-image-")
            .tempfile()
            .expect("cannot create image");
        file.write_all(&bytes).expect("cannot write image");
        file.flush().expect("cannot flush image");
        RandomImage { file, bytes }
    }

    /// The image's path as a string for `memory_source`.
    pub fn path(&self) -> String {
        self.file
            .path()
            .to_str()
            .expect("temp path is UTF-8")
            .to_owned()
    }

    /// This image as a VM's or listener's `memory_source`.
    pub fn source(&self) -> MemorySource {
        MemorySource::File { path: self.path() }
    }
}

/// Guest memory that compresses like real memory does, not 1000:1: the
/// bytes of the system's shared libraries and binaries, with runs of zero
/// pages (about a third, some whole frames) and a zero tail.
pub fn realistic_memory(mib: u64) -> Vec<u8> {
    let len = usize::try_from(mib << 20).expect("fits");
    let mut mem = Vec::with_capacity(len);
    let mut dirs = vec![
        PathBuf::from("/usr/lib/x86_64-linux-gnu"),
        PathBuf::from("/usr/bin"),
    ];
    while mem.len() < len {
        let Some(dir) = dirs.pop() else {
            // Not enough files: pad with a seeded pattern.
            let n = mem.len();
            mem.extend((n..len).map(|i| u8::try_from(i * 7 % 251).unwrap_or(0)));
            break;
        };
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut files: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
        files.sort();
        for f in files {
            if mem.len() >= len {
                break;
            }
            if f.is_file() {
                if let Ok(b) = std::fs::read(&f) {
                    mem.extend_from_slice(&b[..b.len().min(len - mem.len())]);
                }
            }
        }
    }
    mem.truncate(len);
    // Zero runs: 12 of every 32 pages, and the last 100 pages.
    let pages = len / PAGE_BYTES;
    for p in 0..pages {
        if p % 32 >= 20 || p >= pages - 100 {
            mem[p * PAGE_BYTES..(p + 1) * PAGE_BYTES].fill(0);
        }
    }
    mem
}

const PAGE_BYTES: usize = 4096;

/// Pages in `mib` MiB.
pub fn pages_of(mib: u64) -> u64 {
    (mib << 20) / PAGE_SIZE
}

/// Guest `checksum` of pages `[start, start+pages)` of memory `mem`
/// (which starts at guest page 0).
pub fn expected_checksum(mem: &[u8], start: u64, pages: u64) -> u64 {
    shared::pattern::checksum(mem, 0, start, pages)
}

/// VMM `digest` of pages `[start, start+pages)` of memory `mem`.
pub fn expected_digest(mem: &[u8], start: u64, pages: u64) -> u64 {
    shared::pattern::digest(mem, 0, start, pages)
}

/// Apply the guest's `fill` of `seed` to pages `[start, start+pages)` of `mem`.
pub fn apply_fill(mem: &mut [u8], start: u64, pages: u64, seed: u64) {
    let ps = usize::try_from(PAGE_SIZE).expect("page size fits");
    for p in start..start + pages {
        let b = usize::try_from(p).expect("page fits") * ps;
        shared::pattern::fill_page(&mut mem[b..b + ps], p, seed);
    }
}

/// Memory of `mib` MiB of zeroes with `fill` of `seed` applied to all pages.
pub fn filled_zero_memory(mib: u64, seed: u64) -> Vec<u8> {
    let mut mem = vec![0u8; usize::try_from(mib << 20).expect("size fits")];
    apply_fill(&mut mem, 0, pages_of(mib), seed);
    mem
}

/// Pages of a VM with source kind `kind` (0 if the kind is absent).
pub fn pages_by(vm: &VmInfo, kind: &str) -> u64 {
    vm.pages.get(kind).copied().unwrap_or(0)
}

/// Sum of a VM's pages over all source kinds.
pub fn pages_total(vm: &VmInfo) -> u64 {
    vm.pages.values().sum()
}
