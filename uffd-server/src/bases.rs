//! Shared bases: memory every VM on the same template or image maps, not
//! copies.
//!
//! A VM on a base has its guest RAM mapped private over the base's memfd
//! by its VMM (`MemoryKind::Base`) and registered MINOR as well: a page
//! the base holds faults MINOR and is mapped from it with UFFDIO_CONTINUE,
//! the same page-cache page for every VM on that base; the guest's first
//! write to it makes the kernel copy it into a private page of that VMM.
//! A page the base lacks is filled into it once (from the image, a
//! decoded frame), then mapped; the next VM to read it shares it.
//!
//! Two kinds:
//! - a **template** base is the memfd of a paused VM that was forked: its
//!   pages are those its table said it held at the fork, and they never
//!   change again (the VM itself is moved onto it, private, before it
//!   runs again);
//! - an **image** base mirrors one image file (a snapshot's `memory.img`,
//!   a raw or compressed image) and is filled as VMs fault; it is one per
//!   image and host, found by the file's identity, and lives while a VM
//!   maps it.
//!
//! Invariant: a page of a base, once there, never changes while the base
//! lives (VMs map it read-only; the server writes only pages the base does
//! not hold yet, which no VM can map).

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::rc::{Rc, Weak};

use shared::VmId;
use vm_memory::VolatileSlice;

use crate::images::ImageId;
use crate::memory::{GuestMemory, MemoryError, PageSize};
use crate::pages::resolve::{read_pages, ResolveError};
use crate::pages::source::PageSource;
use crate::snapshot::pageset::PageSet;

thread_local! {
    /// Where [`Base::fill`] reads a run before writing it into the base.
    static FILL: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Which image a base mirrors: the image's identity, and whether its
/// pages are 2 MiB ones (a 4 KiB base and a hugetlb base are different
/// memfds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ImageKey {
    pub image: ImageId,
    pub huge: bool,
}

impl ImageKey {
    /// The key of the image `image` for memory of `page_size` pages.
    pub fn new(image: ImageId, page_size: PageSize) -> Self {
        ImageKey {
            image,
            huge: page_size == PageSize::Huge2M,
        }
    }
}

/// What a base is the memory of.
#[derive(Debug)]
pub enum Origin {
    /// A paused VM's memfd, frozen when it was first forked.
    Template(VmId),
    /// An image file, filled as VMs fault (`filled`: the pages it holds).
    Image {
        key: ImageKey,
        filled: RefCell<PageSet>,
    },
}

/// One shared base.
#[derive(Debug)]
pub struct Base {
    /// `base-N`, for the API.
    pub id: u32,
    /// What VMs map: the memfd and the server's mapping of it (through
    /// which the server fills pages the base lacks).
    pub memory: Rc<GuestMemory>,
    pub origin: Origin,
    /// What it mirrors, for the API: `vm-3`, `snapshot:gold`, a path.
    pub what: String,
}

/// Why a base cannot be made or filled.
#[derive(Debug, thiserror::Error)]
pub enum BaseError {
    #[error("cannot create the memfd of a shared base")]
    Create(#[source] MemoryError),
}

impl Base {
    /// `base-N`.
    pub fn name(&self) -> String {
        format!("base-{}", self.id)
    }

    /// Whether the base holds every page of `[lo, hi)`. A template base
    /// holds every page whose table entry names it (the caller's check).
    pub fn holds(&self, lo: u64, hi: u64) -> bool {
        match &self.origin {
            Origin::Template(_) => true,
            Origin::Image { filled, .. } => filled.borrow().all_in(lo, hi),
        }
    }

