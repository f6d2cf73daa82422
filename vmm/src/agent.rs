//! The guest agent: x86-64 machine code generated with iced-x86.
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

use iced_x86::code_asm::*;
use shared::pattern::{DISK_SALT, FOLD_MUL, PATTERN_MUL_PAGE, PATTERN_MUL_SEED};

use crate::layout::{CODE, MAILBOX, SECTOR_BUF, STACK_TOP};

/// IN: the agent waits here for its next command (op code in eax).
pub const CMD_PORT: u16 = 0x510;
/// OUT: the agent finished an op; the result is in the mailbox.
pub const DONE_PORT: u16 = 0x511;
/// IN: the VM's id (u32).
pub const IDENTITY_PORT: u16 = 0x512;
/// OUT: block device command (al = [`DISK_WRITE`] or [`DISK_READ`]); the
/// sector and buffer address are in the mailbox.
pub const DISK_PORT: u16 = 0x513;
/// Block device command: write the sector buffer to the disk.
pub const DISK_WRITE: u8 = 1;
/// Block device command: read a sector into the buffer.
pub const DISK_READ: u8 = 2;

/// Mailbox byte offsets (u64 words).
pub mod mailbox {
    /// First argument: start page or sector.
    pub const ARG0: u64 = 8;
    /// Second argument: page or sector count.
    pub const ARG1: u64 = 16;
    /// Third argument: seed, or the write flag of touch.
    pub const ARG2: u64 = 24;
    /// The op's result.
    pub const RESULT: u64 = 32;
    /// Block device: sector number of the next command.
    pub const DISK_SECTOR: u64 = 40;
    /// Block device: guest-physical address of the 512-byte buffer.
    pub const DISK_BUF: u64 = 48;
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
}

