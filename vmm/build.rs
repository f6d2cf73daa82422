//! Generates the guest agent's machine code (see `src/agent/asm.rs`) into
//! `OUT_DIR`, so the `vmm` binary carries the bytes and not the assembler.

// Only the generator and the constants it needs are used here; the rest of
// the included modules serves the VMM itself.
#![allow(dead_code)]

#[path = "src/agent/asm.rs"]
mod asm;
#[path = "src/layout.rs"]
mod layout;
#[path = "src/agent/protocol.rs"]
mod protocol;

use protocol::*;

fn main() {
    for f in ["src/agent/asm.rs", "src/agent/protocol.rs", "src/layout.rs"] {
        println!("cargo:rerun-if-changed={f}");
    }
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let agent: Agent = match asm::build() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("cannot generate the guest agent: {e}");
            std::process::exit(1);
        }
    };
    let write = |name: &str, bytes: &[u8]| {
        if let Err(e) = std::fs::write(out.join(name), bytes) {
            eprintln!("cannot write {name} in {}: {e}", out.display());
            std::process::exit(1);
        }
    };
    write("agent.bin", &agent.code);
    write(
        "agent.rs",
        format!(
            "/// Entry point of vCPU 0.\npub const ENTRY: u64 = {:#x};\n\
             /// Entry point of the other vCPUs.\npub const PARK: u64 = {:#x};\n",
            agent.entry, agent.park
        )
        .as_bytes(),
    );
}
