//! The journal: what a server needs to take its VMs back after a crash
//! or a handover, beyond what the memfds and VMMs themselves hold.
//!
//! Tables are not in it: each VM's table writes its entries into a
//! mirror memfd as it goes (`pages::mirror`), which the fd store keeps.
//! The journal records the rest, which changes only when an operation
//! changes it: the sources the tables name (ids, files, frozen memfds),
//! the bases, each VM (its memfds, uffd, VMM, state, base), and the
//! Firecracker listeners and clients (`restart::firecracker`). Every fd
//! a record names is handed to the store before the record is written;
//! an fd is removed from the store only after the records that stop
//! naming it are written (`state::Names` counts, for every fd, the
//! written records that name it). [`sync`] runs before every API answer
//! and appends only what changed (a VM still starting is not recorded: a
//! crash before its create answers discards it); a torn last line (a
//! crash mid-write) is skipped when it is read back.
//!
//! A sync is paid by every request, so it is made cheap with many VMs
//! around: it walks the VMs and the sources beside what it wrote, both in
//! id order, and compares each VM with its record field by field without
//! making a record or a name (a source by the address of its `Rc`, which
//! a source changed in place never keeps); only what changed is made
//! into a record and has its fds handed to the store, several per
//! datagram where the keeper takes them (`FdStore::store_all`). (Made
//! again and compared, every VM and every fd name each time, it cost
//! 1.4 ms a request with 1,000 VMs: a fork of 1,000 children whose
//! clients then asked each one something spent 1.4 s in it.)

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::rc::Rc;

use tracing::warn;

use super::handed::{identity_rec, pin_rec, FdName, Found, Replayed};
use super::record::{
    BaseOrigin, BaseRec, FileRec, FillRec, Record, SourceRec, TableOver, VmFds, VmRec,
};
use super::state::{Log, Written};
use crate::bases::{Base, Origin};
use crate::core::registry::Registry;
use crate::core::state::Core;
use crate::core::vm::Vm;
use crate::images::ImageId;
use crate::memory::PageSize;
use crate::pages::mirror::Mirror;
use crate::pages::table::Under;
use crate::pages::{FrozenKind, PageSource, PageTable, VmPages};
use shared::VmId;

/// Names of the listening sockets in the store; they are never removed.
pub const API_LISTENER: &str = "api-listener";
pub const VMM_LISTENER: &str = "vmm-listener";

/// Compact the journal once it grows past this.
const COMPACT_BYTES: u64 = 16 << 20;

fn source_rec(found: &mut Found, id: u32, s: &PageSource) -> Option<SourceRec> {
    Some(match s {
        PageSource::Uninitialized => return None,
        PageSource::Vm(vm) => SourceRec::Vm { vm: vm.0 },
        PageSource::Frozen(f) => SourceRec::Frozen {
            vm: f.vm.0,
            layer: f.kind == FrozenKind::Layer,
            fd: found.memory(&f.memory),
            huge: f.memory.page_size() == PageSize::Huge2M,
        },
        PageSource::File(f) => SourceRec::File {
            file: found.file(id, f),
        },
        PageSource::Image(i) => SourceRec::Image {
            snapshot: i.snapshot.clone(),
            file: found.file(id, &i.file),
        },
        PageSource::Zstd(z) => SourceRec::Zstd {
            file: FileRec {
                path: z.image.path.display().to_string(),
                fd: found.fd(format!("src-{id}"), z.image.file().as_raw_fd()),
                len: z.image.file().metadata().map_or(0, |m| m.len()),
                pin: pin_rec(&z.image.pin),
                identity: z.image.identity.as_ref().map(identity_rec),
            },
            snapshot: z.image.snapshot.clone(),
        },
        PageSource::Remote(r) => SourceRec::Remote {
            manifest: Box::new((*r.image.manifest).clone()),
        },
        PageSource::Swap(w) => SourceRec::Swap {
            vm: w.vm.0,
            key: w.key,
        },
    })
}

