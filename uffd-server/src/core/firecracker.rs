//! Serving Firecracker processes (DESIGN §9): listeners bound to a memory
//! source, and the VMs that connect to them.
//!
//! Firecracker's guest memory is anonymous and lives in its own process, so
//! pages are installed with UFFDIO_COPY (from the server's read-only mapping
//! of the source) and UFFDIO_ZEROPAGE. The table indexes pages by their
//! offset in the source file; `Vm(self)` means "installed in Firecracker".
//!
//! - Fault-around: a fault on an image page installs the run of
//!   not-yet-installed image pages around it within its aligned block.
//! - Working set: with `working_set` on, the pages the first VM of a listener
//!   faulted on are recorded in order; later VMs get them installed in bulk
//!   right after the handshake, while faults keep being served.
//! - REMOVE (balloon, `MADV_DONTNEED`): the range becomes `Uninitialized`, so
//!   the next fault installs zeroes. EAGAIN from an install means such an
//!   event is pending: the fault is deferred and retried after the events.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use proto::firecracker::Region;
use serde_json::{json, Value};
use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tracing::{info, warn};
use userfaultfd::{Event, EventBuffer, FaultKind, Uffd};

use super::vm::{FaultStats, RunState};
use super::{ApiError, ApiResult, Core};
use crate::firecracker::{FcHandshake, ListenerStats};
use crate::pages::{PageTable, SourceId, UNINITIALIZED};
use crate::uffd_ffi::{self, Install};

/// A read-only shared mapping of a source file.
#[derive(Debug)]
pub struct FileMap {
    ptr: std::ptr::NonNull<u8>,
    len: u64,
}

impl FileMap {
    /// Map `file` read-only.
    pub fn new(file: &std::fs::File, len: u64) -> Result<Self, String> {
        let n = std::num::NonZeroUsize::new(usize::try_from(len).unwrap_or(0))
            .ok_or("memory source is empty")?;
        // SAFETY: a fresh read-only shared mapping of a file we hold open;
        // no MAP_FIXED, unmapped in Drop.
        let ptr = unsafe {
            nix::sys::mman::mmap(
                None,
                n,
                nix::sys::mman::ProtFlags::PROT_READ,
                nix::sys::mman::MapFlags::MAP_SHARED,
                file,
                0,
            )
        }
        .map_err(|e| format!("cannot map the memory source: {e}"))?;
        Ok(FileMap {
            ptr: ptr.cast(),
            len,
        })
    }

