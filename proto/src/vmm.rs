//! Messages between a VMM and the server, carried in [`crate::frame`]s.
//!
//! ```text
//!  VMM                                             uffd-server
//!   |-- Hello{version, token, pid} ------------------->|  token issued at launch,
//!   |                                                  |  pid checked with SO_PEERCRED
//!   |<-- Welcome{vm_id, config}  + fds [memfd.., disk]-|
//!   |   mmap memfds (shared, or private over a base),  |
//!   |   register MISSING|WP (|MINOR over a base)       |
//!   |-- UffdReady{bases}         + fds [uffd] -------->|  server starts serving faults
//!   |   start vCPUs; agent waits for its first command |
//!   |-- Running ---------------------------------------->|
//!   |<-- Request{seq, Pause|Resume|CaptureState|Restore|Exec|Stop|Discard}
//!   |<-- Request{seq, Rebase} + fds [base memfd..] -----|  paused: guest RAM mapped
//!   |                                                  |  private over a new base
//!   |-- Reply{seq, result} ---------------------------->|
//!   |-- Console{text} / Exited{code} ------------------>|  unsolicited
//!   |                                                  |
//!   |<-- connection closed --------------------------X|  server gone (killed, or handing
//!   |   VMM keeps its uffd and guest RAM;              |  over): its keeper holds the socket,
//!   |   vCPUs wait on their next fault                 |  the memfds and the uffds
//!   |-- connect (waits in the backlog) --------------->|  a new server accepts
//!   |-- Rejoin{version, vm, pid} --------------------->|  pid checked with SO_PEERCRED
//!   |<-- Rejoined -------------------------------------|  or Error: no such VM here
//!   |   requests in flight were lost with the old server
//! ```
//!
//! Any message that breaks the sequence, or a frame with the wrong number of
//! fds, is answered with [`ServerMsg::Error`] and the connection is closed.
//! A `Rejoin` is a first message, like `Hello`, anywhere else it breaks the
//! sequence; so does a `Rejoined` that does not answer one. A VMM that
//! finds nothing listening on the socket any more (`ENOENT`,
//! `ECONNREFUSED`: the server and its keeper are gone for good), or is
//! refused, exits.

use serde::{Deserialize, Serialize};
use shared::{GuestOp, GuestRegion, OpResult, VmId, VmState};

use crate::frame::{self, FrameError};

/// Messages the VMM sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum VmmMsg {
    /// First message: who the VMM is. No fds.
    Hello {
        version: u16,
        token: String,
        pid: u32,
    },
    /// Guest RAM is mapped and registered; carries the uffd as the only fd.
    /// `bases[i]` is the VMM's host virtual address of region `i`.
    UffdReady { bases: Vec<u64> },
    /// The vCPUs run and the guest agent waits for commands. No fds.
    Running,
    /// Answer to a server request.
    Reply {
        seq: u64,
        result: Result<Reply, RequestError>,
    },
    /// Guest console output.
    Console { text: String },
    /// The VMM is about to exit.
    Exited { code: i32, reason: String },
    /// First message on a new connection from a VMM that was serving VM
    /// `vm` when its connection to the server closed (the server died or
    /// handed over to a new one): take it back. No fds: its uffd and guest
    /// RAM are the ones the server (or its keeper) holds already.
    Rejoin { version: u16, vm: VmId, pid: u32 },
    /// The pid of this VMM's anchor: a process that shares its address
    /// space (and nothing else), made at its start when the server asked
    /// for one (`--anchor`), so that the pages its guest wrote stay
    /// readable for as long as the server needs them, whatever becomes of
    /// the VMM. Sent before `UffdReady` and after each `Rejoined`. No fds.
    Anchor { pid: u32 },
}

/// Messages the server sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ServerMsg {
    /// Answer to `Hello`: carries one memfd per region, then the disk fd if
    /// `config.disk_bytes` is set.
    Welcome { vm_id: VmId, config: LaunchConfig },
    /// A request the VMM must answer with `Reply{seq}`.
    Request { seq: u64, request: Request },
    /// The server refuses what the VMM sent; the connection closes next.
    Error { message: String },
    /// Answer to `Rejoin`: the server took the VM's VMM back and sends its
    /// requests on this connection from now on. No fds.
    Rejoined,
}

/// The message of the [`ServerMsg::Error`] that refuses a connection only
/// because too many connections wait to send their first message: the
/// peer may connect again a moment later (a rejoining VMM does).
pub const BUSY: &str = "too many connections waiting to say hello; try again later";

/// How the VMM must build the VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LaunchConfig {
    /// Guest RAM regions, one memfd each, in order.
    pub regions: Vec<GuestRegion>,
    /// Number of vCPUs.
    pub vcpus: u8,
    /// Size of the disk volume if one is attached (its fd follows the memfds).
    pub disk_bytes: Option<u64>,
    /// Start from this state (a fork child) instead of booting the agent.
    pub start_state: Option<VmState>,
    /// What the memfds are: this VM's own guest RAM, or shared bases.
    pub memory: MemoryKind,
}