fn base_rec(found: &mut Found, b: &Base) -> BaseRec {
    BaseRec {
        id: b.id,
        fd: found.memory(&b.memory),
        huge: b.memory.page_size() == PageSize::Huge2M,
        origin: match &b.origin {
            Origin::Template(vm) => BaseOrigin::Template { vm: vm.0 },
            Origin::Image { key, .. } => match key.image {
                ImageId::File(i) => BaseOrigin::Image {
                    identity: identity_rec(&i),
                },
                ImageId::Content {
                    digest,
                    memory_bytes,
                } => BaseOrigin::Content {
                    digest: format!("{digest:032x}"),
                    memory_bytes,
                },
            },
        },
        what: b.what.clone(),
    }
}

/// What `v`'s record names, by number.
fn vm_fds(v: &Vm) -> VmFds {
    VmFds {
        memory: v.memory.file_id(),
        table: v
            .table
            .mirror()
            .map(|m| (m.ino(), v.table.under().map(|u| u.ino()))),
        uffd: v.faults.uffd.is_some(),
    }
}

fn vm_rec(found: &mut Found, v: &Vm) -> VmRec {
    let (table, table_over) = match v.table.mirror() {
        None => (String::new(), None),
        Some(m) => {
            let table = found.fd(
                FdName::Table(v.id.0, m.ino()).to_string(),
                m.fd().as_raw_fd(),
            );
            match v.table.under() {
                None => (table, None),
                Some(u) => {
                    let under = found.fd(FdName::Under(u.ino()).to_string(), u.fd().as_raw_fd());
                    (String::new(), Some(TableOver { table, under }))
                }
            }
        }
    };
    let uffd = v
        .faults
        .uffd
        .as_ref()
        .map(|u| found.fd(FdName::Uffd(v.id.0).to_string(), u.get_ref().as_raw_fd()));
    VmRec {
        id: v.id.0,
        vcpus: v.vcpus,
        memory: found.memory(&v.memory),
        huge: v.memory.page_size() == PageSize::Huge2M,
        self_src: v.self_src,
        table,
        table_over,
        uffd,
        vmm_base: v.faults.vmm_base,
        pid: v.link.pid,
        state: v.state(),
        failure: v.failure().map(str::to_owned),
        volume: v.volume.clone(),
        owns_volume: v.owns_volume,
        deleted: v.is_deleted(),
        on_base: v.base.on.as_ref().map(|o| (o.base.id, o.src)),
        frozen_for: v.base.frozen_for.as_ref().map(|b| b.id),
        fault_around_pages: v.faults.fault_around_pages,
        readahead_pages: v.faults.readahead.max_pages,
        parent: v.fork.parent.map(|p| p.0),
        rollback_to: v.rollback.under_way().map(str::to_owned),
        reclaim: reclaim_rec(v),
    }
}

fn reclaim_rec(v: &Vm) -> Option<proto::api::ReclaimPolicy> {
    Some(v.reclaim.policy()).filter(|p| *p != proto::api::ReclaimPolicy::default())
}

/// Whether `rec`, which names `fds`, is what [`vm_rec`] makes of `v`,
/// found without making it (no name formatted or read, nothing
/// allocated): a sync compares every VM. Every field is named, so a
/// field added to [`VmRec`] must be added here too.
fn vm_rec_is(fds: &VmFds, rec: &VmRec, v: &Vm) -> bool {
    let VmRec {
        id,
        vcpus,
        // These four are names made of `fds`, compared by number.
        memory: _,
        table: _,
        table_over: _,
        uffd: _,
        huge,
        self_src,
        vmm_base,
        pid,
        state,
        failure,
        volume,
        owns_volume,
        deleted,
        on_base,
        frozen_for,
        fault_around_pages,
        readahead_pages,
        parent,
        rollback_to,
        reclaim,
    } = rec;
    *fds == vm_fds(v)
        && *id == v.id.0
        && *vcpus == v.vcpus
        && *huge == (v.memory.page_size() == PageSize::Huge2M)
        && *self_src == v.self_src
        && *vmm_base == v.faults.vmm_base
        && *pid == v.link.pid
        && *state == v.state()
        && failure.as_deref() == v.failure()
        && *volume == v.volume
        && *owns_volume == v.owns_volume
        && *deleted == v.is_deleted()
        && *on_base == v.base.on.as_ref().map(|o| (o.base.id, o.src))
        && *frozen_for == v.base.frozen_for.as_ref().map(|b| b.id)
        && *fault_around_pages == v.faults.fault_around_pages
        && *readahead_pages == v.faults.readahead.max_pages
        && *parent == v.fork.parent.map(|p| p.0)
        && rollback_to.as_deref() == v.rollback.under_way()
        && *reclaim == reclaim_rec(v)
}

