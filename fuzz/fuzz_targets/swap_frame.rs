//! The swap store's frame header and index scan on arbitrary bytes (see
//! `swapstore::fuzz_frames`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    swapstore::fuzz_frames(data);
});
