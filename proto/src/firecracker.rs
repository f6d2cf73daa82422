//! Firecracker's UFFD memory-backend handshake.
//!
//! When Firecracker restores a snapshot with `mem_backend: {"backend_type":
//! "Uffd", "backend_path": SOCKET}`, it creates a userfaultfd for its
//! anonymous guest memory (registered MISSING, with EVENT_REMOVE), connects
//! to SOCKET, and sends ONE message: a JSON array of region mappings as the
//! data and the uffd as the only SCM_RIGHTS fd. It then keeps the socket
//! open; a hang-up means the VM is gone.
//!
//! ```json
//! [{"base_host_virt_addr": 140..., "size": 67108864, "offset": 0,
//!   "page_size": 4096, "page_size_kib": 4096}]
//! ```
//!
//! `page_size_kib` is the deprecated spelling. Firecracker has sent it with
//! a value in bytes despite its name, so a value of 4096 or more is taken as
//! bytes and a smaller one as KiB.

use serde::{Deserialize, Serialize};

/// Page sizes a source can be served at: 4 KiB and 2 MiB (hugetlbfs).
pub const SUPPORTED_PAGE_SIZES: [u64; 2] = [4096, 2 << 20];

/// Largest handshake message accepted.
pub const MAX_HANDSHAKE: usize = 64 * 1024;

/// One region as Firecracker sends it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestRegionUffdMapping {
    /// Firecracker's host virtual address of the region.
    pub base_host_virt_addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// Offset of the region in the memory snapshot file.
    pub offset: u64,
    /// Page size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_size: Option<u64>,
    /// Deprecated page size field (see the module doc).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_size_kib: Option<u64>,
}

/// A validated region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub base: u64,
    pub size: u64,
    pub offset: u64,
    pub page_size: u64,
}

/// Why a handshake was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    #[error("handshake is not a JSON array of regions: {0}")]
    NotJson(String),
    #[error("handshake lists no regions")]
    NoRegions,
    #[error("region {0} has no page_size (or page_size_kib)")]
    NoPageSize(usize),
    #[error("region {index} has page size {page_size}; supported: 4096 and 2097152")]
    PageSize { index: usize, page_size: u64 },
    #[error("region {0} is empty or not aligned to its page size")]
    Misaligned(usize),
    #[error("region {0} overflows the address space")]
    Overflow(usize),
    #[error("regions {0} and {1} overlap")]
    Overlap(usize, usize),
    #[error(
        "region {index} ends at byte {end} of the memory source, which has only {source_len} bytes"
    )]
    PastSource {
        index: usize,
        end: u64,
        source_len: u64,
    },
    #[error("the handshake carries {0} fds; it must carry exactly one userfaultfd")]
    FdCount(usize),
}

fn page_size_of(m: &GuestRegionUffdMapping, index: usize) -> Result<u64, HandshakeError> {
    match (m.page_size, m.page_size_kib) {
        (Some(b), _) => Ok(b),
        (None, Some(k)) if k >= 4096 => Ok(k),
        (None, Some(k)) => Ok(k.saturating_mul(1024)),
        (None, None) => Err(HandshakeError::NoPageSize(index)),
    }
}