/// Give every VM's table a mirror (a new VM's gets one here, but not a
/// VM still starting). A fork's child's mirror is an overlay of an under
/// of its table, shared with its siblings and with the children of the
/// parent's later forks while its table is mostly the same.
fn attach_mirrors(reg: &mut Registry, unders: &mut HashMap<VmId, Rc<Under>>) {
    for v in reg.vms.values_mut() {
        if v.table.mirror().is_some() || v.state() == proto::api::RunState::Starting {
            continue;
        }
        let under = v.fork.parent.and_then(|p| under_for(unders, p, &v.table));
        let made = match under {
            Some(u) => v.table.attach_overlay(u),
            None => Mirror::create(v.table.pages()).map(|m| v.table.attach_mirror(m)),
        };
        if let Err(e) = made {
            warn!("{}: no mirror of its table: {e}", v.id);
        }
    }
    // An under only the cache holds, or of a parent gone, is not shared
    // by the next children.
    unders.retain(|p, u| Rc::strong_count(u) > 1 && reg.vms.contains_key(p));
}

/// The under for a child of `parent` whose table is `table`: the one its
/// siblings overlay, if it shares at least half its chunks with `table`,
/// else a new one of `table`.
fn under_for(
    unders: &mut HashMap<VmId, Rc<Under>>,
    parent: VmId,
    table: &PageTable,
) -> Option<Rc<Under>> {
    let chunks = table.chunk_count();
    if let Some(u) = unders.get(&parent) {
        if u.pages() == table.pages() && 2 * table.shared_chunks(u.table()) >= chunks {
            return Some(Rc::clone(u));
        }
    }
    match Under::of(table) {
        Ok(u) => {
            unders.insert(parent, Rc::clone(&u));
            Some(u)
        }
        Err(e) => {
            warn!("no shared mirror of the table of {parent}'s children: {e}");
            None
        }
    }
}

