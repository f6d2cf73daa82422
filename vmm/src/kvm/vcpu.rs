//! One vCPU thread: long-mode set-up, the run loop, the agent's command
//! wait, and parking at a consistent point on pause.
//!
//! Pausing: the control thread sets `pause` and kicks the thread with a
//! signal (KVM_RUN returns EINTR). Before parking, the thread re-enters
//! KVM_RUN once with `immediate_exit = 1`: KVM completes any pending I/O
//! (such as the command IN, answered 0) and returns EINTR without running
//! guest code, so the captured state sits on an instruction boundary.

use std::sync::Arc;

use kvm_bindings::kvm_segment;
use kvm_ioctls::{VcpuExit, VcpuFd};

use super::control::{Control, Job};
use super::event::{EventSink, VcpuEvent};
use crate::agent::{mailbox, opcode, CMD_PORT, DONE_PORT};
use crate::devices::Devices;
use crate::layout::{self, CS_SELECTOR, DS_SELECTOR, GDT, GDT_ENTRIES, MAILBOX, PML4, STACK_TOP};
use crate::memory::GuestRam;
use crate::state::{self, StateError};

/// Errors of a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    #[error("cannot set up vCPU registers")]
    Setup(#[source] kvm_ioctls::Error),
    #[error("KVM_RUN failed")]
    Run(#[source] kvm_ioctls::Error),
    #[error("guest stopped with an unexpected exit: {0}")]
    UnexpectedExit(String),
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
    #[error(
        "guest RAM at {0:#x} cannot be mapped: the server could not serve the page \
         (see its log), or no huge page was free to copy it on write"
    )]
    UnmappableRam(u64),
}

/// The page KVM traps as MMIO even without an in-kernel APIC.
const APIC_PAGE: u64 = 0xfee0_0000;

