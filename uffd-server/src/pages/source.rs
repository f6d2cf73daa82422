//! The per-server arena of page sources.
//!
//! A table entry is a [`SourceId`] (4 bytes) naming an `Rc<PageSource>` in
//! the arena. Id 0 is always [`PageSource::Uninitialized`]. A VM gets one id
//! for `Vm(its id)` when it is created, and the arena keeps that VM's
//! memory beside it (where a `Vm(id)` source's bytes are, for the tables
//! of the VMs that read from it); each image file opened gets one id.
//! Ids are never reused while the server runs, so a stale id in a table can
//! never be mistaken for another source.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::rc::Rc;

use shared::VmId;
use vm_memory::mmap::MmapRegion;
use vm_memory::FileOffset;

use super::process::ProcessPages;
use crate::memory::GuestMemory;

/// Index of a source in the arena; what a table entry stores.
pub type SourceId = u32;

/// The id of [`PageSource::Uninitialized`].
pub const UNINITIALIZED: SourceId = 0;

/// A plain image file: guest page p is at byte `p * PAGE_SIZE`.
#[derive(Debug)]
pub struct FileSource {
    /// Path as given by the client (for debugging output).
    pub path: PathBuf,
    /// The open file.
    pub file: File,
    /// Size of the file in bytes when opened.
    pub len: u64,
    /// How the file is kept from changing under its readers.
    pub pin: crate::images::Pin,
    /// The whole file mapped read-only, made at the first 2 MiB block
    /// installed from it (see [`FileSource::mapped`]).
    pub map: std::cell::OnceCell<Option<MmapRegion>>,
    /// The image's identity when opened (before any private copy was
    /// made of it), which its shared base is found by.
    pub identity: Option<crate::images::Identity>,
}

impl FileSource {
    /// A source reading `file` (`len` bytes when opened) at `path`.
    pub fn new(path: PathBuf, file: File, len: u64, pin: crate::images::Pin) -> Self {
        FileSource {
            path,
            file,
            len,
            pin,
            map: std::cell::OnceCell::new(),
            identity: None,
        }
    }

    /// The same source, known to be the image `identity`.
    pub fn with_identity(mut self, identity: crate::images::Identity) -> Self {
        self.identity = Some(identity);
        self
    }

    /// The file mapped whole (`MAP_SHARED`, read-only), for UFFDIO_COPY to
    /// take a hugetlb block straight out of the page cache instead of out
    /// of a buffer `pread` filled first: one copy of 2 MiB instead of two.
    /// `None` if it cannot be mapped (the caller reads instead).
    ///
    /// Only the kernel may read through it: a file truncated under its
    /// readers makes an access past its end fail, which UFFDIO_COPY
    /// reports as EFAULT where a read by the server itself would be a
    /// SIGBUS.
    pub fn mapped(&self) -> Option<&MmapRegion> {
        self.map
            .get_or_init(|| {
                let len = usize::try_from(self.len).ok().filter(|l| *l > 0)?;
                let file = self.file.try_clone().ok()?;
                MmapRegion::build(
                    Some(FileOffset::new(file, 0)),
                    len,
                    libc::PROT_READ,
                    libc::MAP_SHARED | libc::MAP_NORESERVE,
                )
                .ok()
            })
            .as_ref()
    }
}

/// A snapshot's reflinked `memory.img`, opened read-only.
#[derive(Debug)]
pub struct ImageSource {
    /// The snapshot's name.
    pub snapshot: String,
    pub file: FileSource,
}

/// A `memory.zst` image: pages are decoded a frame at a time by the
/// frame pool's threads (see [`crate::images::zst`]); its zero frames are
/// `Uninitialized` in the tables that read it.
#[derive(Debug)]
pub struct ZstdSource {
    pub image: std::sync::Arc<crate::images::zst::ZstdImage>,
}

/// Pages a VM held at a fork, frozen in a memfd the server owns, which
/// the fork's children (and theirs) read them from whatever becomes of
/// that VM and its VMM.
#[derive(Debug)]
pub struct FrozenSource {
    /// The VM they were the pages of.
    pub vm: VmId,
    pub memory: Rc<GuestMemory>,
    pub kind: FrozenKind,
    /// A layer still being filled: what copies a page in before it is
    /// read (see [`LayerFill`]); `None` once whole.
    pub filling: RefCell<Option<Rc<dyn LayerFill>>>,
}

impl FrozenSource {
    /// Frozen pages of `vm` in `memory`, whole.
    pub fn new(vm: VmId, memory: Rc<GuestMemory>, kind: FrozenKind) -> Self {
        FrozenSource {
            vm,
            memory,
            kind,
            filling: RefCell::new(None),
        }
    }

