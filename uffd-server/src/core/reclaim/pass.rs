//! One reclaim pass over one VM: give back up to so many of the pages it
//! holds, from its clock hand on.
//!
//! For each page, cheapest first: an all-zero page is dropped (it reads
//! as `Uninitialized`); a page equal to where it came from when the VM
//! was made (an image, a frozen template: sources that never change) is
//! dropped back to it; any other page is compressed into the swap store
//! and its entry names the VM's `Swap` source. Then the pages leave the
//! memfd (punched: the VMM's mapping and KVM's lose them with it), and
//! the next access faults MISSING and is served from the table, as any
//! page is.
//!
//! A page changes under the pass only if the guest writes it; so first
//! the pages are write-protected through the VM's uffd, and only pages
//! the VMM's page tables show present and protected
//! (`/proc/PID/pagemap`) are taken. A write in between waits in a
//! write-protect fault, which the core serves after the pass (one thread):
//! the page is gone by then, the woken write faults MISSING and finds the
//! bytes the pass saved. Pages other VMs still read from this one (fork
//! children before their pre-write copy) are left alone, as are pages a
//! pass protected but did not take (they cost one write-protect fault at
//! most).

use std::os::unix::fs::FileExt;
use std::rc::Rc;

use shared::{VmId, PAGE_SIZE};
use tracing::warn;
use vm_memory::VolatileSlice;

use super::state::Reclaimer;
use crate::core::registry::Registry;
use crate::core::vm::{RunState, Vm};
use crate::pages::source::SwapSource;
use crate::pages::{read_pages, PageSource, SourceId, UNINITIALIZED};
use crate::reclaim::store::StoreError;

/// Bit 63 of a pagemap entry: present; bit 57: write-protected by uffd.
const PRESENT: u64 = 1 << 63;
const UFFD_WP: u64 = 1 << 57;

/// What one pass took.
#[derive(Debug, Default, Clone, Copy)]
pub struct Took {
    /// Pages looked at (0: nothing left to look at in this VM).
    pub examined: u64,
    pub dropped: u64,
    pub swapped: u64,
    /// Pages it could not take (read by other VMs, the store full).
    pub kept: u64,
    /// Nothing was looked at: the VM was busy with an operation, or one
    /// waited for it.
    pub busy: bool,
}

impl Took {
    /// Pages given back.
    pub fn freed(&self) -> u64 {
        self.dropped + self.swapped
    }
}

/// Bytes of guest RAM `v` holds as its own: its memfd's pages, or, on a
/// shared base, the pages its VMM holds privately (`PAGEMAP_SCAN`).
pub(crate) fn held_bytes(reg: &Registry, v: &Vm) -> u64 {
    if !v.base.is_based() {
        return v.memory.allocated_bytes();
    }
    match reg.arena.memory_of(v.id) {
        Some(crate::pages::VmPages::Process(p)) => p
            .private_runs(v.memory.pages())
            .map_or(0, |r| r.iter().map(|(_, n)| n * PAGE_SIZE).sum()),
        _ => 0,
    }
}

/// Why `v` cannot be reclaimed now, if it cannot.
pub fn ineligible(v: &Vm) -> Option<&'static str> {
    if !v.reclaim.enabled() {
        return Some("it opted out");
    }
    if v.is_deleted() || !matches!(v.state(), RunState::Running | RunState::Paused) {
        return Some("it does not run");
    }
    if v.busy.is_busy() {
        return Some("an operation pauses it");
    }
    if v.base.is_based() && v.rollback.no_discard {
        return Some("it is on a shared base and its VMM cannot discard pages");
    }
    if v.fork.layering.is_some() {
        return Some("a fork's layer is being filled from it");
    }
    if v.memory.unit_pages() != 1 {
        return Some("its memory is hugepages");
    }
    if v.faults.uffd.is_none() || v.link.pid.is_none() {
        return Some("its VMM is not connected");
    }
    if v.snapshot.saving.is_some() || v.snapshot.arming.is_some() {
        return Some("a snapshot of it is saving");
    }
    if !v.rollback.stale.is_empty() {
        return Some("a rollback is scrubbing it");
    }
    None
}

