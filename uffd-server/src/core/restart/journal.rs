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
//! naming it are written. [`sync`] runs before every API answer and
//! appends only what changed (a VM still starting is not recorded: a
//! crash before its create answers discards it); a torn last line (a
//! crash mid-write) is skipped when it is read back.

use std::collections::HashSet;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::rc::Rc;

use tracing::warn;

use super::handed::{identity_rec, pin_rec, Found, Replayed};
use super::record::{BaseOrigin, BaseRec, FileRec, Record, SourceRec, VmRec};
use super::state::{Log, Written};
use crate::bases::{Base, Origin};
use crate::core::state::Core;
use crate::core::vm::Vm;
use crate::images::ImageId;
use crate::memory::PageSize;
use crate::pages::mirror::Mirror;
use crate::pages::{FrozenKind, PageSource, VmPages};

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

fn vm_rec(found: &mut Found, v: &Vm) -> VmRec {
    let table = v
        .table
        .mirror()
        .map(|m| {
            let raw = m.fd().as_raw_fd();
            // SAFETY: `m` is alive for this borrow.
            let f = unsafe { BorrowedFd::borrow_raw(raw) };
            let ino = rustix_ino(f);
            found.fd(format!("table-{}-{ino}", v.id.0), raw)
        })
        .unwrap_or_default();
    let uffd = v
        .faults
        .uffd
        .as_ref()
        .map(|u| found.fd(format!("uffd-{}", v.id.0), u.get_ref().as_raw_fd()));
    VmRec {
        id: v.id.0,
        vcpus: v.vcpus,
        memory: found.memory(&v.memory),
        huge: v.memory.page_size() == PageSize::Huge2M,
        self_src: v.self_src,
        table,
        uffd,
        vmm_base: v.faults.vmm_base,
        pid: v.link.pid,
        state: v.state,
        failure: v.failure.clone(),
        volume: v.volume.clone(),
        owns_volume: v.owns_volume,
        deleted: v.deleted,
        on_base: v.base.on.as_ref().map(|o| (o.base.id, o.src)),
        frozen_for: v.base.frozen_for.as_ref().map(|b| b.id),
        fault_around_pages: v.faults.fault_around_pages,
        readahead_pages: v.faults.readahead.max_pages,
        parent: v.fork.parent.map(|p| p.0),
        rollback_to: v.rollback.under_way().map(str::to_owned),
        reclaim: Some(v.reclaim.policy()).filter(|p| *p != proto::api::ReclaimPolicy::default()),
    }
}

fn rustix_ino(fd: BorrowedFd<'_>) -> u64 {
    nix::sys::stat::fstat(fd.as_raw_fd()).map_or(0, |s| s.st_ino)
}

