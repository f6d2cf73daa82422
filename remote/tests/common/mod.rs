//! What the store tests share: the real store (Ceph RGW, `ceph.rs`, which
//! the end-to-end tests include too), clients of fresh locations in it, and
//! snapshot directories laid out as uffd-server writes them.
#![allow(dead_code)]
// Test data: page and chunk indices become seed bytes, wrapping on purpose.
#![allow(clippy::cast_possible_truncation)]

mod ceph;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pagefork_remote::{Remote, RemoteConfig, Tuning, CHUNK_BYTES};
use proto::snapshot::{Algorithm, FileSum, StateFile, MEMORY_FILE};

pub use ceph::{store, Store};

impl Store {
    /// A configuration for `url` with `tuning`.
    pub fn config(&self, url: &str, tuning: Tuning) -> RemoteConfig {
        let mut c = RemoteConfig::from_lookup(url, |k| self.env.get(k).cloned())
            .expect("the store's environment makes a configuration");
        c.tuning = tuning;
        c
    }

    /// A client of a fresh location.
    pub fn remote(&self, test: &str) -> Remote {
        self.remote_with(test, Tuning::default())
    }

    pub fn remote_with(&self, test: &str, tuning: Tuning) -> Remote {
        Remote::new(self.config(&self.fresh_url(test), tuning)).expect("client")
    }

    /// The RGW process id of our cluster.
    pub fn rgw_pid(&self) -> Option<i32> {
        let dir = self.ceph_dir.as_ref()?;
        fs::read_to_string(dir.join("run/rgw.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

/// A multi-threaded runtime for a test.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The bytes of page `p` of a test image with `seed`: compressible like
/// guest memory, different for each seed and each page of a chunk, the
/// same at the same place of every chunk (so chunks can repeat).
pub fn page_bytes(p: u64, seed: u8) -> Vec<u8> {
    let in_chunk = p % (CHUNK_BYTES / 4096);
    let mut b = vec![0u8; 4096];
    for (i, x) in b.iter_mut().enumerate() {
        *x = ((in_chunk as usize * 31 + i / 64) as u8) ^ seed.wrapping_mul(7);
    }
    b[0] = seed;
    b[8..16].copy_from_slice(&in_chunk.to_le_bytes());
    b
}

/// The XXH3-128 checksums of `path` as state.json has them.
pub fn sum_of(path: &Path) -> FileSum {
    let bytes = fs::read(path).expect("read image");
    let chunks: Vec<String> = bytes
        .chunks(CHUNK_BYTES as usize)
        .map(pagefork_remote::digest)
        .collect();
    let raw: Vec<u8> = chunks
        .iter()
        .flat_map(|c| u128::from_str_radix(c, 16).expect("hex").to_be_bytes())
        .collect();
    FileSum {
        bytes: bytes.len() as u64,
        algorithm: Algorithm::Xxh3,
        digest: pagefork_remote::digest(&raw),
        chunks,
    }
}

/// A snapshot directory `parent/name` with `memory_bytes` of memory whose
/// page `p` holds `page_bytes(p, seed)` where `data(p)` gives `Some(seed)`
/// (a hole elsewhere), and `state.json` as uffd-server writes it.
pub fn make_snapshot(
    parent: &Path,
    name: &str,
    memory_bytes: u64,
    data: &dyn Fn(u64) -> Option<u8>,
    volume_snapshot: Option<&str>,
) -> PathBuf {
    let dir = parent.join(name);
    fs::create_dir_all(&dir).expect("mkdir");
    let img = dir.join(MEMORY_FILE);
    let f = fs::File::create(&img).expect("create image");
    f.set_len(memory_bytes).expect("size");
    for p in 0..memory_bytes / 4096 {
        if let Some(seed) = data(p) {
            f.write_all_at(&page_bytes(p, seed), p * 4096)
                .expect("write page");
        }
    }
    f.sync_all().expect("sync");
    let state = StateFile {
        format_version: proto::snapshot::FORMAT_VERSION,
        name: name.to_owned(),
        vm: "vm-1".into(),
        mode: proto::api::SnapshotMode::Full,
        parent: None,
        created: 1_767_225_600,
        memory_bytes,
        page_size: 4096,
        hugepages: false,
        vm_state: shared::VmState {
            vcpus: vec![shared::VcpuState {
                regs: vec![1; 144],
                ..Default::default()
            }],
            devices: vec![7; 100],
        },
        volume_snapshot: volume_snapshot.map(str::to_owned),
        files: BTreeMap::from([(MEMORY_FILE.to_owned(), sum_of(&img))]),
        origin: None,
    };
    fs::write(
        dir.join("state.json"),
        serde_json::to_vec_pretty(&state).expect("encode"),
    )
    .expect("write state.json");
    dir
}

/// A sparse file of `len` bytes with data where `data(page)` says.
pub fn make_file(path: &Path, len: u64, data: &dyn Fn(u64) -> Option<u8>) {
    let f = fs::File::create(path).expect("create");
    f.set_len(len).expect("size");
    for p in 0..len.div_ceil(4096) {
        if let Some(seed) = data(p) {
            let b = page_bytes(p, seed);
            let n = (len - p * 4096).min(4096) as usize;
            f.write_all_at(&b[..n], p * 4096).expect("write");
        }
    }
}

/// Ignore progress.
pub fn quiet(_: &pagefork_remote::Progress) {}

/// A bound on a step that must not hang: a test fails instead.
pub const HANG: Duration = Duration::from_secs(120);
