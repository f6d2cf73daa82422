//! What the server shows of a VM's memory: sources, pages, the fork tree,
//! the table invariant, access records, page maps and the live fault
//! trace; and the server's own health and metrics.

use std::collections::BTreeMap;

use proto::api::{AccessMap, Health, Invariant, PageInfo, PageMap, Sources, Tree, TreeNode};

use super::{Answer, Api, Reply};

impl Api {
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

    /// `POST /v1/vms/{id}/access/reset`: begin the record again; panics unless
    /// 200. Returns the record, empty.
    pub fn reset_access(&self, id: &str) -> AccessMap {
        self.call("POST", &format!("/v1/vms/{id}/access/reset"), None, 200)
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
}
