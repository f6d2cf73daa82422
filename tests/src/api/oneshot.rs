//! A client of the API that survives a server restart: every request on a
//! connection of its own, and a connection that breaks or a server that
//! does not answer is an error to handle, not a failed test (as with
//! [`super::Api`]). For tests and benchmarks that kill or upgrade the
//! server while they send.
//!
//! A request can be sent now and its answer read later ([`OneShot::send`],
//! [`Sent::answer`]), so that many can be under way at once.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use super::reply::Reply;

/// Why a request got no whole answer.
#[derive(Debug, thiserror::Error)]
pub enum OneShotError {
    #[error("cannot connect to the API socket")]
    Connect(#[source] std::io::Error),
    #[error("cannot set a read timeout on the connection")]
    SetTimeout(#[source] std::io::Error),
    #[error("cannot send the request")]
    Send(#[source] std::io::Error),
    #[error("the connection broke after {read} bytes of the answer")]
    Read {
        read: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("{len} bytes, not a whole answer: {start:?}")]
    Incomplete { len: usize, start: String },
}

impl OneShotError {
    /// Whether nothing listened at the socket, or there was no socket:
    /// what a client never sees while the server's keeper holds the
    /// listener across a restart.
    pub fn refused(&self) -> bool {
        matches!(self, OneShotError::Connect(e)
            if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::NotFound))
    }
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, OneShotError>;

/// A client of one API socket that opens a connection per request.
#[derive(Debug, Clone)]
pub struct OneShot {
    socket: PathBuf,
    /// How long an answer may take.
    timeout: Duration,
}

/// A request sent, its answer not read yet.
#[derive(Debug)]
pub struct Sent {
    stream: UnixStream,
    timeout: Duration,
}

impl OneShot {
    /// A client of the API socket at `socket` that waits up to `timeout`
    /// for an answer.
    pub fn new(socket: impl AsRef<Path>, timeout: Duration) -> Self {
        OneShot {
            socket: socket.as_ref().to_owned(),
            timeout,
        }
    }

    /// The API socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Send `method path` with an optional JSON body and read the answer.
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Reply> {
        self.send(method, path, body)?.answer()
    }

    /// Connect and send `method path` with an optional JSON body; the
    /// answer is read later ([`Sent::answer`]).
    pub fn send(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Sent> {
        let mut stream = UnixStream::connect(&self.socket).map_err(OneShotError::Connect)?;
        stream
            .set_read_timeout(Some(self.timeout))
            .map_err(OneShotError::SetTimeout)?;
        let body = body.map(Value::to_string).unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream
            .write_all(req.as_bytes())
            .map_err(OneShotError::Send)?;
        Ok(Sent {
            stream,
            timeout: self.timeout,
        })
    }
}

impl Sent {
    /// Read the whole answer (the server closes the connection after it).
    pub fn answer(mut self) -> Result<Reply> {
        let mut resp = Vec::new();
        match self.stream.read_to_end(&mut resp) {
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(OneShotError::Timeout(self.timeout))
            }
            Err(source) => {
                return Err(OneShotError::Read {
                    read: resp.len(),
                    source,
                })
            }
        }
        parse_response(&resp).ok_or_else(|| OneShotError::Incomplete {
            len: resp.len(),
            start: String::from_utf8_lossy(&resp[..resp.len().min(200)]).into_owned(),
        })
    }
}

/// The status and JSON body of a whole HTTP/1.1 answer (a body that is
/// not JSON as a string); `None` if `resp` is not one.
fn parse_response(resp: &[u8]) -> Option<Reply> {
    let split = resp.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&resp[..split]).ok()?;
    let mut body = resp[split + 4..].to_vec();
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let (mut chunked, mut len) = (false, None);
    for l in lines {
        let (k, v) = l.split_once(':')?;
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim());
        if k == "content-length" {
            len = Some(v.parse::<usize>().ok()?);
        } else if k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked") {
            chunked = true;
        }
    }
    if chunked {
        body = dechunk(&body)?;
    } else if len.is_some_and(|n| n != body.len()) {
        return None;
    }
    let body = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&body)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()))
    };
    Some(Reply { status, body })
}

/// The body of a chunked transfer encoding; `None` if it is cut short.
fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let nl = b.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&b[..nl])
            .ok()?
            .split(';')
            .next()?
            .trim();
        let size = usize::from_str_radix(size, 16).ok()?;
        b = &b[nl + 2..];
        if size == 0 {
            return Some(out);
        }
        if b.len() < size + 2 {
            return None;
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_sized_json_answer_parses() {
        let r = parse_response(b"HTTP/1.1 201 Created\r\nContent-Length: 9\r\n\r\n{\"id\":1}\n");
        assert_eq!(
            r,
            Some(Reply {
                status: 201,
                body: json!({ "id": 1 })
            })
        );
    }

    #[test]
    fn a_chunked_answer_is_joined() {
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n4;x=y\r\n:2}\n\r\n0\r\n\r\n",
        );
        assert_eq!(r.map(|r| r.body), Some(json!({ "a": 2 })));
    }

    #[test]
    fn an_answer_cut_short_is_not_whole() {
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}"),
            None
        );
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{}"),
            None
        );
        assert_eq!(parse_response(b"HTTP/1.1 200 OK\r\n"), None);
    }

    #[test]
    fn an_empty_body_is_null_and_text_stays_text() {
        let r = parse_response(b"HTTP/1.1 204 No Content\r\n\r\n");
        assert_eq!(r.map(|r| r.body), Some(Value::Null));
        let r = parse_response(b"HTTP/1.1 503 Service Unavailable\r\n\r\nbusy");
        assert_eq!(r.map(|r| r.body), Some(json!("busy")));
    }
}
