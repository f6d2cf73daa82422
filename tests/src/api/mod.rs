//! The tests' client of the REST API, typed on `proto::api`.
//!
//! Requests are built from the types the server parses (`CreateVm`,
//! `ExecRequest`, `ForkRequest`, `CreateSnapshot`, ...) and answers parsed
//! into the types it answers with (`VmInfo`, `ForkResponse`, `Sources`,
//! `SnapshotCreated`, ...), so a test and the server cannot disagree about
//! a field's name or type without the test failing to build or to parse.
//!
//! Each route has a `try_` method returning [`Answer`]: the parsed body if
//! the server answered the route's success status, else the [`Reply`] as
//! it came (status and JSON), for tests that expect a refusal. The method
//! without `try_` panics with that reply instead. Every call fails the
//! test if the server does not answer within [`API_TIMEOUT`].
//!
//! Escape hatches, for tests of bad input and of fields no type has:
//! [`Api::raw`] sends any JSON (or none) and returns the [`Reply`];
//! [`Api::raw_bytes`] sends bytes that need not be JSON on a connection of
//! its own and returns the status and the body text; [`request_within`]
//! is a request a client abandons after a timeout.
//!
//! [`OneShot`] ([`oneshot`]) is the client for a server that restarts
//! under it: a connection per request, and a broken connection or a late
//! answer is an error for the caller to retry, not a failed test.
//!
//! [`requests`] builds request bodies; the routes' methods are grouped by
//! resource in the private modules `vms` (VMs, guest ops, fork), `debug`
//! (sources, pages, tree, invariant, access records, maps, the trace,
//! health, metrics), `firecracker` (listeners), `snapshots`, `remote`
//! (the object store) and `volumes`.

mod debug;
mod firecracker;
mod give_up;
pub mod oneshot;
mod remote;
pub mod reply;
pub mod requests;
mod snapshots;
mod vms;
mod volumes;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::Value;
use uffdctl::client::Client;

pub use give_up::request_within;
pub use oneshot::{OneShot, OneShotError, Sent};
pub use reply::Reply;
pub use requests::*;

/// How long one API call may take before the test fails instead of hanging.
pub const API_TIMEOUT: Duration = Duration::from_secs(120);

/// A route's typed answer, or the reply when its status is not the
/// route's success status.
pub type Answer<T> = Result<T, Reply>;

/// A client of one server's API socket.
#[derive(Debug, Clone)]
pub struct Api {
    client: Client,
    socket: PathBuf,
    /// Pids of the VMMs of the VMs created through it, so the server's
    /// owner can make sure none outlives the test.
    vmm_pids: Arc<Mutex<Vec<u32>>>,
}

impl Api {
    /// A client of the API socket at `socket`.
    pub fn new(socket: impl AsRef<Path>) -> Self {
        Api {
            client: Client::new(socket.as_ref()),
            socket: socket.as_ref().to_owned(),
            vmm_pids: Arc::default(),
        }
    }

    /// The API socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// VMM pids seen in create answers, taken out.
    pub fn take_vmm_pids(&self) -> Vec<u32> {
        std::mem::take(&mut *self.vmm_pids.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Whether `GET /v1/health` answers 200 now (false if nothing
    /// listens yet).
    pub fn answers_health(&self) -> bool {
        self.client
            .request("GET", "/v1/health", None)
            .is_ok_and(|r| r.status == 200)
    }

    /// `GET /v1/health` if the server answers it now.
    pub fn health_now(&self) -> Option<proto::api::Health> {
        let r = self.client.request("GET", "/v1/health", None).ok()?;
        (r.status == 200)
            .then(|| serde_json::from_value(r.body).ok())
            .flatten()
    }

    /// Send `method path` with an optional JSON body and return the reply
    /// whatever its status; panics if the exchange fails or takes longer
    /// than [`API_TIMEOUT`].
    pub fn raw(&self, method: &str, path: &str, body: Option<Value>) -> Reply {
        let client = self.client.clone();
        let (m, p) = (method.to_owned(), path.to_owned());
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(client.request(&m, &p, body.as_ref()));
        });
        match rx.recv_timeout(API_TIMEOUT) {
            Ok(Ok(r)) => Reply {
                status: r.status,
                body: r.body,
            },
            Ok(Err(e)) => panic!("{method} {path}: API call failed: {e}"),
            Err(_) => panic!("{method} {path}: no answer within {API_TIMEOUT:?}"),
        }
    }

    /// Send raw body bytes (which need not be JSON) on a connection of its
    /// own; returns the status and the body text.
    pub fn raw_bytes(&self, method: &str, path: &str, body: &[u8]) -> (u16, String) {
        let mut s = UnixStream::connect(&self.socket).expect("cannot connect to api.sock");
        s.set_read_timeout(Some(API_TIMEOUT))
            .expect("set_read_timeout");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).expect("cannot send request");
        // A server may answer (413, 400) and close before it has read a
        // large body; the answer is still there to read.
        let sent = s.write_all(body);
        let mut resp = Vec::new();
        if let Err(e) = s.read_to_end(&mut resp) {
            assert!(
                !resp.is_empty(),
                "cannot read response: {e} (send: {sent:?})"
            );
        }
        let resp = String::from_utf8_lossy(&resp).into_owned();
        let status = resp
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("not an HTTP response: {resp:?}"));
        let body = resp
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (status, body)
    }

    /// `GET path`: status and the raw body (a picture).
    pub fn get_bytes(&self, path: &str) -> (u16, Vec<u8>) {
        self.client
            .get_bytes(path)
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    }

    /// Call a route whose success status is `ok`, parsing its answer.
    fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
        ok: u16,
    ) -> Answer<T> {
        let r = self.raw(method, path, body);
        if r.status != ok {
            return Err(r);
        }
        Ok(serde_json::from_value(r.body.clone()).unwrap_or_else(|e| {
            panic!(
                "{method} {path}: the answer is not a {}: {e}: {r}",
                std::any::type_name::<T>()
            )
        }))
    }
}