/// Write what changed since the last sync to the journal (everything,
/// into a fresh journal, if `full` or the journal has grown large), with
/// the fds it names handed to the store first. A server without a store
/// keeps no journal.
///
/// Every VM and source is looked at, each compared with its record
/// without making one (a sync ends every request, so this is what a
/// request with many VMs around pays); a record is made, and its fds
/// handed to the store, only for what changed.
pub(crate) fn sync(core: &Core, full: bool) {
    let r = &core.restart;
    let Some(store) = r.store() else {
        return;
    };
    if r.handing_over.get() && !full {
        return;
    }
    let mut found = Found::default();
    let mut reg = core.reg.borrow_mut();
    attach_mirrors(&mut reg, &mut r.unders.borrow_mut());
    super::firecracker::attach_mirrors(&mut reg);
    let big = r
        .log
        .file
        .borrow()
        .as_ref()
        .and_then(|f| f.metadata().ok())
        .is_some_and(|m| m.len() > COMPACT_BYTES);
    let mut w = r.log.written.borrow_mut();
    let full = full || big || w.retry || r.log.file.borrow().is_none();
    if full {
        let stored = std::mem::take(&mut w.stored);
        *w = Written {
            stored,
            ..Written::default()
        };
    }
    let w = &mut *w;
    // Sources, walked beside what was written, both in id order. One is
    // never changed in place: a source changed is a new `Rc` (frozen, or
    // a new source at a new id).
    let (mut changed, mut gone) = (Vec::new(), Vec::new());
    {
        let mut old = w.sources.iter().peekable();
        for (id, s) in reg.arena.iter() {
            while let Some((k, _)) = old.next_if(|(k, _)| **k < id) {
                gone.push(*k);
            }
            let prev = old.next_if(|(k, _)| **k == id).map(|(_, v)| v);
            let key = Rc::as_ptr(s) as usize;
            if prev.is_some_and(|(k, _)| *k == key) {
                continue;
            }
            match source_rec(&mut found, id, s) {
                Some(rec) => changed.push((id, key, prev.is_none_or(|(_, p)| *p != rec), rec)),
                None if prev.is_some() => gone.push(id),
                None => {}
            }
        }
        gone.extend(old.map(|(k, _)| *k));
    }
    for id in gone {
        w.names.drop(&mut w.sources, &id);
        found.records.push(Record::Released { id });
    }
    for (id, key, new, rec) in changed {
        if new {
            found.records.push(Record::Source {
                id,
                source: rec.clone(),
            });
        }
        w.names.put(&mut w.sources, id, (key, rec));
    }
    // Layers still being filled (see `fork::layer`).
    let fills: BTreeMap<u32, FillRec> = reg
        .arena
        .iter()
        .filter_map(|(id, s)| match &**s {
            PageSource::Frozen(f) => f.filling.borrow().as_ref().map(|l| {
                let o = l.origin();
                (
                    id,
                    FillRec {
                        vm: f.vm.0,
                        pid: o.pid,
                        started: o.started,
                        vmm_base: o.vmm_base,
                    },
                )
            }),
            _ => None,
        })
        .collect();
    for (id, fill) in &fills {
        if w.fills.get(id) != Some(fill) {
            found.records.push(Record::Filling {
                id: *id,
                fill: *fill,
            });
        }
    }
    for id in w.fills.keys().filter(|id| !fills.contains_key(id)) {
        found.records.push(Record::Filled { id: *id });
    }
    w.fills = fills;
    // Where VMs' pages are.
    let mut kept = 0;
    for (vm, pages) in reg.arena.memories() {
        let VmPages::Memfd(m) = pages else {
            continue;
        };
        kept += 1;
        let huge = m.page_size() == PageSize::Huge2M;
        if w.memories
            .get(&vm.0)
            .is_some_and(|(id, (_, h))| *h == huge && *id == m.file_id())
        {
            continue;
        }
        let fd = found.memory(m);
        found.records.push(Record::Memory {
            vm: vm.0,
            fd: fd.clone(),
            huge,
        });
        w.names
            .put(&mut w.memories, vm.0, (m.file_id(), (fd, huge)));
    }
    if kept < w.memories.len() {
        // What the arena no longer has is not recorded as gone (a
        // memory is read back only for a source that names its VM);
        // its fd leaves the store unless something else names it.
        let have: HashSet<u32> = reg
            .arena
            .memories()
            .filter(|(_, p)| matches!(p, VmPages::Memfd(_)))
            .map(|(vm, _)| vm.0)
            .collect();
        let gone: Vec<u32> = w
            .memories
            .keys()
            .filter(|vm| !have.contains(vm))
            .copied()
            .collect();
        for vm in gone {
            w.names.drop(&mut w.memories, &vm);
        }
    }
    // Bases (few: each made again and compared).
    let live = reg.bases.live();
    let ids: HashSet<u32> = live.iter().map(|b| b.id).collect();
    for b in &live {
        let rec = base_rec(&mut found, b);
        if w.bases.get(&b.id) != Some(&rec) {
            found.records.push(Record::Base(rec.clone()));
            w.names.put(&mut w.bases, b.id, rec);
        }
    }
    let gone: Vec<u32> = w
        .bases
        .keys()
        .filter(|id| !ids.contains(id))
        .copied()
        .collect();
    for id in gone {
        w.names.drop(&mut w.bases, &id);
        found.records.push(Record::BaseGone { id });
    }
    // VMs, walked beside what was written, both in id order (a VM still
    // starting is not recorded).
    let (mut changed, mut gone) = (Vec::new(), Vec::new());
    {
        let mut old = w.vms.iter().peekable();
        for v in reg.vms.values() {
            let id = v.id.0;
            while let Some((k, _)) = old.next_if(|(k, _)| **k < id) {
                gone.push(*k);
            }
            let prev = old.next_if(|(k, _)| **k == id).map(|(_, v)| v);
            if v.state() == proto::api::RunState::Starting {
                if prev.is_some() {
                    gone.push(id);
                }
                continue;
            }
            if prev.is_some_and(|(fds, rec)| vm_rec_is(fds, rec, v)) {
                debug_assert!(
                    prev.is_some_and(|(_, rec)| *rec == vm_rec(&mut Found::default(), v)),
                    "{}: its record changed and vm_rec_is did not see it",
                    v.id
                );
                continue;
            }
            let rec = vm_rec(&mut found, v);
            if prev.is_none_or(|(_, p)| *p != rec) {
                changed.push((vm_fds(v), rec));
            }
        }
        gone.extend(old.map(|(k, _)| *k));
    }
    for id in gone {
        w.names.drop(&mut w.vms, &id);
        found.records.push(Record::VmGone { id });
    }
    for (fds, rec) in changed {
        found.records.push(Record::Vm(rec.clone()));
        w.names.put(&mut w.vms, rec.id, (fds, rec));
    }
    // Firecracker listeners and clients.
    super::firecracker::records(&reg, &mut found, w);
    // The fds first, then the records that name them.
    let new: Vec<(&str, BorrowedFd<'_>)> = found
        .fds
        .iter()
        .filter(|(name, _)| !w.stored.contains(*name))
        // SAFETY: every fd in `found` belongs to an object `reg` holds,
        // borrowed until `new` is dropped below.
        .map(|(name, fd)| (name.as_str(), unsafe { BorrowedFd::borrow_raw(*fd) }))
        .collect();
    let handed = match store.store_all(&new) {
        Ok(()) => new.len(),
        Err((n, e)) => {
            warn!("cannot hand {} to the fd store: {e}", new[n].0);
            w.retry = true;
            n
        }
    };
    for (name, _) in &new[..handed] {
        w.stored.insert((*name).to_owned());
    }
    drop(new);
    drop(reg);
    if full {
        write_fresh(&r.log, &found.records);
    } else if !found.records.is_empty() {
        append(&r.log, &found.records);
    }
    // Then what nothing names any more.
    let dead: Vec<String> = if full {
        w.names.unnamed.clear();
        w.stored
            .iter()
            .filter(|n| !w.names.contains(n) && !is_listener(n))
            .cloned()
            .collect()
    } else {
        let mut dead = std::mem::take(&mut w.names.unnamed);
        dead.retain(|n| !w.names.contains(n) && w.stored.contains(n) && !is_listener(n));
        dead.sort_unstable();
        dead.dedup();
        dead
    };
    let names: Vec<&str> = dead.iter().map(String::as_str).collect();
    if let Err((n, e)) = store.remove_all(&names) {
        warn!("cannot remove {} from the fd store: {e}", names[n]);
    }
    for name in &dead {
        w.stored.remove(name);
    }
}

fn is_listener(name: &str) -> bool {
    name == API_LISTENER || name == VMM_LISTENER
}

fn lines(records: &[Record]) -> Vec<u8> {
    let mut out = Vec::new();
    for rec in records {
        if let Ok(mut l) = serde_json::to_vec(rec) {
            l.push(b'\n');
            out.extend(l);
        }
    }
    out
}

fn append(log: &Log, records: &[Record]) {
    let mut j = log.file.borrow_mut();
    let Some(f) = j.as_mut() else {
        return;
    };
    // One write: a crash leaves at most its last line torn.
    if let Err(e) = f.write_all(&lines(records)) {
        warn!("cannot write the restart journal: {e}");
    }
}

fn write_fresh(log: &Log, records: &[Record]) {
    let tmp = log.path.with_extension("new");
    let written = (|| -> std::io::Result<File> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&tmp)?;
        f.write_all(&lines(records))?;
        std::fs::rename(&tmp, &log.path)?;
        std::fs::OpenOptions::new().append(true).open(&log.path)
    })();
    match written {
        Ok(f) => *log.file.borrow_mut() = Some(f),
        Err(e) => warn!(
            "cannot write the restart journal {}: {e}",
            log.path.display()
        ),
    }
}

