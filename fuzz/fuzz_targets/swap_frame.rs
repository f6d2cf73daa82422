//! The swap store's frame header and index scan on arbitrary bytes (see
//! `uffd_server::reclaim::store::fuzz_frames`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    uffd_server::reclaim::store::fuzz_frames(data);
});