/// KVM reports an access to any other RAM page as MMIO only when it could
/// not map the page: the server poisoned it (its bytes could not be had),
/// or a copy on write found no free huge page. Touching it here would end
/// the process with SIGBUS; say why instead.
fn unmappable_ram(addr: u64) -> Result<()> {
    if addr & !(shared::PAGE_SIZE - 1) == APIC_PAGE {
        return Ok(());
    }
    Err(VcpuError::UnmappableRam(addr))
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, VcpuError>;

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const CR4_OSFXSR: u64 = 1 << 9;
const CR4_OSXMMEXCPT: u64 = 1 << 10;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

fn segment(selector: u16, descriptor: u64) -> kvm_segment {
    // Decode the GDT descriptor's flags so the cached segment matches it.
    let bit = |n: u32| u8::from(descriptor >> n & 1 == 1);
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: u8::try_from(descriptor >> 40 & 0xf).unwrap_or(0),
        present: bit(47),
        dpl: 0,
        db: bit(54),
        s: bit(44),
        l: bit(53),
        g: bit(55),
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// Put a fresh vCPU in 64-bit long mode at `entry`, with the page tables
/// and GDT of [`layout`].
pub fn setup_long_mode(fd: &VcpuFd, entry: u64) -> Result<()> {
    let mut sregs = fd.get_sregs().map_err(VcpuError::Setup)?;
    let code = segment(CS_SELECTOR, GDT_ENTRIES[1]);
    let data = segment(DS_SELECTOR, GDT_ENTRIES[2]);
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.gdt.base = GDT;
    sregs.gdt.limit = u16::try_from(GDT_ENTRIES.len() * 8 - 1).unwrap_or(u16::MAX);
    sregs.cr3 = PML4;
    sregs.cr4 = CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT;
    sregs.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_PG;
    sregs.efer = EFER_LME | EFER_LMA;
    fd.set_sregs(&sregs).map_err(VcpuError::Setup)?;
    let regs = kvm_bindings::kvm_regs {
        rip: entry,
        rsp: STACK_TOP,
        rflags: 2,
        ..Default::default()
    };
    fd.set_regs(&regs).map_err(VcpuError::Setup)?;
    debug_assert!(entry >= layout::CODE);
    Ok(())
}

/// What one vCPU thread owns.
pub struct VcpuThread {
    /// vCPU index.
    pub index: usize,
    /// The vCPU.
    pub fd: VcpuFd,
    /// Shared pause/command state.
    pub ctl: Arc<Control>,
    /// Guest memory.
    pub mem: Arc<GuestRam>,
    /// Devices (vCPU 0 only).
    pub devices: Option<Devices>,
    /// Where to report readiness and fatal errors.
    pub events: EventSink,
}

/// What the run loop does after handling an exit.
enum Next {
    Run,
    Exit,
    /// Parked, then loaded with another state (a rollback).
    Reloaded,
}

impl VcpuThread {
    /// The thread body: run until stopped, report a fatal error.
    pub fn run(mut self) {
        if let Err(e) = self.run_loop() {
            let reason = format!("vCPU {}: {}", self.index, shared::error_chain(&e));
            tracing::error!("{reason}");
            (self.events)(VcpuEvent::Fatal(reason));
        }
    }

    fn run_loop(&mut self) -> Result<()> {
        let mut current: Option<Job> = None;
        let mut announced = false;
        loop {
            let (pause, stop) = {
                let s = self.ctl.lock();
                (s.pause, s.stop)
            };
            if stop {
                return Ok(());
            }
            if pause {
                match self.park()? {
                    Next::Exit => return Ok(()),
                    Next::Reloaded => {
                        // The op in flight belongs to the discarded past.
                        if let Some(job) = current.take() {
                            (job.reply)(Err(proto::vmm::RequestError::Guest(
                                "the VM was rolled back while the op ran".into(),
                            )));
                        }
                    }
                    Next::Run => {}
                }
                continue;
            }
            let next = match self.fd.run() {
                Ok(VcpuExit::IoIn(CMD_PORT, data)) => {
                    if !announced {
                        announced = true;
                        (self.events)(VcpuEvent::Ready);
                    }
                    let op = wait_command(&self.ctl, &self.mem, &mut current)?;
                    put_in(data, op);
                    Next::Run
                }
                Ok(VcpuExit::IoIn(port, data)) => {
                    let v = self
                        .devices
                        .as_mut()
                        .and_then(|d| d.io_in(port))
                        .unwrap_or(u32::MAX);
                    put_in(data, v);
                    Next::Run
                }
                Ok(VcpuExit::IoOut(DONE_PORT, _)) => {
                    let value = self.mem.read_u64(MAILBOX + mailbox::RESULT)?;
                    let err = self.devices.as_mut().and_then(Devices::take_error);
                    match current.take() {
                        Some(job) => (job.reply)(match err {
                            None => Ok(value),
                            Some(e) => {
                                Err(proto::vmm::RequestError::Guest(shared::error_chain(&e)))
                            }
                        }),
                        None => tracing::debug!(
                            value,
                            "agent finished an op this VMM did not start (fork child)"
                        ),
                    }
                    Next::Run
                }
                Ok(VcpuExit::IoOut(port, data)) => {
                    let handled = match self.devices.as_mut() {
                        Some(d) => d.io_out(&self.mem, port, data),
                        None => false,
                    };
                    if !handled {
                        tracing::debug!(port, "OUT to a port without a device");
                    }
                    Next::Run
                }
                // KVM traps some RAM pages as MMIO (here: the local APIC page
                // at 0xfee0_0000, even without an in-kernel irqchip); emulate
                // those accesses on the RAM mapping so RAM has no holes.
                Ok(VcpuExit::MmioRead(addr, data)) if self.mem.is_ram(addr, data.len()) => {
                    unmappable_ram(addr)?;
                    self.mem.read(addr, data)?;
                    Next::Run
                }
                Ok(VcpuExit::MmioWrite(addr, data)) if self.mem.is_ram(addr, data.len()) => {
                    unmappable_ram(addr)?;
                    self.mem.write(addr, data)?;
                    Next::Run
                }
                Ok(VcpuExit::Hlt) => {
                    // Parked vCPUs halt; wait for a pause or stop, no spin.
                    let mut s = self.ctl.lock();
                    while !s.pause && !s.stop {
                        s = self.ctl.wait(s);
                    }
                    Next::Run
                }
                Ok(VcpuExit::Intr) => Next::Run,
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Next::Run,
                Err(e) => return Err(VcpuError::Run(e)),
                Ok(other) => return Err(VcpuError::UnexpectedExit(format!("{other:?}"))),
            };
            if let Next::Exit = next {
                return Ok(());
            }
        }
    }

    /// Finish pending I/O without running guest code, capture state, and
    /// wait until resumed or stopped.
    fn park(&mut self) -> Result<Next> {
        self.fd.set_kvm_immediate_exit(1);
        let res = loop {
            match self.fd.run() {
                Ok(VcpuExit::Intr) => break Ok(()),
                Err(e) if e.errno() == libc::EINTR => break Ok(()),
                Err(e) if e.errno() == libc::EAGAIN => continue,
                Err(e) => break Err(VcpuError::Run(e)),
                Ok(other) => {
                    break Err(VcpuError::UnexpectedExit(format!(
                        "{other:?} while pausing"
                    )))
                }
            }
        };
        self.fd.set_kvm_immediate_exit(0);
        res?;
        let captured = state::capture(&self.fd)?;
        let mut s = self.ctl.lock();
        s.paused[self.index] = Some(captured);
        self.ctl.notify();
        while s.pause && !s.stop {
            s = self.ctl.wait(s);
        }
        s.paused[self.index] = None;
        let load = s.load[self.index].take();
        if s.stop {
            return Ok(Next::Exit);
        }
        drop(s);
        match load {
            Some(state) => {
                state::restore(&self.fd, &state)?;
                Ok(Next::Reloaded)
            }
            None => Ok(Next::Run),
        }
    }
}

/// Complete an IN with `value` (little-endian, as wide as the access).
fn put_in(data: &mut [u8], value: u32) {
    let b = value.to_le_bytes();
    let n = data.len().min(4);
    data[..n].copy_from_slice(&b[..n]);
}

/// The agent's command wait: block until a command is queued (returns its
/// op code after writing its arguments to the mailbox) or a pause or stop is
/// requested (returns [`opcode::NONE`]).
fn wait_command(ctl: &Control, mem: &GuestRam, current: &mut Option<Job>) -> Result<u32> {
    let mut s = ctl.lock();
    loop {
        if s.pause || s.stop {
            return Ok(opcode::NONE);
        }
        if let Some(job) = s.queue.pop_front() {
            drop(s);
            for (word, a) in mailbox::ARGS.iter().zip(&job.args) {
                mem.write_u64(MAILBOX + word, *a)?;
            }
            let op = job.opcode;
            *current = Some(job);
            return Ok(op);
        }
        s = ctl.wait(s);
    }
}
