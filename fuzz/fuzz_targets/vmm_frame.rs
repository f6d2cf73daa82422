//! Fuzz the VMM frame decoder: arbitrary bytes on a real socket pair must
//! give a message or an error, never a panic.
#![no_main]

use std::io::Write;
use std::os::unix::net::UnixStream;

use libfuzzer_sys::fuzz_target;
use proto::vmm::{ServerMsg, VmmMsg};

fuzz_target!(|data: &[u8]| {
    // Header + payload decoding straight from bytes.
    if data.len() >= proto::frame::HEADER_LEN {
        let mut h = [0u8; proto::frame::HEADER_LEN];
        h.copy_from_slice(&data[..proto::frame::HEADER_LEN]);
        let _ = proto::frame::Header::decode(&h);
    }
    let _ = proto::vmm::decode::<VmmMsg>(data);
    let _ = proto::vmm::decode::<ServerMsg>(data);
    // The whole receive path over a socket.
    if let Ok((mut a, b)) = UnixStream::pair() {
        if a.write_all(data).is_ok() {
            drop(a);
            while proto::vmm::recv::<VmmMsg>(&b).is_ok() {}
        }
    }
});