    /// Bytes of the memfd's pages, counting those a layer still being
    /// filled will hold once whole.
    pub fn held_bytes(&self) -> u64 {
        let pending = self
            .filling
            .borrow()
            .as_ref()
            .map_or(0, |f| f.pending_pages());
        self.memory.allocated_bytes() + pending * shared::PAGE_SIZE
    }

    /// Make sure pages `first..first + n` are in the memfd before they are
    /// read: a layer still being filled copies them in first. Every read
    /// of a frozen source's pages goes through here ([`super::read_pages`]).
    pub fn ensure(&self, first: u64, n: u64) -> Result<(), LayerLost> {
        let filling = self.filling.borrow().clone();
        match filling {
            Some(f) => f.ensure(first, n),
            None => Ok(()),
        }
    }
}

/// Pages a layer was to hold could not be copied into it (the VMM they
/// were read from and its anchor are gone): why, as the first failed copy
/// said.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct LayerLost(pub String);

/// A layer being filled, as its readers see it: pages not copied yet are
/// copied when asked for (out of the VMM they are the pages of).
pub trait LayerFill: std::fmt::Debug {
    /// Copy whichever of pages `first..first + n` are still to copy; the
    /// error says why they cannot be (the VMM and its anchor are gone).
    fn ensure(&self, first: u64, n: u64) -> Result<(), LayerLost>;

    /// Where the pages still to copy are read from, for the journal: a
    /// restarted server goes on filling from there.
    fn origin(&self) -> FillOrigin;

    /// 4 KiB pages still to copy.
    fn pending_pages(&self) -> u64;
}

/// The process a layer is filled from: by pid and start time (which tell
/// it from a later process with the same pid), and the address of guest
/// page 0 in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FillOrigin {
    pub pid: u32,
    pub started: u64,
    pub vmm_base: u64,
}

/// What a frozen memfd was before it froze.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrozenKind {
    /// The VM's own memfd: it was forked as a paused template and moved
    /// onto that memfd as its base (it writes private pages from then
    /// on). Its children map it as their base.
    Template,
    /// A layer: the pages a VM on a shared base had written (private
    /// pages of its VMM), copied out of its VMM when it forked, so that
    /// its children never read them from a process that may die.
    Layer,
}

/// Where the pages of a `Vm(id)` source are.
#[derive(Debug, Clone)]
pub enum VmPages {
    /// In the VM's own memfd, which the server maps.
    Memfd(Rc<GuestMemory>),
    /// Private pages of the VMM of a VM on a shared base.
    Process(Rc<ProcessPages>),
}

/// A snapshot in the object store: pages are fetched a chunk at a time
/// by the chunk pool's threads (see [`crate::remote::chunks`]); its holes
/// are `Uninitialized` in the tables that read it.
#[derive(Debug)]
pub struct RemoteSource {
    pub image: std::sync::Arc<crate::remote::image::RemoteImage>,
}

/// Pages a VM wrote that reclaim compressed into the server's swap store
/// (`crate::reclaim::store`) and dropped from memory: page p's bytes are
/// the store's frame of (this VM, p). The tables of the VM's fork
/// children name it too; its frames go when the last table stops naming
/// it (this source is dropped).
pub struct SwapSource {
    /// The VM whose pages they were.
    pub vm: VmId,
    /// The store's key of its pages: the arena id it was made with (ids
    /// are not reused, so a new source never reads an old one's frames).
    pub key: u64,
    pub store: Rc<std::cell::RefCell<crate::reclaim::store::SwapStore>>,
}

impl SwapSource {
    /// The store's key of this source's pages.
    pub fn owner(&self) -> u64 {
        self.key
    }
}

impl std::fmt::Debug for SwapSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapSource").field("vm", &self.vm).finish()
    }
}

impl Drop for SwapSource {
    fn drop(&mut self) {
        // Nothing names these frames any more: they become garbage (the
        // file keeps them until compaction).
        if let Ok(mut store) = self.store.try_borrow_mut() {
            store.remove_owner(self.owner());
        }
    }
}

/// Where a page's bytes come from.
#[derive(Debug)]
pub enum PageSource {
    /// Never written: all zeroes.
    Uninitialized,
    /// Materialized in this VM: in its memfd, or (a VM on a shared base)
    /// a private page of its VMM.
    Vm(VmId),
    /// A template's memfd, frozen (see [`FrozenSource`]).
    Frozen(FrozenSource),
    /// A raw image file.
    File(FileSource),
    /// A snapshot's image: served like `File`; its holes are
    /// `Uninitialized` in the tables that read it.
    Image(ImageSource),
    /// A compressed image (a file, or a snapshot's `memory.zst`).
    Zstd(ZstdSource),
    /// A snapshot in the object store, fetched chunk by chunk.
    Remote(RemoteSource),
    /// Pages a VM wrote, compressed out of memory by reclaim.
    Swap(SwapSource),
}

