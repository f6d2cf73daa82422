//! The core: the single thread that owns every VM's state (tables, memory,
//! uffd, VMM connection) and serves faults, VMM messages and API commands.
//!
//! Everything here runs on one tokio current-thread runtime inside a
//! `LocalSet`, so state is plain `Rc`/`RefCell`. API handlers (which may run
//! anywhere) talk to it through [`CoreHandle`]; VMM connection threads
//! through [`ConnEvent`]s. No `RefCell` borrow is held across an `.await`.

mod error;
pub mod fault;
pub mod firecracker;
mod fork;
mod inspect;
mod launch;
mod ops;
pub mod vm;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Duration;

pub use error::{ApiError, ApiResult};
use proto::vmm::{Reply, Request, ServerMsg, VmmMsg};
use serde_json::Value;
use shared::VmId;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};
use userfaultfd::{EventBuffer, Uffd};

use crate::pages::SourceArena;
use crate::vmm_conn::{ConnEvent, PendingLaunches};
use vm::{RunState, Vm};

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
            let Some((id, src)) = victim else { return };
            self.vms.remove(&id);
            self.arena.release(src);
            info!("{id}: memory released");
        }
    }
}

/// All VMs and sources.
#[derive(Debug, Default)]
pub struct Registry {
    pub vms: BTreeMap<VmId, Vm>,
    pub arena: SourceArena,
    next_id: u32,
    pub fc_listeners: firecracker::FcListeners,
    pub fc_vms: firecracker::FcVms,
    next_listener: u32,
}

/// The core's state.
pub struct Core {
    pub reg: RefCell<Registry>,
    pub settings: Settings,
    pub pending: PendingLaunches,
    pub volumes: Option<std::sync::Arc<crate::volume::VolumeEngine>>,
    /// Where connection threads (VMM and Firecracker) report.
    pub events: mpsc::UnboundedSender<ConnEvent>,
}

/// The answer to a request in flight.
pub type PendingReply = oneshot::Receiver<Result<Reply, String>>;

/// A command from the API, with where to send its answer.
pub struct Command {
    pub kind: CommandKind,
    pub reply: oneshot::Sender<ApiResult<Value>>,
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
    Fork(VmId, u32),
    Sources(VmId),
    Page(VmId, u64),
    Tree,
    CheckInvariant,
    AddFcListener(firecracker::CreateListener),
    ListFcListeners,
    DeleteFcListener(u32),
    Shutdown,
}

/// A cloneable, `Send` handle to the core for API handlers.
#[derive(Clone)]
pub struct CoreHandle {
    tx: mpsc::UnboundedSender<Command>,
}

impl CoreHandle {
    /// Ask the core and wait for its answer.
    pub async fn call(&self, kind: CommandKind) -> ApiResult<Value> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command { kind, reply })
            .map_err(|_| ApiError::internal("the server is shutting down"))?;
        rx.await
            .map_err(|_| ApiError::internal("the server is shutting down"))?
    }
}

/// One line for an error and its sources.
pub fn chain(e: &dyn std::error::Error) -> String {
    crate::vmm_conn::error_chain(e)
}

