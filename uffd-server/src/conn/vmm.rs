//! The VMM socket: accepts VMM connections, checks who they are, and turns
//! each connection's frames into [`ConnEvent`]s for the core.
//!
//! Each connection gets a reader thread (blocking `recvmsg` with fds); the
//! core writes to the VMM through a [`VmmWriter`]. A connection that sends
//! bad bytes, an unknown launch token, a pid that is not the launched VMM's,
//! or the wrong fds gets a [`ServerMsg::Error`] and is closed; nothing else
//! is affected.

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use proto::frame::FrameError;
use proto::vmm::{self as msg, ServerMsg, VmmMsg};
use tokio::sync::mpsc::UnboundedSender;

use super::{ConnEvent, PendingLaunches, VmmWriter};
use tracing::{debug, info, warn};

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

/// Connections that have not yet proved they are a launched VMM, at most,
/// beyond the launches the server awaits; more are refused at once (each
/// holds a thread for up to [`HELLO_TIMEOUT`]).
pub const MAX_UNAUTHENTICATED: usize = 64;

/// How long a new connection has to send its hello.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Counts a connection as unauthenticated while it lives.
struct Unauthenticated(Arc<AtomicUsize>);

impl Drop for Unauthenticated {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accept connections forever on `listener`, one thread per connection;
/// each VMM's sends are queued up to `queue` messages.
pub fn accept_loop(
    listener: UnixListener,
    pending: PendingLaunches,
    events: UnboundedSender<ConnEvent>,
    queue: usize,
) {
    let unauthenticated = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                // Room for every VMM the server launched and awaits (a fork
                // of a thousand children), plus the fixed allowance for
                // anyone else; a stranger cannot add launches.
                let launched = pending.lock().map_or(0, |p| p.len());
                let cap = MAX_UNAUTHENTICATED + launched;
                if unauthenticated.fetch_add(1, Ordering::Relaxed) >= cap {
                    unauthenticated.fetch_sub(1, Ordering::Relaxed);
                    refuse(
                        &stream,
                        "too many connections waiting to say hello; try again later",
                    );
                    continue;
                }
                let guard = Unauthenticated(unauthenticated.clone());
                let pending = pending.clone();
                let events = events.clone();
                let spawned = std::thread::Builder::new()
                    .name("vmm-conn".into())
                    .spawn(move || serve_connection(stream, pending, events, queue, guard));
                if let Err(e) = spawned {
                    warn!("vmm socket: cannot start a connection thread: {e}");
                }
            }
            Err(e) => {
                warn!("vmm socket: accept failed: {e}{}", crate::fd_hint(&e));
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn serve_connection(
    stream: UnixStream,
    pending: PendingLaunches,
    events: UnboundedSender<ConnEvent>,
    queue: usize,
    unauthenticated: Unauthenticated,
) {
    let peer_pid = getsockopt(&stream, PeerCredentials)
        .map(|c| c.pid())
        .unwrap_or(-1);
    // A peer has a few seconds to say hello.
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
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
        Err(e) => return refuse(&stream, &shared::error_chain(&e)),
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
    drop(unauthenticated);
    let binding = launch.vm;
    let vm = binding.get();
    let writer = match stream
        .try_clone()
        .and_then(|s| VmmWriter::start(vm, s, queue))
    {
        Ok(w) => w,
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
        let received = msg::recv::<VmmMsg>(&stream);
        // A pooled VMM is bound to its VM between its hello and its next
        // message (see [`super::Binding`]).
        let vm = binding.get();
        match received {
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
                let why = shared::error_chain(&e);
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
