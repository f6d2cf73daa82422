//! Firecracker listeners and clients across a restart.
//!
//! A listener's listening socket is in the fd store, so it stays bound
//! and listening while no server runs: a Firecracker connecting meanwhile
//! waits in its backlog, and the next process accepts it on the same
//! socket (never bound anew). A client's uffd and connection are in the
//! store too, so Firecracker sees no hang-up, and its table writes every
//! entry into a mirror memfd, as our VMs' do: after a crash the table is
//! exact. The journal records the rest (`FcListener`, `FcVm`).
//!
//! At adoption each listener is made again from its socket, same id, and
//! each client from its fds, same VM id and same source ids (the arena
//! was adopted before). Its uffd is served by the usual task
//! (`firecracker::serve`) and each region is woken once, so a fault the
//! dead process read and never answered is raised again; its connection
//! is watched for hang-up as a new one's is. A client whose Firecracker
//! died while no server ran is forgotten, as its hang-up would have made
//! it; one that cannot be taken back (its table names a source the
//! journal lacks) is counted as lost and its Firecracker killed, as our
//! VMs' VMMs are.
//!
//! Not carried over: listener counters (accepted, refused), client fault
//! counters, and a client's working set still being recorded (the
//! listener records one from its next client instead). A working set
//! already recorded is kept.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;

use proto::firecracker::Region;
use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tracing::{info, warn};
use userfaultfd::Uffd;

use super::error::{AdoptError, Result};
use super::handed::{Found, Handed, Replayed};
use super::record::{FcListenerRec, FcVmRec, Record, RegionRec};
use super::state::Written;
use crate::conn::firecracker::{ListenerCtx, ListenerStats};
use crate::core::firecracker::state::FcListener;
use crate::core::firecracker::vm::FcVm;
use crate::core::registry::Registry;
use crate::core::state::Core;
use crate::observe::stats::FaultStats;
use crate::pages::mirror::Mirror;
use crate::pages::Readahead;

/// Give every client's table a mirror (a new client's gets one here).
pub(super) fn attach_mirrors(reg: &mut Registry) {
    for v in reg.fc_vms.values_mut() {
        if v.table.mirror().is_none() {
            match Mirror::create(v.table.pages()) {
                Ok(m) => v.table.attach_mirror(m),
                Err(e) => warn!("{}: no mirror of its table: {e}", v.id),
            }
        }
    }
}

/// `pages` (source pages, in order) as runs `(first, pages)`.
fn runs(pages: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &p in pages {
        match out.last_mut() {
            Some((first, n)) if *first + *n == p => *n += 1,
            _ => out.push((p, 1)),
        }
    }
    out
}

fn listener_rec(
    found: &mut Found,
    l: &FcListener,
    recorded: Option<Vec<(u64, u64)>>,
) -> FcListenerRec {
    FcListenerRec {
        id: l.id,
        socket: l.socket.display().to_string(),
        fd: found.fd(format!("fc-listener-{}", l.id), l.sock.as_raw_fd()),
        memory_source: l.memory_source.clone(),
        source: l.source,
        source_len: l.source_len,
        data: l.data.as_ref().clone(),
        fault_around_pages: l.fault_around_pages,
        readahead_pages: l.readahead_pages,
        working_set: l.working_set,
        recorded,
    }
}

fn vm_rec(found: &mut Found, v: &FcVm) -> FcVmRec {
    let id = v.id.0;
    FcVmRec {
        id,
        listener: v.listener,
        conn: v.conn,
        pid: v.pid,
        regions: v
            .regions
            .iter()
            .map(|r| RegionRec {
                base: r.base,
                size: r.size,
                offset: r.offset,
                page_size: r.page_size,
            })
            .collect(),
        self_src: v.self_src,
        file_src: v.file_src,
        table: v
            .table
            .mirror()
            .map(|m| found.fd(format!("fc-table-{id}"), m.fd().as_raw_fd()))
            .unwrap_or_default(),
        uffd: found.fd(format!("fc-uffd-{id}"), v.uffd.get_ref().as_raw_fd()),
        stream: found.fd(format!("fc-conn-{id}"), v.stream.as_raw_fd()),
        state: v.state,
        failure: v.failure.clone(),
        fault_around_pages: v.fault_around_pages,
        readahead_pages: v.readahead.max_pages,
        readahead_piece_pages: v.readahead_piece_pages,
    }
}

