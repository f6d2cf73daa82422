//! `state.json`: what a snapshot directory holds besides its image. A
//! file on disk that a restarted server reads back, so it lives with the
//! other formats a peer can hand the server, and is fuzzed like them.

use std::collections::BTreeMap;

use crate::api::SnapshotMode;
use serde::{Deserialize, Serialize};

/// The version of the snapshot format this server writes. Versions 1
/// (SHA-256 checksums, no `algorithm` field) and 2 (BLAKE3) are still
/// read; version 3 checksums with XXH3-128.
pub const FORMAT_VERSION: u32 = 3;

/// The oldest format version this server reads.
pub const OLDEST_READABLE: u32 = 1;

/// The image file in a snapshot directory.
pub const MEMORY_FILE: &str = "memory.img";

/// The hash function of a file's checksums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    /// Format 1's, and what a checksum without an `algorithm` field is.
    #[default]
    Sha256,
    /// Format 2's: several times faster per core than SHA-256.
    Blake3,
    /// What this server writes (format 3): XXH3 with a 128-bit result,
    /// ~2.5 times faster again than BLAKE3 on this kind of host. The
    /// checksums guard against torn and corrupted files in a state
    /// directory only the server writes, not against someone forging one:
    /// a non-cryptographic hash with 128 bits misses a random change with
    /// a chance of 2^-128, and it keeps hashing off a small snapshot's
    /// critical path.
    #[serde(rename = "xxh3-128")]
    Xxh3,
}

/// Size and checksum of one file of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSum {
    /// Logical size in bytes.
    pub bytes: u64,
    /// The hash function of `digest` and `chunks`.
    #[serde(default)]
    pub algorithm: Algorithm,
    /// The hash over the chunk digests, as lowercase hex (format 1 calls
    /// it `sha256`).
    #[serde(alias = "sha256")]
    pub digest: String,
    /// The hash of each 1 MiB chunk of the content (holes read as zero).
    pub chunks: Vec<String>,
}

/// The contents of `state.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateFile {
    pub format_version: u32,
    pub name: String,
    /// The VM it was taken from (`vm-N`).
    pub vm: String,
    pub mode: SnapshotMode,
    /// The snapshot whose image `memory.img` was reflinked from.
    pub parent: Option<String>,
    /// Seconds since the Unix epoch.
    pub created: u64,
    pub memory_bytes: u64,
    /// Granularity of `memory.img` (always 4 KiB, whatever backs the VM).
    pub page_size: u64,
    /// The VM ran on 2 MiB hugetlb pages; a VM restored from the snapshot
    /// does too unless its create says otherwise.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub hugepages: bool,
    /// vCPU and device state, as the VMM captured it.
    pub vm_state: shared::VmState,
    /// The volume snapshot taken with it, if a volume was attached.
    pub volume_snapshot: Option<String>,
    /// Every other file of the snapshot directory, by name.
    pub files: BTreeMap<String, FileSum>,
    /// The host and software that took it, which a restore elsewhere
    /// must match (absent in snapshots of older servers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Origin>,
}

/// What a restore of a snapshot needs of the host it runs on: the vCPU
/// and device state are in the encoding of the pagefork version that
/// captured them, and the guest may use any CPU feature the host that
/// ran it had.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Origin {
    /// The version of the server and VMM that took it.
    pub pagefork_version: String,
    /// The server-VMM protocol version of that VMM.
    pub vmm_protocol: u16,
    /// The CPU feature flags of that host, as `/proc/cpuinfo` names them.
    pub cpu_flags: Vec<String>,
}

/// The most CPU flags an [`Origin`] may list, and the longest flag.
pub const MAX_CPU_FLAGS: usize = 1024;
const MAX_FLAG_LEN: usize = 64;

impl Origin {
    /// Why a snapshot from `self` cannot be restored on `host`, if it
    /// cannot: another pagefork or protocol version, or CPU features
    /// `host` lacks.
    pub fn mismatch(&self, host: &Origin) -> Option<String> {
        if self.pagefork_version != host.pagefork_version {
            return Some(format!(
                "it was taken by pagefork {}, this host runs {}",
                self.pagefork_version, host.pagefork_version
            ));
        }
        if self.vmm_protocol != host.vmm_protocol {
            return Some(format!(
                "its VMM spoke protocol version {}, this host's speaks {}",
                self.vmm_protocol, host.vmm_protocol
            ));
        }
        let have: std::collections::BTreeSet<&str> =
            host.cpu_flags.iter().map(String::as_str).collect();
        let missing: Vec<&str> = self
            .cpu_flags
            .iter()
            .map(String::as_str)
            .filter(|f| !have.contains(f))
            .collect();
        if !missing.is_empty() {
            return Some(format!(
                "its host's CPU had features this host's lacks: {}",
                missing.join(" ")
            ));
        }
        None
    }
}

impl StateFile {
    /// Number of vCPUs.
    pub fn vcpus(&self) -> u8 {
        u8::try_from(self.vm_state.vcpus.len()).unwrap_or(u8::MAX)
    }

