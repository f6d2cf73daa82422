//! The guest block device: requests of 1 to [`MAX_SECTORS_PER_IO`]
//! sectors between the disk fd and a bounce buffer in the VMM-private
//! region.
//!
//! ```text
//!  agent                                        VMM (vCPU 0 thread)
//!   mailbox[DISK_SECTOR, DISK_COUNT, DISK_BUF] = sector, count, buffer
//!   out DISK_PORT, DISK_WRITE | DISK_READ ---->  Request::from_mailbox, check
//!                                                pwrite / pread of count
//!                                                sectors, straight from / into
//!                                                the buffer (no copy)
//!   (the OUT completes)  <----------------------
//! ```
//! Every word of a request comes from guest memory, so it is checked before
//! a byte moves: the count is 1 to [`MAX_SECTORS_PER_IO`], the sectors lie on
//! the disk, and the buffer lies inside the window
//! `[DISK_BUF_START, DISK_BUF_END)` of the private region or, for a write
//! only, inside one guest RAM region: a write then goes to the disk
//! straight from the guest's pages, as a DMA would (`disk_write_pages`),
//! and through the same mapping the server's userfaultfd serves, so pages
//! not yet present are fetched on the way. A read never lands in guest RAM,
//! and the page tables and the agent code are never a buffer.

use std::fs::File;
use std::os::unix::fs::FileExt;

use shared::pattern::{MAX_SECTORS_PER_IO, SECTOR_SIZE};
use vm_memory::{GuestAddress, GuestMemoryBackend};

use crate::agent::{mailbox, DISK_READ, DISK_WRITE};
use crate::layout::{DISK_BUF_END, DISK_BUF_START, MAILBOX};
use crate::memory::{GuestRam, MemoryError};

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

/// A block device request that failed.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("the VM has no disk")]
    NoDisk,
    #[error("cannot read the block device mailbox")]
    Mailbox(#[source] MemoryError),
    #[error("unknown block device command {0}")]
    UnknownCommand(u8),
    #[error("a request of {0} sectors; the device takes 1 to {MAX_SECTORS_PER_IO}")]
    BadCount(u64),
    #[error("sectors {sector}..{end} are past the end of the disk ({sectors} sectors)", end = sector.saturating_add(*count))]
    PastEnd {
        sector: u64,
        count: u64,
        sectors: u64,
    },
    #[error(
        "buffer {buf:#x} of {count} sectors is outside the device's window \
         {DISK_BUF_START:#x}..{DISK_BUF_END:#x}{}",
        if *from_ram_allowed { " and outside guest RAM" } else { " (a read never lands in guest RAM)" }
    )]
    BufferOutside {
        buf: u64,
        count: u64,
        /// Whether the request could have used guest RAM (a write).
        from_ram_allowed: bool,
    },
    #[error("cannot map the buffer at {buf:#x}")]
    MapBuffer {
        buf: u64,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    #[error("cannot write sectors {sector}..{}", sector + count)]
    Write {
        sector: u64,
        count: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read sectors {sector}..{}", sector + count)]
    Read {
        sector: u64,
        count: u64,
        #[source]
        source: std::io::Error,
    },
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, DiskError>;

/// Direction of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Buffer to disk.
    Write,
    /// Disk to buffer.
    Read,
}

/// One request as the agent left it in the mailbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub command: Command,
    pub sector: u64,
    pub count: u64,
    pub buf: u64,
}

impl Request {
    /// The request of command byte `cmd` and the mailbox words.
    pub fn from_mailbox(mem: &GuestRam, cmd: u8) -> Result<Self> {
        let command = match cmd {
            DISK_WRITE => Command::Write,
            DISK_READ => Command::Read,
            other => return Err(DiskError::UnknownCommand(other)),
        };
        let word = |off| mem.read_u64(MAILBOX + off).map_err(DiskError::Mailbox);
        Ok(Request {
            command,
            sector: word(mailbox::DISK_SECTOR)?,
            count: word(mailbox::DISK_COUNT)?,
            buf: word(mailbox::DISK_BUF)?,
        })
    }

