//! The VMM's end of the server socket: handshake and a shared sender.
//!
//! Only the control thread receives; any thread (vCPU, digest worker) may
//! send, serialized by a mutex so frames never interleave.

use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Mutex;

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
    #[error("cannot send to the server")]
    Send(#[source] FrameError),
    #[error("cannot receive from the server")]
    Recv(#[source] FrameError),
    #[error("the server refused this VMM: {0}")]
    Refused(String),
    #[error("the server broke the protocol: expected {expected}, got {got}")]
    Unexpected { expected: &'static str, got: String },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, ConnectionError>;

/// A connected, greeted VMM socket.
#[derive(Debug)]
pub struct Connection {
    sock: UnixStream,
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
            sock,
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

    /// Send a message with fds.
    pub fn send(&self, msg: &VmmMsg, fds: &[RawFd]) -> Result<()> {
        let _g = self.send_lock.lock().unwrap_or_else(|e| e.into_inner());
        proto::vmm::send(&self.sock, msg, fds).map_err(ConnectionError::Send)
    }

    /// Receive the next message (control thread only).
    pub fn recv(&self) -> Result<(ServerMsg, Vec<OwnedFd>)> {
        proto::vmm::recv(&self.sock).map_err(ConnectionError::Recv)
    }
}
