//! Connections from VMMs and Firecracker processes, and what their threads
//! tell the core.
//!
//! Blocking socket I/O never runs on the core thread: a connection's hello
//! and Firecracker's handshake are read by threads of their own, and what
//! the core reads or writes itself it does without waiting:
//!
//! ```text
//!  vmm-accept ──▶ vmm-conn (checks the hello) ──Hello──▶ core
//!                 (or a rejoin)              ──Rejoin─▶ core (answers Rejoined)
//!                 core reads the VMM's frames itself (vmm::read_frames, never waiting)
//!                 vmm-send (writes frames) ◀──VmmWriter── core   (bounded queue)
//!  fc-accept  ──▶ fc-conn  (reads the handshake, waits for hang-up) ──▶ core
//! ```
//!
//! - [`vmm`]: the VMM socket: launch tokens, frames, fds.
//! - [`firecracker`]: Firecracker's Uffd handshake on a listener's socket.
//!
//! The types both sides exchange ([`ConnEvent`], [`VmmWriter`],
//! [`FcHandshake`]) live here, so neither connection module imports the
//! core and the core imports only this module's types.

pub mod firecracker;
pub mod vmm;

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use proto::firecracker::Region;
use proto::frame;
use proto::vmm::{self as msg, ServerMsg, VmmMsg};
use shared::VmId;
use tracing::warn;

/// What the connection threads tell the core.
#[derive(Debug)]
pub enum ConnEvent {
    /// A VMM proved it is the one launched for `vm`.
    Hello {
        vm: VmId,
        writer: Arc<VmmWriter>,
        pid: u32,
        /// The connection, for the core to read (see [`vmm::read_frames`]).
        stream: UnixStream,
        /// Which VM the connection speaks for, as the core binds it.
        binding: Binding,
    },
    /// A VMM that was serving `vm` when its connection to a server closed
    /// (this server's predecessor died or handed over) asks to be taken
    /// back; its pid is checked against the peer's. The core answers
    /// `Rejoined`, or an error if it has no such VM.
    Rejoin {
        vm: VmId,
        writer: Arc<VmmWriter>,
        pid: u32,
        /// The connection, for the core to read (see [`vmm::read_frames`]).
        stream: UnixStream,
        /// Which VM the connection speaks for (`vm`; never rebound).
        binding: Binding,
    },
    /// A message (and its fds) from `vm`'s VMM.
    Msg {
        vm: VmId,
        msg: VmmMsg,
        fds: Vec<OwnedFd>,
    },
    /// `vm`'s connection is gone (hang-up or protocol error).
    Closed { vm: VmId, reason: String },
    /// A Firecracker process completed its handshake on a listener.
    FcHello(FcHandshake),
    /// A Firecracker connection hung up.
    FcClosed { conn: u64 },
}

/// A launch the server is waiting for: which VM the token's VMM speaks
/// for and the pid of the process it spawned.
#[derive(Debug, Clone)]
pub struct PendingLaunch {
    pub vm: Binding,
    pub pid: u32,
}

/// Which VM a VMM connection speaks for. A VMM of the warm pool is
/// launched (and connects) before its VM exists, under a pool id; the core
/// binds it to the VM that takes it. The connection's reader reads the
/// binding for every message it delivers, so every message after the bind
/// carries the VM's id. The core binds only a VMM whose hello it has
/// handled and which sends nothing until its Welcome.
#[derive(Debug, Clone)]
pub struct Binding(Arc<AtomicU32>);

impl Binding {
    /// A connection speaking for `vm`.
    pub fn new(vm: VmId) -> Self {
        Binding(Arc::new(AtomicU32::new(vm.0)))
    }

    /// The VM it speaks for now.
    pub fn get(&self) -> VmId {
        VmId(self.0.load(Ordering::Acquire))
    }

    /// From now on it speaks for `vm`.
    pub fn bind(&self, vm: VmId) {
        self.0.store(vm.0, Ordering::Release);
    }
}

/// Launch tokens not yet used, shared between the core and the acceptor.
pub type PendingLaunches = Arc<Mutex<HashMap<String, PendingLaunch>>>;

/// A validated Firecracker connection, for the core.
#[derive(Debug)]
pub struct FcHandshake {
    pub listener: u32,
    /// Identifies the connection in the later `FcClosed` event.
    pub conn: u64,
    pub regions: Vec<Region>,
    pub uffd: OwnedFd,
    pub pid: u32,
    pub stream: UnixStream,
    /// Counts the handshake as not yet taken by the core until dropped.
    pub in_flight: InFlight,
}

/// Why a message could not be queued for a VMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    #[error("its send queue is full (the vmm is not reading)")]
    Full,
    #[error("its connection is closed")]
    Closed,
}

/// The rest of a frame on its way to a VMM, with the fds it carries.
#[derive(Debug)]
struct Outgoing {
    payload: Vec<u8>,
    fds: Vec<OwnedFd>,
    /// Bytes of the frame (and its fds, if any were) sent already.
    sent: usize,
}

