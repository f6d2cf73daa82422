//! Taking VMs back at start: the fds the store handed over and the
//! journal make the arena, the bases and every VM again, exactly as the
//! process before this one left them (its tables are read from their
//! mirrors). Each adopted VM's uffd is served again and every range of
//! it woken once: a fault the dead process read but never answered is
//! raised again by the thread that waits on it. Its VMM, alive all along,
//! rejoins on its own (`link::welcome::rejoin`).
//!
//! A VM that cannot be taken back (a table naming a source the journal
//! lacks, made by an operation the crash interrupted; a remote source; a
//! VMM that died meanwhile) is kept as `failed`, with the reason, and
//! counted as lost.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Instant;

use shared::VmId;
use tracing::{info, warn};

use super::error::{AdoptError, Result};
use super::handed::Handed;
use super::journal::{replay, sync};
use super::record::{BaseOrigin, FileRec, IdentityRec, PinRec, SourceRec};
use crate::bases::{Base, ImageKey, Origin};
use crate::core::base::state::OnBase;
use crate::core::fork::layering::Layering;
use crate::core::state::Core;
use crate::core::vm::{Vm, VmParts};
use crate::images::{Identity, ImageId, Pin, Stamp};
use crate::pages::anchor::Anchor;
use crate::pages::process::ProcessPages;
use crate::pages::source::LayerFill;
use crate::pages::{FileSource, FrozenKind, FrozenSource, ImageSource, PageSource, ZstdSource};
use crate::snapshot::pageset::PageSet;

fn identity(i: &IdentityRec) -> Identity {
    Identity {
        dev: i.dev,
        ino: i.ino,
        len: i.len,
        mtime_ns: i128::from(i.mtime_ns),
    }
}

fn pin(p: PinRec) -> Pin {
    match p {
        PinRec::Private => Pin::PrivateClone,
        PinRec::Stamp { len, sec, nsec } => Pin::Stamp(Stamp::from_parts(len, sec, nsec)),
    }
}

fn file_source(h: &mut Handed, f: &FileRec) -> Result<FileSource> {
    let file = h.file(&f.fd)?;
    let mut s = FileSource::new(PathBuf::from(&f.path), file, f.len, pin(f.pin));
    if let Some(i) = &f.identity {
        s = s.with_identity(identity(i));
    }
    Ok(s)
}

/// Layers the server before this one was still filling: the pages the
/// adopted tables name them for that their memfds lack are copied on,
/// from the same process (the parent's VMM's anchor, by pid and start
/// time), before any fault is served. If that process is gone, those pages
/// are lost: every VM that reads one fails, with the reason, instead of
/// reading a page that was never copied.
fn adopt_fills(core: &Rc<Core>, journal: &super::handed::Replayed) {
    let mut fills = Vec::new();
    let mut reg = core.reg.borrow_mut();
    for (id, fill) in &journal.fills {
        let Some(PageSource::Frozen(f)) = reg.arena.get(*id).map(|s| &**s) else {
            continue;
        };
        let layer = Rc::clone(&f.memory);
        let parent = VmId(fill.vm);
        let unit = layer.unit_pages();
        let mut named = PageSet::new(layer.pages());
        for v in reg.vms.values() {
            for (first, n) in v.table.ranges_of(*id) {
                let (lo, hi) = layer.unit_range(first, first + n);
                named.insert_range(lo, hi - lo);
            }
        }
        let lost = |reg: &mut crate::core::registry::Registry, why: String| {
            for v in reg.vms.values_mut() {
                if !v.table.ranges_of(*id).is_empty() {
                    warn!("{}: {why}", v.id);
                    v.fail(why.clone());
                }
            }
        };
        let Some(present) = layer.present_ranges() else {
            lost(
                &mut reg,
                format!("{parent}'s hugepage layer was being filled when the server stopped: which of its pages were copied cannot be told"),
            );
            continue;
        };
        for (first, n) in present {
            for p in first..first + n {
                named.remove(p);
            }
        }
        if named.is_empty() {
            continue;
        }
        let process = Anchor::adopt(fill.pid, fill.started)
            .map_err(|e| shared::error_chain(&e))
            .and_then(|a| {
                ProcessPages::open(fill.pid, fill.vmm_base, Some(Rc::new(a)))
                    .map_err(|e| format!("cannot read the pagemap of pid {}: {e}", fill.pid))
            });
        let process = match process {
            Ok(p) => Rc::new(p),
            Err(why) => {
                lost(
                    &mut reg,
                    format!(
                        "{} page(s) {parent} wrote before it forked were lost before they reached its layer: {why}",
                        named.len()
                    ),
                );
                continue;
            }
        };
        info!(
            "{parent}: its layer (source {id}) still lacks {} page(s); filling it on",
            named.len()
        );
        let l = Rc::new(Layering::new(
            parent,
            *id,
            layer,
            process,
            Some(named),
            unit,
        ));
        *f.filling.borrow_mut() = Some(Rc::clone(&l) as Rc<dyn LayerFill>);
        if let Some(v) = reg.vms.get_mut(&parent) {
            v.fork.layering = Some(Rc::clone(&l));
        }
        fills.push(l);
    }
    drop(reg);
    for l in fills {
        crate::core::fork::layer::spawn_fill(core, l);
    }
}

