//! The tests' client of the REST API, typed on `proto::api`.
//!
//! Requests are built from the types the server parses ([`CreateVm`],
//! [`ExecRequest`], [`ForkRequest`], [`CreateSnapshot`], ...) and answers
//! parsed into the types it answers with ([`VmInfo`], [`ForkResponse`],
//! [`Sources`], [`SnapshotCreated`], ...), so a test and the server cannot
//! disagree about a field's name or type without the test failing to
//! build or to parse.
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
//! its own and returns the status and the body text.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use proto::api::{
    AccessMap, CloneVm, ClonedVms, CreateListener, CreateSnapshot, CreateVm, CreateVolume,
    CreateVolumeSnapshot, Deleted, ExecRequest, ExecResponse, ExportVolume, ExportedVolume,
    ForkRequest, ForkResponse, Health, ImportVolume, ImportedVolume, Invariant, ListenerDeleted,
    ListenerInfo, ListenerList, MemorySource, PageInfo, PageMap, RollbackVm, RollbackVolume,
    RunState, SnapshotCreated, SnapshotDeleted, SnapshotInfo, SnapshotList, SnapshotMode, Sources,
    Tree, TreeNode, VmDeleted, VmInfo, VmKind, VmList, VmRolledBack, VolumeInfo, VolumeRollback,
    VolumeSnapshotInfo,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use uffdctl::client::Client;

/// How long one API call may take before the test fails instead of hanging.
pub const API_TIMEOUT: Duration = Duration::from_secs(120);

/// An answer as the server sent it: its status and JSON body (`Null` when
/// empty).
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

impl Reply {
    /// The `error` message of an error body ("" if there is none).
    pub fn error(&self) -> &str {
        self.body["error"].as_str().unwrap_or_default()
    }
}

impl Reply {
    /// Assert this is a refusal with status `want` whose `error` message
    /// mentions `needle` (case-insensitively); `what` names the request in
    /// the panic. Returns the message.
    pub fn assert_error(&self, want: u16, needle: &str, what: &str) -> String {
        assert_eq!(
            self.status, want,
            "{what}: expected {want}, got {}: {}",
            self.status, self.body
        );
        let msg = self.body["error"]
            .as_str()
            .unwrap_or_else(|| panic!("{what}: error body without \"error\": {}", self.body))
            .to_owned();
        assert!(
            msg.to_lowercase().contains(&needle.to_lowercase()),
            "{what}: error message {msg:?} does not mention {needle:?}"
        );
        msg
    }
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.body)
    }
}

/// A route's typed answer, or the reply when its status is not the
/// route's success status.
pub type Answer<T> = Result<T, Reply>;

/// A request body from its `proto::api` type.
pub fn body<T: Serialize>(req: &T) -> Value {
    serde_json::to_value(req).unwrap_or_else(|e| panic!("cannot encode a request body: {e}"))
}

/// `POST /v1/vms` for `memory_mib` MiB of zeroes, everything else the
/// server's default (the body `{"memory_mib": N}`); change fields with
/// `CreateVm { memory_source: ..., ..new_vm(8) }`.
pub fn new_vm(memory_mib: u64) -> CreateVm {
    CreateVm {
        memory_mib,
        from_snapshot: None,
        vcpus: 1,
        memory_source: None,
        volume: None,
        fault_around_kib: None,
        readahead_kib: None,
        prefetch: false,
        hugepages: None,
    }
}

/// `POST /v1/vms` restoring snapshot `name` (the body `{"from_snapshot": NAME}`).
pub fn from_snapshot(name: &str) -> CreateVm {
    CreateVm {
        from_snapshot: Some(name.to_owned()),
        ..new_vm(0)
    }
}

/// A raw image file as a memory source.
pub fn file_source(path: impl AsRef<Path>) -> MemorySource {
    MemorySource::File {
        path: utf8(path.as_ref()),
    }
}

/// A compressed `memory.zst` image as a memory source.
pub fn zstd_source(path: impl AsRef<Path>) -> MemorySource {
    MemorySource::Zstd {
        path: utf8(path.as_ref()),
    }
}

/// A listener on `socket` serving `memory_source`, everything else the
/// server's default.
pub fn new_listener(socket: impl AsRef<Path>, memory_source: MemorySource) -> CreateListener {
    CreateListener {
        socket: utf8(socket.as_ref()),
        memory_source,
        fault_around_kib: None,
        readahead_kib: None,
        working_set: false,
    }
}

