//! The VMM socket: accepts VMM connections, checks who they are, and turns
//! each connection's frames into [`ConnEvent`]s for the core.
//!
//! Each new connection gets a thread that waits (blocking, with a timeout)
//! for its hello, or the rejoin of a VMM whose server went, and checks it;
//! from then on the core reads the connection on its own event loop
//! ([`read_frames`]) and writes to the VMM through a [`VmmWriter`]. A
//! connection that sends bad bytes, an unknown launch token, a pid that is
//! not the launched VMM's (or, rejoining, not the peer's), or the wrong fds
//! gets a [`ServerMsg::Error`] and is closed; nothing else is affected.

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
use proto::frame::{FrameError, FrameReader};
use proto::vmm::{self as msg, ServerMsg, VmmMsg};
use shared::VmId;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::mpsc::UnboundedSender;

use super::{Binding, ConnEvent, PendingLaunches, VmmWriter};
use tracing::{debug, info, warn};

/// Tell the peer why (best effort, without waiting: this also runs on the
/// core thread, which a peer that stopped reading must not hold) and
/// close the connection.
fn refuse(stream: &UnixStream, why: &str) {
    warn!("vmm socket: refusing connection: {why}");
    let error = ServerMsg::Error {
        message: why.to_owned(),
    };
    if let Ok(payload) = msg::encode(&error) {
        let _ = proto::frame::send_frame_now(stream.as_raw_fd(), &payload, &[]);
    }
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
                    refuse(&stream, msg::BUSY);
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
    let (first, fds) = match msg::recv::<VmmMsg>(&stream) {
        Ok(m) => m,
        Err(e) => return refuse(&stream, &shared::error_chain(&e)),
    };
    let version = match &first {
        VmmMsg::Hello { version, .. } | VmmMsg::Rejoin { version, .. } => *version,
        other => {
            return refuse(
                &stream,
                &format!("expected hello or rejoin, got {}", kind(other)),
            )
        }
    };
    if !fds.is_empty() {
        return refuse(
            &stream,
            &format!("{} must carry no fds, got {}", kind(&first), fds.len()),
        );
    }
    if version != proto::frame::VERSION {
        return refuse(&stream, &format!("unsupported protocol version {version}"));
    }
    let (token, pid) = match first {
        VmmMsg::Hello { token, pid, .. } => (token, pid),
        VmmMsg::Rejoin { vm, pid, .. } => {
            return rejoin(stream, vm, pid, peer_pid, events, queue, unauthenticated)
        }
        other => {
            return refuse(
                &stream,
                &format!("expected hello or rejoin, got {}", kind(&other)),
            )
        }
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
    // From here on the core reads the connection itself (see
    // [`read_frames`]); this thread's work is done.
    let _ = events.send(ConnEvent::Hello {
        vm,
        writer,
        pid,
        stream,
        binding,
    });
}

/// A VMM that was serving `vm` when its server went asks this server to
/// take it back: if it is the process it says it is, hand the connection
/// to the core, which answers (it knows whether it has the VM).
fn rejoin(
    stream: UnixStream,
    vm: VmId,
    pid: u32,
    peer_pid: i32,
    events: UnboundedSender<ConnEvent>,
    queue: usize,
    unauthenticated: Unauthenticated,
) {
    if i64::from(pid) != i64::from(peer_pid) {
        return refuse(
            &stream,
            &format!("rejoin for {vm} says pid {pid}, but the peer is pid {peer_pid}"),
        );
    }
    let _ = stream.set_read_timeout(None);
    drop(unauthenticated);
    let writer = match stream
        .try_clone()
        .and_then(|s| VmmWriter::start(vm, s, queue))
    {
        Ok(w) => w,
        Err(e) => return refuse(&stream, &format!("internal error: {e}")),
    };
    info!("{vm}: vmm pid {pid} asks to rejoin");
    let _ = events.send(ConnEvent::Rejoin {
        vm,
        writer,
        pid,
        stream,
        binding: Binding::new(vm),
    });
}

/// Frames read from one connection in a row before the reader lets the
/// core's other work run.
const BURST: usize = 32;

/// Read a VMM connection's frames on the core's event loop and hand each
/// message to `deliver` until the connection ends, which is delivered as
/// [`ConnEvent::Closed`].
///
/// Reading never waits: a frame that is not whole yet stays in a
/// [`FrameReader`] until the rest arrives, so a VMM that stops in the
/// middle of a frame, or stops sending at all, costs the core nothing.
/// Each message reaches the core with one wake-up (the socket's), not two
/// (a reader thread's, then the core's), which is most of what a start
/// from the pool waits on between the VMM and the server.
pub async fn read_frames(stream: UnixStream, binding: Binding, deliver: impl Fn(ConnEvent)) {
    let closed = |reason: String| {
        deliver(ConnEvent::Closed {
            vm: binding.get(),
            reason,
        })
    };
    // SAFETY: the stream owns its fd, which stays open and unchanged until
    // the stream (moved into the AsyncFd) is dropped.
    let fd = match unsafe { AsyncFd::register_with_interest(stream, Interest::READABLE) } {
        Ok(fd) => fd,
        Err(e) => return closed(format!("cannot watch the vmm connection: {e}")),
    };
    let mut reader = FrameReader::default();
    loop {
        let mut guard = match fd.readable().await {
            Ok(g) => g,
            Err(e) => return closed(format!("cannot watch the vmm connection: {e}")),
        };
        for _ in 0..BURST {
            // A pooled VMM is bound to its VM between its hello and its
            // next message (see [`super::Binding`]).
            let vm = binding.get();
            let frame = reader.read(guard.get_inner()).and_then(|f| {
                f.map(|(p, fds)| Ok((msg::decode::<VmmMsg>(&p)?, fds)))
                    .transpose()
            });
            match frame {
                Ok(Some((m, fds))) => {
                    debug!("{vm}: <- {}", kind(&m));
                    deliver(ConnEvent::Msg { vm, msg: m, fds });
                }
                Ok(None) => {
                    guard.clear_ready();
                    break;
                }
                Err(FrameError::Closed) => return closed("vmm closed its connection".into()),
                Err(e) => {
                    let why = shared::error_chain(&e);
                    if !matches!(e, FrameError::Recv(_) | FrameError::Truncated) {
                        refuse(guard.get_inner(), &why);
                    }
                    return closed(format!("vmm connection failed: {why}"));
                }
            }
        }
        drop(guard);
        // A VMM with more to say waits its turn behind everyone else.
        tokio::task::yield_now().await;
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
        VmmMsg::Rejoin { .. } => "rejoin",
        VmmMsg::Anchor { .. } => "anchor",
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::io::Write;
    use std::rc::Rc;

    use proto::frame::Header;
    use shared::VmId;

    use super::*;

    fn frame(m: &VmmMsg) -> Vec<u8> {
        let payload = msg::encode(m).unwrap();
        let header = Header {
            version: proto::frame::VERSION,
            flags: 0,
            len: u32::try_from(payload.len()).unwrap(),
            nfds: 0,
        }
        .encode();
        header.iter().chain(&payload).copied().collect()
    }

    /// A rejoin is a first message like a hello: checked (version, no
    /// fds, the peer's pid), then handed to the core as `Rejoin`, which
    /// answers it; a refused one gets an error and no event.
    #[test]
    fn a_rejoin_reaches_the_core_only_from_the_process_it_names() {
        let me = std::process::id();
        let try_rejoin = |version: u16, pid: u32| {
            let (ours, theirs) = UnixStream::pair().unwrap();
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            let counter = Arc::new(AtomicUsize::new(1));
            msg::send(
                &theirs,
                &VmmMsg::Rejoin {
                    version,
                    vm: VmId(9),
                    pid,
                },
                &[],
            )
            .unwrap();
            serve_connection(
                ours,
                PendingLaunches::default(),
                tx,
                4,
                Unauthenticated(counter.clone()),
            );
            assert_eq!(counter.load(Ordering::Relaxed), 0, "no longer counted");
            (rx.try_recv().ok(), theirs)
        };
        let (event, theirs) = try_rejoin(proto::frame::VERSION, me);
        match event {
            Some(ConnEvent::Rejoin {
                vm, pid, binding, ..
            }) => {
                assert_eq!((vm, pid), (VmId(9), me));
                assert_eq!(binding.get(), VmId(9));
            }
            other => panic!("expected a rejoin event, got {other:?}"),
        }
        // Nothing is answered yet: the core does.
        theirs.set_nonblocking(true).unwrap();
        assert!(msg::recv::<ServerMsg>(&theirs).is_err());
        for (version, pid, why) in [
            (proto::frame::VERSION, me + 1, "pid"),
            (proto::frame::VERSION + 1, me, "version"),
        ] {
            let (event, theirs) = try_rejoin(version, pid);
            assert!(event.is_none(), "{why}: refused before the core");
            match msg::recv::<ServerMsg>(&theirs).unwrap().0 {
                ServerMsg::Error { message } => assert!(message.contains(why), "{message}"),
                other => panic!("{why}: expected an error, got {other:?}"),
            }
        }
    }

    /// The core reads connections on its own thread: a VMM that stops in
    /// the middle of a frame must not keep another VMM's messages from
    /// being delivered, and its own frame is delivered once the rest
    /// arrives; a hang-up is delivered as `Closed`.
    #[test]
    fn a_connection_stopped_mid_frame_does_not_hold_up_the_others() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            let got: Rc<RefCell<Vec<String>>> = Rc::default();
            let start = |vm: u32| {
                let (ours, theirs) = UnixStream::pair().unwrap();
                let got = got.clone();
                tokio::task::spawn_local(read_frames(ours, Binding::new(VmId(vm)), move |ev| {
                    got.borrow_mut().push(match ev {
                        ConnEvent::Msg { vm, msg, .. } => format!("{vm} {}", kind(&msg)),
                        ConnEvent::Closed { vm, .. } => format!("{vm} closed"),
                        other => format!("{other:?}"),
                    });
                }));
                theirs
            };
            let mut stuck = start(1);
            let mut other = start(2);
            let running = frame(&VmmMsg::Running);
            stuck.write_all(&running[..5]).unwrap();
            for _ in 0..3 {
                other.write_all(&running).unwrap();
            }
            let wait_for = |n: usize| {
                let got = got.clone();
                async move {
                    for _ in 0..1000 {
                        if got.borrow().len() >= n {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(2)).await;
                    }
                }
            };
            wait_for(3).await;
            assert_eq!(*got.borrow(), vec!["vm-2 running"; 3]);
            stuck.write_all(&running[5..]).unwrap();
            wait_for(4).await;
            assert_eq!(got.borrow()[3], "vm-1 running");
            drop(stuck);
            other.write_all(&running[..3]).unwrap();
            drop(other);
            wait_for(6).await;
            let mut ends = got.borrow()[4..].to_vec();
            ends.sort();
            assert_eq!(ends, ["vm-1 closed", "vm-2 closed"]);
        });
    }
}