/// Errors of generating the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot assemble the guest agent: {0}")]
    Assemble(#[from] IcedError),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, AgentError>;

/// The generated agent, to be loaded at [`CODE`].
#[derive(Debug, Clone)]
pub struct Agent {
    /// Machine code.
    pub code: Vec<u8>,
    /// Entry point of vCPU 0.
    pub entry: u64,
    /// Entry point of the other vCPUs (a `hlt` loop).
    pub park: u64,
}

/// Per-page loop set-up shared by the memory ops: rsi = start page,
/// rcx = pages. Jumps to `end` if there are none.
fn load_range(a: &mut CodeAssembler, end: CodeLabel) -> Result<()> {
    a.mov(rsi, qword_ptr(rbx + mailbox::ARG0))?;
    a.mov(rcx, qword_ptr(rbx + mailbox::ARG1))?;
    a.test(rcx, rcx)?;
    a.jz(end)?;
    Ok(())
}

/// rdi = address of page rsi, rdx = its sample word index.
fn page_addr(a: &mut CodeAssembler) -> Result<()> {
    a.mov(rdi, rsi)?;
    a.shl(rdi, 12)?;
    a.mov(rdx, rsi)?;
    a.and(edx, 511)?;
    Ok(())
}

/// rax = pattern word of page rsi, given r8 = seed * PATTERN_MUL_SEED and
/// r10 = PATTERN_MUL_PAGE.
fn pattern(a: &mut CodeAssembler) -> Result<()> {
    a.mov(rax, r8)?;
    a.add(rax, rsi)?;
    a.imul_2(rax, r10)?;
    a.or(rax, 1)?;
    Ok(())
}

/// r8 = r8 * PATTERN_MUL_SEED, r10 = PATTERN_MUL_PAGE.
fn pattern_setup(a: &mut CodeAssembler) -> Result<()> {
    a.mov(r9, PATTERN_MUL_SEED)?;
    a.imul_2(r8, r9)?;
    a.mov(r10, PATTERN_MUL_PAGE)?;
    Ok(())
}

/// Loop tail: next page, `dec rcx`, back to `top` while pages remain.
fn next(a: &mut CodeAssembler, top: CodeLabel) -> Result<()> {
    a.inc(rsi)?;
    a.dec(rcx)?;
    a.jnz(top)?;
    Ok(())
}

/// Issue a block device command for sector rsi with the sector buffer.
fn disk_cmd(a: &mut CodeAssembler, cmd: u8) -> Result<()> {
    a.mov(qword_ptr(rbx + mailbox::DISK_SECTOR), rsi)?;
    a.mov(qword_ptr(rbx + mailbox::DISK_BUF), rdi)?;
    a.mov(edx, u32::from(DISK_PORT))?;
    a.mov(eax, u32::from(cmd))?;
    a.out(dx, al)?;
    Ok(())
}

/// Generate the agent.
pub fn build() -> Result<Agent> {
    let mut a = CodeAssembler::new(64)?;
    let mut park = a.create_label();
    let mut entry = a.create_label();
    let mut wait = a.create_label();
    let mut done = a.create_label();
    let mut l_fill = a.create_label();
    let mut l_touch = a.create_label();
    let mut l_checksum = a.create_label();
    let mut l_verify = a.create_label();
    let mut l_identity = a.create_label();
    let mut l_disk_fill = a.create_label();
    let mut l_disk_checksum = a.create_label();

    a.set_label(&mut park)?;
    a.hlt()?;
    a.jmp(park)?;

    a.set_label(&mut entry)?;
    a.mov(rsp, STACK_TOP)?;
    a.mov(rbx, MAILBOX)?;
    a.set_label(&mut wait)?;
    a.mov(edx, u32::from(CMD_PORT))?;
    a.in_(eax, dx)?;
    for (op, label) in [
        (opcode::FILL, l_fill),
        (opcode::TOUCH, l_touch),
        (opcode::CHECKSUM, l_checksum),
        (opcode::VERIFY, l_verify),
        (opcode::IDENTITY, l_identity),
        (opcode::DISK_FILL, l_disk_fill),
        (opcode::DISK_CHECKSUM, l_disk_checksum),
    ] {
        a.cmp(eax, op)?;
        a.je(label)?;
    }
    // NONE (or an unknown op, which the VMM never sends): wait again.
    a.jmp(wait)?;

    a.set_label(&mut done)?;
    a.mov(qword_ptr(rbx + mailbox::RESULT), rax)?;
    a.mov(edx, u32::from(DONE_PORT))?;
    a.out(dx, eax)?;
    a.jmp(wait)?;

    // Fill: pattern word at word 0 and at the sample word of every page.
    {
        a.set_label(&mut l_fill)?;
        let mut top = a.create_label();
        let mut end = a.create_label();
        a.mov(r8, qword_ptr(rbx + mailbox::ARG2))?;
        pattern_setup(&mut a)?;
        load_range(&mut a, end)?;
        a.set_label(&mut top)?;
        pattern(&mut a)?;
        page_addr(&mut a)?;
        a.mov(qword_ptr(rdi), rax)?;
        a.mov(qword_ptr(rdi + rdx * 8), rax)?;
        next(&mut a, top)?;
        a.set_label(&mut end)?;
        a.xor(eax, eax)?;
        a.jmp(done)?;
    }

    // Touch: read the first byte of every page, write it back if asked.
    {
        a.set_label(&mut l_touch)?;
        let mut top = a.create_label();
        let mut skip = a.create_label();
        let mut end = a.create_label();
        a.mov(r11, qword_ptr(rbx + mailbox::ARG2))?;
        load_range(&mut a, end)?;
        a.set_label(&mut top)?;
        page_addr(&mut a)?;
        a.mov(al, byte_ptr(rdi))?;
        a.test(r11, r11)?;
        a.jz(skip)?;
        a.mov(byte_ptr(rdi), al)?;
        a.set_label(&mut skip)?;
        next(&mut a, top)?;
        a.set_label(&mut end)?;
        a.xor(eax, eax)?;
        a.jmp(done)?;
    }

    // Checksum: fold the sample word of every page.
    {
        a.set_label(&mut l_checksum)?;
        let mut top = a.create_label();
        let mut end = a.create_label();
        a.xor(r12d, r12d)?;
        a.mov(r10, FOLD_MUL)?;
        load_range(&mut a, end)?;
        a.set_label(&mut top)?;
        page_addr(&mut a)?;
        a.rol(r12, 5)?;
        a.xor(r12, qword_ptr(rdi + rdx * 8))?;
        a.imul_2(r12, r10)?;
        next(&mut a, top)?;
        a.set_label(&mut end)?;
        a.mov(rax, r12)?;
        a.jmp(done)?;
    }

    // Verify: count pages whose word 0 or sample word differ.
    {
        a.set_label(&mut l_verify)?;
        let mut top = a.create_label();
        let mut bad = a.create_label();
        let mut ok = a.create_label();
        let mut end = a.create_label();
        a.xor(r12d, r12d)?;
        a.mov(r8, qword_ptr(rbx + mailbox::ARG2))?;
        pattern_setup(&mut a)?;
        load_range(&mut a, end)?;
        a.set_label(&mut top)?;
        pattern(&mut a)?;
        page_addr(&mut a)?;
        a.cmp(qword_ptr(rdi), rax)?;
        a.jne(bad)?;
        a.cmp(qword_ptr(rdi + rdx * 8), rax)?;
        a.je(ok)?;
        a.set_label(&mut bad)?;
        a.inc(r12)?;
        a.set_label(&mut ok)?;
        next(&mut a, top)?;
        a.set_label(&mut end)?;
        a.mov(rax, r12)?;
        a.jmp(done)?;
    }

    // Identity: the VM id from the identity port (zero-extended).
    a.set_label(&mut l_identity)?;
    a.mov(edx, u32::from(IDENTITY_PORT))?;
    a.in_(eax, dx)?;
    a.jmp(done)?;

    // DiskFill: zeroed sector buffer with disk_word in its first 8 bytes.
    {
        a.set_label(&mut l_disk_fill)?;
        let mut top = a.create_label();
        let mut end = a.create_label();
        a.cld()?;
        a.mov(rdi, SECTOR_BUF)?;
        a.mov(ecx, 64)?;
        a.xor(eax, eax)?;
        a.rep().stosq()?;
        a.mov(r8, qword_ptr(rbx + mailbox::ARG2))?;
        a.mov(r9, DISK_SALT)?;
        a.xor(r8, r9)?;
        pattern_setup(&mut a)?;
        a.mov(rdi, SECTOR_BUF)?;
        load_range(&mut a, end)?;
        a.set_label(&mut top)?;
        pattern(&mut a)?;
        a.mov(qword_ptr(rdi), rax)?;
        disk_cmd(&mut a, DISK_WRITE)?;
        next(&mut a, top)?;
        a.set_label(&mut end)?;
        a.xor(eax, eax)?;
        a.jmp(done)?;
    }

    // DiskChecksum: fold the first word of every sector.
    {
        a.set_label(&mut l_disk_checksum)?;
        let mut top = a.create_label();
        let mut end = a.create_label();
        a.xor(r12d, r12d)?;
        a.mov(r10, FOLD_MUL)?;
        a.mov(rdi, SECTOR_BUF)?;
        load_range(&mut a, end)?;
        a.set_label(&mut top)?;
        disk_cmd(&mut a, DISK_READ)?;
        a.rol(r12, 5)?;
        a.xor(r12, qword_ptr(rdi))?;
        a.imul_2(r12, r10)?;
        next(&mut a, top)?;
        a.set_label(&mut end)?;
        a.mov(rax, r12)?;
        a.jmp(done)?;
    }

    let res = a.assemble_options(
        CODE,
        iced_x86::BlockEncoderOptions::RETURN_NEW_INSTRUCTION_OFFSETS,
    )?;
    let entry = res.label_ip(&entry)?;
    let park = res.label_ip(&park)?;
    Ok(Agent {
        code: res.inner.code_buffer,
        entry,
        park,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_assembles_inside_the_code_area() {
        let agent = build().unwrap();
        assert_eq!(agent.park, CODE);
        assert!(agent.entry > CODE);
        assert!((agent.code.len() as u64) < crate::layout::CODE_MAX);
        // park: hlt; jmp park
        assert_eq!(&agent.code[..3], &[0xf4, 0xeb, 0xfd]);
    }
}