/// Parse and validate a handshake against a source of `source_len` bytes.
pub fn parse_regions(bytes: &[u8], source_len: u64) -> Result<Vec<Region>, HandshakeError> {
    let raw: Vec<GuestRegionUffdMapping> =
        serde_json::from_slice(bytes).map_err(|e| HandshakeError::NotJson(e.to_string()))?;
    if raw.is_empty() {
        return Err(HandshakeError::NoRegions);
    }
    let mut out = Vec::with_capacity(raw.len());
    for (index, m) in raw.iter().enumerate() {
        let page_size = page_size_of(m, index)?;
        if !SUPPORTED_PAGE_SIZES.contains(&page_size) {
            return Err(HandshakeError::PageSize { index, page_size });
        }
        if m.size == 0
            || m.size % page_size != 0
            || m.base_host_virt_addr % page_size != 0
            || m.offset % page_size != 0
        {
            return Err(HandshakeError::Misaligned(index));
        }
        let end = m
            .offset
            .checked_add(m.size)
            .ok_or(HandshakeError::Overflow(index))?;
        m.base_host_virt_addr
            .checked_add(m.size)
            .ok_or(HandshakeError::Overflow(index))?;
        if end > source_len {
            return Err(HandshakeError::PastSource {
                index,
                end,
                source_len,
            });
        }
        out.push(Region {
            base: m.base_host_virt_addr,
            size: m.size,
            offset: m.offset,
            page_size,
        });
    }
    for i in 0..out.len() {
        for j in i + 1..out.len() {
            let (a, b) = (out[i], out[j]);
            let addr = a.base < b.base + b.size && b.base < a.base + a.size;
            let file = a.offset < b.offset + b.size && b.offset < a.offset + a.size;
            if addr || file {
                return Err(HandshakeError::Overlap(i, j));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_what_firecracker_sends() {
        let msg = br#"[{"base_host_virt_addr":140000000000000,"size":67108864,"offset":0,"page_size":4096,"page_size_kib":4096}]"#;
        let r = parse_regions(msg, 64 << 20).unwrap();
        assert_eq!(
            r,
            vec![Region {
                base: 140000000000000,
                size: 64 << 20,
                offset: 0,
                page_size: 4096
            }]
        );
    }

    #[test]
    fn deprecated_page_size_kib_is_bytes_or_kib() {
        let b = br#"[{"base_host_virt_addr":4096,"size":8192,"offset":0,"page_size_kib":4096}]"#;
        assert_eq!(parse_regions(b, 8192).unwrap()[0].page_size, 4096);
        let k = br#"[{"base_host_virt_addr":4096,"size":8192,"offset":0,"page_size_kib":4}]"#;
        assert_eq!(parse_regions(k, 8192).unwrap()[0].page_size, 4096);
    }

    #[test]
    fn refuses_bad_handshakes() {
        assert!(matches!(
            parse_regions(b"hello", 1 << 20),
            Err(HandshakeError::NotJson(_))
        ));
        assert_eq!(
            parse_regions(b"[]", 1 << 20),
            Err(HandshakeError::NoRegions)
        );
        let overlap = br#"[{"base_host_virt_addr":0,"size":8192,"offset":0,"page_size":4096},
                           {"base_host_virt_addr":4096,"size":4096,"offset":8192,"page_size":4096}]"#;
        assert_eq!(
            parse_regions(overlap, 1 << 20),
            Err(HandshakeError::Overlap(0, 1))
        );
        let past = br#"[{"base_host_virt_addr":0,"size":8192,"offset":4096,"page_size":4096}]"#;
        assert!(matches!(
            parse_regions(past, 8192),
            Err(HandshakeError::PastSource { .. })
        ));
        let ps = br#"[{"base_host_virt_addr":0,"size":65536,"offset":0,"page_size":65536}]"#;
        assert!(matches!(
            parse_regions(ps, 1 << 20),
            Err(HandshakeError::PageSize { .. })
        ));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_regions(&bytes, 1 << 30);
        }

        #[test]
        fn valid_regions_round_trip(pages in 1u64..1000, base_page in 1u64..1_000_000, off_page in 0u64..1000) {
            let m = GuestRegionUffdMapping {
                base_host_virt_addr: base_page * 4096, size: pages * 4096, offset: off_page * 4096,
                page_size: Some(4096), page_size_kib: None,
            };
            let json = serde_json::to_vec(&vec![m.clone()]).unwrap();
            let r = parse_regions(&json, (off_page + pages) * 4096).unwrap();
            prop_assert_eq!(r[0], Region { base: m.base_host_virt_addr, size: m.size, offset: m.offset, page_size: 4096 });
        }
    }
}
