//! The manifest of a snapshot in an object store: what a host needs to
//! restore the snapshot from the store's chunks, written after every chunk
//! it names (the commit point of a push), read by any host that pulls or
//! restores it. The store is shared with other hosts and other software,
//! so a manifest is bytes from a peer: [`parse_manifest`] bounds its size,
//! parses it and checks every length and index before anyone uses them,
//! and never panics (fuzzed as `remote_manifest`).
//!
//! A manifest is JSON:
//!
//! ```text
//! {
//!   "manifest_version": 1,
//!   "name": "web-3",              the snapshot's name (= state.name)
//!   "pushed": 1767225600,         seconds since the epoch
//!   "chunk_bytes": 1048576,       1 MiB: the granularity of the checksums
//!   "state": { ... },             state.json: vCPU and device state,
//!                                 geometry, memory.img's chunk digests
//!                                 (XXH3-128, the chunks' keys)
//!   "memory": [0, 5123, ...],     stored (compressed) bytes of each chunk
//!                                 of memory.img, 0 for a hole
//!   "volume": {                   the volume snapshot taken with it, if any
//!     "name": "web-3.disk", "sum": { ...chunk digests... }, "stored": [...]
//!   },
//!   "working_set": [[1, 16], [300, 2]]   pages in the order the guest first
//!                                 touched them, as [first page, pages] runs
//! }
//! ```
//!
//! Chunk `i` of a file covers bytes `[i * chunk_bytes, min((i + 1) *
//! chunk_bytes, size))`; its key in the store is derived from its digest,
//! which is lowercase hex and so never a path of its own.

use serde::{Deserialize, Serialize};

use crate::snapshot::{Algorithm, FileSum, StateFile, MEMORY_FILE};

/// The manifest version this code writes and reads.
pub const MANIFEST_VERSION: u32 = 1;

/// Bytes per chunk: the granularity of a snapshot's checksums.
pub const CHUNK_BYTES: u64 = 1 << 20;

/// The largest manifest accepted, in bytes (~5 TiB of guest memory).
pub const MAX_MANIFEST_BYTES: usize = 256 << 20;

/// The most bytes a stored chunk may take: zstd's worst case for 1 MiB
/// that does not compress is 1 MiB plus a few hundred bytes.
pub const MAX_STORED_BYTES: u32 = (1 << 20) + (1 << 14);

/// The longest snapshot name, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// The hex length of an XXH3-128 digest: the only hash chunks are keyed by.
pub const DIGEST_HEX_LEN: usize = 32;

/// A snapshot in the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub manifest_version: u32,
    /// The snapshot's name: the manifest's key, and `state.name`.
    pub name: String,
    /// Seconds since the Unix epoch when the push committed.
    pub pushed: u64,
    /// Bytes per chunk ([`CHUNK_BYTES`]).
    pub chunk_bytes: u64,
    /// The snapshot's `state.json`, with `memory.img` its only file.
    pub state: StateFile,
    /// Stored bytes of each chunk of `memory.img` (0: a hole, not stored).
    pub memory: Vec<u32>,
    /// The disk volume's snapshot, if the VM had a volume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<StoredVolume>,
    /// The guest's pages in the order it first touched them after a
    /// restore, when that was recorded: what a restore fetches first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_set: Option<Vec<PageRun>>,
}

/// A volume snapshot in the store, chunked like `memory.img`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredVolume {
    /// Its name on the host that pushed it (`state.volume_snapshot`).
    pub name: String,
    /// Its size and the digest of each chunk.
    pub sum: FileSum,
    /// Stored bytes of each chunk (0: a hole).
    pub stored: Vec<u32>,
}

/// `pages` pages from page `first` on, in a working set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "[u64; 2]", into = "[u64; 2]")]
pub struct PageRun {
    pub first: u64,
    pub pages: u64,
}

impl From<[u64; 2]> for PageRun {
    fn from([first, pages]: [u64; 2]) -> Self {
        Self { first, pages }
    }
}

