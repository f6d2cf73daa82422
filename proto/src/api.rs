//! Bodies of the REST control API (JSON over a Unix socket).
//!
//! Errors are `{"error": "..."}` with a fitting HTTP status.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use shared::GuestOp;

/// `POST /v1/vms` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateVm {
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// Number of vCPUs (default 1).
    #[serde(default = "default_vcpus")]
    pub vcpus: u8,
    /// Where the initial memory comes from; `null` is all zeroes.
    #[serde(default)]
    pub memory_source: Option<MemorySource>,
    /// Name of a disk volume to attach.
    #[serde(default)]
    pub volume: Option<String>,
    /// Fault-around block for image-backed faults in KiB (0 = one page per
    /// fault); the server's default if absent.
    #[serde(default)]
    pub fault_around_kib: Option<u64>,
    /// Largest readahead window in KiB for sequential faults on an image
    /// (0 = off); the server's default if absent.
    #[serde(default)]
    pub readahead_kib: Option<u64>,
    /// Install every page before the guest starts (no faults at all).
    #[serde(default)]
    pub prefetch: bool,
}

fn default_vcpus() -> u8 {
    1
}

/// A memory source for a new VM.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum MemorySource {
    /// A raw image: guest page p is at byte p * 4096 of the file.
    File { path: String },
}

/// A VM as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmInfo {
    pub id: String,
    /// `starting`, `running`, `paused`, `exited`.
    pub state: String,
    /// `pagefork` for VMs run by our vmm.
    pub kind: String,
    pub pid: Option<u32>,
    pub memory_mib: u64,
    pub vcpus: u8,
    /// Pages per source kind (`uninitialized`, `vm`, `file`, ...).
    pub pages: BTreeMap<String, u64>,
    /// Pages present in this VM's own memfd.
    pub resident_pages: u64,
    /// Why the VM exited, if it did.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub exit_reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub parent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub volume: Option<String>,
    /// Fault engine counters.
    #[serde(default)]
    pub faults: FaultCounters,
}

/// Fault engine counters of one VM.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultCounters {
    pub missing: u64,
    pub write_protect: u64,
    pub pages_installed: u64,
    pub removes: u64,
    /// Installs deferred by EAGAIN until pending events were read.
    #[serde(default)]
    pub deferred: u64,
    pub fault_around_kib: u64,
}

/// `POST /v1/vms/{id}/exec` body: a flat form of [`GuestOp`] that gives
/// field-level error messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// `fill`, `touch`, `checksum`, `verify`, `digest`, `identity`,
    /// `disk_fill`, `disk_checksum`.
    pub op: String,
    #[serde(default)]
    pub start_page: Option<u64>,
    #[serde(default)]
    pub pages: Option<u64>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub write: Option<bool>,
    #[serde(default)]
    pub sector: Option<u64>,
    #[serde(default)]
    pub count: Option<u64>,
}

impl ExecRequest {
    /// Build the guest op, or say which field is missing.
    ///
    /// `total_pages` is the VM's page count; `pages` defaults to the rest of
    /// memory from `start_page`.
    pub fn to_op(&self, total_pages: u64) -> Result<GuestOp, String> {
        let start_page = self.start_page.unwrap_or(0);
        let pages = self.pages.unwrap_or(total_pages.saturating_sub(start_page));
        let need = |v: Option<u64>, what: &str| {
            v.ok_or_else(|| format!("op '{}' needs \"{what}\"", self.op))
        };
        let op = match self.op.as_str() {
            "fill" => GuestOp::Fill { start_page, pages, seed: need(self.seed, "seed")? },
            "touch" => GuestOp::Touch { start_page, pages, write: self.write.unwrap_or(false) },
            "checksum" => GuestOp::Checksum { start_page, pages },
            "verify" => GuestOp::Verify { start_page, pages, seed: need(self.seed, "seed")? },
            "digest" => GuestOp::Digest { start_page, pages },
            "identity" => GuestOp::Identity,
            "disk_fill" => GuestOp::DiskFill {
                sector: self.sector.unwrap_or(0),
                count: need(self.count, "count")?,
                seed: need(self.seed, "seed")?,
            },
            "disk_checksum" => GuestOp::DiskChecksum {
                sector: self.sector.unwrap_or(0),
                count: need(self.count, "count")?,
            },
            other => {
                return Err(format!(
                    "unknown op '{other}'; use fill, touch, checksum, verify, digest, identity, disk_fill or disk_checksum"
                ))
            }
        };
        if let Some((s, n)) = op.page_range() {
            if s.checked_add(n).is_none_or(|end| end > total_pages) {
                return Err(format!(
                    "pages {s}..{} are outside guest memory of {total_pages} pages",
                    s.saturating_add(n)
                ));
            }
        }
        Ok(op)
    }
}

/// `POST /v1/vms/{id}/exec` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecResponse {
    pub op: String,
    pub result: u64,
    pub elapsed_us: u64,
}

/// Error body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn exec_request_says_what_is_missing() {
        let r: ExecRequest = serde_json::from_str(r#"{"op":"fill","pages":3}"#).unwrap();
        assert_eq!(r.to_op(10).unwrap_err(), "op 'fill' needs \"seed\"");
        let r: ExecRequest =
            serde_json::from_str(r#"{"op":"checksum","start_page":8,"pages":3}"#).unwrap();
        assert!(r.to_op(10).unwrap_err().contains("outside guest memory"));
    }

    #[test]
    fn create_vm_defaults() {
        let c: CreateVm = serde_json::from_str(r#"{"memory_mib":256}"#).unwrap();
        assert_eq!(c.vcpus, 1);
        assert_eq!(c.memory_source, None);
        let c: CreateVm =
            serde_json::from_str(r#"{"memory_mib":1,"memory_source":{"kind":"file","path":"/x"}}"#)
                .unwrap();
        assert_eq!(
            c.memory_source,
            Some(MemorySource::File { path: "/x".into() })
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bodies_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = serde_json::from_slice::<CreateVm>(&bytes);
            if let Ok(r) = serde_json::from_slice::<ExecRequest>(&bytes) {
                let _ = r.to_op(1 << 20);
            }
        }

        #[test]
        fn exec_request_round_trips(start in any::<u64>(), pages in any::<u64>(), seed in any::<u64>()) {
            let r = ExecRequest { op: "verify".into(), start_page: Some(start), pages: Some(pages), seed: Some(seed), write: None, sector: None, count: None };
            let s = serde_json::to_string(&r).unwrap();
            prop_assert_eq!(serde_json::from_str::<ExecRequest>(&s).unwrap(), r);
        }
    }
}
