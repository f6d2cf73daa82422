//! The guest agent: x86-64 machine code generated with iced-x86 when the
//! crate is built (see [`asm`]), and the protocol it speaks.
//!
//! Protocol (vCPU 0):
//! ```text
//!  guest                                   VMM (vCPU thread)
//!   in  eax, CMD_PORT  ------------------>  blocks until a command or a pause;
//!                      <------------------  writes args to the mailbox, eax = op (0 = none)
//!   runs the op, result -> mailbox[RESULT]
//!   out DONE_PORT      ------------------>  reads the result, replies
//!   (loops back to the IN)
//! ```
//! A vCPU paused in its command wait has its IN completed with 0, so its
//! state (and a fork child restored from it) sits right after the IN and
//! loops back to wait for its own next command.
//!
//! The ops compute exactly [`shared::pattern`]'s functions, at page
//! granularity: guest pages are identity-mapped, page `p` is at `p << 12`.
//! Other vCPUs run [`Agent::park`]: `hlt` in a loop.

mod protocol;
pub use protocol::*;

#[cfg(test)]
mod asm;

/// Where the generated code and its entry points were written at build
/// time.
mod generated {
    include!(concat!(env!("OUT_DIR"), "/agent.rs"));
}

/// The agent's machine code, as generated when the crate was built.
pub const CODE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/agent.bin"));

/// Entry points of the generated code.
pub use generated::{ENTRY, PARK};

/// The agent, as generated when the crate was built.
#[cfg(test)]
pub fn prebuilt() -> Agent {
    Agent {
        code: CODE.to_vec(),
        entry: generated::ENTRY,
        park: generated::PARK,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prebuilt_agent_is_what_the_generator_makes() {
        let built = asm::build().unwrap();
        let pre = prebuilt();
        assert_eq!(pre.code, built.code);
        assert_eq!((pre.entry, pre.park), (built.entry, built.park));
    }
}