impl From<PageRun> for [u64; 2] {
    fn from(r: PageRun) -> Self {
        [r.first, r.pages]
    }
}

/// One chunk of a stored file, as a reader needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk<'a> {
    /// Its index in the file.
    pub index: u64,
    /// Its first byte in the file.
    pub offset: u64,
    /// Its length (the last chunk may be short).
    pub len: u64,
    /// XXH3-128 of its bytes, lowercase hex: its key in the store.
    pub digest: &'a str,
    /// Its stored (compressed) length; `None` for a hole.
    pub stored: Option<u32>,
}

impl Manifest {
    /// `memory.img`'s checksums.
    pub fn memory_sum(&self) -> Option<&FileSum> {
        self.state.files.get(MEMORY_FILE)
    }

    /// The chunks of `memory.img`, in file order (empty if the manifest
    /// does not validate).
    pub fn memory_chunks(&self) -> Vec<Chunk<'_>> {
        self.memory_sum()
            .map(|sum| chunks_of(sum, &self.memory, self.chunk_bytes))
            .unwrap_or_default()
    }

    /// The chunks of the volume snapshot, in file order.
    pub fn volume_chunks(&self) -> Vec<Chunk<'_>> {
        self.volume
            .as_ref()
            .map(|v| chunks_of(&v.sum, &v.stored, self.chunk_bytes))
            .unwrap_or_default()
    }

    /// Check every length, index and name (what [`parse_manifest`] does
    /// after parsing).
    pub fn validate(&self) -> Result<(), ManifestInvalid> {
        use ManifestInvalid as I;
        if self.manifest_version != MANIFEST_VERSION {
            return Err(I::Version(self.manifest_version));
        }
        check_name(&self.name)?;
        if self.chunk_bytes != CHUNK_BYTES {
            return Err(I::ChunkBytes(self.chunk_bytes));
        }
        self.state.validate().map_err(I::State)?;
        if self.state.name != self.name {
            return Err(I::StateName(self.state.name.clone()));
        }
        if self.state.files.len() != 1 {
            return Err(I::Files(self.state.files.len()));
        }
        let mem = self
            .memory_sum()
            .ok_or(I::State(crate::snapshot::Invalid::NoChecksum))?;
        if mem.bytes != self.state.memory_bytes {
            return Err(I::MemoryBytes {
                file: mem.bytes,
                memory: self.state.memory_bytes,
            });
        }
        check_file(MEMORY_FILE, mem, &self.memory)?;
        match (&self.volume, &self.state.volume_snapshot) {
            (Some(v), Some(name)) if *name == v.name => {
                check_name(&v.name)?;
                check_file("the volume snapshot", &v.sum, &v.stored)?;
            }
            (None, None) => {}
            (v, s) => {
                return Err(I::Volume {
                    manifest: v.as_ref().map(|v| v.name.clone()),
                    state: s.clone(),
                })
            }
        }
        if let Some(ws) = &self.working_set {
            let pages = self.state.memory_bytes / self.state.page_size;
            let mut total: u64 = 0;
            for (i, r) in ws.iter().enumerate() {
                let end = r.first.checked_add(r.pages);
                if r.pages == 0 || end.is_none_or(|e| e > pages) {
                    return Err(I::WorkingSet { run: i, pages });
                }
                total = total.saturating_add(r.pages);
            }
            if total > pages {
                return Err(I::WorkingSetSize { total, pages });
            }
        }
        Ok(())
    }
}

fn chunks_of<'a>(sum: &'a FileSum, stored: &[u32], chunk_bytes: u64) -> Vec<Chunk<'a>> {
    sum.chunks
        .iter()
        .zip(stored)
        .zip(0u64..)
        .map(|((digest, &s), index)| {
            let offset = index.saturating_mul(chunk_bytes);
            Chunk {
                index,
                offset,
                len: chunk_bytes.min(sum.bytes.saturating_sub(offset)),
                digest,
                stored: (s != 0).then_some(s),
            }
        })
        .collect()
}