/// Give back up to `max` pages of `vm`, from its clock hand on (hot pages
/// too, if `all`).
pub fn reclaim_vm(reg: &mut Registry, rc: &mut Reclaimer, vm: VmId, max: u64, all: bool) -> Took {
    let mut took = Took::default();
    if reg.vms.get(&vm).is_none_or(|v| v.base.is_based()) {
        // Its own pages are its VMM's: see `based`.
        return took;
    }
    let Some(pages) = candidates(reg, vm, max, all, &mut took) else {
        return took;
    };
    if pages.is_empty() {
        return took;
    }
    let Registry { vms, arena, .. } = reg;
    let Some(v) = vms.get_mut(&vm) else {
        return took;
    };
    let Some(uffd) = v.faults.uffd.clone() else {
        return took;
    };
    let runs = runs_of(&pages);
    if let Err((_, e)) = v.write_protect_pages(uffd.get_ref(), &runs, true) {
        warn!("{vm}: cannot write-protect pages to reclaim them: {e}");
        took.kept += pages.len() as u64;
        return took;
    }
    let protected = protected_pages(v, &pages);
    let me = v.self_src;
    let mut buf = vec![0u8; shared::geometry::usize_of(PAGE_SIZE)];
    let mut origin_buf = vec![0u8; shared::geometry::usize_of(PAGE_SIZE)];
    let mut gone: Vec<(u64, SourceId)> = Vec::with_capacity(protected.len());
    for p in protected {
        if v.memory.read_pages_at(p, &mut buf).is_err() {
            took.kept += 1;
            continue;
        }
        match destination(arena, rc, v, p, &buf, &mut origin_buf) {
            Some(src) => gone.push((p, src)),
            None => took.kept += 1,
        }
    }
    // The entries first (a crash after them and before the punch leaves
    // pages present that the next process finds again, see
    // `restart::reconcile`), then the memory.
    for &(p, src) in &gone {
        v.table.set(p, src);
    }
    let punched: Vec<u64> = gone.iter().map(|(p, _)| *p).collect();
    for (first, n) in runs_of(&punched) {
        if let Err(e) = v.memory.punch_hole(first, n) {
            warn!(
                "{vm}: cannot drop reclaimed pages {first}..{}: {e}",
                first + n
            );
            for p in first..first + n {
                v.table.set(p, me);
            }
            gone.retain(|(p, _)| !(first..first + n).contains(p));
        }
    }
    account(rc, v, &gone, &mut took);
    took
}

/// Where page `p` of `v` (`bytes`) goes: nowhere if all zero
/// (`Uninitialized`), back to where it came from if that holds the same
/// bytes and never changes, else into the swap store (if the VM has its
/// `Swap` source, see [`swap_source`], and the store has room). None:
/// it stays.
pub(super) fn destination(
    arena: &crate::pages::SourceArena,
    rc: &mut Reclaimer,
    v: &Vm,
    p: u64,
    bytes: &[u8],
    scratch: &mut [u8],
) -> Option<SourceId> {
    let me = v.self_src;
    if bytes.iter().all(|b| *b == 0) {
        Some(UNINITIALIZED)
    } else if let Some(o) = v
        .reclaim
        .origin_of(p)
        .filter(|o| *o != me && *o != UNINITIALIZED)
        .filter(|o| same_as_origin(arena, *o, p, bytes, scratch))
    {
        Some(o)
    } else if rc.can_swap() {
        swap_out(arena, rc, v, p, bytes)
    } else {
        None
    }
}

/// Count the pages `gone` (page, where its entry points now) as given
/// back by `v`.
pub(super) fn account(rc: &mut Reclaimer, v: &mut Vm, gone: &[(u64, SourceId)], took: &mut Took) {
    let before = took.freed();
    for &(p, src) in gone {
        let swapped = v.reclaim.swap_src == Some(src);
        v.reclaim.reclaimed(p, swapped);
        if swapped {
            took.swapped += 1;
        } else {
            took.dropped += 1;
        }
        v.log.pages.dropped(p, 1);
    }
    rc.gave_back((took.freed() - before) * PAGE_SIZE);
}

/// Up to `max` pages of `vm` to reclaim, from its clock hand on (moved
/// past them): present in its memfd, its own, not hot (unless `all`), and
/// read by no other VM. None if the VM cannot be reclaimed.
fn candidates(
    reg: &mut Registry,
    vm: VmId,
    max: u64,
    all: bool,
    took: &mut Took,
) -> Option<Vec<u64>> {
    let v = reg.vms.get(&vm)?;
    if ineligible(v).is_some() {
        return None;
    }
    let present = v.memory.present_ranges()?;
    Some(candidates_in(reg, vm, &present, max, all, took))
}

/// Up to `max` pages of `vm` in the runs `present` (`(first, n)`,
/// ascending: the pages it holds) to reclaim, from its clock hand on
/// (moved past them): its own, not hot (unless `all`), and read by no
/// other VM.
pub(super) fn candidates_in(
    reg: &mut Registry,
    vm: VmId,
    present: &[(u64, u64)],
    max: u64,
    all: bool,
    took: &mut Took,
) -> Vec<u64> {
    let Some(v) = reg.vms.get(&vm) else {
        return Vec::new();
    };
    let me = v.self_src;
    let readers: Vec<&crate::pages::PageTable> = reg
        .vms
        .values()
        .filter(|o| o.id != vm && o.table.count_of(me) > 0)
        .map(|o| &o.table)
        .collect();
    let total = v.memory.pages();
    let start = v.reclaim.hand % total.max(1);
    let mut out = Vec::new();
    let mut next = start;
    // The runs from the hand to the end, then from 0 to the hand.
    let order = present
        .iter()
        .filter(|(f, n)| f + n > start)
        .map(|&(f, n)| (f.max(start), f + n))
        .chain(
            present
                .iter()
                .filter(|(f, _)| *f < start)
                .map(|&(f, n)| (f, (f + n).min(start))),
        );
    'runs: for (lo, hi) in order {
        for p in lo..hi {
            if out.len() as u64 >= max {
                break 'runs;
            }
            took.examined += 1;
            next = p + 1;
            if v.table.get(p) != me || (!all && v.reclaim.hot(p)) {
                continue;
            }
            if readers.iter().any(|t| t.get(p) == me) {
                // Another VM reads it from this one: it stays.
                took.kept += 1;
                continue;
            }
            out.push(p);
        }
    }
    if let Some(v) = reg.vms.get_mut(&vm) {
        v.reclaim.hand = next;
    }
    out
}