    /// Check the request against a disk of `disk_sectors` sectors and a
    /// guest whose RAM holds `[addr, addr + len)` when `in_ram(addr, len)`;
    /// returns its length in bytes.
    pub fn check(&self, disk_sectors: u64, in_ram: impl Fn(u64, usize) -> bool) -> Result<usize> {
        let Request {
            sector, count, buf, ..
        } = *self;
        if !(1..=MAX_SECTORS_PER_IO).contains(&count) {
            return Err(DiskError::BadCount(count));
        }
        if sector
            .checked_add(count)
            .is_none_or(|end| end > disk_sectors)
        {
            return Err(DiskError::PastEnd {
                sector,
                count,
                sectors: disk_sectors,
            });
        }
        let len = count * SECTOR_SIZE;
        // At most 1 MiB: fits any usize this VMM builds for.
        let bytes = usize::try_from(len).map_err(|_| DiskError::BadCount(count))?;
        let in_window =
            buf >= DISK_BUF_START && buf.checked_add(len).is_some_and(|end| end <= DISK_BUF_END);
        let from_ram_allowed = self.command == Command::Write;
        let from_ram = from_ram_allowed && in_ram(buf, bytes);
        if !(in_window || from_ram) {
            return Err(DiskError::BufferOutside {
                buf,
                count,
                from_ram_allowed,
            });
        }
        Ok(bytes)
    }

