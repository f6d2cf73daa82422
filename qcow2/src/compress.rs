//! Decompression of compressed clusters: raw deflate or zstd, always into
//! exactly one cluster.
//!
//! The stored length is rounded up to 512-byte sectors, so the input may
//! carry trailing bytes of whatever follows; decoding stops once the
//! cluster is full. Output never exceeds the cluster, and zstd's window is
//! capped so a hostile frame cannot make the decoder allocate more than a
//! few MiB.

use flate2::{Decompress, FlushDecompress, Status};
use zstd::stream::raw::{DParameter, Decoder, InBuffer, Operation, OutBuffer};

use crate::error::{invalid, Result};
use crate::header::Compression;

/// Inflate `input` into all of `out` (one cluster).
pub fn decompress(kind: Compression, input: &[u8], out: &mut [u8]) -> Result<()> {
    match kind {
        Compression::Deflate => inflate(input, out),
        Compression::Zstd => unzstd(input, out),
    }
}

fn inflate(input: &[u8], out: &mut [u8]) -> Result<()> {
    let mut d = Decompress::new(false);
    match d.decompress(input, out, FlushDecompress::Finish) {
        Ok(Status::Ok | Status::StreamEnd | Status::BufError)
            if d.total_out() == out.len() as u64 =>
        {
            Ok(())
        }
        _ => invalid("a compressed cluster does not inflate to a whole cluster"),
    }
}

fn unzstd(input: &[u8], out: &mut [u8]) -> Result<()> {
    let bad = || invalid("a zstd-compressed cluster does not decode to a whole cluster");
    let Ok(mut d) = Decoder::new() else {
        return bad();
    };
    // Clusters are at most 2 MiB; qemu's frames never need a larger window.
    if d.set_parameter(DParameter::WindowLogMax(22)).is_err() {
        return bad();
    }
    let mut inb = InBuffer::around(input);
    let mut outb = OutBuffer::around(out);
    loop {
        let (ipos, opos) = (inb.pos(), outb.pos());
        if d.run(&mut inb, &mut outb).is_err() {
            return bad();
        }
        if outb.pos() == outb.capacity() {
            return Ok(());
        }
        if inb.pos() == ipos && outb.pos() == opos {
            return bad();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn raw_deflate_with_trailing_garbage_fills_the_cluster() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(&data).unwrap();
        let mut c = e.finish().unwrap();
        c.extend_from_slice(&[0xff; 300]);
        let mut out = vec![0u8; 4096];
        decompress(Compression::Deflate, &c, &mut out).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn zstd_with_trailing_garbage_fills_the_cluster() {
        let data = vec![7u8; 65536];
        let mut c = zstd::bulk::compress(&data, 3).unwrap();
        c.extend_from_slice(&[0u8; 100]);
        let mut out = vec![0u8; 65536];
        decompress(Compression::Zstd, &c, &mut out).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn a_short_stream_is_an_error() {
        let mut out = vec![0u8; 4096];
        assert!(decompress(Compression::Deflate, &[0x03, 0x00], &mut out).is_err());
        assert!(decompress(Compression::Zstd, &[], &mut out).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048), z in any::<bool>()) {
            let mut out = vec![0u8; 4096];
            let _ = decompress(if z { Compression::Zstd } else { Compression::Deflate }, &bytes, &mut out);
        }
    }
}
