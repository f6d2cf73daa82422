//! A snapshot's `state.json` parser and validation on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    proto::fuzz::snapshot_state(data);
});
