//! The core: the single thread that owns every VM's state (tables, memory,
//! uffd, VMM connection) and serves faults, VMM messages and API commands.
//!
//! Everything here runs on one tokio current-thread runtime inside a
//! `LocalSet`, so state is plain `Rc`/`RefCell`. API handlers (which may run
//! anywhere) talk to it through [`CoreHandle`]; VMM connection threads
//! through [`ConnEvent`]s. No `RefCell` borrow is held across an `.await`.

mod arm;
pub mod error;
pub mod fault;
pub mod firecracker;
pub mod fork;
mod inspect;
mod launch;
pub mod link;
mod ops;
pub mod pool;
pub(crate) mod ratelimit;
pub mod rollback;
pub(crate) mod serve;
pub mod snapshot;
mod trace;
pub mod vm;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Duration;

pub use error::{Error, Result};
use proto::api;
use proto::vmm::{Reply, Request, ServerMsg, VmmMsg};
use serve::serve_faults;
use shared::VmId;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};
use userfaultfd::Uffd;

use crate::conn::{ConnEvent, PendingLaunches, QueueError, VmmWriter};
use crate::pages::{SourceArena, SourceId};
pub use vm::RunState;
use vm::Vm;

/// Server-wide settings the core needs.
#[derive(Debug, Clone)]
pub struct Settings {
    pub state_dir: PathBuf,
    pub vmm_bin: PathBuf,
    /// Default fault-around block in pages (1 = off).
    pub fault_around_pages: u64,
    /// Default largest readahead window in pages for sequential faults on
    /// image-backed memory (at most the fault-around block = off).
    pub readahead_pages: u64,
    /// How long a VMM may take to connect and start its guest.
    pub start_timeout: Duration,
    /// How long one guest op may take.
    pub exec_timeout: Duration,
    /// How long a VMM may take to pause, resume or capture its state.
    pub vmm_deadline: Duration,
    /// How long after a rollback's resume its discarded pages start being
    /// punched in the background (see `rollback.rs`).
    pub rollback_scrub_delay: Duration,
    /// Requests in flight per VM at most; beyond it that VM answers 503.
    pub vmm_queue: usize,
    /// Logs of deleted VMs kept for post-mortems.
    pub keep_logs: usize,
    /// Guest memory the server may promise, in bytes (admission control).
    pub memory_budget: u64,
    /// VMs at most (pagefork and Firecracker, frozen ones included).
    pub max_vms: usize,
    /// Images are served only from under this directory (canonical).
    pub image_dir: Option<PathBuf>,
    /// Threads compressing a snapshot's `memory.zst`.
    pub compress_threads: usize,
    /// A snapshot image with more extents than this is rewritten
    /// sequentially in the background (0 = never).
    pub rewrite_extents: u64,
    /// For tests: how long a snapshot's writer waits before the first run
    /// it copies out of guest memory (`writer::Memory::hold`).
    pub snapshot_copy_hold: Duration,
    /// VMM processes kept started and connected, waiting for a VM.
    pub vmm_pool: usize,
    /// Guest RAM size (MiB) pooled VMMs prepare their KVM slot for.
    pub vmm_pool_memory_mib: u64,
    /// Back new VMs' guest RAM with 2 MiB hugetlb pages unless a create
    /// says otherwise.
    pub hugepages: bool,
    /// How long a uffd is polled after its events were served before the
    /// core waits for it in the event loop again (zero = never polled; see
    /// `core/serve.rs`).
    pub fault_poll: Duration,
    /// A readahead window is installed in pieces of this many pages, the
    /// faulting page's first, so its thread runs while the rest goes in
    /// (0 = the whole window before the wake).
    pub readahead_piece_pages: u64,
}