impl PageSource {
    /// The kind's name as the API reports it.
    pub fn kind(&self) -> &'static str {
        match self {
            PageSource::Uninitialized => "uninitialized",
            PageSource::Vm(_) => "vm",
            PageSource::Frozen(_) => "frozen",
            PageSource::File(_) => "file",
            PageSource::Image(_) => "image",
            PageSource::Zstd(_) => "zstd",
            PageSource::Remote(_) => "remote",
            PageSource::Swap(_) => "swap",
        }
    }

    /// Whether a fault on this source installs a run of pages around it
    /// (fault-around and readahead) rather than the one page.
    pub fn fault_around(&self) -> bool {
        matches!(
            self,
            PageSource::File(_)
                | PageSource::Image(_)
                | PageSource::Zstd(_)
                | PageSource::Remote(_)
        )
    }

    /// The image file behind this source, if it is one.
    pub fn file(&self) -> Option<&FileSource> {
        match self {
            PageSource::File(f) | PageSource::Image(ImageSource { file: f, .. }) => Some(f),
            PageSource::Uninitialized
            | PageSource::Vm(_)
            | PageSource::Frozen(_)
            | PageSource::Zstd(_)
            | PageSource::Remote(_)
            | PageSource::Swap(_) => None,
        }
    }

    /// The identity of the image behind this source (file or compressed),
    /// if it is one and it was taken when it was opened.
    pub fn identity(&self) -> Option<crate::images::ImageId> {
        use crate::images::ImageId;
        match self {
            PageSource::File(f) | PageSource::Image(ImageSource { file: f, .. }) => {
                f.identity.map(ImageId::File)
            }
            PageSource::Zstd(z) => z.image.identity.map(ImageId::File),
            PageSource::Remote(r) => Some(r.image.id()),
            _ => None,
        }
    }

    /// The compressed image behind this source, if it is one.
    pub fn zstd(&self) -> Option<&std::sync::Arc<crate::images::zst::ZstdImage>> {
        match self {
            PageSource::Zstd(z) => Some(&z.image),
            _ => None,
        }
    }

    /// The snapshot in the object store behind this source, if it is one.
    pub fn remote(&self) -> Option<&std::sync::Arc<crate::remote::image::RemoteImage>> {
        match self {
            PageSource::Remote(r) => Some(&r.image),
            _ => None,
        }
    }

    /// The local snapshot whose image this is, if it is one.
    pub fn snapshot(&self) -> Option<&str> {
        match self {
            PageSource::Image(i) => Some(&i.snapshot),
            PageSource::Zstd(z) => z.image.snapshot.as_deref(),
            _ => None,
        }
    }

    /// A short human description: `uninitialized`, `vm-3`, `file:/path`.
    pub fn describe(&self) -> String {
        match self {
            PageSource::Uninitialized => "uninitialized".into(),
            PageSource::Vm(id) => id.to_string(),
            PageSource::Frozen(f) => match f.kind {
                FrozenKind::Template => format!("{} (frozen)", f.vm),
                FrozenKind::Layer => format!("{} (layer)", f.vm),
            },
            PageSource::File(f) => format!("file:{}", f.path.display()),
            PageSource::Image(i) => format!("snapshot:{}", i.snapshot),
            PageSource::Zstd(z) => match &z.image.snapshot {
                Some(name) => format!("snapshot:{name} (zstd)"),
                None => format!("zstd:{}", z.image.path.display()),
            },
            PageSource::Remote(r) => format!("remote:{}", r.image.snapshot),
            PageSource::Swap(w) => format!("swap:{}", w.vm),
        }
    }
}

/// What is remembered of a released source, for page histories (a page
/// installed from an image keeps saying so after the image is closed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retired {
    /// [`PageSource::describe`].
    pub name: String,
    /// [`PageSource::kind`].
    pub kind: &'static str,
    /// The image file's path, for `File`, `Image` and `Zstd`.
    pub path: Option<PathBuf>,
}

/// Released sources remembered at most (the most recent ones).
const RETIRED_KEPT: usize = 4096;

/// Called with each source the arena takes, or changes in place, before
/// any table can name it (the restart journal, `core::restart`).
pub struct SourceHook(Box<HookFn>);

