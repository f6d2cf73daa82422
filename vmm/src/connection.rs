//! The VMM's end of the server socket: handshake, a shared sender, and
//! rejoining a new server when the one it talked to went away.
//!
//! Only the control thread receives (and rejoins); any thread (vCPU,
//! digest worker) may send, serialized by a mutex so frames never
//! interleave. A rejoin swaps the socket under the senders: a send made
//! after it goes to the new server, except an answer to a request of the
//! old one (see [`Connection::send_on`]).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{connect, socket, AddressFamily, SockFlag, SockType, UnixAddr};
use proto::frame::{FrameError, VERSION};
use proto::vmm::{LaunchConfig, ServerMsg, VmmMsg};
use shared::VmId;

/// Errors of talking to the server.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    #[error("cannot connect to the server socket {path}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("nothing listens on the server socket {path} any more")]
    ServerGone {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot send to the server")]
    Send(#[source] FrameError),
    #[error("cannot receive from the server")]
    Recv(#[source] FrameError),
    #[error("the server refused this VMM: {0}")]
    Refused(String),
    #[error("the server is busy with other connections")]
    Busy,
    #[error("the server broke the protocol: expected {expected}, got {got}")]
    Unexpected { expected: &'static str, got: String },
    #[error("the server this message was for is gone (the VMM rejoined another)")]
    Superseded,
}

impl ConnectionError {
    /// Whether trying to rejoin again is pointless: nobody holds the
    /// socket any more, or a server answered and refused.
    pub fn is_definitive(&self) -> bool {
        matches!(
            self,
            Self::ServerGone { .. } | Self::Refused(_) | Self::Unexpected { .. }
        )
    }
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, ConnectionError>;

/// Which server connection a message belongs to: it changes with each
/// rejoin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Generation(u64);

/// The socket to the server now, and how many times it was replaced.
#[derive(Debug)]
struct Current {
    sock: UnixStream,
    generation: Generation,
}

/// A connected, greeted VMM socket.
#[derive(Debug)]
pub struct Connection {
    /// Read-locked by every send and receive, write-locked only by a
    /// rejoin (on the control thread, the only one that receives).
    current: RwLock<Current>,
    send_lock: Mutex<()>,
}

/// What the server's Welcome carried.
#[derive(Debug)]
pub struct Welcome {
    pub vm_id: VmId,
    pub config: LaunchConfig,
    pub fds: Vec<OwnedFd>,
}

impl Connection {
    /// Connect and say hello; returns the connection and the Welcome.
    pub fn connect(path: &Path, token: &str) -> Result<(Self, Welcome)> {
        let sock = UnixStream::connect(path).map_err(|source| ConnectionError::Connect {
            path: path.display().to_string(),
            source,
        })?;
        let conn = Connection {
            current: RwLock::new(Current {
                sock,
                generation: Generation(0),
            }),
            send_lock: Mutex::new(()),
        };
        conn.send(
            &VmmMsg::Hello {
                version: VERSION,
                token: token.to_owned(),
                pid: std::process::id(),
            },
            &[],
        )?;
        match conn.recv()? {
            (ServerMsg::Welcome { vm_id, config }, fds) => {
                Ok((conn, Welcome { vm_id, config, fds }))
            }
            (ServerMsg::Error { message }, _) => Err(ConnectionError::Refused(message)),
            (other, _) => Err(ConnectionError::Unexpected {
                expected: "Welcome",
                got: format!("{other:?}"),
            }),
        }
    }

    fn current(&self) -> std::sync::RwLockReadGuard<'_, Current> {
        self.current.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The server connection now: a request received now is answered
    /// with [`Connection::send_on`] this generation.
    pub fn generation(&self) -> Generation {
        self.current().generation
    }

    /// Send a message with fds to the server connected now.
    pub fn send(&self, msg: &VmmMsg, fds: &[RawFd]) -> Result<()> {
        let _g = self.send_lock.lock().unwrap_or_else(|e| e.into_inner());
        proto::vmm::send(&self.current().sock, msg, fds).map_err(ConnectionError::Send)
    }

    /// Send a message only if the server connection is still
    /// `generation`: an answer to a request of a server that has gone
    /// must not reach the next one, whose requests reuse its numbers.
    pub fn send_on(&self, generation: Generation, msg: &VmmMsg, fds: &[RawFd]) -> Result<()> {
        let _g = self.send_lock.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.current();
        if current.generation != generation {
            return Err(ConnectionError::Superseded);
        }
        proto::vmm::send(&current.sock, msg, fds).map_err(ConnectionError::Send)
    }

    /// Receive the next message (control thread only).
    pub fn recv(&self) -> Result<(ServerMsg, Vec<OwnedFd>)> {
        proto::vmm::recv(&self.current().sock).map_err(ConnectionError::Recv)
    }

    /// The server hung up on this VMM, which serves `vm`: connect to the
    /// socket at `path` again (whoever holds it now, a new server or the
    /// keeper of the old one, which queues the connection for the next
    /// server) and ask to be taken back, waiting until `deadline` for the
    /// answer. On `Rejoined` every send from now on goes to the new server.
    /// Control thread only.
    ///
    /// Errors for which [`ConnectionError::is_definitive`] holds end the
    /// attempts: nothing listens on `path` any more (`ENOENT`,
    /// `ECONNREFUSED`), or the server refused (it does not know `vm`).
    /// Others (a full backlog, a server gone again before answering, the
    /// deadline) may pass.
    pub fn rejoin(&self, path: &Path, vm: VmId, deadline: Instant) -> Result<()> {
        let sock = connect_now(path)?;
        let pid = std::process::id();
        proto::vmm::send(
            &sock,
            &VmmMsg::Rejoin {
                version: VERSION,
                vm,
                pid,
            },
            &[],
        )
        .map_err(ConnectionError::Send)?;
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let timeout = |e: std::io::Error| ConnectionError::Recv(FrameError::Recv(errno_of(&e)));
        sock.set_read_timeout(Some(wait)).map_err(timeout)?;
        match proto::vmm::recv(&sock).map_err(ConnectionError::Recv)? {
            (ServerMsg::Rejoined, _) => {}
            (ServerMsg::Error { message }, _) if message == proto::vmm::BUSY => {
                return Err(ConnectionError::Busy)
            }
            (ServerMsg::Error { message }, _) => return Err(ConnectionError::Refused(message)),
            (other, _) => {
                return Err(ConnectionError::Unexpected {
                    expected: "Rejoined",
                    got: format!("{other:?}"),
                })
            }
        }
        sock.set_read_timeout(None).map_err(timeout)?;
        let _g = self.send_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        current.sock = sock;
        current.generation = Generation(current.generation.0 + 1);
        Ok(())
    }
}

/// The errno of an I/O error (EIO if it has none).
fn errno_of(e: &std::io::Error) -> Errno {
    e.raw_os_error().map_or(Errno::EIO, Errno::from_raw)
}

/// Connect to the Unix socket at `path` without waiting: a listener whose
/// backlog is full answers `EAGAIN` (try again) instead of holding this
/// thread for as long as nobody accepts. `ENOENT` and `ECONNREFUSED` (no
/// socket, or nobody holds it) are [`ConnectionError::ServerGone`].
fn connect_now(path: &Path) -> Result<UnixStream> {
    let failed = |errno: Errno| {
        let source = std::io::Error::from(errno);
        let path = path.display().to_string();
        match errno {
            Errno::ENOENT | Errno::ECONNREFUSED => ConnectionError::ServerGone { path, source },
            _ => ConnectionError::Connect { path, source },
        }
    };
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .map_err(failed)?;
    let addr = UnixAddr::new(path).map_err(failed)?;
    connect(fd.as_raw_fd(), &addr).map_err(failed)?;
    let sock = UnixStream::from(fd);
    sock.set_nonblocking(false)
        .map_err(|e| failed(errno_of(&e)))?;
    Ok(sock)
}