/// What the memfds of a Welcome (or a Rebase) are to the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum MemoryKind {
    /// The VM's own guest RAM: mapped shared, so every page the server
    /// installs and every page the guest writes is in the memfd.
    #[default]
    Own,
    /// Shared bases, frozen while any VM maps them: mapped private and
    /// registered MINOR as well. A page present in the base is mapped
    /// from it (UFFDIO_CONTINUE) and shared with every VM on that base;
    /// the guest's writes, and pages the server installs with UFFDIO_COPY,
    /// are private pages of this process.
    Base,
}

/// Requests from the server to the VMM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// Stop all vCPUs at an instruction boundary (pending I/O completed).
    Pause,
    /// Let paused vCPUs run again.
    Resume,
    /// Return the state of the paused vCPUs and devices.
    CaptureState,
    /// Run one guest agent command and return its result.
    Exec(GuestOp),
    /// Shut down the VM and exit.
    Stop,
    /// Load this state into the paused vCPUs and devices (a rollback in
    /// place: the server has already replaced guest memory); it takes
    /// effect at the next resume. An agent op in flight is abandoned.
    Restore(VmState),
    /// Unmap these ranges of guest RAM, `(host address, bytes)` in the
    /// VMM's address space, from the paused VMM and from KVM without
    /// dropping their pages from the memfd (a rollback's reset pages; the
    /// server punches them later). From now on a page present in the memfd
    /// but not mapped faults MINOR, so the server sees every access to
    /// them. `Unsupported` where the kernel or the memory cannot.
    Discard(Vec<(u64, u64)>),
    /// Map guest RAM of the paused VM private over the memfds that come
    /// with this request (one per region, each at least the region's
    /// size), replacing its current mapping: every page it mapped and
    /// every private page it held are dropped from this process, and from
    /// now on it is a VM on a base (see [`MemoryKind::Base`]). The server
    /// sends it when the memfd the VM wrote becomes a base for others (a
    /// template's first resume after a fork) or when a rollback changes
    /// the VM's base.
    Rebase,
}

impl Request {
    /// The request's name, for errors and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Pause => "pause",
            Request::Resume => "resume",
            Request::CaptureState => "capture the state of",
            Request::Exec(_) => "exec",
            Request::Stop => "stop",
            Request::Restore(_) => "restore the state of",
            Request::Discard(_) => "discard pages of",
            Request::Rebase => "map a new base for",
        }
    }
}

/// Successful answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    /// Pause, resume or stop done.
    Done,
    /// The captured state.
    State(VmState),
    /// The guest op's result.
    Op(OpResult),
}

/// Why a VMM could not carry out a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RequestError {
    /// The op does not fit this VM (pages outside memory, sectors past the
    /// disk, no disk).
    #[error("invalid op: {0}")]
    InvalidOp(String),
    /// The op is not supported by this VMM.
    #[error("op {0} is not supported")]
    Unsupported(String),
    /// The VM must be paused first (capture).
    #[error("the VM is not paused; pause it first")]
    NotPaused,
    /// The vCPUs did not stop in time.
    #[error("vCPUs did not pause within {ms} ms")]
    PauseTimeout { ms: u64 },
    /// A vCPU thread has exited.
    #[error("a vCPU thread has exited")]
    VcpuGone,
    /// Reading or writing guest memory failed.
    #[error("guest memory access failed: {0}")]
    Memory(String),
    /// The guest agent or a device reported a failure.
    #[error("the guest failed: {0}")]
    Guest(String),
    /// A worker thread of the VMM has stopped.
    #[error("the VMM's {0} worker has stopped")]
    WorkerGone(String),
}

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum MsgError {
    #[error(transparent)]
    Frame(#[from] FrameError),
}

/// Encode a message into a frame payload.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    postcard::to_stdvec(msg).map_err(FrameError::Encode)
}

/// Decode a frame payload; trailing bytes are an error.
pub fn decode<'a, T: Deserialize<'a>>(payload: &'a [u8]) -> Result<T, FrameError> {
    match postcard::take_from_bytes(payload) {
        Ok((m, [])) => Ok(m),
        Ok(_) => Err(FrameError::Decode(postcard::Error::DeserializeBadEncoding)),
        Err(e) => Err(FrameError::Decode(e)),
    }
}

/// Send a message with fds on a socket.
pub fn send<T: Serialize>(
    sock: &impl std::os::fd::AsRawFd,
    msg: &T,
    fds: &[std::os::fd::RawFd],
) -> Result<(), FrameError> {
    frame::send_frame(sock.as_raw_fd(), &encode(msg)?, fds)
}