/// Read the journal at `path` (a torn or unreadable line is skipped).
pub(super) fn replay(path: &std::path::Path) -> Replayed {
    let mut out = Replayed::default();
    let Ok(text) = std::fs::read_to_string(path) else {
        return out;
    };
    for line in text.lines() {
        let rec = match serde_json::from_str::<Record>(line) {
            Ok(r) => r,
            Err(e) => {
                warn!("restart journal: skipping a line it cannot read: {e}");
                continue;
            }
        };
        match rec {
            Record::Source { id, source } => {
                out.sources.insert(id, source);
            }
            Record::Released { id } => {
                out.sources.remove(&id);
                out.fills.remove(&id);
            }
            Record::Filled { id } => {
                out.fills.remove(&id);
            }
            Record::Filling { id, fill } => {
                out.fills.insert(id, fill);
            }
            Record::Memory { vm, fd, huge } => {
                out.memories.insert(vm, (fd, huge));
            }
            Record::Base(b) => {
                out.bases.insert(b.id, b);
            }
            Record::BaseGone { id } => {
                out.bases.remove(&id);
            }
            Record::Vm(v) => {
                out.vms.insert(v.id, v);
            }
            Record::VmGone { id } => {
                out.vms.remove(&id);
            }
            Record::FcListener(l) => {
                out.fc_listeners.insert(l.id, l);
            }
            Record::FcListenerGone { id } => {
                out.fc_listeners.remove(&id);
            }
            Record::FcVm(v) => {
                out.fc_vms.insert(v.id, v);
            }
            Record::FcVmGone { id } => {
                out.fc_vms.remove(&id);
            }
        }
    }
    out
}