    fn at(&self, offset: u64, len: u64) -> Option<*const u8> {
        let end = offset.checked_add(len)?;
        // SAFETY: `offset + len <= self.len`, inside the mapping.
        (end <= self.len).then(|| unsafe {
            self.ptr.as_ptr().add(shared::geometry::usize_of(offset)) as *const u8
        })
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`.
        let _ = unsafe {
            nix::sys::mman::munmap(self.ptr.cast(), shared::geometry::usize_of(self.len))
        };
    }
}

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

/// A Firecracker VM being served.
#[derive(Debug)]
pub struct FcVm {
    pub id: VmId,
    pub listener: u32,
    pub conn: u64,
    pub pid: u32,
    pub regions: Vec<Region>,
    pub table: PageTable,
    pub self_src: SourceId,
    pub file_src: SourceId,
    pub map: Rc<FileMap>,
    pub uffd: Rc<AsyncFd<Uffd>>,
    pub state: RunState,
    pub stats: FaultStats,
    pub fault_around_pages: u64,
    pub readahead: super::vm::Readahead,
    /// Source pages installed by faults, in order (for working-set
    /// recording).
    pub fault_order: Vec<u64>,
    pub stream: UnixStream,
    /// Signalled on hang-up: the serving task stops and drops the uffd
    /// (after the process exits its uffd never becomes readable again).
    pub closed: Rc<tokio::sync::Notify>,
}

/// Result of resolving one fault.
enum Resolved {
    Ok,
    /// Retry after the pending events.
    Again,
    Gone,
}

impl FcVm {
    fn region_of(&self, addr: u64) -> Option<Region> {
        self.regions
            .iter()
            .copied()
            .find(|r| addr >= r.base && addr < r.base + r.size)
    }

    fn raw_uffd(&self) -> i32 {
        self.uffd.get_ref().as_raw_fd()
    }

    /// Install source pages `[lo, hi)` of region `r`; returns how many pages
    /// from `lo` were installed before an existing page, or the outcome.
    fn install_run(&mut self, r: Region, lo: u64, hi: u64) -> Result<u64, Resolved> {
        let dst = r.base + (lo * PAGE_SIZE - r.offset);
        let len = (hi - lo) * PAGE_SIZE;
        let src_id = self.table.get(lo);
        let res = if src_id == UNINITIALIZED {
            if r.page_size == PAGE_SIZE {
                uffd_ffi::zeropage(self.raw_uffd(), dst, len)
            } else {
                let zeros = zero_buffer(len);
                // SAFETY: `zeros` is a live buffer of at least `len` bytes.
                unsafe { uffd_ffi::copy(self.raw_uffd(), zeros.as_ptr(), dst, len, 0) }
            }
        } else {
            let Some(src) = self.map.at(lo * PAGE_SIZE, len) else {
                return Err(Resolved::Ok);
            };
            // SAFETY: `src..src+len` lies in our live read-only mapping.
            unsafe { uffd_ffi::copy(self.raw_uffd(), src, dst, len, 0) }
        };
        let done = |copied: u64| copied / PAGE_SIZE;
        let n = match res {
            Install::Done => hi - lo,
            Install::Exists { copied } => done(copied),
            Install::Again { copied } => {
                self.mark(lo, done(copied));
                return Err(Resolved::Again);
            }
            Install::Gone => return Err(Resolved::Gone),
            Install::Failed(errno) => {
                warn!(
                    "{}: install of pages {lo}..{hi} failed: errno {errno}",
                    self.id
                );
                return Err(Resolved::Ok);
            }
        };
        self.mark(lo, n);
        Ok(n)
    }

    fn mark(&mut self, lo: u64, n: u64) {
        let me = self.self_src;
        self.table.set_range(lo, n, me);
        self.stats.pages_installed += n;
    }

    fn wake(&self, addr: u64, len: u64) {
        let _ = self
            .uffd
            .get_ref()
            .wake(addr as *mut libc::c_void, shared::geometry::usize_of(len));
    }

    /// Resolve a MISSING fault at `addr`.
    fn resolve(&mut self, addr: u64, record: bool) -> Resolved {
        let Some(r) = self.region_of(addr) else {
            warn!("{}: fault at {addr:#x} outside every region", self.id);
            return Resolved::Ok;
        };
        let unit = r.page_size / PAGE_SIZE;
        let page = (r.offset + (addr - r.base)) / PAGE_SIZE;
        let first = page - page % unit;
        if self.table.get(first) == self.self_src {
            self.wake(addr & !(r.page_size - 1), r.page_size);
            return Resolved::Ok;
        }
        let (lo, hi) = if unit > 1 || self.table.get(page) != self.file_src {
            (first, first + unit)
        } else {
            // Fault-around: the run of image pages around `page` in its
            // block; a fault where the last install ended (a sequential
            // reader) doubles the window up to the readahead limit.
            let block = self.fault_around_pages.max(1);
            let r_lo = r.offset / PAGE_SIZE;
            let r_hi = r_lo + r.size / PAGE_SIZE;
            let sequential = record && block > 1 && page == self.readahead.next;
            let window = if sequential {
                (self.readahead.window * 2).clamp(block, self.readahead.max_pages.max(block))
            } else {
                block
            };
            self.readahead.window = window;
            let b_lo = if sequential {
                page
            } else {
                (page - (page - r_lo) % block).max(r_lo)
            };
            let b_hi = (b_lo + window).min(r_hi);
            let mut lo = page;
            while lo > b_lo && self.table.get(lo - 1) == self.file_src {
                lo -= 1;
            }
            let mut hi = page + 1;
            while hi < b_hi && self.table.get(hi) == self.file_src {
                hi += 1;
            }
            (lo, hi)
        };
        match self.install_run(r, lo, hi) {
            Ok(n) if lo + n > page => {
                if record {
                    self.readahead.next = lo + n;
                    // The working set is every page this VM was given, in
                    // order, including those installed around the fault.
                    self.fault_order.extend(lo..lo + n);
                }
                Resolved::Ok
            }
            Ok(_) => {
                // Something below `page` already existed: install just it.
                match self.install_run(r, first, first + unit) {
                    Ok(n) => {
                        if record {
                            self.fault_order.extend(first..first + n);
                        }
                        self.wake(addr & !(r.page_size - 1), r.page_size);
                        Resolved::Ok
                    }
                    Err(e) => e,
                }
            }
            Err(e) => e,
        }
    }

    fn remove(&mut self, start: u64, end: u64) {
        self.stats.removes += 1;
        for r in self.regions.clone() {
            let s = start.max(r.base);
            let e = end.min(r.base + r.size);
            if s >= e {
                continue;
            }
            let lo = (r.offset + (s - r.base)) / PAGE_SIZE;
            let hi = (r.offset + (e - r.base)).div_ceil(PAGE_SIZE);
            self.table.set_range(lo, hi - lo, UNINITIALIZED);
        }
    }
}

fn zero_buffer(len: u64) -> Rc<Vec<u8>> {
    thread_local! {
        static ZEROS: RefCell<Rc<Vec<u8>>> = RefCell::new(Rc::new(Vec::new()));
    }
    ZEROS.with(|z| {
        let mut z = z.borrow_mut();
        if (z.len() as u64) < len {
            *z = Rc::new(vec![0u8; shared::geometry::usize_of(len)]);
        }
        z.clone()
    })
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
        let fault_around_pages = match req.fault_around_kib {
            Some(0) => 1,
            Some(k) if k % 4 == 0 && (k / 4).is_power_of_two() && k <= 4096 => k / 4,
            Some(_) => {
                return Err(ApiError::bad_request(
                    "fault_around_kib must be 0 or a power-of-two multiple of 4 up to 4096",
                ))
            }
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

/// Handle a batch of events for a Firecracker VM; returns faults to retry.
fn handle_batch(core: &Core, id: VmId, events: Vec<Event>, deferred: &mut Vec<u64>) -> bool {
    let mut reg = core.reg.borrow_mut();
    let Some(v) = reg.fc_vms.get_mut(&id) else {
        return false;
    };
    let record = v.fault_order.len() < (1 << 22);
    // Events that change the address space (REMOVE) apply before retrying
    // deferred faults, so a removed page is installed as zero.
    let mut faults = Vec::new();
    for ev in events {
        match ev {
            Event::Pagefault {
                kind: FaultKind::Missing,
                addr,
                ..
            } => faults.push(addr as u64),
            Event::Pagefault { addr, .. } => v.wake(addr as u64 & !(PAGE_SIZE - 1), PAGE_SIZE),
            Event::Remove { start, end } => v.remove(start as u64, end as u64),
            _ => {}
        }
    }
    let retry: Vec<u64> = std::mem::take(deferred);
    for (i, addr) in retry.into_iter().chain(faults).enumerate() {
        let _ = i;
        v.stats.missing += 1;
        match v.resolve(addr, record) {
            Resolved::Ok => {}
            Resolved::Again => deferred.push(addr),
            Resolved::Gone => return false,
        }
    }
    true
}

async fn serve_fc(
    core: Rc<Core>,
    id: VmId,
    uffd: Rc<AsyncFd<Uffd>>,
    closed: Rc<tokio::sync::Notify>,
) {
    let mut buf = EventBuffer::new(64);
    let mut deferred: Vec<u64> = Vec::new();
    loop {
        let events: Vec<Event> = if deferred.is_empty() {
            let mut guard = tokio::select! {
                g = uffd.readable() => match g {
                    Ok(g) => g,
                    Err(_) => return,
                },
                () = closed.notified() => return,
            };
            match guard.get_inner().read_events(&mut buf) {
                Ok(it) => {
                    let evs: Vec<Event> = it.filter_map(Result::ok).collect();
                    if evs.is_empty() {
                        guard.clear_ready();
                        if !core.reg.borrow().fc_vms.contains_key(&id) {
                            return;
                        }
                        continue;
                    }
                    evs
                }
                Err(_) => return,
            }
        } else {
            // Deferred faults wait for the pending event that made the
            // install fail with EAGAIN; poll for it briefly.
            tokio::time::sleep(Duration::from_micros(200)).await;
            match uffd.get_ref().read_events(&mut buf) {
                Ok(it) => it.filter_map(Result::ok).collect(),
                Err(_) => return,
            }
        };
        if !handle_batch(&core, id, events, &mut deferred) {
            return;
        }
    }
}

/// Install a recorded working set in bulk, a batch at a time, yielding to
/// the fault task between batches.
async fn prefetch_working_set(core: Rc<Core>, id: VmId, pages: Rc<Vec<u64>>) {
    let t = std::time::Instant::now();
    let mut installed = 0u64;
    for chunk in pages.chunks(256) {
        {
            let mut reg = core.reg.borrow_mut();
            let Some(v) = reg.fc_vms.get_mut(&id) else {
                return;
            };
            for &p in chunk {
                let Some(r) = v
                    .regions
                    .iter()
                    .copied()
                    .find(|r| p * PAGE_SIZE >= r.offset && p * PAGE_SIZE < r.offset + r.size)
                else {
                    continue;
                };
                if v.table.get(p) == v.self_src {
                    continue;
                }
                let addr = r.base + (p * PAGE_SIZE - r.offset);
                let before = v.stats.pages_installed;
                if let Resolved::Gone = v.resolve(addr, false) {
                    return;
                }
                installed += v.stats.pages_installed - before;
            }
        }
        tokio::task::yield_now().await;
    }
    info!(
        "{id}: working set prefetched: {installed} pages in {:?}",
        t.elapsed()
    );
}

/// `BTreeMap` of listeners and Firecracker VMs, kept in the registry.
pub type FcListeners = BTreeMap<u32, FcListener>;
/// Firecracker VMs by id.
pub type FcVms = BTreeMap<VmId, FcVm>;
