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

mod serve;
mod vm;

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use proto::api::{
    CreateListener, ListenerDeleted, ListenerInfo, ListenerList, MemorySource, VmDeleted,
};
use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tracing::{info, warn};
use userfaultfd::Uffd;

pub use vm::FcVm;

use super::vm::RunState;
use super::{Core, Error, Result};
use crate::conn::firecracker::ListenerStats;
use crate::conn::FcHandshake;
use crate::observe::stats::FaultStats;
use crate::pages::{FileSource, PageSource, PageTable, SourceId, ZstdSource, UNINITIALIZED};
use serve::{prefetch_working_set, serve_fc};

/// A Firecracker listener.
#[derive(Debug)]
pub struct FcListener {
    pub id: u32,
    pub socket: PathBuf,
    /// What the listener serves, as asked.
    pub memory_source: MemorySource,
    pub source: SourceId,
    /// Runs of source pages holding data (the rest, a compressed image's
    /// zero frames or a snapshot image's holes, read as zero).
    pub data: Rc<Vec<(u64, u64)>>,
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

impl Core {
    /// Start a Firecracker listener.
    pub fn add_fc_listener(self: &Rc<Self>, req: CreateListener) -> Result<ListenerInfo> {
        let path = req.memory_source.describe();
        let (source, len, data) = self.open_listener_source(&req.memory_source)?;
        let socket = PathBuf::from(&req.socket);
        let fault_around = req
            .fault_around_kib
            .map(crate::pages::FaultAround::from_kib);
        let fault_around_pages = match fault_around {
            Some(Ok(f)) => f.pages(),
            Some(Err(e)) => return Err(Error::BadRequest(format!("fault_around_kib {e}"))),
            None => self.settings.fault_around_pages,
        };
        let readahead_pages = match req.readahead_kib {
            Some(k) if k % 4 == 0 && k <= 64 * 1024 => k / 4,
            Some(_) => {
                return Err(Error::BadRequest(
                    "readahead_kib must be a multiple of 4 up to 65536 (0 = off)".into(),
                ))
            }
            None => self.settings.readahead_pages,
        };
        if socket.symlink_metadata().is_ok() {
            return Err(Error::SocketExists { path: socket });
        }
        let listen_err = |source| Error::Listen {
            path: socket.clone(),
            source,
        };
        let sock = std::os::unix::net::UnixListener::bind(&socket).map_err(listen_err)?;
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600));
        let accept = sock.try_clone().map_err(listen_err)?;
        let stats = Arc::new(ListenerStats::default());
        let mut reg = self.reg.borrow_mut();
        reg.next_listener += 1;
        let id = reg.next_listener;
        let source = reg.arena.insert(source);
        let ctx = crate::conn::firecracker::ListenerCtx {
            id,
            socket: socket.clone(),
            source_len: len,
            stats: stats.clone(),
            events: self.events.clone(),
        };
        std::thread::Builder::new()
            .name("fc-accept".into())
            .spawn(move || crate::conn::firecracker::accept_loop(accept, ctx))
            .map_err(|source| Error::SpawnThread {
                what: "accept Firecracker connections",
                source,
            })?;
        reg.fc_listeners.insert(
            id,
            FcListener {
                id,
                socket: socket.clone(),
                memory_source: req.memory_source.clone(),
                source,
                data: Rc::new(data),
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
            socket.display()
        );
        drop(reg);
        self.fc_listener_info(id)
    }

    /// The source a listener serves, the memory size it covers and the
    /// runs of its pages that hold data.
    fn open_listener_source(&self, memory: &MemorySource) -> Result<ListenerSource> {
        match memory {
            MemorySource::File { path } => {
                let (file, len) = crate::images::open_regular(
                    std::path::Path::new(path),
                    self.settings.image_dir.as_deref(),
                )?;
                if len == 0 || len % PAGE_SIZE != 0 {
                    return Err(Error::Image {
                        path: path.clone(),
                        reason: "a memory snapshot must be a non-empty multiple of 4096 bytes"
                            .into(),
                    });
                }
                let (file, pin) =
                    crate::images::pin(file, &self.settings.state_dir).map_err(|source| {
                        Error::OpenImageFile(crate::images::ImageError::Open {
                            path: path.clone(),
                            source,
                        })
                    })?;
                let source = PageSource::File(FileSource::new(PathBuf::from(path), file, len, pin));
                Ok((source, len, vec![(0, len / PAGE_SIZE)]))
            }
            MemorySource::Zstd { path } => {
                let image = self.open_zstd(path, None)?;
                let len = image.header().memory_bytes;
                let data = image.data_pages();
                Ok((PageSource::Zstd(ZstdSource { image }), len, data))
            }
            MemorySource::Snapshot { name } => {
                let (bytes, compressed, path) = {
                    let cat = self.snapshots.borrow();
                    let st = cat.get(name)?;
                    (
                        st.memory_bytes,
                        st.files.contains_key(crate::snapshot::ZSTD_FILE),
                        cat.image_of(name),
                    )
                };
                let (source, data) = self.open_snapshot_memory(name, compressed, &path)?;
                Ok((source, bytes, data))
            }
        }
    }

