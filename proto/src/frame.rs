//! Length-prefixed frames with file descriptors, over a Unix stream socket.
//!
//! ```text
//!  0      4        6        8            12       13      16
//!  +------+--------+--------+------------+--------+-------+----------------+
//!  | PGFK | version| flags  | payload len| n fds  | 0 0 0 | payload ...    |
//!  +------+--------+--------+------------+--------+-------+----------------+
//!   magic   u16 LE   u16 LE    u32 LE       u8
//! ```
//!
//! A frame is written with one `sendmsg`; its fds (SCM_RIGHTS) travel with
//! the header bytes. The reader takes the header with `recvmsg`, and the
//! frame is valid only if exactly `n fds` descriptors arrived with it.
//! Descriptors are received with `MSG_CMSG_CLOEXEC` and owned by the caller.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};

/// Frame magic, "PGFK".
pub const MAGIC: [u8; 4] = *b"PGFK";
/// Protocol version spoken by this build (2: memory kinds and Rebase).
pub const VERSION: u16 = 2;
/// Header size in bytes.
pub const HEADER_LEN: usize = 16;
/// Largest payload accepted.
pub const MAX_PAYLOAD: u32 = 1 << 20;
/// Largest number of fds one frame may carry.
pub const MAX_FDS: u8 = 16;

/// Errors of framing and fd passing.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("peer closed the connection")]
    Closed,
    #[error("connection closed in the middle of a frame")]
    Truncated,
    #[error("bad frame magic {0:02x?}: the peer does not speak the pagefork VMM protocol")]
    BadMagic([u8; 4]),
    #[error("unsupported protocol version {0}; this server speaks version {VERSION}")]
    BadVersion(u16),
    #[error("frame payload of {0} bytes exceeds the limit of {MAX_PAYLOAD}")]
    TooLarge(u32),
    #[error("frame declares {declared} fds but {received} arrived")]
    FdCount { declared: u8, received: usize },
    #[error("reserved header bytes are not zero")]
    Reserved,
    #[error("cannot receive a frame")]
    Recv(#[source] nix::Error),
    #[error("cannot send a frame")]
    Send(#[source] nix::Error),
    #[error("cannot decode message")]
    Decode(#[source] postcard::Error),
    #[error("cannot encode message")]
    Encode(#[source] postcard::Error),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, FrameError>;

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Protocol version.
    pub version: u16,
    /// Flags (none defined yet).
    pub flags: u16,
    /// Payload length in bytes.
    pub len: u32,
    /// Number of fds carried.
    pub nfds: u8,
}

impl Header {
    /// Encode the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&self.version.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12] = self.nfds;
        b
    }

    /// Decode and validate a header.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(FrameError::BadVersion(version));
        }
        if b[13..16] != [0, 0, 0] {
            return Err(FrameError::Reserved);
        }
        let len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        if len > MAX_PAYLOAD {
            return Err(FrameError::TooLarge(len));
        }
        if b[12] > MAX_FDS {
            return Err(FrameError::FdCount {
                declared: b[12],
                received: 0,
            });
        }
        Ok(Header {
            version,
            flags: u16::from_le_bytes([b[6], b[7]]),
            len,
            nfds: b[12],
        })
    }
}

/// Send one frame carrying `payload` and `fds` with a single `sendmsg`.
pub fn send_frame(sock: RawFd, payload: &[u8], fds: &[RawFd]) -> Result<()> {
    send_frame_from(sock, payload, fds, 0, false).map(|_| ())
}

/// Send as much of one frame as `sock` takes without waiting: returns the
/// bytes sent (the fds go with the first), which may be none. The rest
/// goes with [`send_frame_rest`].
pub fn send_frame_now(sock: RawFd, payload: &[u8], fds: &[RawFd]) -> Result<usize> {
    send_frame_from(sock, payload, fds, 0, true)
}