/// The number of VM id `vm-N`.
pub fn vm_num(id: &str) -> u64 {
    id.strip_prefix("vm-")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("not a VM id: {id}"))
}

fn utf8(path: &Path) -> String {
    path.to_str()
        .unwrap_or_else(|| panic!("{} is not UTF-8", path.display()))
        .to_owned()
}

/// Guest agent ops as [`ExecRequest`]s, each over an explicit range.
pub mod op {
    use proto::api::ExecRequest;

    /// `fill` pages `[start, start+pages)` with `seed`'s pattern.
    pub fn fill(start: u64, pages: u64, seed: u64) -> ExecRequest {
        ExecRequest::Fill {
            start_page: Some(start),
            pages: Some(pages),
            seed,
        }
    }

    /// `touch` (read, or rewrite unchanged) pages `[start, start+pages)`.
    pub fn touch(start: u64, pages: u64, write: bool) -> ExecRequest {
        ExecRequest::Touch {
            start_page: Some(start),
            pages: Some(pages),
            write,
        }
    }

    /// `verify` pages `[start, start+pages)` against `seed`'s pattern.
    pub fn verify(start: u64, pages: u64, seed: u64) -> ExecRequest {
        ExecRequest::Verify {
            start_page: Some(start),
            pages: Some(pages),
            seed,
        }
    }

    /// The guest's `checksum` of `[start, start+pages)`.
    pub fn checksum(start: u64, pages: u64) -> ExecRequest {
        ExecRequest::Checksum {
            start_page: Some(start),
            pages: Some(pages),
        }
    }

    /// The VMM's `digest` of `[start, start+pages)`.
    pub fn digest(start: u64, pages: u64) -> ExecRequest {
        ExecRequest::Digest {
            start_page: Some(start),
            pages: Some(pages),
        }
    }

    /// The VM's id, read by the guest from an I/O port.
    pub fn identity() -> ExecRequest {
        ExecRequest::Identity {}
    }

    /// `disk_fill` `count` sectors from `sector` with `seed`'s pattern.
    pub fn disk_fill(sector: u64, count: u64, seed: u64) -> ExecRequest {
        ExecRequest::DiskFill {
            sector,
            count,
            seed,
            sectors_per_io: None,
        }
    }

    /// `disk_checksum` of `count` sectors from `sector`.
    pub fn disk_checksum(sector: u64, count: u64) -> ExecRequest {
        ExecRequest::DiskChecksum {
            sector,
            count,
            sectors_per_io: None,
        }
    }

