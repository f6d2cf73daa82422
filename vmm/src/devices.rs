//! Port-IO devices of the agent vCPU: the identity port and a paravirtual
//! block device over the disk fd; plus the device state blob that travels
//! in [`shared::VmState::devices`].
//!
//! Block device: the guest puts a sector number and a buffer address in the
//! mailbox and writes [`DISK_WRITE`] or [`DISK_READ`] to [`DISK_PORT`]; the
//! VMM moves 512 bytes between the disk fd and guest memory. A failure is
//! remembered and turns the running op's reply into an error.

use std::fs::File;
use std::os::unix::fs::FileExt;

use shared::pattern::SECTOR_SIZE;

use crate::agent::{mailbox, DISK_PORT, DISK_READ, DISK_WRITE, IDENTITY_PORT};
use crate::layout::{MAILBOX, STACK_TOP};
use crate::memory::GuestRam;

/// The disk volume attached to the VM.
#[derive(Debug)]
pub struct Disk {
    /// The volume's fd.
    pub file: File,
    /// Its size in bytes.
    pub bytes: u64,
}

impl Disk {
    /// Whole sectors on the disk.
    pub fn sectors(&self) -> u64 {
        self.bytes / SECTOR_SIZE
    }
}

/// A block device command that failed.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("the VM has no disk")]
    NoDisk,
    #[error("cannot read the block device mailbox")]
    Mailbox(#[source] crate::memory::MemoryError),
    #[error("sector {sector} is past the end of the disk ({sectors} sectors)")]
    PastEnd { sector: u64, sectors: u64 },
    #[error("cannot write sector {sector}")]
    Write {
        sector: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read sector {sector}")]
    Read {
        sector: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("unknown block device command {0}")]
    UnknownCommand(u8),
}

/// Devices seen by the agent vCPU.
#[derive(Debug)]
pub struct Devices {
    vm_id: u32,
    disk: Option<Disk>,
    error: Option<DiskError>,
}

impl Devices {
    /// Devices of VM `vm_id`, with an optional disk.
    pub fn new(vm_id: u32, disk: Option<Disk>) -> Self {
        Devices {
            vm_id,
            disk,
            error: None,
        }
    }

    /// Value of an IN from `port`, or `None` if no device answers there.
    pub fn io_in(&mut self, port: u16) -> Option<u32> {
        (port == IDENTITY_PORT).then_some(self.vm_id)
    }

    /// Handle an OUT; returns false if no device answers at `port`.
    pub fn io_out(&mut self, mem: &GuestRam, port: u16, data: &[u8]) -> bool {
        if port != DISK_PORT {
            return false;
        }
        if let Err(e) = self.disk_command(mem, data.first().copied().unwrap_or(0)) {
            tracing::warn!(error = %shared::error_chain(&e), "block device command failed");
            self.error.get_or_insert(e);
        }
        true
    }

    fn disk_command(&mut self, mem: &GuestRam, cmd: u8) -> Result<(), DiskError> {
        let disk = self.disk.as_ref().ok_or(DiskError::NoDisk)?;
        let sector = mem
            .read_u64(MAILBOX + mailbox::DISK_SECTOR)
            .map_err(DiskError::Mailbox)?;
        let buf = mem
            .read_u64(MAILBOX + mailbox::DISK_BUF)
            .map_err(DiskError::Mailbox)?;
        if sector >= disk.sectors() {
            return Err(DiskError::PastEnd {
                sector,
                sectors: disk.sectors(),
            });
        }
        let mut bytes = [0u8; SECTOR_BYTES];
        let off = sector * SECTOR_SIZE;
        match cmd {
            DISK_WRITE => {
                mem.read(buf, &mut bytes).map_err(DiskError::Mailbox)?;
                disk.file
                    .write_all_at(&bytes, off)
                    .map_err(|e| DiskError::Write { sector, source: e })
            }
            DISK_READ => {
                disk.file
                    .read_exact_at(&mut bytes, off)
                    .map_err(|e| DiskError::Read { sector, source: e })?;
                mem.write(buf, &bytes).map_err(DiskError::Mailbox)
            }
            other => Err(DiskError::UnknownCommand(other)),
        }
    }

    /// The first device error since the last call.
    pub fn take_error(&mut self) -> Option<DiskError> {
        self.error.take()
    }
}

/// Version tag of the device state blob.
const DEVICE_STATE_V1: u32 = 1;
/// The private pages that hold agent state: mailbox, sector buffer, stack.
const STATE_START: u64 = MAILBOX;
const STATE_END: u64 = STACK_TOP;
const STATE_LEN: usize = 0x4000;
const _: () = assert!(STATE_END - STATE_START == STATE_LEN as u64);
/// [`SECTOR_SIZE`] as a buffer length.
const SECTOR_BYTES: usize = 512;
const _: () = assert!(SECTOR_BYTES as u64 == SECTOR_SIZE);

/// Errors of saving or restoring device state.
#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    #[error(
        "device state is {0} bytes or has an unknown version; was it captured by another build?"
    )]
    Format(usize),
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
}

/// Device state: the agent's mailbox, sector buffer and stack, so a child
/// forked in the middle of an op finds its arguments where it left them.
pub fn save(mem: &GuestRam) -> Result<Vec<u8>, DeviceStateError> {
    let mut blob = DEVICE_STATE_V1.to_le_bytes().to_vec();
    let mut pages = vec![0u8; STATE_LEN];
    mem.read(STATE_START, &mut pages)?;
    blob.extend_from_slice(&pages);
    Ok(blob)
}

/// Restore what [`save`] captured; an empty blob restores nothing.
pub fn restore(mem: &GuestRam, blob: &[u8]) -> Result<(), DeviceStateError> {
    if blob.is_empty() {
        return Ok(());
    }
    let want = 4 + STATE_LEN;
    if blob.len() != want || blob[..4] != DEVICE_STATE_V1.to_le_bytes() {
        return Err(DeviceStateError::Format(blob.len()));
    }
    mem.write(STATE_START, &blob[4..])?;
    Ok(())
}
