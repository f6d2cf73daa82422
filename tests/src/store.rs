//! The object store of the remote-snapshot tests (a real Ceph RGW) and a
//! second host to restore on.
//!
//! The store is the one in the environment (`AWS_ENDPOINT_URL`,
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `PAGEFORK_REMOTE`,
//! `PAGEFORK_CEPH_DIR`, as `eval "$(scripts/ceph.sh start)"` sets them;
//! `scripts/test.sh` does), or else one this test binary boots with
//! `scripts/ceph.sh` and stops at exit. Without Ceph the tests skip with
//! the reason, and fail under `CI=true`.
//!
//! A second host ([`Netns`]) is a network namespace (`scripts/netns.sh`)
//! whose only link is a veth pair to this host, so a server run in it
//! reaches RGW over that link, as a server on another machine would.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::SystemTime;

use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

/// The store the tests use.
#[derive(Debug)]
pub struct Store {
    pub env: HashMap<String, String>,
    /// The cluster's directory, when `scripts/ceph.sh` made it.
    pub ceph_dir: Option<PathBuf>,
}

static STORE: OnceLock<Option<Store>> = OnceLock::new();
static BOOTED: OnceLock<PathBuf> = OnceLock::new();
/// Tests that stop RGW take it for writing; every other test of the store
/// for reading, so no test meets another's outage.
static OUTAGE: RwLock<()> = RwLock::new(());

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

extern "C" fn stop_booted() {
    if let Some(dir) = BOOTED.get() {
        let _ = Command::new(repo().join("scripts/ceph.sh"))
            .arg("stop")
            .arg(dir)
            .status();
    }
}

fn skip_or_fail(why: &str) -> Option<Store> {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but the remote-snapshot tests cannot run: {why}");
    }
    eprintln!("skipping: {why}");
    None
}

fn parse_env(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn boot() -> Option<Store> {
    let keys = [
        "AWS_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "PAGEFORK_REMOTE",
    ];
    let env: HashMap<String, String> = keys
        .iter()
        .chain(&["AWS_REGION", "PAGEFORK_CEPH_DIR"])
        .filter_map(|k| std::env::var(k).ok().map(|v| ((*k).to_owned(), v)))
        .collect();
    if keys.iter().all(|k| env.contains_key(*k)) {
        let ceph_dir = env.get("PAGEFORK_CEPH_DIR").map(PathBuf::from);
        return Some(Store { env, ceph_dir });
    }
    if Command::new("radosgw").arg("--version").output().is_err() {
        return skip_or_fail(
            "no object store: set AWS_* and PAGEFORK_REMOTE (eval \"$(scripts/ceph.sh start)\") \
             or install Ceph (scripts/setup.sh)",
        );
    }
    let dir = std::env::temp_dir().join(format!("pagefork-ceph-e2e-{}", std::process::id()));
    eprintln!("booting Ceph for this test binary in {}", dir.display());
    let out = Command::new(repo().join("scripts/ceph.sh"))
        .arg("start")
        .arg(&dir)
        .output();
    let _ = BOOTED.set(dir.clone());
    // SAFETY: registering a plain extern "C" function with no captured state.
    unsafe {
        libc::atexit(stop_booted);
    }
    match out {
        Ok(o) if o.status.success() => Some(Store {
            env: parse_env(&String::from_utf8_lossy(&o.stdout)),
            ceph_dir: Some(dir),
        }),
        Ok(o) => skip_or_fail(&format!(
            "scripts/ceph.sh start failed: {}",
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => skip_or_fail(&format!("cannot run scripts/ceph.sh: {e}")),
    }
}

/// The store, or `None` (the test returns) when there is none to use.
pub fn require_store() -> Option<&'static Store> {
    STORE.get_or_init(boot).as_ref()
}

impl Store {
    /// A location `s3://BUCKET/PREFIX` no other test uses.
    pub fn fresh_url(&self, test: &str) -> String {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!(
            "{}/e2e-{test}-{}-{nanos:x}",
            self.env["PAGEFORK_REMOTE"].trim_end_matches('/'),
            std::process::id()
        )
    }

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

    /// Run `scripts/ceph.sh CMD` on the cluster; false if there is none of
    /// ours to act on (a store from the environment without its dir).
    pub fn ceph(&self, cmd: &str) -> bool {
        let Some(dir) = &self.ceph_dir else {
            return false;
        };
        let st = Command::new(repo().join("scripts/ceph.sh"))
            .arg(cmd)
            .arg(dir)
            .status()
            .expect("run scripts/ceph.sh");
        assert!(st.success(), "scripts/ceph.sh {cmd} failed");
        true
    }

    /// A raw client of the bucket, to read and damage objects behind the
    /// server's back.
    fn raw(&self) -> object_store::aws::AmazonS3 {
        let bucket = self.env["PAGEFORK_REMOTE"]
            .trim_start_matches("s3://")
            .split('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(bucket)
            .with_endpoint(&self.env["AWS_ENDPOINT_URL"])
            .with_region(
                self.env
                    .get("AWS_REGION")
                    .map_or("us-east-1", String::as_str),
            )
            .with_access_key_id(&self.env["AWS_ACCESS_KEY_ID"])
            .with_secret_access_key(&self.env["AWS_SECRET_ACCESS_KEY"])
            .with_allow_http(true)
            .build()
            .expect("raw client")
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