    /// Fill the pages of `[lo, hi)` the base lacks from `source` (the
    /// image it mirrors), whole units at a time (2 MiB on hugetlb), into
    /// the memfd (by `pwrite` from a buffer; through the server's mapping
    /// on hugetlb). No VM maps those pages yet
    /// (a page the base lacks cannot be mapped), so none can see one half
    /// written. Returns the pages filled. A compressed image's frames not
    /// decoded yet come back as `ResolveError::NotDecoded`, as for a
    /// fault; the pages filled before them stay.
    pub fn fill(&self, source: &PageSource, lo: u64, hi: u64) -> Result<u64, ResolveError> {
        let Origin::Image { filled, .. } = &self.origin else {
            return Ok(0);
        };
        let (lo, hi) = self.memory.unit_range(lo, hi);
        let mut done = 0;
        let mut p = lo;
        while p < hi {
            if filled.borrow().contains(p) {
                p += 1;
                continue;
            }
            let mut end = p + 1;
            while end < hi && !filled.borrow().contains(end) {
                end += 1;
            }
            let (a, b) = self.memory.unit_range(p, end);
            if self.memory.unit_pages() == 1 {
                // Read into a buffer, then `pwrite`: a page written
                // through the mapping is present from its first byte, so
                // a crash of the server in the middle of one would leave
                // a half-written page that the next server, which takes
                // the base's filled pages from the memfd's present ones,
                // maps into VMs. A `write` copies whole pages and stops
                // between two at a fatal signal.
                FILL.with(|buf| {
                    let mut buf = buf.borrow_mut();
                    let bytes = shared::geometry::usize_of((b - a) * shared::PAGE_SIZE);
                    if buf.len() < bytes {
                        buf.resize(bytes, 0);
                    }
                    let dst = VolatileSlice::from(&mut buf[..bytes]);
                    read_pages(source, a, &dst, &|_| None)?;
                    self.memory
                        .memfd()
                        .write_all_at(&buf[..bytes], a * shared::PAGE_SIZE)
                        .map_err(|e| ResolveError::Memory(MemoryError::Write(e)))
                })?;
            } else {
                // hugetlbfs takes no `write`: through the mapping. (A
                // crash mid-block can leave that block half written; a
                // hugetlb base is rare and its blocks are filled in one
                // copy each.)
                let dst = self.memory.slice(a, b - a)?;
                read_pages(source, a, &dst, &|_| None)?;
            }
            filled.borrow_mut().insert_range(a, b - a);
            done += b - a;
            p = b;
        }
        Ok(done)
    }

    /// Drop up to `max` pages an image base holds, from page `from` on:
    /// the image has the same bytes, and a VM's next access to one fills
    /// it again (the pages leave every VM's mapping with the memfd's).
    /// Returns the pages dropped and where to go on next time (0 once the
    /// end is reached). A template base holds bytes nothing else has, and
    /// a hugetlb base is left whole: neither drops anything.
    pub fn drop_clean(&self, from: u64, max: u64) -> Result<(u64, u64), MemoryError> {
        let Origin::Image { filled, .. } = &self.origin else {
            return Ok((0, 0));
        };
        if self.memory.unit_pages() != 1 {
            return Ok((0, 0));
        }
        let runs = filled.borrow().runs();
        let mut dropped = 0;
        let mut next = 0;
        for (first, n) in runs.into_iter().filter(|(f, n)| f + n > from) {
            let a = first.max(from);
            let b = (first + n).min(a + (max - dropped));
            self.memory.punch_hole(a, b - a)?;
            let mut f = filled.borrow_mut();
            for p in a..b {
                f.remove(p);
            }
            dropped += b - a;
            next = b;
            if dropped >= max {
                break;
            }
        }
        Ok((dropped, if dropped >= max { next } else { 0 }))
    }