/// The sending half of a VMM connection. A message goes straight into the
/// socket when nothing is queued before it and the socket takes it
/// without waiting (the usual case); what does not fit goes to a bounded
/// queue drained by the connection's own sender thread, so the core never
/// blocks on a VMM that stopped reading (its socket buffer full). Sending
/// straight saves a hop through that thread, 0.03 ms and at times several
/// ms on a small host, on every request to a VMM.
#[derive(Debug)]
pub struct VmmWriter {
    vm: VmId,
    tx: SyncSender<Outgoing>,
    stream: UnixStream,
    /// Frames queued and not yet sent whole by the sender thread.
    queued: Arc<Mutex<usize>>,
}

impl VmmWriter {
    /// Start the sender thread of `stream` with room for `queue` messages.
    pub fn start(vm: VmId, stream: UnixStream, queue: usize) -> std::io::Result<Arc<Self>> {
        let (tx, rx) = sync_channel::<Outgoing>(queue.max(1));
        let out = stream.try_clone()?;
        let queued = Arc::new(Mutex::new(0usize));
        let left = queued.clone();
        std::thread::Builder::new()
            .name("vmm-send".into())
            .spawn(move || {
                for m in rx {
                    let fds: Vec<_> = m.fds.iter().map(AsRawFd::as_raw_fd).collect();
                    let sent = frame::send_frame_rest(out.as_raw_fd(), &m.payload, &fds, m.sent);
                    *left.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
                    if let Err(e) = sent {
                        warn!("{vm}: cannot send to the vmm: {}", shared::error_chain(&e));
                        let _ = out.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                }
            })?;
        Ok(Arc::new(VmmWriter {
            vm,
            tx,
            stream,
            queued,
        }))
    }

    /// Send a message with fds (they are sent, then closed here): now if
    /// the socket takes it, else through the sender thread.
    pub fn send(&self, msg: ServerMsg, fds: Vec<OwnedFd>) -> Result<(), QueueError> {
        let payload = msg::encode(&msg).map_err(|e| {
            warn!(
                "{}: cannot encode a message: {}",
                self.vm,
                shared::error_chain(&e)
            );
            QueueError::Closed
        })?;
        let mut queued = self.queued.lock().unwrap_or_else(|p| p.into_inner());
        let mut sent = 0;
        if *queued == 0 {
            let raw: Vec<_> = fds.iter().map(AsRawFd::as_raw_fd).collect();
            match frame::send_frame_now(self.stream.as_raw_fd(), &payload, &raw) {
                Ok(n) if n == frame::frame_len(&payload) => return Ok(()),
                Ok(n) => sent = n,
                Err(e) => {
                    warn!(
                        "{}: cannot send to the vmm: {}",
                        self.vm,
                        shared::error_chain(&e)
                    );
                    self.shutdown();
                    return Err(QueueError::Closed);
                }
            }
        }
        let queue = self.tx.try_send(Outgoing { payload, fds, sent });
        match queue {
            Ok(()) => {
                *queued += 1;
                Ok(())
            }
            Err(e) => {
                if sent > 0 {
                    // Part of the frame is out and the rest has nowhere to
                    // go: the stream is broken.
                    self.shutdown();
                }
                Err(match e {
                    TrySendError::Full(_) => QueueError::Full,
                    TrySendError::Disconnected(_) => QueueError::Closed,
                })
            }
        }
    }

    /// Close both directions (the core's reader then reports `Closed`, the
    /// sender thread stops).
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Messages go out in order whether they went straight into the socket
    /// or through the sender thread because the socket was full.
    #[test]
    fn messages_keep_their_order_when_the_socket_fills() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let w = VmmWriter::start(VmId(1), ours, 1024).unwrap();
        let big = "x".repeat(64 << 10);
        let n = 64; // 4 MiB in all: far more than a socket buffer
        for i in 0..n {
            let message = format!("{i} {big}");
            w.send(ServerMsg::Error { message }, Vec::new()).unwrap();
        }
        assert!(
            *w.queued.lock().unwrap() > 0,
            "the socket filled and the rest was queued"
        );
        for i in 0..n {
            let (m, _) = msg::recv::<ServerMsg>(&theirs).unwrap();
            match m {
                ServerMsg::Error { message } => {
                    assert!(
                        message.starts_with(&format!("{i} ")),
                        "message {i} in order"
                    );
                    assert_eq!(message.len(), format!("{i} ").len() + big.len());
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        // Drained: the next one goes straight in.
        while *w.queued.lock().unwrap() > 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        w.send(
            ServerMsg::Error {
                message: "last".into(),
            },
            Vec::new(),
        )
        .unwrap();
        assert_eq!(*w.queued.lock().unwrap(), 0);
        let (m, _) = msg::recv::<ServerMsg>(&theirs).unwrap();
        assert!(matches!(m, ServerMsg::Error { message } if message == "last"));
    }
}

/// Connections accepted whose handshake the core has not taken yet.
static IN_FLIGHT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// One connection accepted whose handshake the core has not taken yet
/// (see [`in_flight_handshakes`]); dropped once it has, or once it is refused.
#[derive(Debug)]
pub struct InFlight(());

impl InFlight {
    pub(super) fn take() -> Self {
        IN_FLIGHT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlight(())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Connections accepted whose handshake the core has not taken yet: a
/// handover waits, once paused, until there are none, so that every
/// client it journals last is one the core knows.
pub fn in_flight_handshakes() -> usize {
    IN_FLIGHT.load(std::sync::atomic::Ordering::SeqCst)
}
