//! The core: the single thread that owns every VM's state (tables, memory,
//! uffd, VMM connection) and serves faults, VMM messages and API commands.
//!
//! Everything here runs on one tokio current-thread runtime inside a
//! `LocalSet`, so state is plain `Rc`/`RefCell`. API handlers (which may run
//! anywhere) talk to it through [`CoreHandle`]; VMM connection threads
//! through [`ConnEvent`]s. No `RefCell` borrow is held across an `.await`.
//!
//! This file keeps the event loop ([`Core::run`]: the API's requests, each a
//! closure sent by [`CoreHandle::run`], and connection events); [`actions`]
//! holds one method per API action, which hands it to the feature that
//! does it. Layers, each naming only those below it:
//!
//! ```text
//!   mod.rs (event loop), actions.rs
//!   features: remote/ (uses launch/, snapshot/)
//!             launch/ ops.rs inspect.rs fork/ snapshot/ rollback/ clone.rs
//!             workset/ pool/ firecracker/ fault/ base/ link/ busy.rs sources.rs
//!   the shared state: state.rs (Core), registry.rs, vm.rs
//!   each feature's per-VM state (*/state.rs) and errors (*/error.rs),
//!             fault/install/, settings.rs, error.rs, ratelimit.rs,
//!             fd_budget.rs
//!   snapshot/ pages/ observe/ images/ memory.rs conn/ volume/ (outside core)
//! ```
//!
//! A feature owns its per-VM state type (`vm.rs` holds one field of each)
//! and the functions that change it; features call one another only
//! downwards (`clone` uses `snapshot` and `launch`, `fork` uses `launch`,
//! `pool` and `snapshot::arm`, everything uses `link`).

pub mod actions;
pub mod base;
pub mod busy;
pub mod clone;
pub mod error;
pub mod fault;
pub mod fd_budget;
pub mod firecracker;
pub mod fork;
pub mod inspect;
pub mod kept;
pub mod launch;
pub mod link;
pub mod ops;
pub mod pool;
pub mod ratelimit;
pub mod reclaim;
pub mod registry;
pub mod remote;
pub mod restart;
pub mod rollback;
pub mod settings;
pub mod snapshot;
pub mod sources;
pub mod state;
pub mod vm;
pub mod workset;

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;

pub use error::{Error, Result};
use proto::vmm::VmmMsg;
pub use settings::Settings;
use shared::VmId;
pub use state::Core;
use tokio::sync::{mpsc, oneshot};
use tracing::info;

use crate::conn::ConnEvent;
use pool::state::is_pool_id;
pub use vm::RunState;

/// Work for the core thread, sent from an API handler: it makes the future
/// that does a request and answers it (see [`CoreHandle::run`]). The
/// closure crosses threads; the future it makes stays on the core thread
/// and may hold `Rc`s (it need not be `Send`).
type Job = Box<dyn FnOnce(Rc<Core>) -> Pin<Box<dyn Future<Output = ()>>> + Send>;

/// What the API asks the core.
pub enum Command {
    /// Do one request's work (a [`CoreHandle::run`]).
    Run(Job),
    /// Stop every VM and end the event loop; answered once stopped.
    Shutdown(oneshot::Sender<()>),
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Command::Run(_) => "Run",
            Command::Shutdown(_) => "Shutdown",
        })
    }
}

/// A cloneable, `Send` handle to the core for API handlers.
#[derive(Debug, Clone)]
pub struct CoreHandle {
    tx: mpsc::UnboundedSender<Command>,
}

impl CoreHandle {
    /// Run `work` on the core thread and wait for the value it answers:
    /// `core.run(move |core| async move { core.info(id) })`. The handler
    /// decides the request's type and its answer's; the core only runs it.
    pub async fn run<T, F, Fut>(&self, work: F) -> Result<T>
    where
        F: FnOnce(Rc<Core>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T>> + 'static,
        T: Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job: Job = Box::new(move |core| {
            Box::pin(async move {
                let answer = work(core.clone()).await;
                // What the request changed is in the journal before its
                // client hears of it: an answered request survives a
                // crash of the server.
                restart::journal::sync(&core, false);
                let _ = reply.send(answer);
            })
        });
        self.tx
            .send(Command::Run(job))
            .map_err(|_| Error::ShuttingDown)?;
        answer.await.map_err(|_| Error::ShuttingDown)?
    }

    /// Stop every VM and the core; returns once they are stopped (or the
    /// core was gone already).
    pub async fn shutdown(&self) {
        let (done, stopped) = oneshot::channel();
        if self.tx.send(Command::Shutdown(done)).is_ok() {
            let _ = stopped.await;
        }
    }
}

impl Core {
    /// Run the core until a `Shutdown` command: run API requests (each a
    /// task of its own) and handle VMM connection events. Must run inside
    /// a `LocalSet`.
    pub async fn run(
        self: Rc<Self>,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut events: mpsc::UnboundedReceiver<ConnEvent>,
    ) {
        loop {
            tokio::select! {
                cmd = commands.recv() => match cmd {
                    None => break,
                    Some(Command::Shutdown(done)) => {
                        self.shutdown().await;
                        let _ = done.send(());
                        break;
                    }
                    Some(Command::Run(job)) => {
                        let core = self.clone();
                        tokio::task::spawn_local(async move {
                            // During a handover no request starts: its
                            // client hears 503 (the job is dropped).
                            let Some(_job) = core.restart.job_started() else {
                                return;
                            };
                            // The pool refills only while the API is quiet.
                            let _busy = core.pool_activity();
                            job(core.clone()).await;
                            core.flush_after_answer().await;
                        });
                    }
                },
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

    /// Begin `id`'s access record again; answers the record, empty now
    /// (its install records stay).
    pub(crate) fn reset_access(&self, id: VmId) -> Result<proto::api::AccessMap> {
        if let Some(v) = self.reg.borrow_mut().vms.get_mut(&id) {
            v.log.reset_access();
        }
        self.access(id, &proto::api::AccessQuery::default())
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
            ConnEvent::Rejoin {
                vm,
                writer,
                pid,
                stream,
                binding,
            } => link::welcome::rejoin(self, vm, writer, pid, stream, binding),
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