/// `pages` as runs `(first, n)`; `pages` ascending.
pub(super) fn runs_of(pages: &[u64]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &p in pages {
        match runs.last_mut() {
            Some((f, n)) if *f + *n == p => *n += 1,
            _ => runs.push((p, 1)),
        }
    }
    runs
}

/// Which of `pages` the VMM maps now, write-protected: only those cannot
/// change until the pass is done.
fn protected_pages(v: &Vm, pages: &[u64]) -> Vec<u64> {
    let Some(pid) = v.link.pid else {
        return Vec::new();
    };
    let Ok(map) = std::fs::File::open(format!("/proc/{pid}/pagemap")) else {
        return Vec::new();
    };
    let first_vpn = v.faults.vmm_base / PAGE_SIZE;
    let mut out = Vec::with_capacity(pages.len());
    for (first, n) in runs_of(pages) {
        let mut entries = vec![0u8; usize::try_from(n * 8).unwrap_or(0)];
        if map
            .read_exact_at(&mut entries, (first_vpn + first) * 8)
            .is_err()
        {
            continue;
        }
        for (i, e) in entries.chunks_exact(8).enumerate() {
            let mut b = [0u8; 8];
            b.copy_from_slice(e);
            let e = u64::from_ne_bytes(b);
            if e & PRESENT != 0 && e & UFFD_WP != 0 {
                out.push(first + i as u64);
            }
        }
    }
    out
}

/// Whether page `p` of source `o` (if it is one that never changes) holds
/// `bytes`.
fn same_as_origin(
    arena: &crate::pages::SourceArena,
    o: SourceId,
    p: u64,
    bytes: &[u8],
    scratch: &mut [u8],
) -> bool {
    let Some(source) = arena.get(o).cloned() else {
        return false;
    };
    let fixed = matches!(
        &*source,
        PageSource::File(_)
            | PageSource::Image(_)
            | PageSource::Zstd(_)
            | PageSource::Remote(_)
            | PageSource::Frozen(_)
    );
    if !fixed {
        return false;
    }
    let dst = VolatileSlice::from(&mut scratch[..]);
    // A compressed frame not decoded, a chunk not fetched: not now.
    read_pages(&source, p, &dst, &|_| None).is_ok() && scratch == bytes
}

/// `vm`'s `Swap` source, made now if it has none (and the server has a
/// store): the source its swapped pages' entries name. Returns whether
/// one was made.
///
/// A source another table names too (a fork child copied its parent's
/// entries) is left to them and a new one made: a frame is found by its
/// source's key and page, the newest first, so a page swapped again
/// under the shared key would change what the child reads.
pub(crate) fn swap_source(reg: &mut Registry, rc: &Reclaimer, vm: VmId) -> bool {
    let Some(store) = rc.store() else {
        return false;
    };
    let Registry { vms, arena, .. } = reg;
    let mine = vms.get(&vm).and_then(|v| v.reclaim.swap_src);
    if let Some(s) = mine.filter(|s| arena.get(*s).is_some()) {
        let shared = vms
            .values()
            .any(|o| o.id != vm && (o.table.count_of(s) > 0 || o.reclaim.names(s)));
        if !shared {
            return false;
        }
    }
    let Some(v) = vms.get_mut(&vm) else {
        return false;
    };
    let key = arena.next_id();
    let s = arena.insert(PageSource::Swap(SwapSource {
        vm,
        key: u64::from(key),
        store: Rc::clone(store),
    }));
    v.reclaim.swap_src = Some(s);
    true
}

/// Put page `p` of `v` (`bytes`) into the swap store; the source its entry
/// names then (the VM's `Swap` source, see [`swap_source`]).
fn swap_out(
    arena: &crate::pages::SourceArena,
    rc: &mut Reclaimer,
    v: &Vm,
    p: u64,
    bytes: &[u8],
) -> Option<SourceId> {
    let store = Rc::clone(rc.store()?);
    let src = v.reclaim.swap_src.filter(|s| arena.get(*s).is_some())?;
    let key = match arena.get(src).map(|s| &**s) {
        Some(PageSource::Swap(w)) => w.owner(),
        _ => return None,
    };
    let put = store.borrow_mut().put(key, p, bytes);
    match put {
        Ok(_) => {}
        Err(StoreError::Full { .. }) => {
            rc.store_is_full();
            return None;
        }
        Err(e) => {
            warn!("{}: cannot swap page {p} out: {e}", v.id);
            return None;
        }
    }
    Some(src)
}