/// Send the rest of a frame whose first `sent` bytes (and fds, if any
/// were sent) [`send_frame_now`] sent.
pub fn send_frame_rest(sock: RawFd, payload: &[u8], fds: &[RawFd], sent: usize) -> Result<()> {
    send_frame_from(sock, payload, fds, sent, false).map(|_| ())
}

/// The length of the frame carrying `payload` on the wire.
pub fn frame_len(payload: &[u8]) -> usize {
    HEADER_LEN + payload.len()
}

/// Send the frame from byte `sent` on; with `now`, stop instead of
/// waiting when the socket is full. Returns the bytes sent in all.
fn send_frame_from(
    sock: RawFd,
    payload: &[u8],
    fds: &[RawFd],
    mut sent: usize,
    now: bool,
) -> Result<usize> {
    let len = u32::try_from(payload.len()).map_err(|_| FrameError::TooLarge(u32::MAX))?;
    if len > MAX_PAYLOAD {
        return Err(FrameError::TooLarge(len));
    }
    let nfds = u8::try_from(fds.len())
        .ok()
        .filter(|n| *n <= MAX_FDS)
        .ok_or(FrameError::FdCount {
            declared: MAX_FDS,
            received: fds.len(),
        })?;
    let header = Header {
        version: VERSION,
        flags: 0,
        len,
        nfds,
    }
    .encode();
    let total = HEADER_LEN + payload.len();
    let flags = if now {
        MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT
    } else {
        MsgFlags::MSG_NOSIGNAL
    };
    while sent < total {
        let (h, p) = if sent < HEADER_LEN {
            (&header[sent..], payload)
        } else {
            (&header[..0], &payload[sent - HEADER_LEN..])
        };
        let iov = [IoSlice::new(h), IoSlice::new(p)];
        let cmsg = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage] = if sent == 0 && !fds.is_empty() {
            &cmsg
        } else {
            &[]
        };
        match sendmsg::<()>(sock, &iov, cmsgs, flags, None) {
            Ok(n) => sent += n,
            Err(nix::Error::EINTR) => continue,
            Err(nix::Error::EAGAIN) if now => break,
            Err(e) => return Err(FrameError::Send(e)),
        }
    }
    Ok(sent)
}

fn recv_some(sock: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<usize> {
    recv_with(sock, buf, fds, MsgFlags::empty())
}

/// `recvmsg` into `buf`, taking the fds that come with the bytes; `flags`
/// are added to `MSG_CMSG_CLOEXEC`.
fn recv_with(
    sock: RawFd,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    flags: MsgFlags,
) -> Result<usize> {
    let mut cmsg_space = nix::cmsg_space!([RawFd; MAX_FDS as usize]);
    loop {
        let mut iov = [IoSliceMut::new(buf)];
        let res = recvmsg::<()>(
            sock,
            &mut iov,
            Some(&mut cmsg_space),
            MsgFlags::MSG_CMSG_CLOEXEC | flags,
        );
        let msg = match res {
            Ok(m) => m,
            Err(nix::Error::EINTR) => continue,
            Err(e) => return Err(FrameError::Recv(e)),
        };
        let n = msg.bytes;
        let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
        for c in msg.cmsgs().map_err(FrameError::Recv)? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                for fd in raw {
                    // SAFETY: the kernel just installed `fd` in our table for
                    // this message; nothing else owns it.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        if truncated {
            return Err(FrameError::FdCount {
                declared: MAX_FDS,
                received: MAX_FDS as usize + 1,
            });
        }
        return Ok(n);
    }
}

/// Receive one frame: its payload and the fds that came with it.
///
/// Blocks until a whole frame has arrived. Returns [`FrameError::Closed`] on
/// a clean hang-up between frames.
pub fn recv_frame(sock: &impl AsRawFd) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
    let fd = sock.as_raw_fd();
    let mut header = [0u8; HEADER_LEN];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < HEADER_LEN {
        let n = recv_some(fd, &mut header[got..], &mut fds)?;
        if n == 0 {
            return Err(if got == 0 {
                FrameError::Closed
            } else {
                FrameError::Truncated
            });
        }
        got += n;
    }
    let h = Header::decode(&header)?;
    let mut payload = vec![0u8; h.len as usize];
    let mut got = 0;
    while got < payload.len() {
        let n = recv_some(fd, &mut payload[got..], &mut fds)?;
        if n == 0 {
            return Err(FrameError::Truncated);
        }
        got += n;
    }
    if fds.len() != usize::from(h.nfds) {
        return Err(FrameError::FdCount {
            declared: h.nfds,
            received: fds.len(),
        });
    }
    Ok((payload, fds))
}

