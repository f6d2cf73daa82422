//! A request on a connection of its own that the client abandons after
//! a timeout, as a real client would: for tests of a server that stalls.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;

// ------------------------------------------------- a client that gives up --

/// An HTTP request on a fresh connection; `None` if the server did not
/// answer within `timeout` (the client gives up, as a real one would).
pub fn request_within(
    sock: &Path,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Option<(u16, String)> {
    let mut s = UnixStream::connect(sock).expect("cannot connect to the API socket");
    s.set_read_timeout(Some(timeout)).expect("set_read_timeout");
    s.set_write_timeout(Some(timeout))
        .expect("set_write_timeout");
    let body = body.map(Value::to_string).unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    // A server that answers and closes before reading the request (a 503
    // beyond the connection cap) can make this write fail with EPIPE when
    // it is quicker than the client: its answer is still there to read.
    let sent = s.write_all(head.as_bytes());
    let mut resp = Vec::new();
    // The same early close makes the read after the answer fail with
    // ECONNRESET: the answer is still what was read.
    match s.read_to_end(&mut resp) {
        Ok(_) if resp.is_empty() && sent.is_err() => return None,
        Ok(_) => {}
        Err(_) if !resp.is_empty() => {}
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return None
        }
        Err(e) => panic!("{method} {path}: no answer: {e}"),
    }
    let text = String::from_utf8_lossy(&resp).into_owned();
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}