/// Hand a listening socket to the store (once, at first start).
pub fn store_listener(core: &Core, name: &str, fd: BorrowedFd<'_>) {
    if let Some(store) = core.restart.store() {
        match store.store(name, fd.as_fd()) {
            Ok(()) => {
                core.restart
                    .log
                    .written
                    .borrow_mut()
                    .stored
                    .insert(name.to_owned());
            }
            Err(e) => warn!("cannot hand {name} to the fd store: {e}"),
        }
    }
}

/// Journal source `id`, which the arena just took (or froze in place),
/// with the fds it names, before any table can name it: a crash in the
/// middle of the operation that made it leaves no table naming a source
/// the journal lacks. (A layer is not journaled here: it is empty until
/// its fork fills it, and the journal keeps naming the parent's pages in
/// its VMM until the fork's answer syncs.)
pub(crate) fn log_source(log: &Log, id: u32, src: &Rc<PageSource>) {
    let Some(store) = log.store.as_ref() else {
        return;
    };
    if log.file.borrow().is_none() {
        // Not written yet: the first sync writes everything.
        return;
    }
    let mut found = Found::default();
    let Some(rec) = source_rec(&mut found, id, src) else {
        return;
    };
    let mut w = log.written.borrow_mut();
    for (name, fd) in &found.fds {
        if w.stored.contains(name) {
            continue;
        }
        // SAFETY: the fds belong to `src`, alive for this call.
        let fd = unsafe { BorrowedFd::borrow_raw(*fd) };
        match store.store(name, fd) {
            Ok(()) => {
                w.stored.insert(name.clone());
            }
            Err(e) => {
                warn!("cannot hand {name} to the fd store: {e}");
                w.retry = true;
            }
        }
    }
    append(
        log,
        &[Record::Source {
            id,
            source: rec.clone(),
        }],
    );
    let w = &mut *w;
    w.names
        .put(&mut w.sources, id, (Rc::as_ptr(src) as usize, rec));
}

/// The arena's hook: [`log_source`] into `log`.
pub(crate) fn source_hook(log: Rc<Log>) -> crate::pages::source::SourceHook {
    crate::pages::source::SourceHook::new(move |id, src| log_source(&log, id, src))
}