    /// `disk_write_pages`: guest pages `[start, start+pages)` to the disk
    /// from `sector` on.
    pub fn disk_write_pages(start: u64, pages: u64, sector: u64) -> ExecRequest {
        ExecRequest::DiskWritePages {
            start_page: Some(start),
            pages: Some(pages),
            sector,
            sectors_per_io: None,
        }
    }
}

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

    // ------------------------------------------------------------ raw --

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

    // ------------------------------------------------------------ VMs --

    /// `POST /v1/vms` (201).
    pub fn try_create_vm(&self, req: &CreateVm) -> Answer<VmInfo> {
        let vm: VmInfo = self.call("POST", "/v1/vms", Some(body(req)), 201)?;
        if let Some(pid) = vm.pid {
            self.vmm_pids
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(pid);
        }
        Ok(vm)
    }

    /// Create a VM; panics unless the answer is 201. Returns its id.
    pub fn create_vm(&self, req: &CreateVm) -> String {
        self.try_create_vm(req)
            .unwrap_or_else(|r| panic!("POST /v1/vms {} failed: {r}", body(req)))
            .id
    }

    /// Create a VM from snapshot `name`; returns its id.
    pub fn restore(&self, name: &str) -> String {
        self.create_vm(&from_snapshot(name))
    }

    /// `GET /v1/vms/{id}` (200).
    pub fn try_vm(&self, id: &str) -> Answer<VmInfo> {
        self.call("GET", &format!("/v1/vms/{id}"), None, 200)
    }

    /// `GET /v1/vms/{id}`; panics unless 200.
    pub fn vm(&self, id: &str) -> VmInfo {
        self.try_vm(id)
            .unwrap_or_else(|r| panic!("GET {id} failed: {r}"))
    }

    /// `GET /v1/vms`.
    pub fn vms(&self) -> Vec<VmInfo> {
        let list: VmList = self
            .call("GET", "/v1/vms", None, 200)
            .unwrap_or_else(|r| panic!("GET /v1/vms failed: {r}"));
        list.vms
    }

    /// Ids listed by `GET /v1/vms`.
    pub fn vm_ids(&self) -> Vec<String> {
        self.vms().into_iter().map(|vm| vm.id).collect()
    }

    /// `DELETE /v1/vms/{id}` (200).
    pub fn try_delete_vm(&self, id: &str) -> Answer<VmDeleted> {
        self.call("DELETE", &format!("/v1/vms/{id}"), None, 200)
    }

    /// Delete a VM; panics unless 200 and `deleted`.
    pub fn delete_vm(&self, id: &str) -> VmDeleted {
        let d = self
            .try_delete_vm(id)
            .unwrap_or_else(|r| panic!("DELETE {id} failed: {r}"));
        assert!(d.deleted, "DELETE {id}: {d:?}");
        d
    }

    /// `POST /v1/vms/{id}/pause` (200).
    pub fn try_pause(&self, id: &str) -> Answer<VmInfo> {
        self.call("POST", &format!("/v1/vms/{id}/pause"), None, 200)
    }

    /// Pause a VM's vCPUs; panics unless 200.
    pub fn pause(&self, id: &str) -> VmInfo {
        self.try_pause(id)
            .unwrap_or_else(|r| panic!("pause of {id} failed: {r}"))
    }

    /// `POST /v1/vms/{id}/resume` (200).
    pub fn try_resume(&self, id: &str) -> Answer<VmInfo> {
        self.call("POST", &format!("/v1/vms/{id}/resume"), None, 200)
    }

    /// Resume a VM's vCPUs; panics unless 200.
    pub fn resume(&self, id: &str) -> VmInfo {
        self.try_resume(id)
            .unwrap_or_else(|r| panic!("resume of {id} failed: {r}"))
    }

    /// Poll `GET /v1/vms/{id}` until its state is `state`; panics after
    /// `within`. Returns the last answer.
    pub fn wait_state(&self, id: &str, state: RunState, within: Duration) -> VmInfo {
        let deadline = Instant::now() + within;
        loop {
            let v = self.vm(id);
            if v.state == state {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{id} did not become {state} within {within:?}: {v:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The pid of VM `id`'s VMM; panics if it has none.
    pub fn vmm_pid(&self, id: &str) -> u32 {
        let vm = self.vm(id);
        vm.pid.unwrap_or_else(|| panic!("no pid in {vm:?}"))
    }

    /// 4 KiB pages per unit the server installs, protects and tracks for
    /// VM `id`: 512 on hugepage guest RAM, else 1.
    pub fn unit_pages(&self, id: &str) -> u64 {
        if self.vm(id).hugepages {
            512
        } else {
            1
        }
    }

    /// Firecracker VMs listed by `GET /v1/vms`.
    pub fn firecracker_vms(&self) -> Vec<VmInfo> {
        self.vms()
            .into_iter()
            .filter(|vm| vm.kind == VmKind::Firecracker)
            .collect()
    }

    /// The Firecracker VM of client process `pid`, if listed.
    pub fn firecracker_vm(&self, pid: u32) -> Option<VmInfo> {
        self.firecracker_vms()
            .into_iter()
            .find(|vm| vm.pid == Some(pid))
    }

    /// Wait until client process `pid` shows up as a Firecracker VM;
    /// panics after `within`. Returns the VM.
    pub fn wait_firecracker_vm(&self, pid: u32, within: Duration) -> VmInfo {
        crate::host::wait_until(
            &format!("fc_client pid {pid} in GET /v1/vms"),
            within,
            || self.firecracker_vm(pid),
        )
    }

    /// Wait until no Firecracker VM of client process `pid` is listed;
    /// panics after `within`.
    pub fn wait_firecracker_vm_gone(&self, pid: u32, within: Duration) {
        crate::host::wait_until(
            &format!("fc_client pid {pid} to leave GET /v1/vms"),
            within,
            || self.firecracker_vm(pid).is_none().then_some(()),
        );
    }

    // ------------------------------------------------------- guest ops --

    /// `POST /v1/vms/{id}/exec` (200).
    pub fn try_exec(&self, id: &str, req: &ExecRequest) -> Answer<ExecResponse> {
        self.call("POST", &format!("/v1/vms/{id}/exec"), Some(body(req)), 200)
    }

    /// Run a guest op; panics unless the answer is 200. Returns its result.
    pub fn exec(&self, id: &str, req: &ExecRequest) -> u64 {
        self.try_exec(id, req)
            .unwrap_or_else(|r| panic!("exec {} on {id} failed: {r}", body(req)))
            .result
    }

    /// `fill` pages `[start, start+pages)` of `id` with `seed`'s pattern.
    pub fn fill(&self, id: &str, start: u64, pages: u64, seed: u64) {
        let r = self.exec(id, &op::fill(start, pages, seed));
        assert_eq!(r, 0, "fill on {id} returned {r}");
    }

    /// `touch` (read, or rewrite unchanged) pages `[start, start+pages)`.
    pub fn touch(&self, id: &str, start: u64, pages: u64, write: bool) {
        self.exec(id, &op::touch(start, pages, write));
    }

    /// Pages of `[start, start+pages)` whose fill words differ from `seed`'s.
    pub fn verify(&self, id: &str, start: u64, pages: u64, seed: u64) -> u64 {
        self.exec(id, &op::verify(start, pages, seed))
    }

    /// The guest's checksum of `[start, start+pages)`.
    pub fn checksum(&self, id: &str, start: u64, pages: u64) -> u64 {
        self.exec(id, &op::checksum(start, pages))
    }

    /// The VMM's digest of `[start, start+pages)`.
    pub fn digest(&self, id: &str, start: u64, pages: u64) -> u64 {
        self.exec(id, &op::digest(start, pages))
    }

    /// The VM's id as its guest reads it.
    pub fn identity(&self, id: &str) -> u64 {
        self.exec(id, &op::identity())
    }

    // ------------------------------------------------------------ fork --

    /// `POST /v1/vms/{id}/fork` (201).
    pub fn try_fork(&self, id: &str, req: &ForkRequest) -> Answer<ForkResponse> {
        self.call("POST", &format!("/v1/vms/{id}/fork"), Some(body(req)), 201)
    }

    /// Fork `id` into `count` children; panics unless 201 with `count`
    /// children. Returns the whole answer.
    pub fn fork(&self, id: &str, count: u32) -> ForkResponse {
        let f = self
            .try_fork(id, &ForkRequest { count })
            .unwrap_or_else(|r| panic!("fork of {id} (count {count}) failed: {r}"));
        assert_eq!(
            f.children.len(),
            usize::try_from(count).expect("fits"),
            "fork answer: {f:?}"
        );
        f
    }

    /// Fork `id` into one child; returns the child's id.
    pub fn fork_one(&self, id: &str) -> String {
        self.fork(id, 1).children.remove(0)
    }

    // ---------------------------------------------------- debug views --

    /// `GET /v1/vms/{id}/sources` (200).
    pub fn try_sources(&self, id: &str) -> Answer<Sources> {
        self.call("GET", &format!("/v1/vms/{id}/sources"), None, 200)
    }

    /// Where `id`'s pages come from; panics unless 200.
    pub fn sources(&self, id: &str) -> Sources {
        self.try_sources(id)
            .unwrap_or_else(|r| panic!("sources of {id} failed: {r}"))
    }

    /// `by_source` of `id` (absent sources are simply missing).
    pub fn by_source(&self, id: &str) -> BTreeMap<String, u64> {
        self.sources(id).by_source
    }

    /// The coalesced extents of `id` as `(start, pages, source)`.
    pub fn extents(&self, id: &str) -> Vec<(u64, u64, String)> {
        self.sources(id)
            .extents
            .into_iter()
            .map(|e| (e.start_page, e.pages, e.source))
            .collect()
    }

    /// `GET /v1/vms/{id}/pages/{page}` (200).
    pub fn try_page(&self, id: &str, page: u64) -> Answer<PageInfo> {
        self.call("GET", &format!("/v1/vms/{id}/pages/{page}"), None, 200)
    }

    /// One page's source and presence; panics unless 200.
    pub fn page(&self, id: &str, page: u64) -> PageInfo {
        self.try_page(id, page)
            .unwrap_or_else(|r| panic!("page {page} of {id} failed: {r}"))
    }

    /// `GET /v1/vms/{id}/pages/{page}?explain=true`: the page with its
    /// whole chain; panics unless 200.
    pub fn explain(&self, id: &str, page: u64) -> PageInfo {
        self.call(
            "GET",
            &format!("/v1/vms/{id}/pages/{page}?explain=true"),
            None,
            200,
        )
        .unwrap_or_else(|r| panic!("explain of page {page} of {id} failed: {r}"))
    }

    /// `GET /v1/tree`; panics unless 200.
    pub fn tree(&self) -> Tree {
        self.call("GET", "/v1/tree", None, 200)
            .unwrap_or_else(|r| panic!("tree failed: {r}"))
    }

    /// The `/v1/tree` node of `id`, if listed.
    pub fn tree_node(&self, id: &str) -> Option<TreeNode> {
        self.tree().vms.into_iter().find(|n| n.id == id)
    }

    /// `GET /v1/debug/invariant`; panics unless 200.
    pub fn invariant(&self) -> Invariant {
        self.call("GET", "/v1/debug/invariant", None, 200)
            .unwrap_or_else(|r| panic!("invariant check failed: {r}"))
    }

    /// Assert the table invariant holds (`when` says at what point).
    pub fn assert_invariant(&self, when: &str) {
        let v = self.invariant();
        assert!(v.ok, "table invariant violated {when}: {v:?}");
    }

    // ------------------------------------------------------- observing --

    /// `GET /v1/vms/{id}/access[?within_ms=N]`; panics unless 200.
    pub fn access(&self, id: &str, within_ms: Option<u64>) -> AccessMap {
        let path = match within_ms {
            Some(ms) => format!("/v1/vms/{id}/access?within_ms={ms}"),
            None => format!("/v1/vms/{id}/access"),
        };
        self.call("GET", &path, None, 200)
            .unwrap_or_else(|r| panic!("GET {path} failed: {r}"))
    }

    /// `DELETE /v1/vms/{id}/access`: begin the record again; panics unless
    /// 200. Returns the record as it was.
    pub fn reset_access(&self, id: &str) -> AccessMap {
        self.call("DELETE", &format!("/v1/vms/{id}/access"), None, 200)
            .unwrap_or_else(|r| panic!("reset of {id}'s access record failed: {r}"))
    }

    /// `GET /v1/vms/{id}/map[?cells=N]`; panics unless 200.
    pub fn map(&self, id: &str, cells: Option<u64>) -> PageMap {
        let path = match cells {
            Some(n) => format!("/v1/vms/{id}/map?cells={n}"),
            None => format!("/v1/vms/{id}/map"),
        };
        self.call("GET", &path, None, 200)
            .unwrap_or_else(|r| panic!("GET {path} failed: {r}"))
    }

    /// `GET /v1/vms/{id}/faults?...`: read the live trace's lines until
    /// `line` returns false or the stream ends. A status other than 2xx is
    /// returned as its reply.
    pub fn trace(&self, path: &str, line: impl FnMut(&str) -> bool) -> Option<Reply> {
        self.client
            .stream_lines(path, line)
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
            .map(|r| Reply {
                status: r.status,
                body: r.body,
            })
    }

    /// `GET /v1/health`; panics unless 200.
    pub fn health(&self) -> Health {
        self.call("GET", "/v1/health", None, 200)
            .unwrap_or_else(|r| panic!("health check failed: {r}"))
    }

    /// Check `/v1/health` answers 200 with status `ok`.
    pub fn assert_healthy(&self) {
        let h = self.health();
        assert_eq!(h.status, "ok", "health check body: {h:?}");
    }

    /// The text of `GET /metrics`; panics unless 200.
    pub fn metrics_text(&self) -> String {
        let (status, text) = self.raw_bytes("GET", "/metrics", b"");
        assert_eq!(status, 200, "GET /metrics: {text}");
        text
    }

    /// The value of the first `GET /metrics` line that starts with
    /// `series` (a name, optionally with labels), if it is an integer.
    pub fn metric(&self, series: &str) -> Option<u64> {
        self.metrics_text()
            .lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    /// VMMs ready in the server's warm pool (`--vmm-pool`).
    pub fn pool_ready(&self) -> u64 {
        self.metric("pagefork_vmm_pool{state=\"ready\"}")
            .unwrap_or(0)
    }

    // ------------------------------------------------------- listeners --

    /// `POST /v1/firecracker/listeners` (201).
    pub fn try_add_listener(&self, req: &CreateListener) -> Answer<ListenerInfo> {
        self.call("POST", "/v1/firecracker/listeners", Some(body(req)), 201)
    }

    /// Add a Firecracker listener; panics unless 201.
    pub fn add_listener(&self, req: &CreateListener) -> ListenerInfo {
        self.try_add_listener(req)
            .unwrap_or_else(|r| panic!("listener {} failed: {r}", body(req)))
    }

    /// `GET /v1/firecracker/listeners`; panics unless 200.
    pub fn listeners(&self) -> Vec<ListenerInfo> {
        let l: ListenerList = self
            .call("GET", "/v1/firecracker/listeners", None, 200)
            .unwrap_or_else(|r| panic!("listing listeners failed: {r}"));
        l.listeners
    }

    /// Listener `id` as listed; panics if it is not.
    pub fn listener(&self, id: &str) -> ListenerInfo {
        self.listeners()
            .into_iter()
            .find(|l| l.id == id)
            .unwrap_or_else(|| panic!("listener {id} is not listed"))
    }

    /// `DELETE /v1/firecracker/listeners/{id}` (200).
    pub fn try_delete_listener(&self, id: &str) -> Answer<ListenerDeleted> {
        self.call(
            "DELETE",
            &format!("/v1/firecracker/listeners/{id}"),
            None,
            200,
        )
    }

    /// Delete a listener; panics unless 200.
    pub fn delete_listener(&self, id: &str) -> ListenerDeleted {
        self.try_delete_listener(id)
            .unwrap_or_else(|r| panic!("DELETE listener {id} failed: {r}"))
    }

    // ------------------------------------------------------- snapshots --

    /// `POST /v1/vms/{vm}/snapshots` (201).
    pub fn try_snapshot(&self, vm: &str, req: &CreateSnapshot) -> Answer<SnapshotCreated> {
        self.call(
            "POST",
            &format!("/v1/vms/{vm}/snapshots"),
            Some(body(req)),
            201,
        )
    }

    /// Snapshot `vm` as `name` in `mode`; panics unless 201.
    pub fn snapshot(&self, vm: &str, name: &str, mode: SnapshotMode) -> SnapshotCreated {
        self.try_snapshot(
            vm,
            &CreateSnapshot {
                name: name.to_owned(),
                mode,
                compress: false,
            },
        )
        .unwrap_or_else(|r| panic!("snapshot {name} of {vm}: {r}"))
    }

    /// `GET /v1/snapshots`; panics unless 200.
    pub fn snapshots(&self) -> SnapshotList {
        self.call("GET", "/v1/snapshots", None, 200)
            .unwrap_or_else(|r| panic!("GET /v1/snapshots failed: {r}"))
    }

    /// `GET /v1/snapshots/{name}` (200).
    pub fn try_snapshot_info(&self, name: &str) -> Answer<SnapshotInfo> {
        self.call("GET", &format!("/v1/snapshots/{name}"), None, 200)
    }

    /// Snapshot `name`; panics unless 200.
    pub fn snapshot_info(&self, name: &str) -> SnapshotInfo {
        self.try_snapshot_info(name)
            .unwrap_or_else(|r| panic!("GET snapshot {name} failed: {r}"))
    }

    /// `DELETE /v1/snapshots/{name}` (200).
    pub fn try_delete_snapshot(&self, name: &str) -> Answer<SnapshotDeleted> {
        self.call("DELETE", &format!("/v1/snapshots/{name}"), None, 200)
    }

    /// Delete snapshot `name`; panics unless 200.
    pub fn delete_snapshot(&self, name: &str) -> SnapshotDeleted {
        self.try_delete_snapshot(name)
            .unwrap_or_else(|r| panic!("DELETE snapshot {name} failed: {r}"))
    }

    /// `POST /v1/vms/{vm}/rollback` (200).
    pub fn try_rollback(&self, vm: &str, snapshot: &str) -> Answer<VmRolledBack> {
        let req = RollbackVm {
            snapshot: snapshot.to_owned(),
        };
        self.call(
            "POST",
            &format!("/v1/vms/{vm}/rollback"),
            Some(body(&req)),
            200,
        )
    }

    /// Roll `vm` back to `snapshot`; panics unless 200.
    pub fn rollback(&self, vm: &str, snapshot: &str) -> VmRolledBack {
        self.try_rollback(vm, snapshot)
            .unwrap_or_else(|r| panic!("rollback of {vm} to {snapshot} failed: {r}"))
    }

    /// `POST /v1/vms/{vm}/clone` (201).
    pub fn try_clone_vm(&self, vm: &str, req: &CloneVm) -> Answer<ClonedVms> {
        self.call("POST", &format!("/v1/vms/{vm}/clone"), Some(body(req)), 201)
    }

    /// Clone `vm` `count` times; panics unless 201.
    pub fn clone_vm(&self, vm: &str, count: u32, concurrency: u32) -> ClonedVms {
        self.try_clone_vm(vm, &CloneVm { count, concurrency })
            .unwrap_or_else(|r| panic!("clone of {vm} (count {count}) failed: {r}"))
    }

    // --------------------------------------------------------- volumes --

    /// `POST /v1/volumes` (201).
    pub fn try_create_volume(&self, req: &CreateVolume) -> Answer<VolumeInfo> {
        self.call("POST", "/v1/volumes", Some(body(req)), 201)
    }

    /// Create an empty volume of `size_mib`; panics unless 201.
    pub fn create_volume(&self, name: &str, size_mib: u64) -> VolumeInfo {
        self.try_create_volume(&CreateVolume {
            name: name.to_owned(),
            size_mib: Some(size_mib),
            from_snapshot: None,
        })
        .unwrap_or_else(|r| panic!("volume {name} failed: {r}"))
    }

    /// `GET /v1/volumes`; panics unless 200.
    pub fn volumes(&self) -> Vec<VolumeInfo> {
        self.call("GET", "/v1/volumes", None, 200)
            .unwrap_or_else(|r| panic!("GET /v1/volumes failed: {r}"))
    }

    /// `GET /v1/volumes/{name}` (200).
    pub fn try_volume(&self, name: &str) -> Answer<VolumeInfo> {
        self.call("GET", &format!("/v1/volumes/{name}"), None, 200)
    }

    /// `DELETE /v1/volumes/{name}` (200).
    pub fn try_delete_volume(&self, name: &str) -> Answer<Deleted> {
        self.call("DELETE", &format!("/v1/volumes/{name}"), None, 200)
    }

    /// `POST /v1/volumes/{volume}/snapshots` (201).
    pub fn try_snapshot_volume(&self, volume: &str, name: &str) -> Answer<VolumeSnapshotInfo> {
        let req = CreateVolumeSnapshot {
            name: name.to_owned(),
        };
        self.call(
            "POST",
            &format!("/v1/volumes/{volume}/snapshots"),
            Some(body(&req)),
            201,
        )
    }

    /// Snapshot `volume` as `name`; panics unless 201.
    pub fn snapshot_volume(&self, volume: &str, name: &str) -> VolumeSnapshotInfo {
        self.try_snapshot_volume(volume, name)
            .unwrap_or_else(|r| panic!("snapshot {name} of volume {volume} failed: {r}"))
    }

    /// `GET /v1/volume-snapshots/{name}` (200).
    pub fn try_volume_snapshot(&self, name: &str) -> Answer<VolumeSnapshotInfo> {
        self.call("GET", &format!("/v1/volume-snapshots/{name}"), None, 200)
    }

    /// `POST /v1/volumes/{volume}/rollback` (200).
    pub fn try_rollback_volume(
        &self,
        volume: &str,
        req: &RollbackVolume,
    ) -> Answer<VolumeRollback> {
        self.call(
            "POST",
            &format!("/v1/volumes/{volume}/rollback"),
            Some(body(req)),
            200,
        )
    }

    /// `POST /v1/volumes/import` (201).
    pub fn try_import_volume(&self, req: &ImportVolume) -> Answer<ImportedVolume> {
        self.call("POST", "/v1/volumes/import", Some(body(req)), 201)
    }

    /// `POST /v1/volumes/{volume}/export` (200).
    pub fn try_export_volume(&self, volume: &str, req: &ExportVolume) -> Answer<ExportedVolume> {
        self.call(
            "POST",
            &format!("/v1/volumes/{volume}/export"),
            Some(body(req)),
            200,
        )
    }
}

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