/// Check a file's checksums against its stored lengths.
fn check_file(what: &str, sum: &FileSum, stored: &[u32]) -> Result<(), ManifestInvalid> {
    use ManifestInvalid as I;
    if sum.algorithm != Algorithm::Xxh3 {
        return Err(I::Algorithm(sum.algorithm));
    }
    let want = sum.bytes.div_ceil(CHUNK_BYTES);
    if sum.chunks.len() as u64 != want || stored.len() as u64 != want {
        return Err(I::ChunkCount {
            what: what.to_owned(),
            bytes: sum.bytes,
            digests: sum.chunks.len(),
            stored: stored.len(),
        });
    }
    if let Some(i) = sum.chunks.iter().position(|d| !is_digest(d)) {
        return Err(I::Digest {
            what: what.to_owned(),
            chunk: i,
        });
    }
    if let Some(i) = stored.iter().position(|&s| s > MAX_STORED_BYTES) {
        return Err(I::Stored {
            what: what.to_owned(),
            chunk: i,
            bytes: stored[i],
        });
    }
    Ok(())
}

/// Whether `s` is an XXH3-128 digest in lowercase hex.
pub fn is_digest(s: &str) -> bool {
    s.len() == DIGEST_HEX_LEN && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Check that `name` can name a snapshot in the store (and a directory on
/// a host): 1 to [`MAX_NAME_LEN`] bytes of `[A-Za-z0-9._-]`, starting with
/// a letter or a digit, without `..`.
pub fn check_name(name: &str) -> Result<(), ManifestInvalid> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && !name.contains("..");
    if ok {
        Ok(())
    } else {
        Err(ManifestInvalid::Name(name.chars().take(80).collect()))
    }
}

/// Parse and validate the bytes of a manifest.
pub fn parse_manifest(bytes: &[u8]) -> Result<Manifest, ManifestError> {
    if bytes.len() > MAX_MANIFEST_BYTES {
        return Err(ManifestError::TooLarge(bytes.len()));
    }
    let m: Manifest = serde_json::from_slice(bytes).map_err(ManifestError::Parse)?;
    m.validate().map_err(ManifestError::Invalid)?;
    Ok(m)
}

/// The bytes of a manifest (what [`parse_manifest`] reads back).
pub fn encode_manifest(m: &Manifest) -> Vec<u8> {
    // Serializing plain structs of strings and numbers cannot fail.
    serde_json::to_vec(m).unwrap_or_default()
}

/// Why bytes are not a manifest.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("{0} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have")]
    TooLarge(usize),
    #[error("not a manifest: {0}")]
    Parse(#[source] serde_json::Error),
    #[error(transparent)]
    Invalid(ManifestInvalid),
}

/// Why a parsed manifest cannot describe a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestInvalid {
    #[error("manifest version {0} (this build reads {MANIFEST_VERSION})")]
    Version(u32),
    #[error("bad snapshot name {0:?}: use 1 to {MAX_NAME_LEN} of [A-Za-z0-9._-], starting with a letter or digit")]
    Name(String),
    #[error("chunks of {0} bytes (this build reads {CHUNK_BYTES})")]
    ChunkBytes(u64),
    #[error("state.json: {0}")]
    State(crate::snapshot::Invalid),
    #[error("state.json names the snapshot {0:?}, the manifest another")]
    StateName(String),
    #[error("state.json lists {0} files; a manifest carries memory.img alone")]
    Files(usize),
    #[error("memory.img has {file} bytes for {memory} bytes of memory")]
    MemoryBytes { file: u64, memory: u64 },
    #[error("checksums with {0:?}; chunks are keyed by XXH3-128")]
    Algorithm(Algorithm),
    #[error("{what}: {bytes} bytes, {digests} chunk digests and {stored} stored lengths")]
    ChunkCount {
        what: String,
        bytes: u64,
        digests: usize,
        stored: usize,
    },
    #[error("{what}: chunk {chunk}'s digest is not 32 lowercase hex digits")]
    Digest { what: String, chunk: usize },
    #[error("{what}: chunk {chunk} stored in {bytes} bytes, more than a chunk can take")]
    Stored {
        what: String,
        chunk: usize,
        bytes: u32,
    },
    #[error("the volume snapshot is {manifest:?} in the manifest, {state:?} in state.json")]
    Volume {
        manifest: Option<String>,
        state: Option<String>,
    },
    #[error("working-set run {run} is empty or outside the {pages} pages of memory")]
    WorkingSet { run: usize, pages: u64 },
    #[error("the working set has {total} pages, more than the {pages} of memory")]
    WorkingSetSize { total: u64, pages: u64 },
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // small test sizes
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;
    use crate::api::SnapshotMode;

    fn digest(i: u64) -> String {
        format!(
            "{:032x}",
            u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c)
        )
    }

    fn sum(bytes: u64) -> FileSum {
        let n = bytes.div_ceil(CHUNK_BYTES);
        FileSum {
            bytes,
            algorithm: Algorithm::Xxh3,
            digest: digest(u64::MAX),
            chunks: (0..n).map(digest).collect(),
        }
    }

    pub(crate) fn sample(memory_bytes: u64) -> Manifest {
        let mem = sum(memory_bytes);
        let chunks = mem.chunks.len();
        Manifest {
            manifest_version: MANIFEST_VERSION,
            name: "web-3".into(),
            pushed: 1_767_225_600,
            chunk_bytes: CHUNK_BYTES,
            state: StateFile {
                format_version: crate::snapshot::FORMAT_VERSION,
                name: "web-3".into(),
                vm: "vm-1".into(),
                mode: SnapshotMode::Full,
                parent: None,
                created: 1,
                memory_bytes,
                page_size: shared::PAGE_SIZE,
                hugepages: false,
                vm_state: shared::VmState {
                    vcpus: vec![shared::VcpuState::default()],
                    devices: vec![1, 2, 3],
                },
                volume_snapshot: Some("web-3.disk".into()),
                files: BTreeMap::from([(MEMORY_FILE.to_owned(), mem)]),
                origin: None,
            },
            memory: (0..chunks).map(|i| (i % 3) as u32 * 1000).collect(),
            volume: Some(StoredVolume {
                name: "web-3.disk".into(),
                sum: sum(3 * CHUNK_BYTES + 512),
                stored: vec![0, 7, 9, 11],
            }),
            working_set: Some(vec![PageRun {
                first: 1,
                pages: 16,
            }]),
        }
    }

    #[test]
    fn a_manifest_round_trips_and_validates() {
        let m = sample(5 * CHUNK_BYTES + 4096);
        let back = parse_manifest(&encode_manifest(&m)).unwrap();
        assert_eq!(back, m);
        let chunks = back.memory_chunks();
        assert_eq!(chunks.len(), 6);
        assert_eq!(chunks[0].stored, None);
        assert_eq!(chunks[1].stored, Some(1000));
        assert_eq!(chunks[5].offset, 5 * CHUNK_BYTES);
        assert_eq!(chunks[5].len, 4096);
        let vol = back.volume_chunks();
        assert_eq!(vol.len(), 4);
        assert_eq!(vol[3].len, 512);
    }

    #[test]
    fn inconsistent_manifests_are_refused() {
        let good = sample(3 * CHUNK_BYTES);
        type Breaker = Box<dyn Fn(&mut Manifest)>;
        let cases: Vec<(Breaker, &str)> = vec![
            (Box::new(|m| m.manifest_version = 2), "version"),
            (Box::new(|m| m.name = "../etc".into()), "name"),
            (Box::new(|m| m.chunk_bytes = 4096), "chunk size"),
            (
                Box::new(|m| {
                    m.memory.pop();
                }),
                "count",
            ),
            (
                Box::new(|m| {
                    if let Some(s) = m.state.files.get_mut(MEMORY_FILE) {
                        s.chunks[0] = "../../x".into();
                    }
                }),
                "digest",
            ),
            (Box::new(|m| m.memory[1] = u32::MAX), "stored"),
            (Box::new(|m| m.state.name = "other".into()), "state name"),
            (Box::new(|m| m.volume = None), "volume"),
            (
                Box::new(|m| {
                    m.working_set = Some(vec![PageRun {
                        first: 767,
                        pages: 2,
                    }])
                }),
                "working set",
            ),
            (
                Box::new(|m| {
                    m.working_set = Some(vec![PageRun {
                        first: u64::MAX,
                        pages: 2,
                    }])
                }),
                "working set overflow",
            ),
            (
                Box::new(|m| {
                    if let Some(s) = m.state.files.get_mut(MEMORY_FILE) {
                        s.algorithm = Algorithm::Blake3;
                    }
                }),
                "algorithm",
            ),
        ];
        for (break_it, what) in cases {
            let mut m = good.clone();
            break_it(&mut m);
            let err = parse_manifest(&encode_manifest(&m));
            assert!(
                matches!(err, Err(ManifestError::Invalid(_))),
                "{what}: {err:?}"
            );
        }
        assert!(matches!(
            parse_manifest(&vec![b' '; MAX_MANIFEST_BYTES + 1]),
            Err(ManifestError::TooLarge(_))
        ));
        assert!(matches!(
            parse_manifest(b"{\"manifest_version\": 1"),
            Err(ManifestError::Parse(_))
        ));
    }

    #[test]
    fn names_are_single_safe_components() {
        for ok in ["a", "web-3", "s.1_x", &"x".repeat(MAX_NAME_LEN)] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            ".a",
            "a/b",
            "a..b",
            "-a",
            "a b",
            &"x".repeat(MAX_NAME_LEN + 1),
        ] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }

    fn arb_manifest() -> impl Strategy<Value = Manifest> {
        (
            1u64..40,
            any::<u64>(),
            proptest::collection::vec(any::<u32>(), 40),
            proptest::option::of(proptest::collection::vec((0u64..200, 1u64..8), 0..20)),
            proptest::option::of(1u64..(5 * CHUNK_BYTES)),
            "[a-z0-9][a-z0-9_-]{0,20}",
        )
            .prop_map(|(mib, pushed, stored, ws, vol, name)| {
                let mut m = sample(mib * CHUNK_BYTES);
                m.name = name.clone();
                m.state.name = name;
                m.pushed = pushed;
                m.memory = stored[..mib as usize]
                    .iter()
                    .map(|s| s % MAX_STORED_BYTES)
                    .collect();
                m.working_set = ws.map(|runs| {
                    runs.into_iter()
                        .map(|(first, pages)| PageRun { first, pages })
                        .collect()
                });
                m.volume = vol.map(|bytes| {
                    let s = sum(bytes);
                    let n = s.chunks.len();
                    StoredVolume {
                        name: "v.disk".into(),
                        sum: s,
                        stored: vec![3; n],
                    }
                });
                m.state.volume_snapshot = m.volume.as_ref().map(|v| v.name.clone());
                m
            })
    }

    proptest! {
        #[test]
        fn manifests_round_trip(m in arb_manifest()) {
            let bytes = encode_manifest(&m);
            let back = parse_manifest(&bytes).unwrap();
            prop_assert_eq!(&back, &m);
            prop_assert_eq!(encode_manifest(&back), bytes);
        }

        #[test]
        fn damaged_manifests_never_panic(
            m in arb_manifest(),
            at in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let mut bytes = encode_manifest(&m);
            let i = at.index(bytes.len());
            bytes[i] = byte;
            if let Ok(back) = parse_manifest(&bytes) {
                // Whatever parses is consistent.
                prop_assert!(back.validate().is_ok());
                prop_assert_eq!(back.memory_chunks().len(), back.memory.len());
            }
        }
    }
}