/// Receive a message and its fds from a socket.
pub fn recv<T: for<'a> Deserialize<'a>>(
    sock: &impl std::os::fd::AsRawFd,
) -> Result<(T, Vec<std::os::fd::OwnedFd>), FrameError> {
    let (payload, fds) = frame::recv_frame(sock)?;
    Ok((decode(&payload)?, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_op() -> impl Strategy<Value = GuestOp> {
        prop_oneof![
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(a, b, c)| GuestOp::Fill {
                start_page: a,
                pages: b,
                seed: c
            }),
            (any::<u64>(), any::<u64>(), any::<bool>()).prop_map(|(a, b, w)| GuestOp::Touch {
                start_page: a,
                pages: b,
                write: w
            }),
            (any::<u64>(), any::<u64>()).prop_map(|(a, b)| GuestOp::Checksum {
                start_page: a,
                pages: b
            }),
            Just(GuestOp::Identity),
        ]
    }

    fn arb_vmm_msg() -> impl Strategy<Value = VmmMsg> {
        prop_oneof![
            (any::<u16>(), ".{0,40}", any::<u32>()).prop_map(|(version, token, pid)| {
                VmmMsg::Hello {
                    version,
                    token,
                    pid,
                }
            }),
            proptest::collection::vec(any::<u64>(), 0..4)
                .prop_map(|bases| VmmMsg::UffdReady { bases }),
            Just(VmmMsg::Running),
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(seq, value, elapsed_us)| {
                VmmMsg::Reply {
                    seq,
                    result: Ok(Reply::Op(OpResult { value, elapsed_us })),
                }
            }),
            ".{0,40}".prop_map(|text| VmmMsg::Console { text }),
            (any::<u16>(), any::<u32>(), any::<u32>()).prop_map(|(version, vm, pid)| {
                VmmMsg::Rejoin {
                    version,
                    vm: VmId(vm),
                    pid,
                }
            }),
            any::<u32>().prop_map(|pid| VmmMsg::Anchor { pid }),
        ]
    }

    /// Rejoin and Rejoined come after every older message: a VMM and a
    /// server of different versions (the VMM outlives its server across a
    /// handover) still agree on the messages both know.
    #[test]
    fn rejoin_messages_round_trip_after_the_older_ones() {
        let rejoin = VmmMsg::Rejoin {
            version: crate::frame::VERSION,
            vm: VmId(7),
            pid: 4242,
        };
        let bytes = encode(&rejoin).unwrap();
        assert_eq!(bytes[0], 6, "Rejoin is VmmMsg's seventh variant");
        assert_eq!(decode::<VmmMsg>(&bytes).unwrap(), rejoin);
        let rejoined = encode(&ServerMsg::Rejoined).unwrap();
        assert_eq!(rejoined, [3], "Rejoined is ServerMsg's fourth variant");
        assert_eq!(decode::<ServerMsg>(&rejoined).unwrap(), ServerMsg::Rejoined);
        // Over a socket, as the VMM sends it and the server's first read
        // takes it.
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        send(&a, &rejoin, &[]).unwrap();
        let (got, fds) = recv::<VmmMsg>(&b).unwrap();
        assert_eq!(got, rejoin);
        assert!(fds.is_empty());
        send(&b, &ServerMsg::Rejoined, &[]).unwrap();
        assert_eq!(recv::<ServerMsg>(&a).unwrap().0, ServerMsg::Rejoined);
    }

    proptest! {
        #[test]
        fn vmm_messages_round_trip(m in arb_vmm_msg()) {
            let bytes = encode(&m).unwrap();
            prop_assert_eq!(decode::<VmmMsg>(&bytes).unwrap(), m);
        }

        #[test]
        fn server_requests_round_trip(seq: u64, op in arb_op()) {
            let m = ServerMsg::Request { seq, request: Request::Exec(op) };
            let bytes = encode(&m).unwrap();
            prop_assert_eq!(decode::<ServerMsg>(&bytes).unwrap(), m);
        }

        #[test]
        fn welcomes_round_trip_with_either_memory_kind(vm in any::<u32>(), base: bool, vcpus: u8) {
            let config = LaunchConfig {
                regions: vec![GuestRegion { guest_phys: 0, size: 1 << 20 }],
                vcpus,
                disk_bytes: None,
                start_state: None,
                memory: if base { MemoryKind::Base } else { MemoryKind::Own },
            };
            let m = ServerMsg::Welcome { vm_id: VmId(vm), config };
            let bytes = encode(&m).unwrap();
            prop_assert_eq!(decode::<ServerMsg>(&bytes).unwrap(), m);
            let r = ServerMsg::Request { seq: u64::from(vm), request: Request::Rebase };
            let bytes = encode(&r).unwrap();
            prop_assert_eq!(decode::<ServerMsg>(&bytes).unwrap(), r);
        }

        #[test]
        fn arbitrary_payloads_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode::<VmmMsg>(&bytes);
            let _ = decode::<ServerMsg>(&bytes);
        }
    }
}
