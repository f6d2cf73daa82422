//! The generator of the guest agent: x86-64 machine code assembled with
//! iced-x86. It runs when the `vmm` crate is built (`build.rs` includes
//! this file), never in a running VMM: assembling needs iced-x86's encoder
//! tables, about 700 KB of heap that every VMM would otherwise carry for
//! its whole life. The crate's tests run it again and compare.

use iced_x86::code_asm::*;
use shared::pattern::{DISK_SALT, FOLD_MUL, PATTERN_MUL_PAGE, PATTERN_MUL_SEED};

use super::protocol::{
    mailbox, opcode, Agent, CMD_PORT, DISK_PORT, DISK_READ, DISK_WRITE, DONE_PORT, IDENTITY_PORT,
};
use crate::layout::{CODE, DISK_READ_BUF, DISK_WRITE_BUF, MAILBOX, STACK_TOP};

/// Errors of generating the agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot assemble the guest agent: {0}")]
    Assemble(#[from] IcedError),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, AgentError>;

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
    pattern_product(a)?;
    a.or(rax, 1)?;
    Ok(())
}

/// rax = the pattern word of page rsi before its low bit is set.
fn pattern_product(a: &mut CodeAssembler) -> Result<()> {
    a.mov(rax, r8)?;
    a.add(rax, rsi)?;
    a.imul_2(rax, r10)?;
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

/// Sectors of the add-in-place loop of `disk_fill`, and of the first-batch
/// loop (which pairs sectors), per iteration.
const FILL_UNROLL: i32 = 16;
const INIT_UNROLL: i32 = 8;
/// Sectors the `disk_checksum` fold takes per iteration.
const FOLD_UNROLL: i32 = 8;
const SECTOR: i32 = 512;

/// Loads of a disk op: rsi = first sector, rcx = count, rbp = sectors per
/// request. Jumps to `end` if there are no sectors.
fn disk_range(a: &mut CodeAssembler, end: CodeLabel) -> Result<()> {
    a.mov(rbp, qword_ptr(rbx + mailbox::ARG3))?;
    load_range(a, end)
}

/// r13 = sectors in the next request: min(rcx, rbp).
fn request_len(a: &mut CodeAssembler) -> Result<()> {
    a.mov(r13, rbp)?;
    a.cmp(rcx, r13)?;
    a.cmovb(r13, rcx)?;
    Ok(())
}

/// Mark a disk op on buffer `buf` in flight for `slots_reg` sectors.
fn disk_begin(a: &mut CodeAssembler, buf: u64, slots: AsmRegister64) -> Result<()> {
    a.mov(rax, buf)?;
    a.mov(qword_ptr(rbx + mailbox::DISK_BUF), rax)?;
    a.mov(qword_ptr(rbx + mailbox::DISK_SLOTS), slots)?;
    Ok(())
}

/// Issue a request of r13 sectors from sector rsi.
fn disk_request(a: &mut CodeAssembler, cmd: u8) -> Result<()> {
    a.mov(qword_ptr(rbx + mailbox::DISK_SECTOR), rsi)?;
    a.mov(qword_ptr(rbx + mailbox::DISK_COUNT), r13)?;
    a.mov(edx, u32::from(DISK_PORT))?;
    a.mov(eax, u32::from(cmd))?;
    a.out(dx, al)?;
    Ok(())
}

/// `disk_fill`: [`shared::pattern::disk_word`] in the first word of every
/// sector, zeros elsewhere.
///
/// Guest instructions are the cost, so the agent touches one word per
/// sector and never clears the buffer: [`DISK_WRITE_BUF`] is zero but for
/// those words. The first request's words are computed incrementally, two
/// sectors at a time: word(s) = ((k + s) * M) | 1 with k = seed' * M_SEED,
/// and as M is odd the parity of (k + s) * M alternates, so the words of
/// even and of odd sectors each grow by 2M. A later request of P sectors
/// (P even) needs each word grown by P * M, which keeps its parity: one
/// `add` to memory per sector. With P odd, every request recomputes; with
/// P = 1 the op is the one-sector-per-request loop of the first device.
fn disk_fill(a: &mut CodeAssembler, mut label: CodeLabel, done: CodeLabel) -> Result<()> {
    let mut one = a.create_label();
    let mut batch = a.create_label();
    let mut init = a.create_label();
    let mut init_top = a.create_label();
    let mut add_top = a.create_label();
    let mut issue = a.create_label();
    let mut finish = a.create_label();
    let mut end = a.create_label();

    a.set_label(&mut label)?;
    a.mov(r8, qword_ptr(rbx + mailbox::ARG2))?;
    a.mov(r9, DISK_SALT)?;
    a.xor(r8, r9)?;
    pattern_setup(a)?;
    disk_range(a, end)?;
    a.cmp(rbp, 1)?;
    a.je(one)?;
    request_len(a)?;
    disk_begin(a, DISK_WRITE_BUF, r13)?;
    // r14 = the growth of a word per request, r15 = 1 once the buffer
    // holds the previous request's words and P is even.
    a.mov(r14, rbp)?;
    a.imul_2(r14, r10)?;
    a.xor(r15d, r15d)?;

    a.set_label(&mut batch)?;
    request_len(a)?;
    a.test(r15, r15)?;
    a.jz(init)?;
    // Grow the words of ceil(r13 / FILL_UNROLL) * FILL_UNROLL sectors; the
    // buffer holds MAX_SECTORS_PER_IO, a multiple, and words past r13 are
    // not sent.
    a.mov(rdi, DISK_WRITE_BUF)?;
    a.lea(rdx, qword_ptr(r13 + (FILL_UNROLL - 1)))?;
    a.shr(rdx, FILL_UNROLL.trailing_zeros())?;
    a.set_label(&mut add_top)?;
    for k in 0..FILL_UNROLL {
        a.add(qword_ptr(rdi + k * SECTOR), r14)?;
    }
    a.add(rdi, FILL_UNROLL * SECTOR)?;
    a.dec(rdx)?;
    a.jnz(add_top)?;
    a.jmp(issue)?;

    // Compute the words of sectors rsi.. (rounded up to INIT_UNROLL).
    a.set_label(&mut init)?;
    pattern_product(a)?;
    a.lea(rdx, qword_ptr(rax + r10))?;
    a.or(rax, 1)?;
    a.or(rdx, 1)?;
    a.lea(r11, qword_ptr(r10 + r10))?;
    a.mov(rdi, DISK_WRITE_BUF)?;
    a.lea(r9, qword_ptr(r13 + (INIT_UNROLL - 1)))?;
    a.shr(r9, INIT_UNROLL.trailing_zeros())?;
    a.set_label(&mut init_top)?;
    for k in (0..INIT_UNROLL).step_by(2) {
        a.mov(qword_ptr(rdi + k * SECTOR), rax)?;
        a.mov(qword_ptr(rdi + (k + 1) * SECTOR), rdx)?;
        a.add(rax, r11)?;
        a.add(rdx, r11)?;
    }
    a.add(rdi, INIT_UNROLL * SECTOR)?;
    a.dec(r9)?;
    a.jnz(init_top)?;
    // r15 = 1 if P is even.
    a.mov(r15d, ebp)?;
    a.not(r15d)?;
    a.and(r15d, 1)?;

    a.set_label(&mut issue)?;
    disk_request(a, DISK_WRITE)?;
    a.add(rsi, r13)?;
    a.sub(rcx, r13)?;
    a.jnz(batch)?;
    a.jmp(finish)?;

    // One sector per request.
    a.set_label(&mut one)?;
    a.mov(r13d, 1)?;
    disk_begin(a, DISK_WRITE_BUF, r13)?;
    a.mov(rdi, DISK_WRITE_BUF)?;
    let mut top = a.create_label();
    a.set_label(&mut top)?;
    pattern(a)?;
    a.mov(qword_ptr(rdi), rax)?;
    disk_request(a, DISK_WRITE)?;
    next(a, top)?;

    a.set_label(&mut finish)?;
    a.mov(qword_ptr(rbx + mailbox::DISK_SLOTS), 0)?;
    a.set_label(&mut end)?;
    a.xor(eax, eax)?;
    a.jmp(done)?;
    Ok(())
}

/// `disk_write_pages`: requests of up to rbp sectors whose buffer is guest
/// RAM itself, from the address in ARG2 on; nothing per sector. The
/// bounce buffer holds nothing the op needs, so `DISK_SLOTS` stays 0.
fn disk_write_pages(a: &mut CodeAssembler, mut label: CodeLabel, done: CodeLabel) -> Result<()> {
    let mut top = a.create_label();
    let mut end = a.create_label();
    a.set_label(&mut label)?;
    a.mov(r12, qword_ptr(rbx + mailbox::ARG2))?;
    disk_range(a, end)?;
    a.set_label(&mut top)?;
    request_len(a)?;
    a.mov(qword_ptr(rbx + mailbox::DISK_BUF), r12)?;
    disk_request(a, DISK_WRITE)?;
    a.mov(rax, r13)?;
    a.shl(rax, SECTOR.trailing_zeros())?;
    a.add(r12, rax)?;
    a.add(rsi, r13)?;
    a.sub(rcx, r13)?;
    a.jnz(top)?;
    a.set_label(&mut end)?;
    a.xor(eax, eax)?;
    a.jmp(done)?;
    Ok(())
}

/// `disk_checksum`: fold the first word of every sector, read in requests
/// of up to rbp sectors into [`DISK_READ_BUF`].
fn disk_checksum(a: &mut CodeAssembler, mut label: CodeLabel, done: CodeLabel) -> Result<()> {
    let mut one = a.create_label();
    let mut batch = a.create_label();
    let mut group = a.create_label();
    let mut tail = a.create_label();
    let mut tail_top = a.create_label();
    let mut next_batch = a.create_label();
    let mut finish = a.create_label();
    let mut end = a.create_label();
    let fold = |a: &mut CodeAssembler, disp: i32| -> Result<()> {
        a.rol(r12, 5)?;
        a.xor(r12, qword_ptr(rdi + disp))?;
        a.imul_2(r12, r10)?;
        Ok(())
    };

    a.set_label(&mut label)?;
    a.xor(r12d, r12d)?;
    a.mov(r10, FOLD_MUL)?;
    disk_range(a, end)?;
    a.cmp(rbp, 1)?;
    a.je(one)?;
    request_len(a)?;
    disk_begin(a, DISK_READ_BUF, r13)?;

    a.set_label(&mut batch)?;
    request_len(a)?;
    disk_request(a, DISK_READ)?;
    a.mov(rdi, DISK_READ_BUF)?;
    a.mov(rdx, r13)?;
    a.cmp(rdx, FOLD_UNROLL)?;
    a.jb(tail)?;
    a.set_label(&mut group)?;
    for k in 0..FOLD_UNROLL {
        fold(a, k * SECTOR)?;
    }
    a.add(rdi, FOLD_UNROLL * SECTOR)?;
    a.sub(rdx, FOLD_UNROLL)?;
    a.cmp(rdx, FOLD_UNROLL)?;
    a.jae(group)?;
    a.set_label(&mut tail)?;
    a.test(rdx, rdx)?;
    a.jz(next_batch)?;
    a.set_label(&mut tail_top)?;
    fold(a, 0)?;
    a.add(rdi, SECTOR)?;
    a.dec(rdx)?;
    a.jnz(tail_top)?;
    a.set_label(&mut next_batch)?;
    a.add(rsi, r13)?;
    a.sub(rcx, r13)?;
    a.jnz(batch)?;
    a.jmp(finish)?;

    // One sector per request.
    a.set_label(&mut one)?;
    a.mov(r13d, 1)?;
    disk_begin(a, DISK_READ_BUF, r13)?;
    a.mov(rdi, DISK_READ_BUF)?;
    let mut top = a.create_label();
    a.set_label(&mut top)?;
    disk_request(a, DISK_READ)?;
    fold(a, 0)?;
    next(a, top)?;

    a.set_label(&mut finish)?;
    a.mov(qword_ptr(rbx + mailbox::DISK_SLOTS), 0)?;
    a.set_label(&mut end)?;
    a.mov(rax, r12)?;
    a.jmp(done)?;
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
    let l_disk_fill = a.create_label();
    let l_disk_checksum = a.create_label();
    let l_disk_write_pages = a.create_label();

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
        (opcode::DISK_WRITE_PAGES, l_disk_write_pages),
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

    disk_fill(&mut a, l_disk_fill, done)?;
    disk_checksum(&mut a, l_disk_checksum, done)?;
    disk_write_pages(&mut a, l_disk_write_pages, done)?;

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
