//! The core: the single thread that owns every VM's state (tables, memory,
//! uffd, VMM connection) and serves faults, VMM messages and API commands.
//!
//! Everything here runs on one tokio current-thread runtime inside a
//! `LocalSet`, so state is plain `Rc`/`RefCell`. API handlers (which may run
//! anywhere) talk to it through [`CoreHandle`]; VMM connection threads
//! through [`ConnEvent`]s. No `RefCell` borrow is held across an `.await`.
//!
//! This file keeps the event loop ([`Core::run`]: API commands, connection
//! events) and the dispatch of commands; [`actions`] maps each action to
//! the feature that does it. Layers, each naming only those below it:
//!
//! ```text
//!   mod.rs (event loop, dispatch), actions.rs
//!   features: launch/ ops.rs inspect.rs fork/ snapshot/ rollback/ clone.rs
//!             pool/ firecracker/ fault/ link/ busy.rs sources.rs
//!   the shared state: state.rs (Core), registry.rs, vm.rs
//!   each feature's per-VM state (*/state.rs) and errors (*/error.rs),
//!             fault/install.rs, settings.rs, error.rs, ratelimit.rs
//!   snapshot/ pages/ observe/ images/ memory.rs conn/ volume/ (outside core)
//! ```
//!
//! A feature owns its per-VM state type (`vm.rs` holds one field of each)
//! and the functions that change it; features call one another only
//! downwards (`clone` uses `snapshot` and `launch`, `fork` uses `launch`,
//! `pool` and `snapshot::arm`, everything uses `link`).

pub mod actions;
pub mod busy;
pub mod clone;
pub mod error;
pub mod fault;
pub mod firecracker;
pub mod fork;
pub mod inspect;
pub mod launch;
pub mod link;
pub mod ops;
pub mod pool;
pub mod ratelimit;
pub mod registry;
pub mod rollback;
pub mod settings;
pub mod snapshot;
pub mod sources;
pub mod state;
pub mod vm;

use std::rc::Rc;

pub use error::{Error, Result};
use proto::api;
use proto::vmm::VmmMsg;
pub use settings::Settings;
use shared::VmId;
pub use state::Core;
use tokio::sync::{mpsc, oneshot};
use tracing::info;

use crate::conn::ConnEvent;
use pool::state::is_pool_id;
pub use vm::RunState;

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
                if is_pool_id(vm) {
                    if !pool::take::hello(self, vm, writer.clone(), pid) {
                        writer.shutdown();
                    }
                } else {
                    link::welcome::welcome(self, vm, writer, pid);
                }
            }
            ConnEvent::Msg {
                vm,
                msg: VmmMsg::UffdReady { bases },
                fds,
            } => fault::serve::on_uffd_ready(self, vm, bases, fds),
            ConnEvent::Msg { vm, msg, .. } => link::messages::on_message(self, vm, msg),
            ConnEvent::Closed { vm, reason } if is_pool_id(vm) => {
                pool::take::gone(self, vm, &reason);
            }
            ConnEvent::Closed { vm, reason } => link::exit::mark_exited(self, vm, &reason),
            ConnEvent::FcHello(hs) => firecracker::client::on_fc_hello(self, hs),
            ConnEvent::FcClosed { conn } => firecracker::client::on_fc_closed(self, conn),
        }
    }

    async fn shutdown(self: &Rc<Self>) {
        let ids: Vec<VmId> = self.reg.borrow().vms.keys().copied().collect();
        info!("shutting down: stopping {} vm(s)", ids.len());
        let stops = ids.into_iter().map(|id| {
            let core = self.clone();
            async move { link::process::stop_vmm(&core, id).await }
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