    /// `GET /v1/firecracker/listeners/{id}` body.
    pub fn fc_listener_info(&self, id: u32) -> Result<ListenerInfo> {
        let reg = self.reg.borrow();
        let l = reg
            .fc_listeners
            .get(&id)
            .ok_or_else(|| Error::NoSuchListener(format!("fc-{id}")))?;
        let vms: Vec<String> = reg
            .fc_vms
            .values()
            .filter(|v| v.listener == id)
            .map(|v| v.id.to_string())
            .collect();
        let last_refusal = l
            .stats
            .last_refusal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        Ok(ListenerInfo {
            id: format!("fc-{id}"),
            socket: l.socket.display().to_string(),
            memory_source: l.memory_source.clone(),
            fault_around_kib: super::fault_around_kib(l.fault_around_pages),
            readahead_kib: l.readahead_pages * PAGE_SIZE / 1024,
            working_set: l.working_set,
            recorded_pages: l.recorded.as_ref().map_or(0, |r| r.len() as u64),
            accepted: l.stats.accepted.load(Ordering::Relaxed),
            refused: l.stats.refused.load(Ordering::Relaxed),
            last_refusal,
            vms,
        })
    }

    /// `GET /v1/firecracker/listeners`.
    pub fn fc_listeners(&self) -> ListenerList {
        let ids: Vec<u32> = self.reg.borrow().fc_listeners.keys().copied().collect();
        ListenerList {
            listeners: ids
                .into_iter()
                .filter_map(|id| self.fc_listener_info(id).ok())
                .collect(),
        }
    }

    /// `DELETE /v1/firecracker/listeners/{id}`: stop accepting; connected
    /// VMs keep being served.
    pub fn delete_fc_listener(&self, id: u32) -> Result<ListenerDeleted> {
        let mut reg = self.reg.borrow_mut();
        let l = reg
            .fc_listeners
            .remove(&id)
            .ok_or_else(|| Error::NoSuchListener(format!("fc-{id}")))?;
        reg.release_unused_sources();
        drop(reg);
        // SAFETY: shutdown(2) on our own listening socket; it makes the
        // accept thread's accept() fail with EINVAL so it exits.
        unsafe { libc::shutdown(l.sock.as_raw_fd(), libc::SHUT_RDWR) };
        let _ = std::fs::remove_file(&l.socket);
        Ok(ListenerDeleted {
            id: format!("fc-{id}"),
            deleted: true,
        })
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
        let data = Rc::clone(&l.data);
        let (file_src, fault_around, recorded) = (
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
            let (lo, hi) = (r.offset / PAGE_SIZE, (r.offset + r.size) / PAGE_SIZE);
            for &(first, n) in data.iter() {
                let (a, b) = (first.max(lo), (first + n).min(hi));
                if a < b {
                    table.set_range(a, b - a, file_src);
                }
            }
        }
        let id = reg.alloc_id(&self.settings.state_dir);
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
                uffd: afd.clone(),
                state: RunState::Running,
                failure: None,
                warnings: Default::default(),
                stats: FaultStats::default(),
                fault_around_pages: fault_around,
                readahead: crate::pages::Readahead {
                    next: u64::MAX,
                    window: 0,
                    max_pages: readahead_pages,
                },
                fault_order: Vec::new(),
                stream,
                closed: closed.clone(),
                phases: Default::default(),
                readahead_piece_pages: self.settings.readahead_piece_pages,
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
        reg.retired.add(&v.stats);
        reg.arena.release(v.self_src);
        reg.release_unused_sources();
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
    pub fn delete_fc_vm(&self, id: VmId) -> Option<VmDeleted> {
        let reg = self.reg.borrow();
        let v = reg.fc_vms.get(&id)?;
        let _ = v.stream.shutdown(std::net::Shutdown::Both);
        Some(VmDeleted {
            id: id.to_string(),
            deleted: true,
            frozen: false,
        })
    }
}

/// What a listener serves: the source, the memory size it covers and the
/// runs of its pages that hold data.
type ListenerSource = (PageSource, u64, Vec<(u64, u64)>);

/// `BTreeMap` of listeners and Firecracker VMs, kept in the registry.
pub type FcListeners = BTreeMap<u32, FcListener>;
/// Firecracker VMs by id.
pub type FcVms = BTreeMap<VmId, FcVm>;