fn source(core: &Core, h: &mut Handed, rec: &SourceRec) -> Result<PageSource> {
    Ok(match rec {
        SourceRec::Vm { vm } => PageSource::Vm(VmId(*vm)),
        SourceRec::Frozen {
            vm,
            layer,
            fd,
            huge,
        } => PageSource::Frozen(FrozenSource::new(
            VmId(*vm),
            h.memory(fd, *huge)?,
            if *layer {
                FrozenKind::Layer
            } else {
                FrozenKind::Template
            },
        )),
        SourceRec::File { file } => PageSource::File(file_source(h, file)?),
        SourceRec::Image { snapshot, file } => PageSource::Image(ImageSource {
            snapshot: snapshot.clone(),
            file: file_source(h, file)?,
        }),
        SourceRec::Zstd { file, snapshot } => {
            let f = h.file(&file.fd)?;
            let image = core
                .frames
                .open(
                    f,
                    PathBuf::from(&file.path),
                    pin(file.pin),
                    snapshot.clone(),
                    file.identity.as_ref().map(identity),
                )
                .map_err(|e| AdoptError::OpenZstd(file.path.clone(), e))?;
            PageSource::Zstd(ZstdSource { image })
        }
        SourceRec::Swap { vm, key } => {
            let store = core
                .reclaim
                .borrow()
                .store_for_reading()
                .cloned()
                .ok_or(AdoptError::NoSwapStore(*vm))?;
            PageSource::Swap(crate::pages::source::SwapSource {
                vm: VmId(*vm),
                key: *key,
                store,
            })
        }
        SourceRec::Remote { manifest } => {
            let service = core
                .remote
                .service()
                .map_err(|_| AdoptError::NoRemote(manifest.name.clone()))?;
            PageSource::Remote(crate::pages::RemoteSource {
                image: std::sync::Arc::new(crate::remote::image::RemoteImage::new(
                    manifest,
                    service.url(),
                    std::sync::Arc::clone(&service.chunks),
                )),
            })
        }
        SourceRec::Lost { why } => return Err(AdoptError::SourceLost(why.clone())),
    })
}

