//! Serving Firecracker processes (DESIGN §9): listeners bound to a memory
//! source, and the VMs that connect to them.
//!
//! Firecracker's guest memory is anonymous and lives in its own process, so
//! pages are installed with UFFDIO_COPY (from the server's read-only mapping
//! of the source) and UFFDIO_ZEROPAGE. The table indexes pages by their
//! offset in the source file; `Vm(self)` means "installed in Firecracker".
//!
//! - Fault-around: a fault on an image page installs the run of
//!   not-yet-installed image pages around it within its aligned block;
//!   readahead doubles that window for sequential faults, up to a limit.
//! - Working set: with `working_set` on, the pages the first VM of a listener
//!   was given are recorded in order; later VMs get them installed in bulk
//!   right after the handshake, while faults keep being served.
//! - REMOVE (balloon, `MADV_DONTNEED`): the range becomes `Uninitialized`, so
//!   the next fault installs zeroes. EAGAIN from an install means such an
//!   event is pending: the fault is deferred and retried after the events.

mod map;
mod serve;
mod vm;

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde_json::{json, Value};
use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tracing::{info, warn};
use userfaultfd::Uffd;

pub use map::FileMap;
pub use vm::FcVm;

use super::vm::{FaultStats, RunState};
use super::{ApiError, ApiResult, Core};
use crate::firecracker::{FcHandshake, ListenerStats};
use crate::pages::{PageTable, SourceId, UNINITIALIZED};
use serve::{prefetch_working_set, serve_fc};

/// A Firecracker listener.
#[derive(Debug)]
pub struct FcListener {
    pub id: u32,
    pub socket: PathBuf,
    pub source_path: PathBuf,
    pub source: SourceId,
    pub map: Rc<FileMap>,
    pub fault_around_pages: u64,
    /// Largest readahead window in pages.
    pub readahead_pages: u64,
    pub working_set: bool,
    /// Pages (source page index) the first VM faulted on, in order.
    pub recorded: Option<Rc<Vec<u64>>>,
    pub stats: Arc<ListenerStats>,
    /// The listening socket, shut down to stop the accept thread.
    pub sock: std::os::unix::net::UnixListener,
}

/// Body of `POST /v1/firecracker/listeners`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateListener {
    pub socket: PathBuf,
    pub memory_source: proto::api::MemorySource,
    #[serde(default)]
    pub fault_around_kib: Option<u64>,
    #[serde(default)]
    pub readahead_kib: Option<u64>,
    #[serde(default)]
    pub working_set: bool,
}