/// Write what changed since the last sync to the journal (everything,
/// into a fresh journal, if `full` or the journal has grown large), with
/// the fds it names handed to the store first. A server without a store
/// keeps no journal.
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
    // Every VM's table keeps a mirror (a new VM's gets one here).
    for v in reg.vms.values_mut() {
        if v.table.mirror().is_none() && v.state != proto::api::RunState::Starting {
            match Mirror::create(v.table.pages()) {
                Ok(m) => v.table.attach_mirror(m),
                Err(e) => warn!("{}: no mirror of its table: {e}", v.id),
            }
        }
    }
    super::firecracker::attach_mirrors(&mut reg);
    let big = r
        .log
        .file
        .borrow()
        .as_ref()
        .and_then(|f| f.metadata().ok())
        .is_some_and(|m| m.len() > COMPACT_BYTES);
    let full = full || big || r.log.file.borrow().is_none();
    let mut w = r.log.written.borrow_mut();
    if full {
        let stored = std::mem::take(&mut w.stored);
        *w = Written {
            stored,
            ..Written::default()
        };
    }
    // Sources.
    let mut seen = HashSet::new();
    for (id, s) in reg.arena.iter() {
        let key = Rc::as_ptr(s) as usize;
        let Some(rec) = source_rec(&mut found, id, s) else {
            continue;
        };
        seen.insert(id);
        if w.sources
            .get(&id)
            .is_none_or(|(k, old)| *k != key || *old != rec)
        {
            found.records.push(Record::Source {
                id,
                source: rec.clone(),
            });
            w.sources.insert(id, (key, rec));
        }
    }
    let gone: Vec<u32> = w
        .sources
        .keys()
        .filter(|id| !seen.contains(id))
        .copied()
        .collect();
    for id in gone {
        w.sources.remove(&id);
        found.records.push(Record::Released { id });
    }
    // Where VMs' pages are.
    for (vm, pages) in reg.arena.memories() {
        if let VmPages::Memfd(m) = pages {
            let fd = found.memory(m);
            let rec = (fd.clone(), m.page_size() == PageSize::Huge2M);
            if w.memories.get(&vm.0) != Some(&rec) {
                found.records.push(Record::Memory {
                    vm: vm.0,
                    fd,
                    huge: rec.1,
                });
                w.memories.insert(vm.0, rec);
            }
        }
    }
    // Bases.
    let live = reg.bases.live();
    let ids: HashSet<u32> = live.iter().map(|b| b.id).collect();
    for b in &live {
        let rec = base_rec(&mut found, b);
        if w.bases.get(&b.id) != Some(&rec) {
            w.bases.insert(b.id, rec.clone());
            found.records.push(Record::Base(rec));
        }
    }
    let gone: Vec<u32> = w
        .bases
        .keys()
        .filter(|id| !ids.contains(id))
        .copied()
        .collect();
    for id in gone {
        w.bases.remove(&id);
        found.records.push(Record::BaseGone { id });
    }
    // VMs.
    let mut ids = HashSet::new();
    for v in reg.vms.values() {
        if v.state == proto::api::RunState::Starting {
            continue;
        }
        ids.insert(v.id.0);
        let rec = vm_rec(&mut found, v);
        if w.vms.get(&v.id.0) != Some(&rec) {
            w.vms.insert(v.id.0, rec.clone());
            found.records.push(Record::Vm(rec));
        }
    }
    let gone: Vec<u32> = w
        .vms
        .keys()
        .filter(|id| !ids.contains(id))
        .copied()
        .collect();
    for id in gone {
        w.vms.remove(&id);
        found.records.push(Record::VmGone { id });
    }
    // Firecracker listeners and clients.
    super::firecracker::records(&reg, &mut found, &mut w);
    // The fds first, then the records that name them.
    for (name, fd) in &found.fds {
        if w.stored.contains(name) {
            continue;
        }
        // SAFETY: every fd in `found` belongs to an object `reg` holds,
        // borrowed for this whole function.
        let fd = unsafe { BorrowedFd::borrow_raw(*fd) };
        match store.store(name, fd) {
            Ok(()) => {
                w.stored.insert(name.clone());
            }
            Err(e) => warn!("cannot hand {name} to the fd store: {e}"),
        }
    }
    drop(reg);
    if full {
        write_fresh(&r.log, &found.records);
    } else if !found.records.is_empty() {
        append(&r.log, &found.records);
    }
    // Then what nothing names any more.
    let dead: Vec<String> = w
        .stored
        .iter()
        .filter(|n| {
            !found.fds.contains_key(*n) && n.as_str() != API_LISTENER && n.as_str() != VMM_LISTENER
        })
        .cloned()
        .collect();
    for name in dead {
        if let Err(e) = store.remove(&name) {
            warn!("cannot remove {name} from the fd store: {e}");
        }
        w.stored.remove(&name);
    }
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
            Err(e) => warn!("cannot hand {name} to the fd store: {e}"),
        }
    }
    append(
        log,
        &[Record::Source {
            id,
            source: rec.clone(),
        }],
    );
    w.sources.insert(id, (Rc::as_ptr(src) as usize, rec));
}

/// The arena's hook: [`log_source`] into `log`.
pub(crate) fn source_hook(log: Rc<Log>) -> crate::pages::source::SourceHook {
    crate::pages::source::SourceHook::new(move |id, src| log_source(&log, id, src))
}