/// The records of what changed among listeners and clients since the
/// last sync (`journal::sync`), with the fds they name.
pub(super) fn records(reg: &Registry, found: &mut Found, w: &mut Written) {
    let mut ids = HashSet::new();
    for l in reg.fc_listeners.values() {
        ids.insert(l.id);
        let key = l.recorded.as_ref().map_or(0, |r| Rc::as_ptr(r) as usize);
        let recorded = match w.fc_listeners.get(&l.id) {
            Some((k, old)) if *k == key => old.recorded.clone(),
            _ => l.recorded.as_deref().map(|r| runs(r)),
        };
        let rec = listener_rec(found, l, recorded);
        if w.fc_listeners.get(&l.id).is_none_or(|(_, old)| *old != rec) {
            found.records.push(Record::FcListener(rec.clone()));
            w.names.put(&mut w.fc_listeners, l.id, (key, rec));
        }
    }
    let gone: Vec<u32> = w
        .fc_listeners
        .keys()
        .filter(|id| !ids.contains(id))
        .copied()
        .collect();
    for id in gone {
        w.names.drop(&mut w.fc_listeners, &id);
        found.records.push(Record::FcListenerGone { id });
    }
    let mut ids = HashSet::new();
    for v in reg.fc_vms.values() {
        ids.insert(v.id.0);
        let rec = vm_rec(found, v);
        if w.fc_vms.get(&v.id.0) != Some(&rec) {
            found.records.push(Record::FcVm(rec.clone()));
            w.names.put(&mut w.fc_vms, v.id.0, rec);
        }
    }
    let gone: Vec<u32> = w
        .fc_vms
        .keys()
        .filter(|id| !ids.contains(id))
        .copied()
        .collect();
    for id in gone {
        w.names.drop(&mut w.fc_vms, &id);
        found.records.push(Record::FcVmGone { id });
    }
}

/// Whether the process `pid` exists.
fn alive(pid: u32) -> bool {
    pid != 0
        && nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap_or(0)),
            None,
        )
        .is_ok()
}

