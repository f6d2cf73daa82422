//! The registry: every VM (ours and Firecracker's), every listener, and
//! the arena of page sources their tables name; the ids handed out,
//! admission against the memory budget, and the release of VMs and
//! sources nothing reads any more.

use std::collections::BTreeMap;
use std::path::Path;

use shared::VmId;
use tracing::{info, warn};

use crate::core::error::{Error, Result};
use crate::core::firecracker::state::FcListeners;
use crate::core::firecracker::vm::FcVms;
use crate::core::settings::Settings;
use crate::core::vm::Vm;
use crate::memory::GuestMemory;
use crate::observe::stats::FaultStats;
use crate::pages::{PageTable, SourceArena, SourceId};

/// All VMs and sources.
#[derive(Debug, Default)]
pub struct Registry {
    pub vms: BTreeMap<VmId, Vm>,
    pub arena: SourceArena,
    next_id: u32,
    /// Ids up to this one are recorded as used in the state directory.
    id_mark: u32,
    pub fc_listeners: FcListeners,
    pub fc_vms: FcVms,
    next_listener: u32,
    /// Fault counters of VMs that are gone (for server-wide totals).
    pub retired: FaultStats,
    /// Pages the fault engine installed in any VM, ever (the trace reads
    /// what one event installed from it).
    pub installed: u64,
    /// A readahead window is installed in pieces of this many pages (at
    /// least the fault-around block), the faulting page's first; 0 = in
    /// one piece.
    pub readahead_piece_pages: u64,
    /// The shared bases VMs map.
    pub bases: crate::bases::Bases,
    /// How many more pages faults may install before reclaim looks at
    /// memory again (`core::reclaim::gate`).
    pub gate: crate::core::reclaim::gate::FaultGate,
}

impl Registry {
    /// Host memory promised: the whole guest RAM of every live VM (it may
    /// all be written), plus what frozen (deleted) VMs still hold.
    pub fn promised_bytes(&self) -> u64 {
        let ours: u64 = self
            .vms
            .values()
            .map(|v| {
                if v.is_deleted() {
                    v.memory.allocated_bytes()
                } else {
                    v.memory.size()
                }
            })
            .sum();
        ours
    }

    /// Refuse `count` more VMs of `size` bytes each that would pass the
    /// budget or the VM limit, before anything is allocated.
    pub fn admit(&self, settings: &Settings, count: u64, size: u64) -> Result<()> {
        let vms = self.vms.len() + self.fc_vms.len();
        if vms + usize::try_from(count).unwrap_or(usize::MAX) > settings.max_vms {
            return Err(Error::TooManyVms(vms));
        }
        let asked = count.saturating_mul(size);
        let promised = self.promised_bytes();
        if promised.saturating_add(asked) > settings.memory_budget {
            return Err(Error::OverBudget {
                asked_mib: asked >> 20,
                promised_mib: promised >> 20,
                budget_mib: settings.memory_budget >> 20,
            });
        }
        Ok(())
    }
}

impl Registry {
    /// Release deleted VMs that no other table reads from any more (their
    /// memfd goes with them). Repeats, since releasing one VM drops its own
    /// table's references to its ancestors.
    pub fn collect_garbage(&mut self) {
        loop {
            let victim = self
                .vms
                .values()
                .filter(|v| v.is_deleted())
                .map(|v| (v.id, v.self_src))
                .find(|(id, src)| {
                    !self
                        .vms
                        .values()
                        .any(|o| o.id != *id && o.table.count_of(*src) > 0)
                });
            let Some((id, _)) = victim else { break };
            self.forget(id);
            info!("{id}: memory released");
        }
        self.release_unused_sources();
    }

    /// Remove `id` from the registry and release its own source. Its
    /// memfd goes when the last `Rc` of its memory does.
    pub fn forget(&mut self, id: VmId) {
        if let Some(v) = self.vms.remove(&id) {
            self.retired.add(&v.log.stats);
            self.arena.release(v.self_src);
            v.faults.closed.notify_one();
        }
    }

    /// Whether a table, a VM's reclaim origin or a listener refers to
    /// `src`.
    fn source_in_use(&self, src: SourceId) -> bool {
        self.vms
            .values()
            .any(|v| v.table.count_of(src) > 0 || v.reclaim.names(src))
            || self.fc_vms.values().any(|v| v.table.count_of(src) > 0)
            || self.fc_listeners.values().any(|l| l.source == src)
    }

    /// Release image sources that no table and no listener refers to any
    /// more: their files close, so a deleted VM never keeps an image (or
    /// the filesystem under it) open.
    pub fn release_unused_sources(&mut self) {
        let unused: Vec<SourceId> = self
            .arena
            .image_ids()
            .filter(|src| !self.source_in_use(*src))
            .collect();
        for src in unused {
            self.arena.release(src);
        }
    }

