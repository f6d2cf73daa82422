//! The API's connection cap against clients that hold connections open.
//! At the cap, the connection that has been idle longest (no request in
//! flight) is closed to admit the new one, so an operator's health check
//! or delete gets through however many clients sit silent; a connection
//! with a request in flight (here a streamed fault trace) is never the
//! one closed; only when every connection has a request in flight is a
//! newcomer refused, with a 503 that says why.
//!
//! Every request here goes over a connection of its own, as raw HTTP/1.1
//! on the API socket, so the test decides which connections exist.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use pagefork_tests::{new_vm, require_kvm_uffd, TestServer};
use serde_json::Value;

/// How long a read waits for the server before the test gives up on it.
const WAIT: Duration = Duration::from_secs(30);

/// Send one request on a new connection (`Connection: close`); the status
/// and body of the answer.
fn request(sock: &Path, method: &str, path: &str) -> (u16, String) {
    let mut c = UnixStream::connect(sock).expect("connect");
    c.set_read_timeout(Some(WAIT)).expect("set_read_timeout");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\
         Connection: close\r\n\r\n"
    );
    // A refusal (503) is written and the connection closed as soon as it
    // is accepted: the request may meet a closed socket, the answer is
    // there to read all the same.
    if let Err(e) = c.write_all(head.as_bytes()) {
        assert_eq!(
            e.kind(),
            ErrorKind::BrokenPipe,
            "{method} {path}: send: {e}"
        );
    }
    let mut answer = Vec::new();
    if let Err(e) = c.read_to_end(&mut answer) {
        assert!(!answer.is_empty(), "{method} {path}: no answer: {e}");
    }
    parse(&String::from_utf8_lossy(&answer))
        .unwrap_or_else(|| panic!("{method} {path}: not an HTTP answer"))
}

/// Status and body of an HTTP answer.
fn parse(answer: &str) -> Option<(u16, String)> {
    let status = answer.split_whitespace().nth(1)?.parse().ok()?;
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

/// Whether the server closed `c` (end of file or reset) before it sent
/// anything.
fn closed_by_server(c: &mut UnixStream) -> bool {
    c.set_read_timeout(Some(WAIT)).expect("set_read_timeout");
    let mut buf = [0u8; 256];
    match c.read(&mut buf) {
        Ok(0) => true,
        Err(e) => e.kind() == ErrorKind::ConnectionReset,
        Ok(_) => false,
    }
}

/// A live fault trace of `vm` on a connection of its own, its answer's
/// head read: a request in flight for as long as the connection lasts.
struct Trace(UnixStream);

impl Trace {
    fn open(sock: &Path, vm: &str) -> Self {
        let mut c = UnixStream::connect(sock).expect("connect");
        c.set_read_timeout(Some(WAIT)).expect("set_read_timeout");
        let head =
            format!("GET /v1/vms/{vm}/faults?follow=true HTTP/1.1\r\nHost: localhost\r\n\r\n");
        c.write_all(head.as_bytes()).expect("send");
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = c.read(&mut buf).expect("read the trace's head");
            assert!(n > 0, "the trace closed before its head");
            got.extend_from_slice(&buf[..n]);
        }
        let head = String::from_utf8_lossy(&got);
        assert!(head.starts_with("HTTP/1.1 200"), "trace: {head}");
        Trace(c)
    }

    /// Read until an event of the trace arrives; false if the connection
    /// closed first.
    fn next_event(&mut self) -> bool {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match self.0.read(&mut buf) {
                Ok(0) | Err(_) => return false,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
            if String::from_utf8_lossy(&got).contains("\"kind\"") {
                return true;
            }
        }
    }
}

#[test]
fn health_and_delete_get_through_300_silent_connections() {
    if !require_kvm_uffd() {
        return;
    }
    // The default cap (256); a header timeout long enough that only the
    // cap can close a silent connection during the test.
    let s = TestServer::start_with_args(&["--api-header-timeout-ms", "60000"]);
    let vm = s.create_vm(&new_vm(4));
    let sock = s.api_sock();
    let mut silent: Vec<UnixStream> = (0..300)
        .map(|_| UnixStream::connect(&sock).expect("connect"))
        .collect();

    let (status, body) = request(&sock, "GET", "/v1/health");
    assert_eq!(status, 200, "health with 300 silent connections: {body}");
    let (status, body) = request(&sock, "DELETE", &format!("/v1/vms/{vm}"));
    assert_eq!(status, 200, "delete with 300 silent connections: {body}");

    // The ones that made room are the oldest: at least the 44 beyond the
    // cap of 256 (then one each for the health check and the delete, unless
    // a connection the harness had used was still counted).
    for (i, c) in silent.iter_mut().take(300 - 256).enumerate() {
        assert!(
            closed_by_server(c),
            "silent connection {i} is open, though newer ones were admitted"
        );
    }
    // The newest is open, and serves a request when its client speaks.
    let newest = silent.last_mut().expect("connections");
    newest
        .set_read_timeout(Some(WAIT))
        .expect("set_read_timeout");
    newest
        .write_all(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .expect("send on the newest connection");
    let mut answer = Vec::new();
    let _ = newest.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert_eq!(
        parse(&answer).map(|(status, _)| status),
        Some(200),
        "newest connection: {answer:?}"
    );
    s.assert_healthy();
}

#[test]
fn a_request_in_flight_keeps_its_connection_and_a_full_cap_says_why() {
    if !require_kvm_uffd() {
        return;
    }
    let cap = 8;
    let s = TestServer::start_with_args(&[
        "--api-max-connections",
        &cap.to_string(),
        "--api-header-timeout-ms",
        "60000",
    ]);
    let vm = s.create_vm(&new_vm(8));
    let sock = s.api_sock();
    // The oldest connection has a request in flight (the live trace);
    // silent ones fill the rest of the cap.
    let mut trace = Trace::open(&sock, &vm);
    let _silent: Vec<UnixStream> = (1..cap)
        .map(|_| UnixStream::connect(&sock).expect("connect"))
        .collect();

    // Many more requests than the cap has slots: each gets through, by
    // the silent connections' slots, never the trace's.
    for i in 0..3 * cap {
        let (status, body) = request(&sock, "GET", "/v1/health");
        assert_eq!(status, 200, "health {i} at the cap: {body}");
    }
    s.touch(&vm, 100, 16, false);
    assert!(
        trace.next_event(),
        "the trace's connection was closed to make room"
    );

    // Every slot with a request in flight: a newcomer is refused, and told
    // why.
    let _traces: Vec<Trace> = (1..cap).map(|_| Trace::open(&sock, &vm)).collect();
    let (status, body) = request(&sock, "GET", "/v1/health");
    assert_eq!(status, 503, "health with every connection busy: {body}");
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    let why = v["error"].as_str().unwrap_or_default();
    assert!(
        why.contains("connections") && why.contains("in flight"),
        "503 without a reason: {body}"
    );
}