type HookFn = dyn Fn(SourceId, &Rc<PageSource>);

impl SourceHook {
    pub fn new(f: impl Fn(SourceId, &Rc<PageSource>) + 'static) -> Self {
        SourceHook(Box::new(f))
    }
}

impl std::fmt::Debug for SourceHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SourceHook")
    }
}

/// All sources the server knows, by id.
#[derive(Debug)]
pub struct SourceArena {
    hook: Option<SourceHook>,
    slots: Vec<Option<Rc<PageSource>>>,
    vm_ids: HashMap<VmId, SourceId>,
    /// Where the pages of each VM with a `Vm(id)` source are, when the
    /// server can read them (Firecracker VMs have none it can).
    memories: HashMap<VmId, VmPages>,
    retired: std::collections::BTreeMap<SourceId, Retired>,
}

impl Default for SourceArena {
    fn default() -> Self {
        Self::new()
    }
}

impl SourceArena {
    /// An arena holding only `Uninitialized`.
    pub fn new() -> Self {
        SourceArena {
            hook: None,
            slots: vec![Some(Rc::new(PageSource::Uninitialized))],
            vm_ids: HashMap::new(),
            memories: HashMap::new(),
            retired: std::collections::BTreeMap::new(),
        }
    }

    /// Add a source and return its id.
    pub fn insert(&mut self, source: PageSource) -> SourceId {
        let id = SourceId::try_from(self.slots.len()).unwrap_or(SourceId::MAX);
        if let PageSource::Vm(vm) = source {
            self.vm_ids.insert(vm, id);
        }
        let source = Rc::new(source);
        if let Some(h) = &self.hook {
            (h.0)(id, &source);
        }
        self.slots.push(Some(source));
        id
    }

    /// The id the next source inserted gets.
    pub fn next_id(&self) -> SourceId {
        SourceId::try_from(self.slots.len()).unwrap_or(SourceId::MAX)
    }

    /// Call `hook` with every source taken or frozen from now on.
    pub fn set_hook(&mut self, hook: SourceHook) {
        self.hook = Some(hook);
    }

    /// The id of `Vm(vm)`, registering it on first use.
    pub fn vm(&mut self, vm: VmId) -> SourceId {
        match self.vm_ids.get(&vm) {
            Some(id) => *id,
            None => self.insert(PageSource::Vm(vm)),
        }
    }

    /// The id of `Vm(vm)` for a VM whose pages are in `memory`: a table
    /// that reads `Vm(vm)` reads them there ([`Self::memory_of`]).
    pub fn vm_with_memory(&mut self, vm: VmId, memory: Rc<GuestMemory>) -> SourceId {
        self.memories.insert(vm, VmPages::Memfd(memory));
        self.vm(vm)
    }

    /// The pages of `Vm(vm)` are private pages of its VMM from now on (a
    /// VM on a shared base whose uffd arrived).
    pub fn vm_in_process(&mut self, vm: VmId, pages: ProcessPages) {
        self.memories.insert(vm, VmPages::Process(Rc::new(pages)));
    }

