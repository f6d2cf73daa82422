//! Fuzz the qcow2 reader: any bytes open as an image (and read a few
//! clusters of every view) or give an error, never a panic (see
//! `qcow2::fuzz`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| qcow2::fuzz::image(data));