impl Core {
    /// A core with no VMs.
    pub fn new(
        settings: Settings,
        pending: PendingLaunches,
        volumes: Option<std::sync::Arc<crate::volume::VolumeEngine>>,
        events: mpsc::UnboundedSender<ConnEvent>,
    ) -> Rc<Self> {
        Rc::new(Core {
            reg: RefCell::new(Registry::default()),
            settings,
            pending,
            volumes,
            events,
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
                        let _ = cmd.reply.send(Ok(Value::Null));
                        break;
                    }
                    let core = self.clone();
                    tokio::task::spawn_local(async move {
                        let r = core.dispatch(cmd.kind).await;
                        let _ = cmd.reply.send(r);
                    });
                }
                ev = events.recv() => {
                    let Some(ev) = ev else { break };
                    self.on_conn_event(ev);
                }
            }
        }
    }

    /// A channel pair for API commands.
    pub fn command_channel() -> (CoreHandle, mpsc::UnboundedReceiver<Command>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (CoreHandle { tx }, rx)
    }

    async fn dispatch(self: Rc<Self>, kind: CommandKind) -> ApiResult<Value> {
        match kind {
            CommandKind::CreateVm(req) => self.create_vm(req).await,
            CommandKind::ListVms => Ok(self.list_vms()),
            CommandKind::GetVm(id) => self.vm_info(id),
            CommandKind::DeleteVm(id) => self.delete_vm(id).await,
            CommandKind::Pause(id) => self.pause(id).await,
            CommandKind::Resume(id) => self.resume(id).await,
            CommandKind::Exec(id, req) => self.exec(id, req).await,
            CommandKind::Fork(id, count) => self.fork(id, count).await,
            CommandKind::Sources(id) => self.sources(id),
            CommandKind::Page(id, page) => self.page(id, page),
            CommandKind::Tree => Ok(self.tree()),
            CommandKind::CheckInvariant => self.check_invariant(),
            CommandKind::AddFcListener(req) => self.add_fc_listener(req),
            CommandKind::ListFcListeners => Ok(self.fc_listeners()),
            CommandKind::DeleteFcListener(id) => self.delete_fc_listener(id),
            CommandKind::Shutdown => Ok(Value::Null),
        }
    }

    /// Handle a VMM connection event.
    fn on_conn_event(self: &Rc<Self>, ev: ConnEvent) {
        match ev {
            ConnEvent::Hello { vm, writer, pid } => self.on_hello(vm, writer, pid),
            ConnEvent::Msg { vm, msg, fds } => self.on_vmm_msg(vm, msg, fds),
            ConnEvent::Closed { vm, reason } => self.mark_exited(vm, &reason),
            ConnEvent::FcHello(hs) => self.on_fc_hello(hs),
            ConnEvent::FcClosed { conn } => self.on_fc_closed(conn),
        }
    }

    fn on_hello(
        self: &Rc<Self>,
        vm: VmId,
        writer: std::sync::Arc<crate::vmm_conn::VmmWriter>,
        pid: u32,
    ) {
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
        let mut fds = vec![v.memory.memfd().as_raw_fd()];
        let disk = match &config {
            Ok((_, Some(f))) => Some(f.as_raw_fd()),
            _ => None,
        };
        fds.extend(disk);
        let sent = match &config {
            Ok((cfg, _)) => writer.send(
                &ServerMsg::Welcome {
                    vm_id: vm,
                    config: cfg.clone(),
                },
                &fds,
            ),
            Err(e) => {
                let _ = writer.send(&ServerMsg::Error { message: e.clone() }, &[]);
                writer.shutdown();
                v.fail_pending(e);
                return;
            }
        };
        if let Err(e) = sent {
            warn!("{vm}: cannot send welcome: {e}");
        }
        v.pid = Some(pid);
        v.writer = Some(writer);
    }

    fn on_vmm_msg(self: &Rc<Self>, vm: VmId, msg: VmmMsg, fds: Vec<std::os::fd::OwnedFd>) {
        match msg {
            VmmMsg::UffdReady { bases } => self.on_uffd_ready(vm, bases, fds),
            VmmMsg::Running => {
                let mut reg = self.reg.borrow_mut();
                if let Some(v) = reg.vms.get_mut(&vm) {
                    if v.uffd.is_none() {
                        drop(reg);
                        return self.protocol_error(vm, "running before uffd-ready");
                    }
                    v.state = RunState::Running;
                    if let Some(tx) = v.ready.take() {
                        let _ = tx.send(Ok(()));
                    }
                }
            }
            VmmMsg::Reply { seq, result } => {
                let mut reg = self.reg.borrow_mut();
                if let Some(tx) = reg.vms.get_mut(&vm).and_then(|v| v.pending.remove(&seq)) {
                    let _ = tx.send(result);
                }
            }
            VmmMsg::Console { text } => info!("{vm} console: {}", text.trim_end()),
            VmmMsg::Exited { code, reason } => {
                info!("{vm}: vmm exiting with code {code}: {reason}");
                if let Some(v) = self.reg.borrow_mut().vms.get_mut(&vm) {
                    v.exit_reason = Some(format!("vmm exited ({code}): {reason}"));
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
            .and_then(|v| v.writer.clone());
        if let Some(w) = writer {
            let _ = w.send(
                &ServerMsg::Error {
                    message: why.to_owned(),
                },
                &[],
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
            if v.uffd.is_some() {
                drop(reg);
                return self.protocol_error(vm, "uffd-ready sent twice");
            }
            v.vmm_base = bases[0];
            v.uffd = Some(afd.clone());
        }
        tokio::task::spawn_local(serve_faults(self.clone(), vm, afd));
    }

    /// Record that `vm`'s VMM is gone; its memory stays for dependents.
    pub fn mark_exited(&self, vm: VmId, reason: &str) {
        let mut reg = self.reg.borrow_mut();
        let Some(v) = reg.vms.get_mut(&vm) else {
            return;
        };
        if v.state != RunState::Exited {
            info!("{vm}: exited: {reason}");
        }
        v.state = RunState::Exited;
        v.exit_reason.get_or_insert_with(|| reason.to_owned());
        if let (Some(name), Some(engine)) = (&v.volume, &self.volumes) {
            engine.detach(name);
        }
        if let Some(w) = v.writer.take() {
            w.shutdown();
        }
        v.uffd = None;
        v.fail_pending(&format!("{vm} exited: {reason}"));
    }

    /// Send a request to `vm`'s VMM and wait for the reply.
    pub async fn request(&self, vm: VmId, request: Request, timeout: Duration) -> ApiResult<Reply> {
        let rx = self.send_request(vm, request)?;
        self.await_reply(vm, rx, timeout).await
    }

    /// Send a request to `vm`'s VMM without waiting; the VMM answers its
    /// requests in order, so several can be in flight.
    pub fn send_request(&self, vm: VmId, request: Request) -> ApiResult<PendingReply> {
        let (tx, rx) = oneshot::channel();
        let mut reg = self.reg.borrow_mut();
        let v = reg.vms.get_mut(&vm).ok_or_else(|| not_found(vm))?;
        let writer = match (&v.writer, v.state) {
            (Some(w), RunState::Running | RunState::Paused) => w.clone(),
            _ => {
                return Err(ApiError::conflict(format!(
                    "{vm} is {}; only a running or paused VM can do that",
                    v.state.name()
                )))
            }
        };
        v.next_seq += 1;
        let seq = v.next_seq;
        v.pending.insert(seq, tx);
        if let Err(e) = writer.send(&ServerMsg::Request { seq, request }, &[]) {
            v.pending.remove(&seq);
            return Err(ApiError::vmm(format!("cannot reach {vm}'s vmm: {e}")));
        }
        Ok(rx)
    }

    /// Wait for the answer to a request sent with [`Core::send_request`].
    pub async fn await_reply(
        &self,
        vm: VmId,
        rx: PendingReply,
        timeout: Duration,
    ) -> ApiResult<Reply> {
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(Ok(reply))) => Ok(reply),
            Ok(Ok(Err(e))) => Err(ApiError::vmm(format!("{vm}: {e}"))),
            Ok(Err(_)) => Err(ApiError::vmm(format!("{vm}'s vmm went away"))),
            Err(_) => Err(ApiError::timeout(format!(
                "{vm}'s vmm did not answer within {timeout:?}"
            ))),
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

fn not_found(vm: VmId) -> ApiError {
    ApiError::not_found(format!("no VM {vm}; list VMs with GET /v1/vms"))
}

/// Read and resolve `vm`'s uffd events until the uffd closes.
async fn serve_faults(core: Rc<Core>, vm: VmId, uffd: Rc<AsyncFd<Uffd>>) {
    let mut buf = EventBuffer::new(64);
    loop {
        let mut guard = match uffd.readable().await {
            Ok(g) => g,
            Err(e) => {
                warn!("{vm}: uffd poll failed: {e}");
                return;
            }
        };
        let events: Vec<_> = match guard.get_inner().read_events(&mut buf) {
            Ok(it) => it.collect(),
            Err(userfaultfd::Error::ReadEof) => return,
            Err(e) => {
                warn!("{vm}: uffd read failed: {e}");
                return;
            }
        };
        if events.is_empty() {
            guard.clear_ready();
            // The VM may have exited and dropped its uffd: stop then.
            let gone = core
                .reg
                .borrow()
                .vms
                .get(&vm)
                .is_none_or(|v| v.uffd.is_none());
            if gone {
                return;
            }
            continue;
        }
        let mut vmm_gone = false;
        {
            let mut reg = core.reg.borrow_mut();
            for ev in events {
                match ev {
                    Ok(ev) => vmm_gone |= reg.handle_event(vm, ev) == fault::Handled::VmmGone,
                    Err(e) => warn!("{vm}: bad uffd event: {e}"),
                }
            }
            reg.collect_garbage();
        }
        if vmm_gone {
            core.mark_exited(vm, "vmm address space is gone (ESRCH)");
            return;
        }
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