    /// Bytes of host memory the base holds.
    pub fn bytes(&self) -> u64 {
        self.memory.allocated_bytes()
    }
}

/// Why this host cannot serve VMs on shared bases.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("the kernel cannot register shared memory for MINOR userfaultfd faults (Linux 5.14+)")]
    Minor(#[source] userfaultfd::Error),
    #[error(
        "the kernel has no PAGEMAP_SCAN to tell a VM's own pages from its base's (Linux 6.7+)"
    )]
    PagemapScan(#[source] nix::errno::Errno),
    #[error("cannot read this process's pagemap")]
    Pagemap(#[source] std::io::Error),
}

/// Check, once at start, what shared bases need of the kernel: MINOR
/// faults on shmem and PAGEMAP_SCAN.
pub fn probe() -> Result<(), ProbeError> {
    use userfaultfd::{FeatureFlags, UffdBuilder};
    UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(true)
        .require_features(FeatureFlags::from_bits_retain(
            uffd_abi::UFFD_FEATURE_MINOR_SHMEM,
        ))
        .create()
        .map_err(ProbeError::Minor)?;
    let pagemap =
        uffd_abi::pagemap::Pagemap::open(std::process::id()).map_err(ProbeError::Pagemap)?;
    let probe = [0u8; 4096];
    let at = probe.as_ptr() as u64 & !4095;
    pagemap
        .private_runs(at, at + 4096)
        .map_err(ProbeError::PagemapScan)?;
    Ok(())
}

/// Every base of the server: image bases by the identity of their file.
#[derive(Debug, Default)]
pub struct Bases {
    by_image: HashMap<ImageKey, Weak<Base>>,
    all: Vec<Weak<Base>>,
    next: u32,
}

impl Bases {
    /// The base of the image `key` (`what` names it), made empty on first
    /// use, of `size` bytes of `page_size` pages.
    pub fn for_image(
        &mut self,
        key: ImageKey,
        what: &str,
        size: u64,
        page_size: PageSize,
    ) -> Result<Rc<Base>, BaseError> {
        if let Some(b) = self.by_image.get(&key).and_then(Weak::upgrade) {
            if b.memory.size() >= size {
                return Ok(b);
            }
        }
        self.next += 1;
        let id = self.next;
        let memory = GuestMemory::create_with(&format!("pagefork-base-{id}"), size, page_size)
            .map_err(BaseError::Create)?;
        let pages = memory.pages();
        let base = Rc::new(Base {
            id,
            memory: Rc::new(memory),
            origin: Origin::Image {
                key,
                filled: RefCell::new(PageSet::new(pages)),
            },
            what: what.to_owned(),
        });
        self.by_image.insert(key, Rc::downgrade(&base));
        self.remember(&base);
        Ok(base)
    }

    /// A template base over `memory`, the memfd of the paused VM `vm`.
    pub fn template(&mut self, vm: VmId, memory: Rc<GuestMemory>) -> Rc<Base> {
        self.next += 1;
        let base = Rc::new(Base {
            id: self.next,
            memory,
            origin: Origin::Template(vm),
            what: vm.to_string(),
        });
        self.remember(&base);
        base
    }

    fn remember(&mut self, base: &Rc<Base>) {
        self.all.retain(|w| w.strong_count() > 0);
        self.by_image.retain(|_, w| w.strong_count() > 0);
        self.all.push(Rc::downgrade(base));
    }

    /// Take back `base`, made by a server before this one (adopted after
    /// a restart): VMs of its image find it again, and new bases get
    /// other ids.
    pub fn adopt(&mut self, base: &Rc<Base>) {
        if let Origin::Image { key, .. } = &base.origin {
            self.by_image.insert(*key, Rc::downgrade(base));
        }
        self.next = self.next.max(base.id);
        self.remember(base);
    }

    /// The bases some VM (or source) still holds.
    pub fn live(&self) -> Vec<Rc<Base>> {
        self.all.iter().filter_map(Weak::upgrade).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(ino: u64) -> ImageKey {
        let image = crate::images::Identity {
            dev: 1,
            ino,
            len: 1 << 20,
            mtime_ns: 7,
        };
        ImageKey::new(ImageId::File(image), PageSize::Small)
    }

    #[test]
    fn one_base_per_image_while_it_is_held() {
        let mut bases = Bases::default();
        let a = bases
            .for_image(key(1), "a", 1 << 20, PageSize::Small)
            .unwrap();
        let again = bases
            .for_image(key(1), "a", 1 << 20, PageSize::Small)
            .unwrap();
        assert!(Rc::ptr_eq(&a, &again));
        let b = bases
            .for_image(key(2), "b", 1 << 20, PageSize::Small)
            .unwrap();
        assert!(!Rc::ptr_eq(&a, &b));
        assert_eq!(bases.live().len(), 2);
        drop((a, again));
        assert_eq!(bases.live().len(), 1);
        let fresh = bases
            .for_image(key(1), "a", 1 << 20, PageSize::Small)
            .unwrap();
        assert_ne!(fresh.id, b.id);
    }

    #[test]
    fn fill_reads_only_what_the_base_lacks() {
        let mut bases = Bases::default();
        let base = bases
            .for_image(key(3), "zero", 1 << 20, PageSize::Small)
            .unwrap();
        assert!(!base.holds(0, 4));
        assert_eq!(base.fill(&PageSource::Uninitialized, 0, 4).unwrap(), 4);
        assert!(base.holds(0, 4));
        assert_eq!(base.fill(&PageSource::Uninitialized, 2, 6).unwrap(), 2);
        assert!(base.holds(0, 6) && !base.holds(0, 7));
    }
}
