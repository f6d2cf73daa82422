//! Where an image's bytes live: a file, or bytes in memory (tests, fuzzing).
//!
//! Reads past the end of the storage return zeroes, as qemu's file driver
//! does; writes past the end extend it.

use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

/// Read access to an image's bytes.
#[allow(clippy::len_without_is_empty)] // a length that can fail, not a collection
pub trait Storage {
    /// Fill `buf` from `offset`; bytes past the end read as zeroes.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;
}

/// Write access, for the snapshot operations.
pub trait StorageMut: Storage {
    /// Write all of `buf` at `offset`.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Make every write so far durable (fsync).
    fn sync(&self) -> io::Result<()>;
    /// Deallocate a range, keeping the size; it then reads as zeroes.
    fn punch(&self, offset: u64, len: u64) -> io::Result<()>;
}

impl Storage for File {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let at = offset.saturating_add(done as u64);
            match FileExt::read_at(self, &mut buf[done..], at) {
                Ok(0) => {
                    buf[done..].fill(0);
                    return Ok(());
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.metadata()?.len())
    }
}

impl StorageMut for File {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.write_all_at(buf, offset)
    }

    fn sync(&self) -> io::Result<()> {
        self.sync_data()
    }

    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        let (Ok(off), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        // SAFETY: fallocate takes a file descriptor we own for the call's
        // duration and two integers; it touches no memory of ours.
        let rc = unsafe {
            libc::fallocate(
                self.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                len,
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

impl Storage for [u8] {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        buf.fill(0);
        let Ok(start) = usize::try_from(offset) else {
            return Ok(());
        };
        if start < self.len() {
            let n = buf.len().min(self.len() - start);
            buf[..n].copy_from_slice(&self[start..start + n]);
        }
        Ok(())
    }

    fn len(&self) -> io::Result<u64> {
        Ok(<[u8]>::len(self) as u64)
    }
}

/// A growable in-memory image, for unit tests of the write paths.
#[derive(Debug, Default)]
pub struct MemStorage(pub RefCell<Vec<u8>>);

impl Storage for MemStorage {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.0.borrow().as_slice().read_at(buf, offset)
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.0.borrow().len() as u64)
    }
}

impl StorageMut for MemStorage {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::InvalidInput)?;
        let mut v = self.0.borrow_mut();
        let end = start + buf.len();
        if v.len() < end {
            v.resize(end, 0);
        }
        v[start..end].copy_from_slice(buf);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        Ok(())
    }

    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        let mut v = self.0.borrow_mut();
        let n = v.len() as u64;
        let (s, e) = (offset.min(n), offset.saturating_add(len).min(n));
        #[allow(clippy::cast_possible_truncation)] // both are at most v.len()
        v[s as usize..e as usize].fill(0);
        Ok(())
    }
}

impl<T: Storage + ?Sized> Storage for &T {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (**self).read_at(buf, offset)
    }

    fn len(&self) -> io::Result<u64> {
        (**self).len()
    }
}

impl<T: StorageMut + ?Sized> StorageMut for &T {
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        (**self).write_at(buf, offset)
    }

    fn sync(&self) -> io::Result<()> {
        (**self).sync()
    }

    fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        (**self).punch(offset, len)
    }
}
