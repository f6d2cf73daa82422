//! The VMM socket: accepts VMM connections, checks who they are, and turns
//! each connection's frames into [`ConnEvent`]s for the core.
//!
//! Each connection gets a reader thread (blocking `recvmsg` with fds); the
//! core writes to the VMM through a [`VmmWriter`]. A connection that sends
//! bad bytes, an unknown launch token, a pid that is not the launched VMM's,
//! or the wrong fds gets a [`ServerMsg::Error`] and is closed; nothing else
//! is affected.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use proto::frame::FrameError;
use proto::vmm::{self as msg, ServerMsg, VmmMsg};
use shared::VmId;
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, info, warn};

/// What the connection threads tell the core.
#[derive(Debug)]
pub enum ConnEvent {
    /// A VMM proved it is the one launched for `vm`.
    Hello {
        vm: VmId,
        writer: Arc<VmmWriter>,
        pid: u32,
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
    FcHello(crate::firecracker::FcHandshake),
    /// A Firecracker connection hung up.
    FcClosed { conn: u64 },
}

/// A launch the server is waiting for: the token's VM and the pid of the
/// process it spawned.
#[derive(Debug, Clone, Copy)]
pub struct PendingLaunch {
    pub vm: VmId,
    pub pid: u32,
}

/// Launch tokens not yet used, shared between the core and the acceptor.
pub type PendingLaunches = Arc<Mutex<HashMap<String, PendingLaunch>>>;

/// The sending half of a VMM connection.
#[derive(Debug)]
pub struct VmmWriter {
    stream: Mutex<UnixStream>,
}

impl VmmWriter {
    /// Send a message with fds.
    pub fn send(&self, m: &ServerMsg, fds: &[std::os::fd::RawFd]) -> Result<(), FrameError> {
        let s = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        msg::send(&*s, m, fds)
    }

    /// Close both directions (the reader thread then reports `Closed`).
    pub fn shutdown(&self) {
        let s = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
}

fn refuse(stream: &UnixStream, why: &str) {
    warn!("vmm socket: refusing connection: {why}");
    let _ = msg::send(
        stream,
        &ServerMsg::Error {
            message: why.to_owned(),
        },
        &[],
    );
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// Accept connections forever on `listener`, one thread per connection.
pub fn accept_loop(
    listener: UnixListener,
    pending: PendingLaunches,
    events: UnboundedSender<ConnEvent>,
) {
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                let pending = pending.clone();
                let events = events.clone();
                let spawned = std::thread::Builder::new()
                    .name("vmm-conn".into())
                    .spawn(move || serve_connection(stream, pending, events));
                if let Err(e) = spawned {
                    warn!("vmm socket: cannot start a connection thread: {e}");
                }
            }
            Err(e) => {
                warn!("vmm socket: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn serve_connection(
    stream: UnixStream,
    pending: PendingLaunches,
    events: UnboundedSender<ConnEvent>,
) {
    let peer_pid = getsockopt(&stream, PeerCredentials)
        .map(|c| c.pid())
        .unwrap_or(-1);
    // A peer has a few seconds to say hello.
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let hello = msg::recv::<VmmMsg>(&stream);
    let (token, pid) = match hello {
        Ok((
            VmmMsg::Hello {
                version,
                token,
                pid,
            },
            fds,
        )) => {
            if !fds.is_empty() {
                return refuse(
                    &stream,
                    &format!("hello must carry no fds, got {}", fds.len()),
                );
            }
            if version != proto::frame::VERSION {
                return refuse(&stream, &format!("unsupported protocol version {version}"));
            }
            (token, pid)
        }
        Ok((other, _)) => return refuse(&stream, &format!("expected hello, got {}", kind(&other))),
        Err(e) => return refuse(&stream, &error_chain(&e)),
    };
    let launch = {
        let mut map = pending.lock().unwrap_or_else(|p| p.into_inner());
        match map.get(&token) {
            Some(l) if i64::from(l.pid) == i64::from(peer_pid) && l.pid == pid => {
                map.remove(&token)
            }
            Some(l) => {
                let why = format!(
                    "launch token belongs to pid {}, but the peer is pid {peer_pid} (says {pid})",
                    l.pid
                );
                drop(map);
                return refuse(&stream, &why);
            }
            None => None,
        }
    };
    let Some(launch) = launch else {
        return refuse(&stream, "unknown launch token: a VMM may only connect with the token its server launched it with");
    };
    let _ = stream.set_read_timeout(None);
    let vm = launch.vm;
    let writer = match stream.try_clone() {
        Ok(s) => Arc::new(VmmWriter {
            stream: Mutex::new(s),
        }),
        Err(e) => return refuse(&stream, &format!("internal error: {e}")),
    };
    info!("{vm}: vmm pid {pid} connected");
    if events
        .send(ConnEvent::Hello {
            vm,
            writer: writer.clone(),
            pid,
        })
        .is_err()
    {
        return;
    }
    loop {
        match msg::recv::<VmmMsg>(&stream) {
            Ok((m, fds)) => {
                debug!("{vm}: <- {}", kind(&m));
                if events.send(ConnEvent::Msg { vm, msg: m, fds }).is_err() {
                    return;
                }
            }
            Err(FrameError::Closed) => {
                let _ = events.send(ConnEvent::Closed {
                    vm,
                    reason: "vmm closed its connection".into(),
                });
                return;
            }
            Err(e) => {
                let why = error_chain(&e);
                if !matches!(e, FrameError::Recv(_) | FrameError::Truncated) {
                    refuse(&stream, &why);
                }
                let _ = events.send(ConnEvent::Closed {
                    vm,
                    reason: format!("vmm connection failed: {why}"),
                });
                let _ = stream.as_raw_fd();
                return;
            }
        }
    }
}

/// A message's variant name, for logs and errors.
pub fn kind(m: &VmmMsg) -> &'static str {
    match m {
        VmmMsg::Hello { .. } => "hello",
        VmmMsg::UffdReady { .. } => "uffd-ready",
        VmmMsg::Running => "running",
        VmmMsg::Reply { .. } => "reply",
        VmmMsg::Console { .. } => "console",
        VmmMsg::Exited { .. } => "exited",
    }
}

/// An error and its sources on one line.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