    /// After a restart: release the own sources (`Vm`, `Swap`) of VMs
    /// that were not taken back and that no table reads. The journal
    /// records a VM's `Vm` source, and the memory it names, the moment an
    /// operation makes them, but the VM only once it has started: a crash
    /// while a create or a fork starts its VMMs leaves sources of VMs that
    /// never were (and a VM that could not be adopted leaves its own).
    /// Nothing else releases them, since only [`Self::forget`] releases a
    /// VM's own source, and their memfds would stay in this process and
    /// in the fd store for good. Returns how many it released.
    pub fn release_sources_of_absent_vms(&mut self) -> usize {
        let absent: Vec<SourceId> = self
            .arena
            .iter()
            .filter_map(|(id, s)| {
                let vm = match &**s {
                    crate::pages::PageSource::Vm(vm) => *vm,
                    crate::pages::PageSource::Swap(w) => w.vm,
                    _ => return None,
                };
                if self.vms.contains_key(&vm) || self.fc_vms.contains_key(&vm) {
                    return None;
                }
                (!self.source_in_use(id)).then_some(id)
            })
            .collect();
        for src in &absent {
            self.arena.release(*src);
        }
        absent.len()
    }

    /// A new VM id. Ids never repeat on one state directory: the highest
    /// id handed out is recorded in `next-vm-id` in blocks of
    /// `ID_BLOCK`, so a restarted server starts past every id it may
    /// have used (and past volumes named after them).
    pub fn alloc_id(&mut self, state_dir: &Path) -> VmId {
        self.next_id += 1;
        if self.next_id > self.id_mark {
            self.id_mark = self.next_id.saturating_add(ID_BLOCK);
            let path = state_dir.join(ID_FILE);
            if let Err(e) = write_id_file(&path, self.id_mark) {
                warn!("cannot record VM ids in {}: {e}", path.display());
            }
        }
        VmId(self.next_id)
    }

    /// VM `id`, or [`Error::NoSuchVm`].
    pub fn vm(&self, id: VmId) -> Result<&Vm> {
        self.vms.get(&id).ok_or(Error::NoSuchVm(id))
    }

    /// VM `id` to change, or [`Error::NoSuchVm`].
    pub fn vm_mut(&mut self, id: VmId) -> Result<&mut Vm> {
        self.vms.get_mut(&id).ok_or(Error::NoSuchVm(id))
    }

    /// Whether VM `vm` maps a shared base (its own pages are its VMM's).
    pub fn is_based(&self, vm: VmId) -> bool {
        self.vms.get(&vm).is_some_and(|v| v.base.is_based())
    }

    /// VM `id` exists (taken back after a restart): new VMs get ids past
    /// it.
    pub fn vm_id_taken(&mut self, id: u32) {
        self.next_id = self.next_id.max(id);
    }
}

/// Record `mark` in the id file `path`: written beside it, then renamed
/// over it, so a crash in between leaves the old mark, never an empty
/// file (which would hand out ids from 1 again).
fn write_id_file(path: &Path, mark: u32) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{mark}\n"))?;
    std::fs::rename(&tmp, path)
}

/// Ids reserved at a time in the state directory's id file.
const ID_BLOCK: u32 = 64;
/// The file in the state directory that records the VM ids handed out.
const ID_FILE: &str = "next-vm-id";

/// The first VM id a server on `state_dir` may hand out.
fn first_free_id(state_dir: &Path) -> u32 {
    std::fs::read_to_string(state_dir.join(ID_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

impl Registry {
    /// An empty registry on `state_dir`, whose ids start past every id a
    /// server on it handed out before.
    pub fn new(state_dir: &Path, readahead_piece_pages: u64) -> Self {
        let first = first_free_id(state_dir);
        Registry {
            next_id: first,
            id_mark: first,
            readahead_piece_pages,
            ..Registry::default()
        }
    }

    /// A new Firecracker listener id.
    pub fn next_listener_id(&mut self) -> u32 {
        self.next_listener += 1;
        self.next_listener
    }

    /// Listener `id` is taken (by a listener adopted after a restart): new
    /// listeners get ids past it.
    pub fn listener_id_taken(&mut self, id: u32) {
        self.next_listener = self.next_listener.max(id);
    }

    /// Pages per source kind of `table`.
    pub fn pages_by_kind(&self, table: &PageTable) -> BTreeMap<String, u64> {
        let mut pages = BTreeMap::new();
        for (src, n) in table.counts() {
            let kind = self.arena.get(*src).map_or("unknown", |s| s.kind());
            *pages.entry(kind.to_owned()).or_insert(0) += n;
        }
        pages
    }

    /// The table of a pagefork or Firecracker VM.
    pub fn table_view(&self, id: VmId) -> Option<TableView<'_>> {
        if let Some(v) = self.vms.get(&id) {
            return Some(TableView {
                table: &v.table,
                self_src: v.self_src,
                memory: Some(&v.memory),
            });
        }
        self.fc_vms.get(&id).map(|v| TableView {
            table: &v.table,
            self_src: v.self_src,
            memory: None,
        })
    }
}

/// What the debugging views need of any VM.
#[derive(Debug)]
pub struct TableView<'a> {
    pub table: &'a PageTable,
    pub self_src: SourceId,
    pub memory: Option<&'a GuestMemory>,
}