impl Core {
    /// Start a Firecracker listener.
    pub fn add_fc_listener(self: &Rc<Self>, req: CreateListener) -> ApiResult<Value> {
        let proto::api::MemorySource::File { path } = &req.memory_source;
        let file = std::fs::File::open(path).map_err(|e| {
            ApiError::bad_request(format!("cannot open memory source {path}: {e}; give a Firecracker memory snapshot or raw image"))
        })?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if len == 0 || len % PAGE_SIZE != 0 {
            return Err(ApiError::bad_request(format!(
                "memory source {path} is {len} bytes; it must be a non-empty multiple of 4096"
            )));
        }
        let fault_around = req
            .fault_around_kib
            .map(crate::pages::FaultAround::from_kib);
        let fault_around_pages = match fault_around {
            Some(Ok(f)) => f.pages(),
            Some(Err(e)) => return Err(ApiError::bad_request(format!("fault_around_kib {e}"))),
            None => self.settings.fault_around_pages,
        };
        let readahead_pages = match req.readahead_kib {
            Some(k) if k % 4 == 0 && k <= 64 * 1024 => k / 4,
            Some(_) => {
                return Err(ApiError::bad_request(
                    "readahead_kib must be a multiple of 4 up to 65536 (0 = off)",
                ))
            }
            None => self.settings.readahead_pages,
        };
        let map = FileMap::new(&file, len).map_err(ApiError::internal)?;
        if req.socket.exists() {
            return Err(ApiError::conflict(format!(
                "{} already exists; remove it or pick another path",
                req.socket.display()
            )));
        }
        let sock = std::os::unix::net::UnixListener::bind(&req.socket).map_err(|e| {
            ApiError::bad_request(format!("cannot listen on {}: {e}", req.socket.display()))
        })?;
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&req.socket, std::fs::Permissions::from_mode(0o600));
        let accept = sock
            .try_clone()
            .map_err(|e| ApiError::internal(e.to_string()))?;
        let stats = Arc::new(ListenerStats::default());
        let mut reg = self.reg.borrow_mut();
        reg.next_listener += 1;
        let id = reg.next_listener;
        let source = reg
            .arena
            .insert(crate::pages::PageSource::File(crate::pages::FileSource {
                path: PathBuf::from(path),
                file,
                len,
            }));
        let ctx = crate::firecracker::ListenerCtx {
            id,
            socket: req.socket.clone(),
            source_len: len,
            stats: stats.clone(),
            events: self.events.clone(),
        };
        std::thread::Builder::new()
            .name("fc-accept".into())
            .spawn(move || crate::firecracker::accept_loop(accept, ctx))
            .map_err(|e| ApiError::internal(format!("cannot start the listener thread: {e}")))?;
        reg.fc_listeners.insert(
            id,
            FcListener {
                id,
                socket: req.socket.clone(),
                source_path: PathBuf::from(path),
                source,
                map: Rc::new(map),
                fault_around_pages,
                readahead_pages,
                working_set: req.working_set,
                recorded: None,
                stats,
                sock,
            },
        );
        info!(
            "firecracker listener fc-{id} on {} serving {path}",
            req.socket.display()
        );
        drop(reg);
        self.fc_listener_info(id)
    }

    /// `GET /v1/firecracker/listeners/{id}` body.
    pub fn fc_listener_info(&self, id: u32) -> ApiResult<Value> {
        let reg = self.reg.borrow();
        let l = reg
            .fc_listeners
            .get(&id)
            .ok_or_else(|| ApiError::not_found(format!("no listener fc-{id}")))?;
        let vms: Vec<String> = reg
            .fc_vms
            .values()
            .filter(|v| v.listener == id)
            .map(|v| v.id.to_string())
            .collect();
        Ok(json!({
            "id": format!("fc-{id}"),
            "socket": l.socket,
            "memory_source": { "kind": "file", "path": l.source_path },
            "fault_around_kib": super::fault_around_kib(l.fault_around_pages),
            "readahead_kib": l.readahead_pages * PAGE_SIZE / 1024,
            "working_set": l.working_set,
            "recorded_pages": l.recorded.as_ref().map(|r| r.len()).unwrap_or(0),
            "accepted": l.stats.accepted.load(Ordering::Relaxed),
            "refused": l.stats.refused.load(Ordering::Relaxed),
            "last_refusal": *l.stats.last_refusal.lock().unwrap_or_else(|p| p.into_inner()),
            "vms": vms,
        }))
    }

    /// `GET /v1/firecracker/listeners`.
    pub fn fc_listeners(&self) -> Value {
        let ids: Vec<u32> = self.reg.borrow().fc_listeners.keys().copied().collect();
        json!({ "listeners": ids.into_iter().filter_map(|id| self.fc_listener_info(id).ok()).collect::<Vec<_>>() })
    }

    /// `DELETE /v1/firecracker/listeners/{id}`: stop accepting; connected
    /// VMs keep being served.
    pub fn delete_fc_listener(&self, id: u32) -> ApiResult<Value> {
        let l = self
            .reg
            .borrow_mut()
            .fc_listeners
            .remove(&id)
            .ok_or_else(|| ApiError::not_found(format!("no listener fc-{id}")))?;
        // SAFETY: shutdown(2) on our own listening socket; it makes the
        // accept thread's accept() fail with EINVAL so it exits.
        unsafe { libc::shutdown(l.sock.as_raw_fd(), libc::SHUT_RDWR) };
        let _ = std::fs::remove_file(&l.socket);
        Ok(json!({ "id": format!("fc-{id}"), "deleted": true }))
    }

    /// A Firecracker process completed its handshake: serve it.
    pub(super) fn on_fc_hello(self: &Rc<Self>, hs: FcHandshake) {
        let FcHandshake {
            listener,
            conn,
            regions,
            uffd,
            pid,
            stream,
        } = hs;
        if let Err(e) = nix::fcntl::fcntl(
            uffd.as_raw_fd(),
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        ) {
            warn!("firecracker: cannot make uffd non-blocking: {e}");
            return;
        }
        // SAFETY: `uffd` came from SCM_RIGHTS and is owned here; ownership
        // moves into the Uffd.
        let uffd = unsafe { Uffd::from_raw_fd(uffd.into_raw_fd()) };
        // SAFETY: the Uffd owns its fd until the AsyncFd drops it.
        let afd =
            match unsafe { AsyncFd::register_with_interest(uffd, tokio::io::Interest::READABLE) } {
                Ok(a) => Rc::new(a),
                Err(e) => {
                    warn!("firecracker: cannot poll the uffd: {e}");
                    return;
                }
            };
        let mut reg = self.reg.borrow_mut();
        let Some(l) = reg.fc_listeners.get(&listener) else {
            return;
        };
        let readahead_pages = l.readahead_pages;
        let (map, file_src, fault_around, recorded) = (
            l.map.clone(),
            l.source,
            l.fault_around_pages,
            if l.working_set {
                l.recorded.clone()
            } else {
                None
            },
        );
        let pages = regions
            .iter()
            .map(|r| (r.offset + r.size) / PAGE_SIZE)
            .max()
            .unwrap_or(0);
        let mut table = PageTable::new(pages, UNINITIALIZED);
        for r in &regions {
            table.set_range(r.offset / PAGE_SIZE, r.size / PAGE_SIZE, file_src);
        }
        reg.next_id += 1;
        let id = VmId(reg.next_id);
        let self_src = reg.arena.vm(id);
        let closed = Rc::new(tokio::sync::Notify::new());
        reg.fc_vms.insert(
            id,
            FcVm {
                id,
                listener,
                conn,
                pid,
                regions,
                table,
                self_src,
                file_src,
                map,
                uffd: afd.clone(),
                state: RunState::Running,
                stats: FaultStats::default(),
                fault_around_pages: fault_around,
                readahead: super::vm::Readahead {
                    next: u64::MAX,
                    window: 0,
                    max_pages: readahead_pages,
                },
                fault_order: Vec::new(),
                stream,
                closed: closed.clone(),
            },
        );
        drop(reg);
        info!("{id}: firecracker pid {pid} connected to fc-{listener}");
        tokio::task::spawn_local(serve_fc(self.clone(), id, afd, closed));
        if let Some(ws) = recorded {
            tokio::task::spawn_local(prefetch_working_set(self.clone(), id, ws));
        }
    }

    /// A Firecracker connection hung up: the VM is gone.
    pub(super) fn on_fc_closed(&self, conn: u64) {
        let mut reg = self.reg.borrow_mut();
        let Some(id) = reg.fc_vms.values().find(|v| v.conn == conn).map(|v| v.id) else {
            return;
        };
        let Some(v) = reg.fc_vms.remove(&id) else {
            return;
        };
        info!(
            "{id}: firecracker pid {} disconnected after {} faults",
            v.pid, v.stats.missing
        );
        reg.arena.release(v.self_src);
        // `notify_one` keeps a permit if the task is not waiting right now.
        v.closed.notify_one();
        if let Some(l) = reg.fc_listeners.get_mut(&v.listener) {
            if l.working_set && l.recorded.is_none() && !v.fault_order.is_empty() {
                let mut seen = std::collections::HashSet::new();
                let ws: Vec<u64> = v
                    .fault_order
                    .iter()
                    .copied()
                    .filter(|p| seen.insert(*p))
                    .collect();
                info!("fc-{}: recorded a working set of {} pages", l.id, ws.len());
                l.recorded = Some(Rc::new(ws));
            }
        }
    }

    /// Drop a Firecracker VM on request: close its connection.
    pub fn delete_fc_vm(&self, id: VmId) -> Option<Value> {
        let reg = self.reg.borrow();
        let v = reg.fc_vms.get(&id)?;
        let _ = v.stream.shutdown(std::net::Shutdown::Both);
        Some(json!({ "id": id.to_string(), "deleted": true }))
    }
}

/// `BTreeMap` of listeners and Firecracker VMs, kept in the registry.
pub type FcListeners = BTreeMap<u32, FcListener>;
/// Firecracker VMs by id.
pub type FcVms = BTreeMap<VmId, FcVm>;
