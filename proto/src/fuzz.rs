//! Entry points of the fuzz targets in `fuzz/`: each decoder of bytes a
//! peer sends, fed arbitrary input. A panic is a bug; errors are fine.
//!
//! They live here so the checked-in seed corpus (`fuzz/seeds/<target>/`)
//! is also replayed by the ordinary test suite on the stable toolchain
//! (the test below), while `scripts/fuzz.sh` runs libFuzzer on them.

use std::io::Write;
use std::os::unix::net::UnixStream;

use crate::vmm::{ServerMsg, VmmMsg};

/// `vmm_frame`: frame headers, message payloads, and both receive paths
/// over real socket pairs: the blocking one (the VMM's, and the server's
/// for a hello) and the core's non-blocking [`crate::frame::FrameReader`],
/// which must find exactly the frames the blocking one finds.
pub fn vmm_frame(data: &[u8]) {
    if let Some(h) = data.first_chunk::<{ crate::frame::HEADER_LEN }>() {
        let _ = crate::frame::Header::decode(h);
    }
    let _ = crate::vmm::decode::<VmmMsg>(data);
    let _ = crate::vmm::decode::<ServerMsg>(data);
    let Ok((mut a, b)) = UnixStream::pair() else {
        return;
    };
    if a.write_all(data).is_err() {
        return;
    }
    drop(a);
    let mut blocking = Vec::new();
    while let Ok((payload, _)) = crate::frame::recv_frame(&b) {
        let _ = crate::vmm::decode::<VmmMsg>(&payload);
        blocking.push(payload);
    }
    // The reader the server's core uses, fed a few bytes at a time (as
    // many as the first byte says) and asked between pieces: it must
    // find the same frames as the blocking receive, never waiting.
    let Ok((mut a, b)) = UnixStream::pair() else {
        return;
    };
    let step = usize::from(data.first().copied().unwrap_or(1)).max(1);
    let mut reader = crate::frame::FrameReader::default();
    let mut pieces = Vec::new();
    let mut failed = false;
    let take = |reader: &mut crate::frame::FrameReader, pieces: &mut Vec<Vec<u8>>| loop {
        match reader.read(&b) {
            Ok(Some((payload, _))) => pieces.push(payload),
            Ok(None) => return false,
            Err(_) => return true,
        }
    };
    for piece in data.chunks(step) {
        if a.write_all(piece).is_err() {
            return;
        }
        if take(&mut reader, &mut pieces) {
            failed = true;
            break;
        }
    }
    drop(a);
    if !failed {
        take(&mut reader, &mut pieces);
    }
    assert_eq!(
        pieces, blocking,
        "the non-blocking reader and the blocking receive disagree"
    );
}

/// `firecracker_handshake`: the JSON region array Firecracker sends.
pub fn firecracker_handshake(data: &[u8]) {
    let _ = crate::firecracker::parse_regions(data, 1 << 30);
}

/// `snapshot_state`: a snapshot's `state.json` as a restarted server
/// reads it from disk.
pub fn snapshot_state(data: &[u8]) {
    if let Ok(state) = crate::snapshot::parse_state(data) {
        let _ = state.vcpus();
        let _ = serde_json::to_vec(&state);
    }
}

/// `remote_manifest`: a snapshot's manifest as a host reads it from an
/// object store another host wrote.
pub fn remote_manifest(data: &[u8]) {
    if let Ok(m) = crate::manifest::parse_manifest(data) {
        let chunks = m.memory_chunks();
        assert_eq!(
            chunks.len(),
            m.memory.len(),
            "a valid manifest lists every chunk"
        );
        let _ = m.volume_chunks();
        let again = crate::manifest::parse_manifest(&crate::manifest::encode_manifest(&m));
        assert!(again.is_ok(), "a valid manifest re-encodes to a valid one");
    }
}

/// A fuzz target: bytes in, no panic.
pub type Target = fn(&[u8]);

/// Every fuzz target by name.
pub const TARGETS: &[(&str, Target)] = &[
    ("vmm_frame", vmm_frame),
    ("firecracker_handshake", firecracker_handshake),
    ("snapshot_state", snapshot_state),
    ("remote_manifest", remote_manifest),
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Replay every checked-in seed of every target.
    #[test]
    fn seed_corpus_replays_without_panics() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds");
        for (name, target) in TARGETS {
            let dir = root.join(name);
            let entries = std::fs::read_dir(&dir)
                .unwrap_or_else(|e| panic!("no seed corpus at {}: {e}", dir.display()));
            let mut n = 0;
            for e in entries {
                let path = e.expect("corpus entry").path();
                let data = std::fs::read(&path).expect("seed readable");
                target(&data);
                n += 1;
            }
            assert!(n > 0, "{name}: empty seed corpus");
            eprintln!("{name}: {n} seeds replayed");
        }
    }

    /// The `state.json` seeds reach past the parser: one is a valid
    /// snapshot description, others fail validation, not parsing.
    #[test]
    fn snapshot_state_seeds_include_valid_and_invalid_descriptions() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/snapshot_state");
        let (mut valid, mut invalid) = (0, 0);
        for e in std::fs::read_dir(&dir).expect("seeds") {
            let data = std::fs::read(e.expect("entry").path()).expect("seed");
            match crate::snapshot::parse_state(&data) {
                Ok(_) => valid += 1,
                Err(crate::snapshot::StateError::Invalid(_)) => invalid += 1,
                Err(crate::snapshot::StateError::Parse(_)) => {}
            }
        }
        assert!(
            valid >= 1 && invalid >= 4,
            "valid {valid}, invalid {invalid}"
        );
    }

    /// The manifest seeds reach past the parser: two are valid snapshots
    /// (one with a volume and a working set), others fail validation.
    #[test]
    fn remote_manifest_seeds_include_valid_and_invalid_manifests() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/remote_manifest");
        let (mut valid, mut invalid) = (0, 0);
        for e in std::fs::read_dir(&dir).expect("seeds") {
            let data = std::fs::read(e.expect("entry").path()).expect("seed");
            match crate::manifest::parse_manifest(&data) {
                Ok(m) => {
                    valid += 1;
                    assert!(!m.memory_chunks().is_empty());
                }
                Err(crate::manifest::ManifestError::Invalid(_)) => invalid += 1,
                Err(_) => {}
            }
        }
        assert!(
            valid >= 2 && invalid >= 6,
            "valid {valid}, invalid {invalid}"
        );
    }
}
