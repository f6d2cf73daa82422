//! The `memory.zst` header and frame-table decoder on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    zst::fuzz_decode(data);
});