/// Reads frames from a socket without ever waiting, for an event loop that
/// serves many peers and must not stall on one: [`FrameReader::read`]
/// takes what has arrived, keeps a frame that is not whole yet for the next
/// call, and reads exactly up to each frame's end, so the fds that travel
/// with a frame's header are never taken with another frame's bytes.
#[derive(Debug, Default)]
pub struct FrameReader {
    header: [u8; HEADER_LEN],
    header_got: usize,
    /// The frame's header once whole, and its payload so far.
    body: Option<(Header, Vec<u8>)>,
    body_got: usize,
    fds: Vec<OwnedFd>,
}

impl FrameReader {
    /// Read what `sock` holds now: `Some` frame (payload and fds) once one
    /// is whole, `None` when the socket has nothing more for now (read
    /// again when it is readable). Errors are those of [`recv_frame`];
    /// after one the stream is out of step and must be closed.
    pub fn read(&mut self, sock: &impl AsRawFd) -> Result<Option<(Vec<u8>, Vec<OwnedFd>)>> {
        let fd = sock.as_raw_fd();
        while self.header_got < HEADER_LEN {
            let Some(n) = recv_now(fd, &mut self.header[self.header_got..], &mut self.fds)? else {
                return Ok(None);
            };
            if n == 0 {
                return Err(if self.header_got == 0 {
                    FrameError::Closed
                } else {
                    FrameError::Truncated
                });
            }
            self.header_got += n;
        }
        let (header, payload) = match &mut self.body {
            Some(body) => body,
            None => {
                let h = Header::decode(&self.header)?;
                self.body.insert((h, vec![0u8; h.len as usize]))
            }
        };
        while self.body_got < payload.len() {
            let Some(n) = recv_now(fd, &mut payload[self.body_got..], &mut self.fds)? else {
                return Ok(None);
            };
            if n == 0 {
                return Err(FrameError::Truncated);
            }
            self.body_got += n;
        }
        if self.fds.len() != usize::from(header.nfds) {
            return Err(FrameError::FdCount {
                declared: header.nfds,
                received: self.fds.len(),
            });
        }
        let payload = std::mem::take(payload);
        let fds = std::mem::take(&mut self.fds);
        *self = FrameReader::default();
        Ok(Some((payload, fds)))
    }
}

