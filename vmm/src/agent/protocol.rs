//! The agent's side of the protocol: ports, mailbox words, op codes, and
//! the shape of the generated code. Shared by the running VMM and by the
//! generator at build time (`build.rs` includes this file).

/// IN: the agent waits here for its next command (op code in eax).
pub const CMD_PORT: u16 = 0x510;
/// OUT: the agent finished an op; the result is in the mailbox.
pub const DONE_PORT: u16 = 0x511;
/// IN: the VM's id (u32).
pub const IDENTITY_PORT: u16 = 0x512;
/// OUT: block device request (al = [`DISK_WRITE`] or [`DISK_READ`]); the
/// sector, count and buffer address are in the mailbox (see
/// [`crate::block`]).
pub const DISK_PORT: u16 = 0x513;
/// Block device command: write the buffer to the disk.
pub const DISK_WRITE: u8 = 1;
/// Block device command: read sectors into the buffer.
pub const DISK_READ: u8 = 2;

/// Mailbox byte offsets (u64 words).
pub mod mailbox {
    /// First argument: start page or sector.
    pub const ARG0: u64 = 8;
    /// Second argument: page or sector count.
    pub const ARG1: u64 = 16;
    /// Third argument: seed, the write flag of touch, or the guest address
    /// `disk_write_pages` writes from.
    pub const ARG2: u64 = 24;
    /// Fourth argument: sectors per block device request of a disk op.
    pub const ARG3: u64 = 32;
    /// The argument words, in order.
    pub const ARGS: [u64; 4] = [ARG0, ARG1, ARG2, ARG3];
    /// The op's result.
    pub const RESULT: u64 = 40;
    /// Block device: first sector of the next request.
    pub const DISK_SECTOR: u64 = 48;
    /// Block device: guest-physical address of the request's buffer.
    pub const DISK_BUF: u64 = 56;
    /// Block device: sectors in the next request.
    pub const DISK_COUNT: u64 = 64;
    /// Sectors of `DISK_BUF` whose first words a disk op in flight still
    /// needs (0 between disk ops); see [`crate::devices`].
    pub const DISK_SLOTS: u64 = 72;
}

/// Op codes the VMM returns from the command IN.
pub mod opcode {
    /// No command: wait again.
    pub const NONE: u32 = 0;
    pub const FILL: u32 = 1;
    pub const TOUCH: u32 = 2;
    pub const CHECKSUM: u32 = 3;
    pub const VERIFY: u32 = 4;
    pub const IDENTITY: u32 = 5;
    pub const DISK_FILL: u32 = 6;
    pub const DISK_CHECKSUM: u32 = 7;
    pub const DISK_WRITE_PAGES: u32 = 8;
}

/// The generated agent, to be loaded at `layout::CODE`. The generator
/// (the build script, and tests) makes it; the VMM itself uses the bytes
/// and entry points it left in `OUT_DIR` (see [`crate::agent::CODE`]).
#[cfg_attr(not(test), allow(dead_code))]
#[derive(Debug, Clone)]
pub struct Agent {
    /// Machine code.
    pub code: Vec<u8>,
    /// Entry point of vCPU 0.
    pub entry: u64,
    /// Entry point of the other vCPUs (a `hlt` loop).
    pub park: u64,
}
