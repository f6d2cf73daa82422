//! The object store of the remote-snapshot tests (a real Ceph RGW) and a
//! second host to restore on.
//!
//! The store itself (found in the environment or booted) is
//! `remote/tests/common/ceph.rs`, which the `remote` crate's store tests
//! use too; this module adds what the end-to-end tests need of it.
//!
//! A second host ([`Netns`]) is a network namespace (`scripts/netns.sh`)
//! whose only link is a veth pair to this host, so a server run in it
//! reaches RGW over that link, as a server on another machine would.

use std::process::Command;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

#[path = "../../remote/tests/common/ceph.rs"]
mod ceph;
use ceph::repo;
pub use ceph::{store as require_store, Store};

/// Tests that stop RGW take it for writing; every other test of the store
/// for reading, so no test meets another's outage.
static OUTAGE: RwLock<()> = RwLock::new(());

impl Store {
    /// The server arguments and environment for store location `url`,
    /// reached at `endpoint` (default: the store's own).
    pub fn server_env(&self, endpoint: Option<&str>) -> Vec<(String, String)> {
        let mut env: Vec<(String, String)> = self
            .env
            .iter()
            .filter(|(k, _)| k.starts_with("AWS_"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if let Some(e) = endpoint {
            env.retain(|(k, _)| k != "AWS_ENDPOINT_URL");
            env.push(("AWS_ENDPOINT_URL".into(), e.to_owned()));
        }
        env
    }

    /// The RGW port of the endpoint.
    pub fn port(&self) -> u16 {
        self.env["AWS_ENDPOINT_URL"]
            .rsplit(':')
            .next()
            .and_then(|p| p.trim_end_matches('/').parse().ok())
            .expect("AWS_ENDPOINT_URL ends with a port")
    }

    /// Hold off outages for the caller's lifetime (every test of the
    /// store takes this, or [`Store::outage`]).
    pub fn shared(&self) -> RwLockReadGuard<'static, ()> {
        OUTAGE
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The right to stop RGW: no other test of the store runs meanwhile.
    pub fn outage(&self) -> RwLockWriteGuard<'static, ()> {
        OUTAGE
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The key of `rel` under location `url`.
    fn key(url: &str, rel: &str) -> Key {
        let prefix = url
            .trim_start_matches("s3://")
            .split_once('/')
            .map_or("", |(_, p)| p);
        Key::from(format!("{prefix}/{rel}"))
    }

    fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    /// The bytes of object `rel` under location `url`.
    pub fn get(&self, url: &str, rel: &str) -> Vec<u8> {
        let key = Self::key(url, rel);
        let raw = self.raw();
        Self::block_on(async move {
            raw.get(&key)
                .await
                .expect("GET object")
                .bytes()
                .await
                .expect("object bytes")
                .to_vec()
        })
    }

    /// Write object `rel` under location `url`.
    pub fn put(&self, url: &str, rel: &str, bytes: Vec<u8>) {
        let key = Self::key(url, rel);
        let raw = self.raw();
        Self::block_on(async move {
            raw.put(&key, PutPayload::from(bytes))
                .await
                .expect("PUT object");
        });
    }

    /// Keys (relative to `url`) of the objects under `url`/`dir`.
    pub fn list(&self, url: &str, dir: &str) -> Vec<String> {
        let key = Self::key(url, dir);
        let base = Self::key(url, "");
        let raw = self.raw();
        Self::block_on(async move {
            use futures_util::TryStreamExt;
            let metas: Vec<object_store::ObjectMeta> =
                raw.list(Some(&key)).try_collect().await.expect("LIST");
            metas
                .into_iter()
                .map(|m| {
                    m.location
                        .as_ref()
                        .trim_start_matches(base.as_ref())
                        .trim_start_matches('/')
                        .to_owned()
                })
                .collect()
        })
    }
}

/// A network namespace reaching this host (and RGW) over a veth pair,
/// made with `scripts/netns.sh`; deleted on drop.
#[derive(Debug)]
pub struct Netns {
    pub name: String,
    /// This host's address as the namespace reaches it.
    pub host_addr: String,
}

impl Netns {
    /// Make one for a test, or `None` (not root: the second host then
    /// shares this host's network).
    pub fn up(test: &str) -> Option<Self> {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("not root: the second host shares the first's network namespace");
            return None;
        }
        let name = format!("pf-{test}-{}", std::process::id());
        let out = Command::new(repo().join("scripts/netns.sh"))
            .args(["up", &name])
            .output()
            .expect("run scripts/netns.sh");
        assert!(
            out.status.success(),
            "scripts/netns.sh up {name} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let host_addr = String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("PAGEFORK_NETNS_HOST="))
            .expect("netns.sh prints PAGEFORK_NETNS_HOST")
            .trim()
            .to_owned();
        Some(Netns { name, host_addr })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new(repo().join("scripts/netns.sh"))
            .args(["down", &self.name])
            .status();
    }
}
