//! Port-IO devices of the agent vCPU: the identity port and the block
//! device ([`crate::block`]); plus the device state blob that travels in
//! [`shared::VmState::devices`].
//!
//! Device state: the private pages that hold the agent's state (mailbox,
//! stack), and, only while a disk op is in flight, the first word of each
//! sector of its bounce buffer. A state is captured on an instruction
//! boundary with every I/O exit complete, so a VM forked, restored or rolled
//! back in the middle of `disk_fill` or `disk_checksum` resumes with its
//! registers and needs exactly these words: `disk_checksum` folds the first
//! words of the request it has read; `disk_fill` writes a buffer that is zero
//! but for those words (see [`crate::layout::DISK_WRITE_BUF`]), which it
//! either has written for the current request already or will write next.
//! Everything else in a buffer is never read by the agent, and the write
//! buffer holds nothing else, so a fresh VMM (zeroed private region) and a
//! rollback in place (stale buffers) resume alike.

use shared::pattern::{MAX_SECTORS_PER_IO, SECTOR_SIZE};

use crate::agent::{mailbox, DISK_PORT, IDENTITY_PORT};
pub use crate::block::Disk;
use crate::block::{DiskError, Request};
use crate::layout::{DISK_BUF_END, DISK_BUF_START, MAILBOX, STACK_TOP};
use crate::memory::GuestRam;

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

    /// Handle an OUT; returns false if no device answers at `port`. A failed
    /// block request is remembered and turns the running op's reply into an
    /// error; the agent carries on, so the op still ends.
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
        Request::from_mailbox(mem, cmd)?.execute(disk, mem)
    }

    /// The first device error since the last call.
    pub fn take_error(&mut self) -> Option<DiskError> {
        self.error.take()
    }
}

/// Version tag of the device state blob: the agent pages, then the buffer
/// words of an in-flight disk op. Version 1 (agent pages only) came from an
/// agent with another mailbox layout and code, which this VMM cannot resume.
const DEVICE_STATE_V2: u32 = 2;
/// The private pages that hold agent state: mailbox, a reserved page, stack.
pub const STATE_START: u64 = MAILBOX;
const STATE_END: u64 = STACK_TOP;
pub const STATE_LEN: usize = 0x4000;
const _: () = assert!(STATE_END - STATE_START == STATE_LEN as u64);
const HEADER: usize = 4;

/// Errors of saving or restoring device state.
#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    #[error(
        "device state is {0} bytes or has an unknown version; was it captured by another build?"
    )]
    Format(usize),
    #[error("the in-flight disk op names {slots} sectors at {buf:#x}, outside the buffer window")]
    InFlight { buf: u64, slots: u64 },
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
}

/// The buffer and sector slots of the disk op in flight, from the mailbox
/// words in `pages` (the agent pages from [`STATE_START`]).
fn in_flight(pages: &[u8]) -> Result<Option<(u64, u64)>, DeviceStateError> {
    let word = |off: u64| {
        let o = usize::try_from(MAILBOX - STATE_START + off).unwrap_or(usize::MAX);
        pages
            .get(o..o.saturating_add(8))
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
            .ok_or(DeviceStateError::Format(pages.len()))
    };
    let slots = word(mailbox::DISK_SLOTS)?;
    if slots == 0 {
        return Ok(None);
    }
    let buf = word(mailbox::DISK_BUF)?;
    let fits = slots <= MAX_SECTORS_PER_IO
        && buf >= DISK_BUF_START
        && buf
            .checked_add(slots * SECTOR_SIZE)
            .is_some_and(|end| end <= DISK_BUF_END);
    if fits {
        Ok(Some((buf, slots)))
    } else {
        Err(DeviceStateError::InFlight { buf, slots })
    }
}

