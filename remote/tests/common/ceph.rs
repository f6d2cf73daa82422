//! The real object store of the remote-snapshot tests, shared by the
//! `remote` crate's store tests and the end-to-end tests (which include
//! this file by path): a one-node Ceph with RGW.
//!
//! The store is the one in the environment (`AWS_ENDPOINT_URL`,
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `PAGEFORK_REMOTE`,
//! `PAGEFORK_CEPH_DIR`, as `eval "$(scripts/ceph.sh start)"` sets them;
//! scripts/test.sh does), or else one the test binary boots with
//! scripts/ceph.sh and stops at exit. Without Ceph installed the tests skip
//! with the reason, and fail under `CI=true`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::SystemTime;

/// The store the tests use.
#[derive(Debug)]
pub struct Store {
    pub env: HashMap<String, String>,
    /// The cluster's directory, when scripts/ceph.sh made it.
    pub ceph_dir: Option<PathBuf>,
}

static STORE: OnceLock<Option<Store>> = OnceLock::new();
static BOOTED: OnceLock<PathBuf> = OnceLock::new();

pub fn repo() -> PathBuf {
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
            "no store: set AWS_* and PAGEFORK_REMOTE (eval \"$(scripts/ceph.sh start)\") \
             or install Ceph (scripts/setup.sh)",
        );
    }
    let dir = std::env::temp_dir().join(format!("pagefork-ceph-{}", std::process::id()));
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
        Ok(o) if o.status.success() => {
            let env = parse_env(&String::from_utf8_lossy(&o.stdout));
            Some(Store {
                env,
                ceph_dir: Some(dir),
            })
        }
        Ok(o) => skip_or_fail(&format!(
            "scripts/ceph.sh start failed: {}",
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => skip_or_fail(&format!("cannot run scripts/ceph.sh: {e}")),
    }
}

/// The store, or `None` (the test returns) when there is none to use.
pub fn store() -> Option<&'static Store> {
    STORE.get_or_init(boot).as_ref()
}

impl Store {
    /// A location `s3://BUCKET/PREFIX` no other test uses.
    pub fn fresh_url(&self, test: &str) -> String {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!(
            "{}/t-{test}-{}-{nanos:x}",
            self.env["PAGEFORK_REMOTE"].trim_end_matches('/'),
            std::process::id()
        )
    }

    /// A raw client of the bucket, to read and damage objects behind
    /// the code's back.
    pub fn raw(&self) -> object_store::aws::AmazonS3 {
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

    /// Run `scripts/ceph.sh CMD` on the cluster; false if there is none of
    /// ours to act on.
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
}
