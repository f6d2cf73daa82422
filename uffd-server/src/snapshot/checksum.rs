//! File checksums: SHA-256 of a file's whole logical content. Holes are
//! hashed as the zeroes they read as, without reading them from disk, so a
//! mostly-empty image of a large VM hashes at the speed of its data.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use sha2::{Digest, Sha256};

use super::image::data_ranges;
use super::FileSum;

/// Bytes read (or zero bytes fed) per step.
const STEP: usize = 1 << 20;

/// Size and SHA-256 of `file`'s content.
pub fn sum_file(file: &File) -> std::io::Result<FileSum> {
    let len = file.metadata()?.len();
    let mut h = Sha256::new();
    let mut buf = vec![0u8; STEP];
    let zeros = vec![0u8; STEP];
    let mut pos = 0u64;
    let feed_zeros = |h: &mut Sha256, mut n: u64| {
        while n > 0 {
            let k = n.min(STEP as u64);
            h.update(&zeros[..shared::geometry::usize_of(k)]);
            n -= k;
        }
    };
    for (start, end) in data_ranges(file.as_raw_fd(), len)? {
        feed_zeros(&mut h, start - pos);
        let mut off = start;
        while off < end {
            let k = shared::geometry::usize_of((end - off).min(STEP as u64));
            file.read_exact_at(&mut buf[..k], off)?;
            h.update(&buf[..k]);
            off += k as u64;
        }
        pos = end;
    }
    feed_zeros(&mut h, len - pos);
    let digest = h.finalize();
    Ok(FileSum {
        bytes: len,
        sha256: digest.iter().map(|b| format!("{b:02x}")).collect(),
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    #[test]
    fn holes_hash_as_zeroes() {
        let mut dense = tempfile::tempfile().unwrap();
        let mut data = vec![0u8; 3 << 20];
        data[(2 << 20) + 5] = 7;
        dense.write_all(&data).unwrap();
        let sparse = tempfile::tempfile().unwrap();
        sparse.set_len(3 << 20).unwrap();
        sparse.write_all_at(&[7], (2 << 20) + 5).unwrap();
        let a = sum_file(&dense).unwrap();
        let b = sum_file(&sparse).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.bytes, 3 << 20);
        sparse.write_all_at(&[1], 0).unwrap();
        assert_ne!(sum_file(&sparse).unwrap(), a);
    }
}
