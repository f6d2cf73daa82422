//! Fuzz the VMM frame decoder: arbitrary bytes on a real socket pair must
//! give a message or an error, never a panic (see `proto::fuzz`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| proto::fuzz::vmm_frame(data));