/// Take back everything the journal and `fds` hold. Returns the VMs
/// whose uffds are to be served, with those uffds.
pub(crate) fn adopt(core: &Rc<Core>, fds: Vec<(String, OwnedFd)>) -> Vec<(VmId, OwnedFd, u64)> {
    let t0 = Instant::now();
    let r = &core.restart;
    let journal = replay(&r.log.path);
    {
        // What the store holds now: what nothing names after adoption is
        // removed from it by the sync below.
        let mut w = r.log.written.borrow_mut();
        w.stored.extend(fds.iter().map(|(n, _)| n.clone()));
        w.stored.insert(super::journal::API_LISTENER.to_owned());
        w.stored.insert(super::journal::VMM_LISTENER.to_owned());
    }
    let mut h = Handed {
        fds: fds.into_iter().collect(),
        memories: HashMap::new(),
        unders: HashMap::new(),
    };
    let mut lost_sources: HashMap<u32, String> = HashMap::new();
    let mut serve = Vec::new();
    let mut adopted = 0;
    let mut lost = Vec::new();
    {
        let mut reg = core.reg.borrow_mut();
        for (id, rec) in &journal.sources {
            match source(core, &mut h, rec) {
                Ok(s) => reg.arena.adopt(*id, s),
                Err(why) => {
                    lost_sources.insert(*id, shared::error_chain(&why));
                }
            }
        }
        for (vm, (fd, huge)) in &journal.memories {
            // Only the memories of VMs a source still names (a VM gone
            // leaves its record behind until the journal is compacted).
            let named = journal
                .sources
                .values()
                .any(|s| matches!(s, SourceRec::Vm { vm: v } if v == vm));
            if !named {
                continue;
            }
            match h.memory(fd, *huge) {
                Ok(m) => reg.arena.adopt_memory(VmId(*vm), m),
                Err(e) => warn!("vm-{vm}: {}", shared::error_chain(&e)),
            }
        }
        let mut bases: HashMap<u32, Rc<Base>> = HashMap::new();
        for (id, b) in &journal.bases {
            let memory = match h.memory(&b.fd, b.huge) {
                Ok(m) => m,
                Err(e) => {
                    warn!("base-{id}: {}", shared::error_chain(&e));
                    continue;
                }
            };
            let origin = match &b.origin {
                BaseOrigin::Template { vm } => Origin::Template(VmId(*vm)),
                BaseOrigin::Image { identity: i } => {
                    let mut filled = PageSet::new(memory.pages());
                    for (first, n) in memory.present_ranges().unwrap_or_default() {
                        filled.insert_range(first, n);
                    }
                    Origin::Image {
                        key: ImageKey::new(ImageId::File(identity(i)), memory.page_size()),
                        filled: std::cell::RefCell::new(filled),
                    }
                }
                BaseOrigin::Content {
                    digest,
                    memory_bytes,
                } => {
                    let mut filled = PageSet::new(memory.pages());
                    for (first, n) in memory.present_ranges().unwrap_or_default() {
                        filled.insert_range(first, n);
                    }
                    Origin::Image {
                        key: ImageKey::new(
                            ImageId::Content {
                                digest: u128::from_str_radix(digest, 16).unwrap_or(0),
                                memory_bytes: *memory_bytes,
                            },
                            memory.page_size(),
                        ),
                        filled: std::cell::RefCell::new(filled),
                    }
                }
            };
            let base = Rc::new(Base {
                id: *id,
                memory,
                origin,
                what: b.what.clone(),
            });
            reg.bases.adopt(&base);
            bases.insert(*id, base);
        }
        for (id, rec) in &journal.vms {
            let vm = VmId(*id);
            let adopted_vm = (|| -> Result<Vm> {
                let memory = h.memory(&rec.memory, rec.huge)?;
                let table = h.table(&rec.table, rec.table_over.as_ref(), memory.pages())?;
                for src in table.counts().keys() {
                    if let Some(why) = lost_sources.get(src) {
                        return Err(AdoptError::SourceLost(why.clone()));
                    }
                    if reg.arena.get(*src).is_none() {
                        return Err(AdoptError::UnknownSource(*src));
                    }
                }
                // Its newest `Vm(id)` source: a fork the crash cut short
                // may have given it one the journal has and its record
                // does not.
                let self_src = reg.arena.vm_id(vm).unwrap_or(rec.self_src);
                let (ready, _) = tokio::sync::oneshot::channel();
                let mut v = Vm::new(VmParts {
                    id: vm,
                    memory,
                    table,
                    self_src,
                    vcpus: rec.vcpus,
                    fault_around_pages: rec.fault_around_pages,
                    readahead_pages: rec.readahead_pages,
                    ready,
                });
                v.link.ready = None;
                v.adopt_state(rec.state, rec.failure.clone(), rec.deleted);
                v.volume.clone_from(&rec.volume);
                v.owns_volume = rec.owns_volume;
                v.link.pid = rec.pid;
                v.faults.vmm_base = rec.vmm_base;
                v.fork.parent = rec.parent.map(VmId);
                v.reclaim = crate::core::reclaim::state::VmReclaim::new(
                    rec.reclaim.as_ref(),
                    v.memory.pages(),
                    None,
                );
                if let Some(snapshot) = &rec.rollback_to {
                    if rec.state == proto::api::RunState::Running {
                        // Finished once its VMM rejoins; nothing else may
                        // pause it before.
                        v.rollback.begin(snapshot);
                        v.busy.hold("a rollback a restart cut short");
                    }
                }
                v.adopted = Some(crate::core::restart::state::AdoptedVm::now());
                if let Some((b, src)) = rec.on_base {
                    let base = bases.get(&b).ok_or(AdoptError::NoBase(b))?;
                    v.base.on = Some(OnBase {
                        base: Rc::clone(base),
                        src,
                    });
                }
                v.base.frozen_for = rec.frozen_for.and_then(|b| bases.get(&b).cloned());
                if matches!(
                    rec.state,
                    proto::api::RunState::Running | proto::api::RunState::Paused
                ) {
                    super::reconcile::own_pages(&mut v);
                }
                Ok(v)
            })();
            // Its id stays taken, adopted or lost: the id file may lag
            // behind the journal.
            reg.vm_id_taken(vm.0);
            match adopted_vm {
                Ok(v) => {
                    let live = matches!(
                        v.state(),
                        proto::api::RunState::Running | proto::api::RunState::Paused
                    );
                    if live {
                        if let Some(uffd) = rec.uffd.as_ref().and_then(|n| h.fds.remove(n)) {
                            serve.push((vm, uffd, rec.vmm_base));
                        }
                    }
                    if let (Some(name), Some(engine)) = (&v.volume, &core.volumes) {
                        // Its VMM holds the disk, as before.
                        engine.attach(name, &vm.to_string());
                    }
                    crate::core::launch::make::enlist(&mut reg, v);
                    adopted += 1;
                }
                Err(why) => {
                    let why = shared::error_chain(&why);
                    warn!("{vm}: cannot be taken back: {why}");
                    lost.push(format!("{vm}: {why}"));
                    if let Some(pid) = rec.pid {
                        // Its VMM serves nobody now.
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap_or(0)),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                    }
                }
            }
        }
    }
    adopt_fills(core, &journal);
    let (fc_adopted, fc_lost) = super::firecracker::adopt(core, &mut h, &journal, &lost_sources);
    adopted += fc_adopted;
    lost.extend(fc_lost);
    {
        // What an operation the crash cut made for VMs that never started
        // (their memories, the images they were to read) goes now.
        let mut reg = core.reg.borrow_mut();
        let orphans = reg.release_sources_of_absent_vms();
        if orphans > 0 {
            info!("{orphans} source(s) of VMs that were not taken back released");
        }
        reg.release_unused_sources();
    }
    let unused: Vec<&String> = h.fds.keys().collect();
    if !unused.is_empty() {
        info!(
            "{} handed-over fd(s) nothing names any more are closed",
            unused.len()
        );
    }
    drop(h);
    r.adopted.set(adopted);
    *r.lost.borrow_mut() = lost;
    // The journal again, compacted, and the store trimmed to what it names.
    sync(core, true);
    info!(
        "adopted {adopted} VM(s) in {:.1} ms ({} start)",
        t0.elapsed().as_secs_f64() * 1e3,
        r.start_kind().as_str()
    );
    serve
}