    /// Check what does not need the files: version, geometry.
    pub fn validate(&self) -> Result<(), Invalid> {
        if !(OLDEST_READABLE..=FORMAT_VERSION).contains(&self.format_version) {
            return Err(Invalid::Version(self.format_version));
        }
        if self.page_size != shared::PAGE_SIZE {
            return Err(Invalid::PageSize(self.page_size));
        }
        if self.memory_bytes == 0 || !self.memory_bytes.is_multiple_of(self.page_size) {
            return Err(Invalid::MemorySize(self.memory_bytes));
        }
        if self.vm_state.vcpus.is_empty() {
            return Err(Invalid::NoVcpus);
        }
        if !self.files.contains_key(MEMORY_FILE) {
            return Err(Invalid::NoChecksum);
        }
        if let Some(o) = &self.origin {
            let bad_flag = |f: &String| {
                f.is_empty()
                    || f.len() > MAX_FLAG_LEN
                    || !f.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            };
            if o.cpu_flags.len() > MAX_CPU_FLAGS
                || o.cpu_flags.iter().any(bad_flag)
                || o.pagefork_version.len() > MAX_FLAG_LEN
            {
                return Err(Invalid::Origin);
            }
        }
        Ok(())
    }
}

/// Parse and validate the bytes of a `state.json`.
pub fn parse_state(bytes: &[u8]) -> Result<StateFile, StateError> {
    let state: StateFile = serde_json::from_slice(bytes).map_err(StateError::Parse)?;
    state.validate().map_err(StateError::Invalid)?;
    Ok(state)
}

/// Why bytes are not a `state.json` this server serves.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("not a state.json: {0}")]
    Parse(#[source] serde_json::Error),
    #[error(transparent)]
    Invalid(Invalid),
}

/// Why a `state.json` cannot describe a snapshot this server serves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("format version {0} (this server reads {OLDEST_READABLE} to {FORMAT_VERSION})")]
    Version(u32),
    #[error("page size {0} is not {page}", page = shared::PAGE_SIZE)]
    PageSize(u64),
    #[error("memory size {0} is not whole pages")]
    MemorySize(u64),
    #[error("no vCPU state")]
    NoVcpus,
    #[error("no checksum of {}", MEMORY_FILE)]
    NoChecksum,
    #[error(
        "its origin lists more than {MAX_CPU_FLAGS} CPU flags, or one that is not a flag name"
    )]
    Origin,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StateFile {
        StateFile {
            format_version: FORMAT_VERSION,
            name: "s".into(),
            vm: "vm-1".into(),
            mode: SnapshotMode::Full,
            parent: None,
            created: 1,
            memory_bytes: 1 << 20,
            page_size: shared::PAGE_SIZE,
            hugepages: false,
            vm_state: shared::VmState {
                vcpus: vec![shared::VcpuState::default()],
                devices: vec![1, 2],
            },
            volume_snapshot: None,
            origin: None,
            files: BTreeMap::from([(
                super::MEMORY_FILE.to_owned(),
                FileSum {
                    bytes: 1 << 20,
                    algorithm: Algorithm::Xxh3,
                    digest: "00".into(),
                    chunks: vec!["00".into()],
                },
            )]),
        }
    }

    #[test]
    fn state_file_round_trips_and_validates() {
        let s = sample();
        let text = serde_json::to_string(&s).unwrap();
        let back: StateFile = serde_json::from_str(&text).unwrap();
        assert_eq!(back, s);
        assert!(back.validate().is_ok());
        let mut bad = s.clone();
        bad.format_version = 99;
        assert_eq!(bad.validate(), Err(Invalid::Version(99)));
        let mut bad = s;
        bad.memory_bytes = 100;
        assert!(bad.validate().is_err());
    }

    #[test]
    fn origins_match_on_version_and_a_superset_of_cpu_flags() {
        let o = |v: &str, flags: &[&str]| Origin {
            pagefork_version: v.into(),
            vmm_protocol: 1,
            cpu_flags: flags.iter().map(|f| (*f).to_owned()).collect(),
        };
        let host = o("0.1.0", &["sse2", "avx2", "xsave"]);
        assert_eq!(o("0.1.0", &["sse2", "xsave"]).mismatch(&host), None);
        let why = o("0.1.0", &["sse2", "avx512f"]).mismatch(&host).unwrap();
        assert!(why.contains("avx512f") && !why.contains("sse2"), "{why}");
        let why = o("0.2.0", &[]).mismatch(&host).unwrap();
        assert!(why.contains("0.2.0"), "{why}");
        let mut s = sample();
        s.origin = Some(o("0.1.0", &["bad flag"]));
        assert_eq!(s.validate(), Err(Invalid::Origin));
        s.origin = Some(host);
        let text = serde_json::to_vec(&s).unwrap();
        assert_eq!(parse_state(&text).unwrap(), s);
    }

    #[test]
    fn algorithms_have_stable_names() {
        for (alg, name) in [
            (Algorithm::Sha256, "\"sha256\""),
            (Algorithm::Blake3, "\"blake3\""),
            (Algorithm::Xxh3, "\"xxh3-128\""),
        ] {
            assert_eq!(serde_json::to_string(&alg).unwrap(), name);
            assert_eq!(serde_json::from_str::<Algorithm>(name).unwrap(), alg);
        }
    }

    #[test]
    fn format_1_reads_as_sha256() {
        let mut s = sample();
        s.format_version = 1;
        let mut v = serde_json::to_value(&s).unwrap();
        let sum = v["files"][MEMORY_FILE].as_object_mut().unwrap();
        sum.remove("algorithm");
        let digest = sum.remove("digest").unwrap();
        sum.insert("sha256".into(), digest);
        let back = parse_state(&serde_json::to_vec(&v).unwrap()).unwrap();
        let sum = &back.files[MEMORY_FILE];
        assert_eq!(sum.algorithm, Algorithm::Sha256);
        assert_eq!(sum.digest, "00");
        assert_eq!(back.format_version, 1);
    }
}
