//! Firecracker-compatible UFFD listeners: the accept and handshake threads
//! (the listeners and the VMs they make are `core/firecracker/`).
//!
//! Each listener is a Unix socket bound to one memory source. A Firecracker
//! process restoring a snapshot connects, sends its regions as JSON with its
//! userfaultfd as the only fd (see [`proto::firecracker`]), and keeps the
//! socket open. A thread per connection reads the handshake, validates it
//! against the source, and hands the uffd to the core, which starts serving
//! at once (Firecracker faults on its own thread during `/snapshot/load`).
//! The same thread then waits for the hang-up that means the VM is gone.
//!
//! A bad handshake is logged, counted on the listener, and the connection
//! closed; other connections are unaffected.
//!
//! While a handover is under way ([`pause`]) listeners accept nothing:
//! connections wait in the backlog of the socket, which the keeper holds,
//! for the next process (see `core::restart::firecracker`).

use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::socket::{
    getsockopt, recvmsg, sockopt::PeerCredentials, ControlMessageOwned, MsgFlags,
};
use proto::firecracker::{parse_regions, HandshakeError, MAX_HANDSHAKE};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{info, warn};

use super::{ConnEvent, FcHandshake, InFlight};

/// Counters and the last refusal, shared between the listener's threads and
/// the API.
#[derive(Debug, Default)]
pub struct ListenerStats {
    pub accepted: AtomicU64,
    pub refused: AtomicU64,
    pub last_refusal: Mutex<Option<String>>,
}

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

/// Set while a handover is under way: listeners leave new connections in
/// their backlogs (the keeper holds the sockets) for the next process.
static PAUSED: AtomicBool = AtomicBool::new(false);
/// Stop accepting (`true`, a handover begins) or accept again.
pub fn pause(paused: bool) {
    PAUSED.store(paused, Ordering::SeqCst);
}

/// Wait until `listener` has a connection to accept (or is shut down).
fn wait_readable(listener: &UnixListener) {
    let mut p = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd; EINTR just polls again.
    while unsafe { libc::poll(&mut p, 1, -1) } < 0 {}
}

/// What a listener thread needs.
#[derive(Debug, Clone)]
pub struct ListenerCtx {
    pub id: u32,
    pub socket: PathBuf,
    pub source_len: u64,
    pub stats: Arc<ListenerStats>,
    pub events: UnboundedSender<ConnEvent>,
}

/// Accept Firecracker connections until the listener is shut down; while
/// paused (see [`pause`]), leave them in the backlog.
pub fn accept_loop(listener: UnixListener, ctx: ListenerCtx) {
    loop {
        wait_readable(&listener);
        // Counted before the pause is looked at: a handover that pauses
        // and then finds none in flight knows no accept is under way.
        let taken = InFlight::take();
        if PAUSED.load(Ordering::SeqCst) {
            drop(taken);
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                let ctx = ctx.clone();
                let spawned = std::thread::Builder::new()
                    .name("fc-conn".into())
                    .spawn(move || serve_connection(stream, ctx, taken));
                if let Err(e) = spawned {
                    warn!("firecracker listener: cannot start a connection thread: {e}");
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break, // shut down
            Err(e) => {
                warn!(
                    "firecracker listener {}: accept failed: {e}{}",
                    ctx.socket.display(),
                    crate::fd_hint(&e)
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    info!("firecracker listener {} closed", ctx.socket.display());
}

fn refuse(ctx: &ListenerCtx, stream: &UnixStream, why: &str) {
    warn!(
        "firecracker listener {}: refusing handshake: {why}",
        ctx.socket.display()
    );
    ctx.stats.refused.fetch_add(1, Ordering::Relaxed);
    *ctx.stats
        .last_refusal
        .lock()
        .unwrap_or_else(|p| p.into_inner()) = Some(why.to_owned());
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// Read the one handshake message: its bytes and fds.
fn read_handshake(stream: &UnixStream) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; MAX_HANDSHAKE];
    let mut cmsg = nix::cmsg_space!([RawFd; 8]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = loop {
        match recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(m) => break m,
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let n = msg.bytes;
    let mut fds = Vec::new();
    for c in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: the kernel just installed `fd` for this message;
                // nothing else owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    buf.truncate(n);
    Ok((buf, fds))
}

fn serve_connection(stream: UnixStream, ctx: ListenerCtx, in_flight: InFlight) {
    let pid = getsockopt(&stream, PeerCredentials)
        .map(|c| c.pid())
        .unwrap_or(0);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let (bytes, mut fds) = match read_handshake(&stream) {
        Ok(r) => r,
        Err(e) => return refuse(&ctx, &stream, &format!("cannot read the handshake: {e}")),
    };
    if bytes.is_empty() && fds.is_empty() {
        return refuse(&ctx, &stream, "peer closed without a handshake");
    }
    if fds.len() != 1 {
        return refuse(
            &ctx,
            &stream,
            &HandshakeError::FdCount(fds.len()).to_string(),
        );
    }
    let regions = match parse_regions(&bytes, ctx.source_len) {
        Ok(r) => r,
        Err(e) => return refuse(&ctx, &stream, &e.to_string()),
    };
    let _ = stream.set_read_timeout(None);
    let Ok(core_stream) = stream.try_clone() else {
        return refuse(&ctx, &stream, "internal error: cannot clone the connection");
    };
    let conn = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
    ctx.stats.accepted.fetch_add(1, Ordering::Relaxed);
    let hs = FcHandshake {
        listener: ctx.id,
        conn,
        regions,
        uffd: fds.remove(0),
        pid: u32::try_from(pid).unwrap_or(0),
        stream: core_stream,
        in_flight,
    };
    if ctx.events.send(ConnEvent::FcHello(hs)).is_err() {
        return;
    }
    wait_hangup(&stream, conn, &ctx.events);
}

/// Firecracker sends nothing after its handshake; EOF (or an error) on
/// `stream` means it is gone: tell the core.
fn wait_hangup(stream: &UnixStream, conn: u64, events: &UnboundedSender<ConnEvent>) {
    let mut b = [0u8; 256];
    loop {
        match nix::unistd::read(stream.as_raw_fd(), &mut b) {
            Ok(0) | Err(_) => break,
            Ok(_) => continue,
        }
    }
    let _ = events.send(ConnEvent::FcClosed { conn });
}

/// Connections get ids past `conn` from now on: it names a connection
/// taken over from a server before this one.
pub fn reserve_conns(conn: u64) {
    NEXT_CONN.fetch_max(conn.saturating_add(1), Ordering::Relaxed);
}

/// Watch connection `conn` of a Firecracker client taken over from a
/// server before this one (see `core::restart::firecracker`) for its
/// hang-up, on a thread of its own as a new connection's is.
pub fn watch(
    stream: UnixStream,
    conn: u64,
    events: UnboundedSender<ConnEvent>,
) -> std::io::Result<()> {
    reserve_conns(conn);
    stream.set_nonblocking(false)?;
    std::thread::Builder::new()
        .name("fc-conn".into())
        .spawn(move || wait_hangup(&stream, conn, &events))
        .map(drop)
}