/// Whether the peer of `stream` has closed its end (without waiting).
fn hung_up(stream: &UnixStream) -> bool {
    let mut p = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Listener `rec`, made again from its socket in the store.
fn listener(
    core: &Core,
    reg: &Registry,
    h: &mut Handed,
    rec: &FcListenerRec,
    lost_sources: &HashMap<u32, String>,
) -> Result<FcListener> {
    if let Some(why) = lost_sources.get(&rec.source) {
        return Err(AdoptError::SourceLost(why.clone()));
    }
    if reg.arena.get(rec.source).is_none() {
        return Err(AdoptError::ListenerSourceMissing(rec.source));
    }
    let sock = UnixListener::from(h.fd(&rec.fd)?);
    sock.set_nonblocking(false)
        .map_err(AdoptError::ListenerSocket)?;
    let accept = sock.try_clone().map_err(AdoptError::ListenerSocket)?;
    let socket = PathBuf::from(&rec.socket);
    let stats = Arc::new(ListenerStats::default());
    let ctx = ListenerCtx {
        id: rec.id,
        socket: socket.clone(),
        source_len: rec.source_len,
        stats: stats.clone(),
        events: core.events.clone(),
    };
    std::thread::Builder::new()
        .name("fc-accept".into())
        .spawn(move || crate::conn::firecracker::accept_loop(accept, ctx))
        .map_err(AdoptError::StartAcceptThread)?;
    let recorded = rec.recorded.as_ref().map(|runs| {
        Rc::new(
            runs.iter()
                .flat_map(|&(first, n)| first..first + n)
                .collect::<Vec<u64>>(),
        )
    });
    Ok(FcListener {
        id: rec.id,
        socket,
        memory_source: rec.memory_source.clone(),
        source: rec.source,
        source_len: rec.source_len,
        data: Rc::new(rec.data.clone()),
        fault_around_pages: rec.fault_around_pages,
        readahead_pages: rec.readahead_pages,
        working_set: rec.working_set,
        recorded,
        stats,
        sock,
    })
}

/// What became of a client at adoption.
enum Taken {
    /// Made again: to be served, with its connection to watch.
    Adopted(Box<FcVm>, UnixStream),
    /// Its Firecracker is gone.
    Gone,
}

/// Client `rec`, made again from its fds in the store.
fn client(
    reg: &mut Registry,
    h: &mut Handed,
    rec: &FcVmRec,
    lost_sources: &HashMap<u32, String>,
) -> Result<Taken> {
    let vm = VmId(rec.id);
    let stream = UnixStream::from(h.fd(&rec.stream)?);
    if hung_up(&stream) || !alive(rec.pid) {
        return Ok(Taken::Gone);
    }
    let regions: Vec<Region> = rec
        .regions
        .iter()
        .map(|r| Region {
            base: r.base,
            size: r.size,
            offset: r.offset,
            page_size: r.page_size,
        })
        .collect();
    let pages = regions
        .iter()
        .map(|r| (r.offset + r.size) / PAGE_SIZE)
        .max()
        .unwrap_or(0);
    let table = h.table(&rec.table, None, pages)?;
    for src in table.counts().keys() {
        if let Some(why) = lost_sources.get(src) {
            return Err(AdoptError::SourceLost(why.clone()));
        }
        if reg.arena.get(*src).is_none() {
            return Err(AdoptError::UnknownSource(*src));
        }
    }
    let uffd = h.fd(&rec.uffd)?;
    nix::fcntl::fcntl(
        uffd.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    )
    .map_err(AdoptError::UffdNonBlocking)?;
    // SAFETY: `uffd` is owned here; ownership moves into the Uffd, which
    // closes it on drop.
    let uffd = unsafe { Uffd::from_raw_fd(uffd.into_raw_fd()) };
    // SAFETY: the Uffd owns its fd until the AsyncFd drops it.
    let uffd = unsafe { AsyncFd::register_with_interest(uffd, tokio::io::Interest::READABLE) }
        .map_err(|e| AdoptError::PollUffd(e.into_parts().1))?;
    let watched = stream.try_clone().map_err(AdoptError::WatchConnection)?;
    let self_src = reg.arena.vm(vm);
    Ok(Taken::Adopted(
        Box::new(FcVm {
            id: vm,
            listener: rec.listener,
            conn: rec.conn,
            pid: rec.pid,
            regions,
            table,
            self_src,
            file_src: rec.file_src,
            uffd: Rc::new(uffd),
            state: rec.state,
            failure: rec.failure.clone(),
            warnings: Default::default(),
            stats: FaultStats::default(),
            fault_around_pages: rec.fault_around_pages,
            readahead: Readahead {
                next: u64::MAX,
                window: 0,
                max_pages: rec.readahead_pages,
            },
            fault_order: Vec::new(),
            stream,
            closed: Rc::new(tokio::sync::Notify::new()),
            phases: Default::default(),
            readahead_piece_pages: rec.readahead_piece_pages,
        }),
        watched,
    ))
}

/// Take back every listener and client the journal names, serve each
/// client's uffd again and wake its regions. Returns how many clients
/// were adopted and those lost, each with why.
pub(super) fn adopt(
    core: &Rc<Core>,
    h: &mut Handed,
    journal: &Replayed,
    lost_sources: &HashMap<u32, String>,
) -> (u64, Vec<String>) {
    // New connections (on the listeners about to accept again) get ids
    // past every connection taken over.
    for v in journal.fc_vms.values() {
        crate::conn::firecracker::reserve_conns(v.conn);
    }
    let mut reg = core.reg.borrow_mut();
    for rec in journal.fc_listeners.values() {
        reg.listener_id_taken(rec.id);
        match listener(core, &reg, h, rec, lost_sources) {
            Ok(l) => {
                info!(
                    "firecracker listener fc-{} on {} taken back",
                    l.id,
                    l.socket.display()
                );
                reg.fc_listeners.insert(l.id, l);
            }
            Err(why) => {
                warn!(
                    "fc-{}: cannot be taken back: {}",
                    rec.id,
                    shared::error_chain(&why)
                );
                let path = std::path::Path::new(&rec.socket);
                if std::fs::symlink_metadata(path)
                    .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
                {
                    let _ = std::fs::remove_file(path);
                }
            }
        }
    }
    let mut serve = Vec::new();
    let mut lost = Vec::new();
    let mut gone = false;
    for rec in journal.fc_vms.values() {
        let vm = VmId(rec.id);
        reg.listener_id_taken(rec.listener);
        match client(&mut reg, h, rec, lost_sources) {
            Ok(Taken::Adopted(v, watched)) => {
                serve.push((
                    vm,
                    Rc::clone(&v.uffd),
                    Rc::clone(&v.closed),
                    v.regions.clone(),
                    watched,
                    v.conn,
                ));
                reg.fc_vms.insert(vm, *v);
            }
            Ok(Taken::Gone) => {
                info!(
                    "{vm}: firecracker pid {} exited while no server ran",
                    rec.pid
                );
                if let Some(src) = reg.arena.vm_id(vm) {
                    reg.arena.release(src);
                }
                gone = true;
            }
            Err(why) => {
                let why = shared::error_chain(&why);
                warn!("{vm}: cannot be taken back: {why}");
                lost.push(format!("{vm}: {why}"));
                if let Some(src) = reg.arena.vm_id(vm) {
                    reg.arena.release(src);
                }
                gone = true;
                if alive(rec.pid) {
                    // Nobody can serve its faults any more.
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(i32::try_from(rec.pid).unwrap_or(0)),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
    }
    if gone {
        reg.release_unused_sources();
    }
    drop(reg);
    let adopted = serve.len() as u64;
    for (vm, uffd, closed, regions, watched, conn) in serve {
        for r in &regions {
            let len = usize::try_from(r.size).unwrap_or(0);
            if let Err(e) = uffd.get_ref().wake(r.base as *mut libc::c_void, len) {
                warn!("{vm}: cannot wake its region at {:#x}: {e}", r.base);
            }
        }
        tokio::task::spawn_local(crate::core::firecracker::serve::serve_fc(
            Rc::clone(core),
            vm,
            uffd,
            closed,
        ));
        if let Err(e) = crate::conn::firecracker::watch(watched, conn, core.events.clone()) {
            warn!("{vm}: cannot watch its connection for hang-up: {e}");
        }
    }
    (adopted, lost)
}