    /// Check and carry out the request.
    pub fn execute(&self, disk: &Disk, mem: &GuestRam) -> Result<()> {
        let len = self.check(disk.sectors(), |addr, len| mem.is_ram(addr, len))?;
        let slice = mem
            .mem
            .get_slice(GuestAddress(self.buf), len)
            .map_err(|source| DiskError::MapBuffer {
                buf: self.buf,
                source,
            })?;
        let off = self.sector * SECTOR_SIZE;
        let (sector, count) = (self.sector, self.count);
        match self.command {
            Command::Write => {
                let guard = slice.ptr_guard();
                // SAFETY: `guard` points at `len` bytes of the private
                // region's or guest RAM's mapping, which lives as long as
                // `mem`; only the agent writes the private region, and its
                // vCPU waits in this OUT exit. Other vCPUs only park; a
                // concurrent store to guest RAM would change the bytes
                // written, as DMA from a page being written does, never
                // memory safety: the slice is read once, as plain bytes.
                let bytes = unsafe { std::slice::from_raw_parts(guard.as_ptr(), len) };
                disk.file
                    .write_all_at(bytes, off)
                    .map_err(|source| DiskError::Write {
                        sector,
                        count,
                        source,
                    })
            }
            Command::Read => {
                let guard = slice.ptr_guard_mut();
                // SAFETY: as for the write; nothing else reads or writes the
                // buffer while the agent's vCPU waits in this OUT exit, so
                // the exclusive slice aliases nothing.
                let bytes = unsafe { std::slice::from_raw_parts_mut(guard.as_ptr(), len) };
                disk.file
                    .read_exact_at(bytes, off)
                    .map_err(|source| DiskError::Read {
                        sector,
                        count,
                        source,
                    })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{DISK_READ_BUF, DISK_WRITE_BUF};

    fn no_ram(_: u64, _: usize) -> bool {
        false
    }

    fn req(sector: u64, count: u64, buf: u64) -> Request {
        Request {
            command: Command::Write,
            sector,
            count,
            buf,
        }
    }

    #[test]
    fn requests_inside_the_disk_and_the_window_pass() {
        assert_eq!(req(0, 1, DISK_WRITE_BUF).check(8, no_ram).unwrap(), 512);
        assert_eq!(
            req(10, MAX_SECTORS_PER_IO, DISK_READ_BUF)
                .check(10 + MAX_SECTORS_PER_IO, no_ram)
                .unwrap(),
            1 << 20
        );
        // The last sector of the window.
        assert!(req(0, 1, DISK_BUF_END - 512).check(1, no_ram).is_ok());
    }

    #[test]
    fn bad_counts_are_refused() {
        for count in [0, MAX_SECTORS_PER_IO + 1, u64::MAX] {
            assert!(matches!(
                req(0, count, DISK_WRITE_BUF).check(u64::MAX, no_ram),
                Err(DiskError::BadCount(c)) if c == count
            ));
        }
    }

    #[test]
    fn sectors_past_the_end_are_refused_without_overflow() {
        for (sector, count) in [(7, 2), (8, 1), (u64::MAX, 1), (u64::MAX - 1, 2)] {
            assert!(
                matches!(
                    req(sector, count, DISK_WRITE_BUF).check(8, no_ram),
                    Err(DiskError::PastEnd { .. })
                ),
                "{sector}+{count}"
            );
        }
    }

    #[test]
    fn buffers_outside_the_window_are_refused() {
        for (buf, count) in [
            (0, 1),
            (MAILBOX, 1),
            (DISK_BUF_START - 512, 2),
            (DISK_BUF_END - 512, 2),
            (DISK_BUF_END, 1),
            (u64::MAX - 100, 1),
        ] {
            assert!(
                matches!(
                    req(0, count, buf).check(1 << 20, no_ram),
                    Err(DiskError::BufferOutside { .. })
                ),
                "{buf:#x}+{count}"
            );
        }
    }

    #[test]
    fn guest_ram_is_a_write_source_but_never_a_read_target() {
        let ram =
            |addr: u64, len: usize| addr.checked_add(len as u64).is_some_and(|e| e <= 1 << 20);
        assert_eq!(req(0, 8, 0).check(8, ram).unwrap(), 4096);
        let read = Request {
            command: Command::Read,
            ..req(0, 8, 0)
        };
        assert!(matches!(
            read.check(8, ram),
            Err(DiskError::BufferOutside {
                from_ram_allowed: false,
                ..
            })
        ));
        // Past the end of RAM.
        assert!(matches!(
            req(0, 2, (1 << 20) - 512).check(8, ram),
            Err(DiskError::BufferOutside {
                from_ram_allowed: true,
                ..
            })
        ));
    }

    #[test]
    fn execute_moves_whole_requests_and_refuses_bad_ones_untouched() {
        let mem = GuestRam::anonymous(&[shared::GuestRegion {
            guest_phys: 0,
            size: 1 << 20,
        }])
        .unwrap();
        let file = tempfile_disk(16 * 512);
        let disk = Disk {
            file,
            bytes: 16 * 512,
        };
        let words: Vec<u8> = (0..4u8).flat_map(|i| [i + 1; 512]).collect();
        mem.write(DISK_WRITE_BUF, &words).unwrap();
        req(3, 4, DISK_WRITE_BUF).execute(&disk, &mem).unwrap();
        let mut back = Request {
            command: Command::Read,
            ..req(3, 4, DISK_READ_BUF)
        };
        back.execute(&disk, &mem).unwrap();
        let mut got = vec![0u8; words.len()];
        mem.read(DISK_READ_BUF, &mut got).unwrap();
        assert_eq!(got, words);

        // A write straight from guest RAM.
        mem.write(0x3000, &[7u8; 1024]).unwrap();
        req(0, 2, 0x3000).execute(&disk, &mem).unwrap();
        let mut on_disk = vec![0u8; 1024];
        disk.file.read_exact_at(&mut on_disk, 0).unwrap();
        assert_eq!(on_disk, vec![7u8; 1024]);

        // Refused: nothing moves, guest RAM is untouched.
        back.buf = 0;
        assert!(back.execute(&disk, &mem).is_err());
        assert_eq!(mem.read_u64(0).unwrap(), 0);
        back.buf = DISK_READ_BUF;
        back.sector = 13;
        assert!(back.execute(&disk, &mem).is_err());
    }

    fn tempfile_disk(len: u64) -> File {
        let fd = nix::sys::memfd::memfd_create(c"disk", nix::sys::memfd::MemFdCreateFlag::empty())
            .unwrap();
        let f = File::from(fd);
        f.set_len(len).unwrap();
        f
    }
}
