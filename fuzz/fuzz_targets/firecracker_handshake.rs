//! Fuzz the Firecracker handshake parser: any bytes give regions or an
//! error, never a panic (see `proto::fuzz`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| proto::fuzz::firecracker_handshake(data));