impl Registry {
    /// Host memory promised: the whole guest RAM of every live VM (it may
    /// all be written), plus what frozen (deleted) VMs still hold.
    pub fn promised_bytes(&self) -> u64 {
        let ours: u64 = self
            .vms
            .values()
            .map(|v| {
                if v.deleted {
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
                .filter(|v| v.deleted)
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

    /// Release image sources that no table and no listener refers to any
    /// more: their files close, so a deleted VM never keeps an image (or
    /// the filesystem under it) open.
    pub fn release_unused_sources(&mut self) {
        let in_use = |src: SourceId| {
            self.vms.values().any(|v| v.table.count_of(src) > 0)
                || self.fc_vms.values().any(|v| v.table.count_of(src) > 0)
                || self.fc_listeners.values().any(|l| l.source == src)
        };
        let unused: Vec<SourceId> = self.arena.image_ids().filter(|src| !in_use(*src)).collect();
        for src in unused {
            self.arena.release(src);
        }
    }

    /// A new VM id. Ids never repeat on one state directory: the highest
    /// id handed out is recorded in `next-vm-id` in blocks of
    /// [`ID_BLOCK`], so a restarted server starts past every id it may
    /// have used (and past volumes named after them).
    pub fn alloc_id(&mut self, state_dir: &std::path::Path) -> VmId {
        self.next_id += 1;
        if self.next_id > self.id_mark {
            self.id_mark = self.next_id.saturating_add(ID_BLOCK);
            let path = state_dir.join(ID_FILE);
            if let Err(e) = std::fs::write(&path, format!("{}\n", self.id_mark)) {
                warn!("cannot record VM ids in {}: {e}", path.display());
            }
        }
        VmId(self.next_id)
    }
}

/// Ids reserved at a time in the state directory's id file.
const ID_BLOCK: u32 = 64;
/// The file in the state directory that records the VM ids handed out.
const ID_FILE: &str = "next-vm-id";

/// The first VM id a server on `state_dir` may hand out.
fn first_free_id(state_dir: &std::path::Path) -> u32 {
    std::fs::read_to_string(state_dir.join(ID_FILE))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// All VMs and sources.
#[derive(Debug, Default)]
pub struct Registry {
    pub vms: BTreeMap<VmId, Vm>,
    pub arena: SourceArena,
    next_id: u32,
    /// Ids up to this one are recorded as used in the state directory.
    id_mark: u32,
    pub fc_listeners: firecracker::FcListeners,
    pub fc_vms: firecracker::FcVms,
    next_listener: u32,
    /// Fault counters of VMs that are gone (for server-wide totals).
    pub retired: crate::observe::stats::FaultStats,
    /// Pages the fault engine installed in any VM, ever (the trace reads
    /// what one event installed from it).
    pub installed: u64,
    /// A readahead window is installed in pieces of this many pages (at
    /// least the fault-around block), the faulting page's first; 0 = in
    /// one piece.
    pub readahead_piece_pages: u64,
}

/// The core's state.
#[derive(Debug)]
pub struct Core {
    pub reg: RefCell<Registry>,
    pub settings: Settings,
    pub pending: PendingLaunches,
    pub volumes: Option<std::sync::Arc<crate::volume::VolumeEngine>>,
    /// The complete VM snapshots of the state directory.
    pub snapshots: RefCell<crate::snapshot::Catalog>,
    /// Where connection threads (VMM and Firecracker) report.
    pub events: mpsc::UnboundedSender<ConnEvent>,
    /// Time spent on each uffd event (both kinds of VM), for `/metrics`.
    pub fault_seconds: prometheus_client::metrics::histogram::Histogram,
    /// The threads and cache that decode compressed images' frames.
    pub frames: std::sync::Arc<crate::images::zst::FramePool>,
    /// VMMs started ahead of need (`--vmm-pool`).
    pub pool: RefCell<pool::state::VmmPool>,
    /// Log lines that report a finished request, written once its answer
    /// is out (see [`Core::log_after_answer`]).
    after_answer: RefCell<Vec<String>>,
}

/// The answer to a request in flight.
pub type PendingReply = oneshot::Receiver<Result<Reply>>;

/// A command from the API, with where to send its answer.
#[derive(Debug)]
pub struct Command {
    pub kind: CommandKind,
    pub reply: oneshot::Sender<Result<Answer>>,
}

/// What the core answers: one `proto::api` type per kind of request. Only
/// the HTTP layer turns it into JSON.
#[derive(Debug, serde::Serialize)]
#[serde(untagged)]
pub enum Answer {
    Vm(Box<api::VmInfo>),
    Vms(api::VmList),
    VmDeleted(api::VmDeleted),
    Exec(api::ExecResponse),
    Fork(api::ForkResponse),
    Sources(api::Sources),
    Page(api::PageInfo),
    Tree(api::Tree),
    Invariant(api::Invariant),
    Listener(api::ListenerInfo),
    Listeners(api::ListenerList),
    ListenerDeleted(api::ListenerDeleted),
    SnapshotCreated(api::SnapshotCreated),
    Snapshots(api::SnapshotList),
    Snapshot(Box<api::SnapshotInfo>),
    SnapshotDeleted(api::SnapshotDeleted),
    RolledBack(api::VmRolledBack),
    Cloned(api::ClonedVms),
    /// Counters for `/metrics` (rendered as text by the API, never JSON).
    #[serde(skip)]
    Metrics(Box<crate::observe::metrics::Sample>),
    /// A listener of a VM's fault trace (streamed as NDJSON by the API).
    #[serde(skip)]
    Trace(Box<crate::observe::trace::Subscription>),
    Access(api::AccessMap),
    Map(Box<api::PageMap>),
    /// A picture (PNG bytes, sent as they are).
    #[serde(skip)]
    Png(Vec<u8>),
    /// The server is stopping.
    Stopped,
}

/// What the API can ask.
#[derive(Debug)]
pub enum CommandKind {
    CreateVm(proto::api::CreateVm),
    ListVms,
    GetVm(VmId),
    DeleteVm(VmId),
    Pause(VmId),
    Resume(VmId),
    Exec(VmId, proto::api::ExecRequest),
    Fork(VmId, proto::api::ForkRequest),
    Sources(VmId),
    /// A page; with `true`, its whole chain.
    Page(VmId, u64, bool),
    Faults(VmId),
    Access(VmId, api::AccessQuery),
    ResetAccess(VmId),
    Map(VmId, api::MapQuery),
    MapPng(VmId, api::MapQuery),
    AccessPng(VmId, api::MapQuery),
    Tree,
    CheckInvariant,
    Metrics,
    AddFcListener(proto::api::CreateListener),
    ListFcListeners,
    DeleteFcListener(u32),
    Snapshot(VmId, proto::api::CreateSnapshot),
    ListSnapshots,
    GetSnapshot(String),
    DeleteSnapshot(String),
    Rollback(VmId, proto::api::RollbackVm),
    Clone(VmId, proto::api::CloneVm),
    Shutdown,
}

/// A cloneable, `Send` handle to the core for API handlers.
#[derive(Debug, Clone)]
pub struct CoreHandle {
    tx: mpsc::UnboundedSender<Command>,
}

impl CoreHandle {
    /// Ask the core and wait for its answer.
    pub async fn call(&self, kind: CommandKind) -> Result<Answer> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command { kind, reply })
            .map_err(|_| Error::ShuttingDown)?;
        rx.await.map_err(|_| Error::ShuttingDown)?
    }
}

impl Core {
    /// A core with no VMs.
    pub fn new(
        settings: Settings,
        pending: PendingLaunches,
        volumes: Option<std::sync::Arc<crate::volume::VolumeEngine>>,
        snapshots: crate::snapshot::Catalog,
        events: mpsc::UnboundedSender<ConnEvent>,
        frames: std::sync::Arc<crate::images::zst::FramePool>,
    ) -> Rc<Self> {
        let first = first_free_id(&settings.state_dir);
        let settings_pool = settings.vmm_pool;
        Rc::new(Core {
            reg: RefCell::new(Registry {
                next_id: first,
                id_mark: first,
                readahead_piece_pages: settings.readahead_piece_pages,
                ..Registry::default()
            }),
            settings,
            pending,
            volumes,
            snapshots: RefCell::new(snapshots),
            events,
            fault_seconds: crate::observe::metrics::fault_histogram(),
            frames,
            pool: RefCell::new(pool::state::VmmPool::new(settings_pool)),
            after_answer: RefCell::new(Vec::new()),
        })
    }

    /// Run the core until a `Shutdown` command: dispatch API commands and
    /// VMM connection events. Must run inside a `LocalSet`.
    pub async fn run(
        self: Rc<Self>,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut events: mpsc::UnboundedReceiver<ConnEvent>,
    ) {
        loop {
            tokio::select! {
                cmd = commands.recv() => {
                    let Some(cmd) = cmd else { break };
                    if matches!(cmd.kind, CommandKind::Shutdown) {
                        self.shutdown().await;
                        let _ = cmd.reply.send(Ok(Answer::Stopped));
                        break;
                    }
                    let core = self.clone();
                    tokio::task::spawn_local(async move {
                        let _busy = core.pool_activity();
                        let r = core.clone().dispatch(cmd.kind).await;
                        let _ = cmd.reply.send(r);
                        core.flush_after_answer().await;
                    });
                }
                ev = events.recv() => {
                    let Some(ev) = ev else { break };
                    self.on_conn_event(ev);
                }
            }
        }
    }

    /// Log `line` (at info level) once the answer of the request that
    /// wrote it has gone out. A log line costs this thread 0.02–0.04 ms
    /// here, and the lines that report a started VM were on the start's
    /// path, between the VM answering `running` and the client hearing
    /// of it.
    pub(super) fn log_after_answer(&self, line: String) {
        self.after_answer.borrow_mut().push(line);
    }

    /// Write the lines [`Self::log_after_answer`] holds, after letting the
    /// task that answers the client run.
    async fn flush_after_answer(&self) {
        if self.after_answer.borrow().is_empty() {
            return;
        }
        tokio::task::yield_now().await;
        let lines = std::mem::take(&mut *self.after_answer.borrow_mut());
        for line in lines {
            info!("{line}");
        }
    }

    /// A channel pair for API commands.
    pub fn command_channel() -> (CoreHandle, mpsc::UnboundedReceiver<Command>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (CoreHandle { tx }, rx)
    }

    async fn dispatch(self: Rc<Self>, kind: CommandKind) -> Result<Answer> {
        let vm = |info: api::VmInfo| Answer::Vm(Box::new(info));
        Ok(match kind {
            CommandKind::CreateVm(req) => vm(self.create_vm(req).await?),
            CommandKind::ListVms => Answer::Vms(self.list_vms()),
            CommandKind::Metrics => Answer::Metrics(Box::new(self.metrics_sample())),
            CommandKind::GetVm(id) => vm(self.info(id)?),
            CommandKind::DeleteVm(id) => Answer::VmDeleted(self.delete_vm(id).await?),
            CommandKind::Pause(id) => vm(self.pause(id).await?),
            CommandKind::Resume(id) => vm(self.resume(id).await?),
            CommandKind::Exec(id, req) => Answer::Exec(self.exec(id, req).await?),
            CommandKind::Fork(id, req) => Answer::Fork(self.fork(id, req.count).await?),
            CommandKind::Sources(id) => Answer::Sources(self.sources(id)?),
            CommandKind::Page(id, page, explain) => Answer::Page(self.page(id, page, explain)?),
            CommandKind::Faults(id) => Answer::Trace(Box::new(self.subscribe_faults(id)?)),
            CommandKind::Access(id, q) => Answer::Access(self.access(id, &q)?),
            CommandKind::ResetAccess(id) => {
                if let Some(v) = self.reg.borrow_mut().vms.get_mut(&id) {
                    v.log.reset_access();
                }
                Answer::Access(self.access(id, &api::AccessQuery::default())?)
            }
            CommandKind::Map(id, q) => Answer::Map(Box::new(self.page_map(id, &q)?)),
            CommandKind::MapPng(id, q) => {
                Answer::Png(crate::observe::map::source_png(&self.page_map(id, &q)?))
            }
            CommandKind::AccessPng(id, q) => Answer::Png(self.access_png(id, &q)?),
            CommandKind::Tree => Answer::Tree(self.tree()),
            CommandKind::CheckInvariant => Answer::Invariant(self.check_invariant()),
            CommandKind::AddFcListener(req) => Answer::Listener(self.add_fc_listener(req)?),
            CommandKind::ListFcListeners => Answer::Listeners(self.fc_listeners()),
            CommandKind::DeleteFcListener(id) => {
                Answer::ListenerDeleted(self.delete_fc_listener(id)?)
            }
            CommandKind::Snapshot(id, req) => {
                Answer::SnapshotCreated(self.snapshot(id, req).await?)
            }
            CommandKind::ListSnapshots => Answer::Snapshots(self.list_snapshots()),
            CommandKind::GetSnapshot(name) => {
                Answer::Snapshot(Box::new(self.snapshot_info(&name)?))
            }
            CommandKind::DeleteSnapshot(name) => {
                Answer::SnapshotDeleted(self.delete_snapshot(&name)?)
            }
            CommandKind::Rollback(id, req) => Answer::RolledBack(self.rollback(id, req).await?),
            CommandKind::Clone(id, req) => Answer::Cloned(self.clone_vm(id, req).await?),
            CommandKind::Shutdown => Answer::Stopped,
        })
    }

    /// Handle a VMM connection event.
    fn on_conn_event(self: &Rc<Self>, ev: ConnEvent) {
        match ev {
            ConnEvent::Hello {
                vm,
                writer,
                pid,
                stream,
                binding,
            } => {
                let core = self.clone();
                tokio::task::spawn_local(crate::conn::vmm::read_frames(
                    stream,
                    binding,
                    move |ev| core.on_conn_event(ev),
                ));
                self.on_hello(vm, writer, pid);
            }
            ConnEvent::Msg { vm, msg, fds } => self.on_vmm_msg(vm, msg, fds),
            ConnEvent::Closed { vm, reason } if pool::is_pool_id(vm) => self.pool_gone(vm, &reason),
            ConnEvent::Closed { vm, reason } => self.mark_exited(vm, &reason),
            ConnEvent::FcHello(hs) => self.on_fc_hello(hs),
            ConnEvent::FcClosed { conn } => self.on_fc_closed(conn),
        }
    }

    fn on_hello(self: &Rc<Self>, vm: VmId, writer: std::sync::Arc<VmmWriter>, pid: u32) {
        if pool::is_pool_id(vm) {
            if !self.pool_hello(vm, writer.clone(), pid) {
                writer.shutdown();
            }
            return;
        }
        let mut reg = self.reg.borrow_mut();
        let Some(v) = reg.vms.get_mut(&vm) else {
            writer.shutdown();
            return;
        };
        let config = launch::launch_config(v, self.volumes.as_deref());
        if let (Ok((_, Some(_))), Some(name), Some(engine)) = (&config, &v.volume, &self.volumes) {
            // While this VMM holds the disk, the volume may not be deleted
            // or rolled back underneath it.
            engine.attach(name, &vm.to_string());
        }
        let sent = match config {
            Ok((cfg, disk)) => match v.memory.memfd().try_clone() {
                Ok(memfd) => {
                    let mut fds = vec![std::os::fd::OwnedFd::from(memfd)];
                    fds.extend(disk.map(std::os::fd::OwnedFd::from));
                    writer.send(
                        ServerMsg::Welcome {
                            vm_id: vm,
                            config: cfg,
                        },
                        fds,
                    )
                }
                Err(e) => {
                    warn!("{vm}: cannot share its memfd: {e}");
                    Err(QueueError::Closed)
                }
            },
            Err(e) => {
                let message = e.message();
                let _ = writer.send(
                    ServerMsg::Error {
                        message: message.clone(),
                    },
                    Vec::new(),
                );
                writer.shutdown();
                v.fail_pending(&message);
                return;
            }
        };
        if let Err(e) = sent {
            warn!("{vm}: cannot send welcome: {e}");
        }
        v.link.pid = Some(pid);
        v.link.writer = Some(writer);
    }

    fn on_vmm_msg(self: &Rc<Self>, vm: VmId, msg: VmmMsg, fds: Vec<std::os::fd::OwnedFd>) {
        match msg {
            VmmMsg::UffdReady { bases } => self.on_uffd_ready(vm, bases, fds),
            VmmMsg::Running => {
                let mut reg = self.reg.borrow_mut();
                if let Some(v) = reg.vms.get_mut(&vm) {
                    if v.faults.uffd.is_none() {
                        drop(reg);
                        return self.protocol_error(vm, "running before uffd-ready");
                    }
                    v.state = RunState::Running;
                    if let Some(tx) = v.link.ready.take() {
                        let _ = tx.send(Ok(()));
                    }
                }
            }
            VmmMsg::Reply { seq, result } => {
                let mut reg = self.reg.borrow_mut();
                if let Some(tx) = reg
                    .vms
                    .get_mut(&vm)
                    .and_then(|v| v.link.pending.remove(&seq))
                {
                    let _ = tx.send(result.map_err(|source| Error::Vmm { vm, source }));
                }
            }
            VmmMsg::Console { text } => info!("{vm} console: {}", text.trim_end()),
            VmmMsg::Exited { code, reason } => {
                info!("{vm}: vmm exiting with code {code}: {reason}");
                if let Some(v) = self.reg.borrow_mut().vms.get_mut(&vm) {
                    v.link.exit_reason = Some(format!("vmm exited ({code}): {reason}"));
                }
            }
            VmmMsg::Hello { .. } => self.protocol_error(vm, "hello sent twice"),
        }
    }

    fn protocol_error(self: &Rc<Self>, vm: VmId, why: &str) {
        warn!("{vm}: protocol error: {why}");
        let writer = self
            .reg
            .borrow()
            .vms
            .get(&vm)
            .and_then(|v| v.link.writer.clone());
        if let Some(w) = writer {
            let _ = w.send(
                ServerMsg::Error {
                    message: why.to_owned(),
                },
                Vec::new(),
            );
            w.shutdown();
        }
        self.mark_exited(vm, &format!("protocol error: {why}"));
    }

    fn on_uffd_ready(
        self: &Rc<Self>,
        vm: VmId,
        bases: Vec<u64>,
        mut fds: Vec<std::os::fd::OwnedFd>,
    ) {
        if fds.len() != 1 || bases.len() != 1 {
            return self.protocol_error(
                vm,
                &format!(
                    "uffd-ready needs exactly one fd and one base, got {} fds and {} bases",
                    fds.len(),
                    bases.len()
                ),
            );
        }
        let fd = fds.remove(0);
        if let Err(e) = nix::fcntl::fcntl(
            fd.as_raw_fd(),
            nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
        ) {
            return self.protocol_error(vm, &format!("cannot make the uffd non-blocking: {e}"));
        }
        // SAFETY: `fd` came from SCM_RIGHTS and is owned here; ownership
        // moves into the Uffd, which closes it on drop.
        let uffd = unsafe { Uffd::from_raw_fd(fd.into_raw_fd()) };
        // SAFETY: the Uffd owns its fd, which stays open and unchanged
        // until the Uffd (moved into the AsyncFd) is dropped.
        let afd =
            match unsafe { AsyncFd::register_with_interest(uffd, tokio::io::Interest::READABLE) } {
                Ok(a) => Rc::new(a),
                Err(e) => return self.protocol_error(vm, &format!("cannot poll the uffd: {e}")),
            };
        {
            let mut reg = self.reg.borrow_mut();
            let Some(v) = reg.vms.get_mut(&vm) else {
                return;
            };
            if v.faults.uffd.is_some() {
                drop(reg);
                return self.protocol_error(vm, "uffd-ready sent twice");
            }
            v.faults.vmm_base = bases[0];
            v.faults.uffd = Some(afd.clone());
            for w in v.faults.on_uffd.drain(..) {
                let _ = w.send(());
            }
            tokio::task::spawn_local(serve_faults(
                self.clone(),
                vm,
                afd,
                v.faults.closed.clone(),
                v.log.tap.clone(),
            ));
        }
    }

    /// Append why `vm` failed to its log, next to its VMM's last words.
    pub fn log_failure(&self, vm: VmId, reason: &str) {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.log_path(vm);
        let appended = std::fs::OpenOptions::new()
            .append(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .and_then(|mut f| writeln!(f, "uffd-server: {vm} failed: {reason}"));
        if let Err(e) = appended {
            warn!("{vm}: cannot note the failure in {}: {e}", path.display());
        }
    }

    /// Record that `vm`'s VMM is gone; its memory stays for dependents.
    pub fn mark_exited(&self, vm: VmId, reason: &str) {
        let mut reg = self.reg.borrow_mut();
        let Some(v) = reg.vms.get_mut(&vm) else {
            return;
        };
        if !matches!(v.state, RunState::Exited | RunState::Failed) {
            info!("{vm}: exited: {reason}");
            v.state = RunState::Exited;
        }
        v.link.exit_reason.get_or_insert_with(|| reason.to_owned());
        if let (Some(name), Some(engine)) = (&v.volume, &self.volumes) {
            engine.detach(name);
        }
        if let Some(w) = v.link.writer.take() {
            w.shutdown();
        }
        v.faults.uffd = None;
        // Writes waiting for its uffd go on: nothing runs in it any more.
        v.faults.on_uffd.clear();
        v.faults.closed.notify_one();
        v.log.tap.close();
        // A VM that failed tells its waiting requests why, not just that
        // its VMM went away.
        let why = v.failure.clone();
        v.fail_pending(why.as_deref().unwrap_or(reason));
    }

    /// Send a request to `vm`'s VMM and wait for the reply.
    pub async fn request(&self, vm: VmId, request: Request, timeout: Duration) -> Result<Reply> {
        let rx = self.send_request(vm, request)?;
        self.await_reply(vm, rx, timeout).await
    }

    /// Send a request to `vm`'s VMM without waiting; the VMM answers its
    /// requests in order, so several can be in flight.
    pub fn send_request(&self, vm: VmId, request: Request) -> Result<PendingReply> {
        let (tx, rx) = oneshot::channel();
        let mut reg = self.reg.borrow_mut();
        let v = reg.vms.get_mut(&vm).ok_or(Error::NoSuchVm(vm))?;
        let writer = match (&v.link.writer, v.state) {
            (Some(w), RunState::Running | RunState::Paused) => w.clone(),
            (_, state) => {
                return Err(Error::WrongState {
                    vm,
                    state,
                    action: request.name(),
                })
            }
        };
        if v.link.pending.len() >= self.settings.vmm_queue {
            return Err(Error::QueueFull {
                vm,
                queued: v.link.pending.len(),
            });
        }
        v.link.next_seq += 1;
        let seq = v.link.next_seq;
        if let Err(e) = writer.send(ServerMsg::Request { seq, request }, Vec::new()) {
            return Err(match e {
                QueueError::Full => Error::QueueFull {
                    vm,
                    queued: v.link.pending.len(),
                },
                QueueError::Closed => Error::VmmGone { vm },
            });
        }
        v.link.pending.insert(seq, tx);
        Ok(rx)
    }

    /// Wait for the answer to a request sent with [`Core::send_request`].
    pub async fn await_reply(
        &self,
        vm: VmId,
        rx: PendingReply,
        timeout: Duration,
    ) -> Result<Reply> {
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Error::VmmGone { vm }),
            Err(_) => Err(Error::VmmTimeout { vm, after: timeout }),
        }
    }

    async fn shutdown(self: &Rc<Self>) {
        let ids: Vec<VmId> = self.reg.borrow().vms.keys().copied().collect();
        info!("shutting down: stopping {} vm(s)", ids.len());
        let stops = ids.into_iter().map(|id| {
            let core = self.clone();
            async move { core.stop_vmm(id).await }
        });
        futures_join_all(stops).await;
        // Firecracker listeners: stop accepting and remove their sockets.
        let listeners: Vec<u32> = self.reg.borrow().fc_listeners.keys().copied().collect();
        for id in listeners {
            let _ = self.delete_fc_listener(id);
        }
    }
}

async fn futures_join_all<F: std::future::Future<Output = ()> + 'static>(
    futs: impl Iterator<Item = F>,
) {
    let set: Vec<_> = futs
        .map(|f| tokio::task::spawn_local(f))
        .collect::<Vec<_>>();
    for h in set {
        let _ = h.await;
    }
}

/// A fault-around block in pages as the API reports it: KiB, 0 when off
/// (one page per fault).
pub fn fault_around_kib(pages: u64) -> u64 {
    if pages <= 1 {
        0
    } else {
        pages * shared::PAGE_SIZE / 1024
    }
}