/// [`recv_some`] without waiting: `None` when nothing has arrived.
fn recv_now(sock: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> Result<Option<usize>> {
    match recv_with(sock, buf, fds, MsgFlags::MSG_DONTWAIT) {
        Ok(n) => Ok(Some(n)),
        Err(FrameError::Recv(nix::Error::EAGAIN)) => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn frame_round_trips_with_fds() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = std::fs::File::open("/dev/null").unwrap();
        send_frame(a.as_raw_fd(), b"hello", &[f.as_raw_fd(), f.as_raw_fd()]).unwrap();
        let (p, fds) = recv_frame(&b).unwrap();
        assert_eq!(p, b"hello");
        assert_eq!(fds.len(), 2);
    }

    #[test]
    fn wrong_fd_count_is_an_error() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let h = Header {
            version: VERSION,
            flags: 0,
            len: 0,
            nfds: 1,
        }
        .encode()
        .to_vec();
        a.write_all(&h).unwrap();
        assert!(matches!(
            recv_frame(&b),
            Err(FrameError::FdCount {
                declared: 1,
                received: 0
            })
        ));
    }

    #[test]
    fn hang_up_mid_frame_is_truncated() {
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(
            &Header {
                version: VERSION,
                flags: 0,
                len: 10,
                nfds: 0,
            }
            .encode(),
        )
        .unwrap();
        a.write_all(b"abc").unwrap();
        drop(a);
        assert!(matches!(recv_frame(&b), Err(FrameError::Truncated)));
    }

    /// A frame that arrives a few bytes at a time, its fds with the first
    /// piece, comes out whole once its last byte is in; the reader waits
    /// for nothing in between, and the frame after it keeps its own fds.
    #[test]
    fn reader_takes_frames_piece_by_piece_without_waiting() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = std::fs::File::open("/dev/null").unwrap();
        let payload = b"a payload of some length".to_vec();
        let header = Header {
            version: VERSION,
            flags: 0,
            len: u32::try_from(payload.len()).unwrap(),
            nfds: 1,
        }
        .encode();
        let wire: Vec<u8> = header.iter().chain(&payload).copied().collect();
        let mut r = FrameReader::default();
        assert!(r.read(&b).unwrap().is_none(), "nothing sent yet");
        let mut sent = 0;
        for piece in wire.chunks(5) {
            let fds = [f.as_raw_fd()];
            let cmsg = [ControlMessage::ScmRights(&fds)];
            let cmsgs: &[ControlMessage] = if sent == 0 { &cmsg } else { &[] };
            sendmsg::<()>(
                a.as_raw_fd(),
                &[IoSlice::new(piece)],
                cmsgs,
                MsgFlags::empty(),
                None,
            )
            .unwrap();
            sent += piece.len();
            let got = r.read(&b).unwrap();
            if sent < wire.len() {
                assert!(got.is_none(), "incomplete after {sent} bytes");
            } else {
                let (p, fds) = got.expect("whole after the last byte");
                assert_eq!(p, payload);
                assert_eq!(fds.len(), 1);
            }
        }
        send_frame(a.as_raw_fd(), b"next", &[]).unwrap();
        send_frame(a.as_raw_fd(), b"and its fd", &[f.as_raw_fd()]).unwrap();
        let (p, fds) = r.read(&b).unwrap().unwrap();
        assert_eq!((p.as_slice(), fds.len()), (&b"next"[..], 0));
        let (p, fds) = r.read(&b).unwrap().unwrap();
        assert_eq!((p.as_slice(), fds.len()), (&b"and its fd"[..], 1));
        assert!(r.read(&b).unwrap().is_none());
        drop(a);
        assert!(matches!(r.read(&b), Err(FrameError::Closed)));
    }

    #[test]
    fn reader_reports_a_hang_up_mid_frame() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let mut r = FrameReader::default();
        a.write_all(b"PG").unwrap();
        assert!(r.read(&b).unwrap().is_none());
        drop(a);
        assert!(matches!(r.read(&b), Err(FrameError::Truncated)));
    }

    proptest! {
        #[test]
        fn header_decoder_never_panics(bytes in proptest::array::uniform16(any::<u8>())) {
            let _ = Header::decode(&bytes);
        }

        #[test]
        fn header_round_trips(flags: u16, len in 0..=MAX_PAYLOAD, nfds in 0..=MAX_FDS) {
            let h = Header { version: VERSION, flags, len, nfds };
            prop_assert_eq!(Header::decode(&h.encode()).unwrap(), h);
        }

        #[test]
        fn arbitrary_stream_bytes_give_errors_not_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let (mut a, b) = UnixStream::pair().unwrap();
            a.write_all(&bytes).unwrap();
            drop(a);
            let _ = recv_frame(&b);
        }

        #[test]
        fn reader_gives_errors_not_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let (mut a, b) = UnixStream::pair().unwrap();
            a.write_all(&bytes).unwrap();
            drop(a);
            let mut r = FrameReader::default();
            while let Ok(Some(_)) = r.read(&b) {}
        }
    }
}
