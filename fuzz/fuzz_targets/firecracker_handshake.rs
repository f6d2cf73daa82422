//! Fuzz the Firecracker handshake parser: any bytes give regions or an
//! error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = proto::firecracker::parse_regions(data, 1 << 30);
});
