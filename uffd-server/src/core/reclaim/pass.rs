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
}

impl Took {
    /// Pages given back.
    pub fn freed(&self) -> u64 {
        self.dropped + self.swapped
    }
}

/// Why `v` cannot be reclaimed now, if it cannot.
pub fn ineligible(v: &Vm) -> Option<&'static str> {
    if !v.reclaim.enabled() {
        return Some("it opted out");
    }
    if v.deleted || !matches!(v.state, RunState::Running | RunState::Paused) {
        return Some("it does not run");
    }
    if v.busy.is_some() {
        return Some("an operation pauses it");
    }
    if v.base.is_based() {
        return Some("its pages are its VMM's (a shared base)");
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
        let to = if buf.iter().all(|b| *b == 0) {
            Some(UNINITIALIZED)
        } else if let Some(o) = v
            .reclaim
            .origin_of(p)
            .filter(|o| *o != me && *o != UNINITIALIZED)
            .filter(|o| same_as_origin(arena, *o, p, &buf, &mut origin_buf))
        {
            Some(o)
        } else if rc.can_swap() {
            swap_out(arena, rc, v, p, &buf)
        } else {
            None
        };
        match to {
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
    for &(p, src) in &gone {
        let swapped = v.reclaim.swap_src == Some(src);
        v.reclaim.reclaimed(p, swapped);
        if swapped {
            took.swapped += 1;
        } else {
            took.dropped += 1;
        }
        v.log.pages.dropped(p, 1);
    }
    rc.gave_back(took.freed() * PAGE_SIZE);
    took
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
    let me = v.self_src;
    let readers: Vec<&crate::pages::PageTable> = reg
        .vms
        .values()
        .filter(|o| o.id != vm && o.table.count_of(me) > 0)
        .map(|o| &o.table)
        .collect();
    let present = v.memory.present_ranges()?;
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
    Some(out)
}

/// `pages` as runs `(first, n)`; `pages` ascending.
fn runs_of(pages: &[u64]) -> Vec<(u64, u64)> {
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

/// Put page `p` of `v` (`bytes`) into the swap store; the source its entry
/// names then (the VM's `Swap` source, made at its first page).
fn swap_out(
    arena: &mut crate::pages::SourceArena,
    rc: &mut Reclaimer,
    v: &mut Vm,
    p: u64,
    bytes: &[u8],
) -> Option<SourceId> {
    let store = Rc::clone(rc.store()?);
    let src = match v.reclaim.swap_src {
        Some(s) if arena.get(s).is_some() => s,
        _ => {
            let key = arena.next_id();
            let s = arena.insert(PageSource::Swap(SwapSource {
                vm: v.id,
                key: u64::from(key),
                store: Rc::clone(&store),
            }));
            v.reclaim.swap_src = Some(s);
            s
        }
    };
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
