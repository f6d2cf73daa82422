//! A remote snapshot's manifest parser and validation on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    proto::fuzz::remote_manifest(data);
});