    /// Every VM whose pages the arena can find, and where they are.
    pub fn memories(&self) -> impl Iterator<Item = (VmId, &VmPages)> + '_ {
        self.memories.iter().map(|(vm, p)| (*vm, p))
    }

    /// Put `source` back at `id`, the id it had in the server before this
    /// one (adopted after a restart); ids between are retired.
    pub fn adopt(&mut self, id: SourceId, source: PageSource) {
        let at = id as usize;
        if self.slots.len() <= at {
            self.slots.resize(at + 1, None);
        }
        if let PageSource::Vm(vm) = source {
            self.vm_ids.insert(vm, id);
        }
        self.slots[at] = Some(Rc::new(source));
    }

    /// The pages of `Vm(vm)` are in `memory` (adopted after a restart).
    pub fn adopt_memory(&mut self, vm: VmId, memory: Rc<GuestMemory>) {
        self.memories.insert(vm, VmPages::Memfd(memory));
    }

    /// Where the pages of VM `vm` are, while its source is held.
    pub fn memory_of(&self, vm: VmId) -> Option<VmPages> {
        self.memories.get(&vm).cloned()
    }

    /// Freeze `vm`'s memfd: its source becomes [`PageSource::Frozen`] (the
    /// tables that name it read the memfd as it is), and `Vm(vm)` gets a
    /// new id the next time it is asked for. Returns the frozen id.
    pub fn freeze(&mut self, vm: VmId) -> Option<SourceId> {
        let id = self.vm_ids.remove(&vm)?;
        let memory = match self.memories.remove(&vm) {
            Some(VmPages::Memfd(m)) => m,
            other => {
                // Not a memfd: nothing to freeze; put things back.
                if let Some(o) = other {
                    self.memories.insert(vm, o);
                }
                self.vm_ids.insert(vm, id);
                return None;
            }
        };
        if let Some(slot) = self.slots.get_mut(id as usize) {
            let frozen = Rc::new(PageSource::Frozen(FrozenSource::new(
                vm,
                memory,
                FrozenKind::Template,
            )));
            if let Some(h) = &self.hook {
                (h.0)(id, &frozen);
            }
            *slot = Some(frozen);
        }
        Some(id)
    }

    /// Freeze the pages of `Vm(vm)`, a VM on a shared base, into `layer`
    /// (filled by the caller before any table reads them): its source
    /// becomes [`PageSource::Frozen`] over the layer, so the tables that
    /// name it read the layer, and `Vm(vm)` gets a new id the next time it
    /// is asked for (the VM's pages stay in its VMM). Returns the frozen
    /// id.
    pub fn freeze_to_layer(&mut self, vm: VmId, layer: Rc<GuestMemory>) -> Option<SourceId> {
        let id = self.vm_ids.remove(&vm)?;
        if let Some(slot) = self.slots.get_mut(id as usize) {
            *slot = Some(Rc::new(PageSource::Frozen(FrozenSource::new(
                vm,
                layer,
                FrozenKind::Layer,
            ))));
        }
        Some(id)
    }

    /// The id of `Vm(vm)` if registered.
    pub fn vm_id(&self, vm: VmId) -> Option<SourceId> {
        self.vm_ids.get(&vm).copied()
    }

    /// The source behind `id`.
    pub fn get(&self, id: SourceId) -> Option<&Rc<PageSource>> {
        self.slots.get(id as usize).and_then(Option::as_ref)
    }

    /// Every source held, with its id.
    pub fn iter(&self) -> impl Iterator<Item = (SourceId, &Rc<PageSource>)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((SourceId::try_from(i).ok()?, s.as_ref()?)))
    }

    /// How many sources of each kind are held.
    pub fn count_by_kind(&self) -> std::collections::BTreeMap<&'static str, u64> {
        let mut counts = std::collections::BTreeMap::new();
        for s in self.slots.iter().flatten() {
            *counts.entry(s.kind()).or_insert(0) += 1;
        }
        counts
    }

    /// Ids of the image sources (`File`, `Image`, `Zstd`, `Remote`) still
    /// held.
    pub fn image_ids(&self) -> impl Iterator<Item = SourceId> + '_ {
        self.slots.iter().enumerate().filter_map(|(i, s)| {
            matches!(
                s.as_deref(),
                Some(
                    PageSource::File(_)
                        | PageSource::Image(_)
                        | PageSource::Zstd(_)
                        | PageSource::Frozen(_)
                        | PageSource::Remote(_)
                )
            )
            .then(|| SourceId::try_from(i).ok())
            .flatten()
        })
    }

    /// Forget a source no table refers to any more (its id stays retired).
    pub fn release(&mut self, id: SourceId) {
        if id == UNINITIALIZED {
            return;
        }
        if let Some(slot) = self.slots.get_mut(id as usize) {
            if let Some(src) = slot.take() {
                match &*src {
                    PageSource::Vm(vm) => {
                        self.vm_ids.remove(vm);
                        self.memories.remove(vm);
                    }
                    PageSource::Zstd(z) => z.image.release_cache(),
                    _ => {}
                }
                self.retired.insert(
                    id,
                    Retired {
                        name: src.describe(),
                        kind: src.kind(),
                        path: src
                            .file()
                            .map(|f| f.path.clone())
                            .or_else(|| src.zstd().map(|z| z.path.clone())),
                    },
                );
                if self.retired.len() > RETIRED_KEPT {
                    self.retired.pop_first();
                }
            }
        }
    }

    /// What is remembered of a released source.
    pub fn retired(&self, id: SourceId) -> Option<&Retired> {
        self.retired.get(&id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_ids_are_stable_and_not_reused() {
        let mut a = SourceArena::new();
        let v1 = a.vm(VmId(1));
        assert_eq!(a.vm(VmId(1)), v1);
        a.release(v1);
        assert!(a.get(v1).is_none());
        let v2 = a.vm(VmId(2));
        assert_ne!(v1, v2);
        assert_eq!(
            a.get(UNINITIALIZED).map(|s| s.kind()),
            Some("uninitialized")
        );
    }
}