/// The agent's last result word in a saved state (for `vmm standalone`).
pub fn saved_result(blob: &[u8]) -> Option<u64> {
    let o = HEADER + usize::try_from(MAILBOX - STATE_START + mailbox::RESULT).ok()?;
    blob.get(o..o + 8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
}

/// Whether a saved state caught a disk op in flight (for `vmm standalone`).
pub fn saved_in_flight(blob: &[u8]) -> bool {
    blob.get(HEADER..HEADER + STATE_LEN)
        .is_some_and(|pages| matches!(in_flight(pages), Ok(Some(_))))
}

/// Save the device state of a paused VM.
pub fn save(mem: &GuestRam) -> Result<Vec<u8>, DeviceStateError> {
    let mut blob = DEVICE_STATE_V2.to_le_bytes().to_vec();
    let mut pages = vec![0u8; STATE_LEN];
    mem.read(STATE_START, &mut pages)?;
    let carry = in_flight(&pages)?;
    blob.extend_from_slice(&pages);
    if let Some((buf, slots)) = carry {
        for i in 0..slots {
            blob.extend_from_slice(&mem.read_u64(buf + i * SECTOR_SIZE)?.to_le_bytes());
        }
    }
    Ok(blob)
}

/// Restore what [`save`] captured; an empty blob restores nothing.
pub fn restore(mem: &GuestRam, blob: &[u8]) -> Result<(), DeviceStateError> {
    if blob.is_empty() {
        return Ok(());
    }
    let format = || DeviceStateError::Format(blob.len());
    if blob.len() < HEADER + STATE_LEN || blob[..HEADER] != DEVICE_STATE_V2.to_le_bytes() {
        return Err(format());
    }
    let (pages, words) = blob[HEADER..].split_at(STATE_LEN);
    let carry = in_flight(pages)?;
    let want = carry.map_or(0, |(_, slots)| slots * 8);
    if words.len() as u64 != want {
        return Err(format());
    }
    mem.write(STATE_START, pages)?;
    if let Some((buf, _)) = carry {
        for (i, w) in (0u64..).zip(words.chunks_exact(8)) {
            mem.write(buf + i * SECTOR_SIZE, w)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DISK_READ_BUF, DISK_WRITE_BUF};

    fn ram() -> GuestRam {
        GuestRam::anonymous(&[shared::GuestRegion {
            guest_phys: 0,
            size: 1 << 20,
        }])
        .unwrap()
    }

    #[test]
    fn between_ops_the_state_is_the_agent_pages_only() {
        let mem = ram();
        mem.write_u64(MAILBOX + mailbox::RESULT, 77).unwrap();
        // Stale words of an op that has ended do not travel.
        mem.write_u64(DISK_READ_BUF, 5).unwrap();
        let blob = save(&mem).unwrap();
        assert_eq!(blob.len(), HEADER + STATE_LEN);
        let other = ram();
        restore(&other, &blob).unwrap();
        assert_eq!(other.read_u64(MAILBOX + mailbox::RESULT).unwrap(), 77);
        assert_eq!(other.read_u64(DISK_READ_BUF).unwrap(), 0);
    }

    #[test]
    fn an_op_in_flight_carries_the_first_word_of_each_sector() {
        let mem = ram();
        mem.write_u64(MAILBOX + mailbox::DISK_BUF, DISK_WRITE_BUF)
            .unwrap();
        mem.write_u64(MAILBOX + mailbox::DISK_SLOTS, 3).unwrap();
        for i in 0..4u64 {
            mem.write_u64(DISK_WRITE_BUF + i * 512, 100 + i).unwrap();
        }
        let blob = save(&mem).unwrap();
        assert_eq!(blob.len(), HEADER + STATE_LEN + 3 * 8);

        // Rollback in place over stale words, and a fresh VMM, alike.
        mem.write_u64(DISK_WRITE_BUF + 512, 9).unwrap();
        for target in [&mem, &ram()] {
            restore(target, &blob).unwrap();
            for i in 0..3u64 {
                assert_eq!(target.read_u64(DISK_WRITE_BUF + i * 512).unwrap(), 100 + i);
            }
        }
    }

    #[test]
    fn bad_blobs_and_bad_in_flight_words_are_refused() {
        let mem = ram();
        mem.write_u64(MAILBOX + mailbox::DISK_BUF, DISK_READ_BUF)
            .unwrap();
        mem.write_u64(MAILBOX + mailbox::DISK_SLOTS, 2).unwrap();
        let blob = save(&mem).unwrap();
        for bad in [
            &blob[..blob.len() - 1],
            &blob[..HEADER + STATE_LEN],
            &blob[..10],
        ] {
            assert!(matches!(
                restore(&ram(), bad),
                Err(DeviceStateError::Format(_))
            ));
        }
        let mut v1 = blob[..HEADER + STATE_LEN].to_vec();
        v1[..4].copy_from_slice(&1u32.to_le_bytes());
        assert!(matches!(
            restore(&ram(), &v1),
            Err(DeviceStateError::Format(_))
        ));

        for (buf, slots) in [
            (0, 1),
            (DISK_READ_BUF, MAX_SECTORS_PER_IO + 1),
            (DISK_BUF_END - 512, 2),
        ] {
            mem.write_u64(MAILBOX + mailbox::DISK_BUF, buf).unwrap();
            mem.write_u64(MAILBOX + mailbox::DISK_SLOTS, slots).unwrap();
            assert!(matches!(save(&mem), Err(DeviceStateError::InFlight { .. })));
        }
    }
}
