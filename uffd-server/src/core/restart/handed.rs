//! What the journal's writer, its reader and the adoption of VMs and
//! Firecracker clients share: the fds one sync found ([`Found`]), a
//! journal replayed ([`Replayed`]), and the fds handed back at start
//! ([`Handed`]).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;

use super::error::{AdoptError, Result};
use super::record::{
    BaseRec, FcListenerRec, FcVmRec, FileRec, IdentityRec, PinRec, Record, SourceRec, TableOver,
    VmRec,
};
use crate::images::{Identity, Pin};
use crate::memory::{GuestMemory, PageSize};
use crate::pages::mirror::Mirror;
use crate::pages::table::{PageTable, Under};
use crate::pages::FileSource;

pub(super) fn identity_rec(i: &Identity) -> IdentityRec {
    IdentityRec {
        dev: i.dev,
        ino: i.ino,
        len: i.len,
        mtime_ns: i64::try_from(i.mtime_ns).unwrap_or(i64::MAX),
    }
}

pub(super) fn pin_rec(p: &Pin) -> PinRec {
    match p {
        Pin::PrivateClone => PinRec::Private,
        Pin::Stamp(s) => {
            let (len, sec, nsec) = s.parts();
            PinRec::Stamp { len, sec, nsec }
        }
    }
}

/// The name in the fd store of a VM's fd (made by the server, named by
/// its inode number where a VM can have another one later).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FdName {
    /// A memfd of guest memory (a VM's, a frozen source's, a base's), by
    /// device and inode number: hugetlbfs and shmem number their inodes
    /// each on their own, so that a hugetlb memfd and a 4 KiB one alive at
    /// once can share an inode number.
    Mem(u64, u64),
    /// The mirror of VM `.0`'s table.
    Table(u32, u64),
    /// An under its children's mirrors overlay.
    Under(u64),
    /// VM `.0`'s uffd.
    Uffd(u32),
}

impl std::fmt::Display for FdName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FdName::Mem(dev, ino) => write!(f, "mem-{dev:x}-{ino}"),
            FdName::Table(vm, ino) => write!(f, "table-{vm}-{ino}"),
            FdName::Under(ino) => write!(f, "under-{ino}"),
            FdName::Uffd(vm) => write!(f, "uffd-{vm}"),
        }
    }
}

/// What one sync found: records and the fds they name.
#[derive(Default)]
pub(super) struct Found {
    pub(super) records: Vec<Record>,
    pub(super) fds: HashMap<String, RawFd>,
}

impl Found {
    /// Fd `fd`, which a record names `name`, goes to the store.
    pub(super) fn fd(&mut self, name: String, fd: RawFd) -> String {
        self.fds.insert(name.clone(), fd);
        name
    }

    pub(super) fn memory(&mut self, m: &GuestMemory) -> String {
        let (dev, ino) = m.file_id();
        self.fd(FdName::Mem(dev, ino).to_string(), m.memfd().as_raw_fd())
    }

    pub(super) fn file(&mut self, id: u32, f: &FileSource) -> FileRec {
        FileRec {
            path: f.path.display().to_string(),
            fd: self.fd(format!("src-{id}"), f.file.as_raw_fd()),
            len: f.len,
            pin: pin_rec(&f.pin),
            identity: f.identity.as_ref().map(identity_rec),
        }
    }
}

/// What a journal says, replayed: the last record of each key.
#[derive(Debug, Default)]
pub(super) struct Replayed {
    pub sources: BTreeMap<u32, SourceRec>,
    pub memories: HashMap<u32, (String, bool)>,
    pub bases: BTreeMap<u32, BaseRec>,
    pub vms: BTreeMap<u32, VmRec>,
    pub fc_listeners: BTreeMap<u32, FcListenerRec>,
    pub fc_vms: BTreeMap<u32, FcVmRec>,
    /// Layers still being filled, by source id.
    pub fills: BTreeMap<u32, super::record::FillRec>,
}

/// The fds handed over, by name; each is taken once.
pub(super) struct Handed {
    pub(super) fds: HashMap<String, OwnedFd>,
    pub(super) memories: HashMap<String, Rc<GuestMemory>>,
    pub(super) unders: HashMap<String, Rc<Under>>,
}

impl Handed {
    /// Fd `name`, taken.
    pub(super) fn fd(&mut self, name: &str) -> Result<OwnedFd> {
        self.fds
            .remove(name)
            .ok_or_else(|| AdoptError::NotHandedBack(name.to_owned()))
    }

    pub(super) fn file(&mut self, name: &str) -> Result<File> {
        self.fd(name).map(File::from)
    }

    pub(super) fn memory(&mut self, name: &str, huge: bool) -> Result<Rc<GuestMemory>> {
        if let Some(m) = self.memories.get(name) {
            return Ok(Rc::clone(m));
        }
        let file = self.file(name)?;
        let m = GuestMemory::adopt(file, name, PageSize::huge(huge))
            .map_err(|e| AdoptError::MapMemory(name.to_owned(), e))?;
        let m = Rc::new(m);
        self.memories.insert(name.to_owned(), Rc::clone(&m));
        Ok(m)
    }

    /// Under `name`, of tables of `pages` pages (read once, shared by
    /// the overlays that name it).
    pub(super) fn under(&mut self, name: &str, pages: u64) -> Result<Rc<Under>> {
        if let Some(u) = self.unders.get(name) {
            if u.pages() != pages {
                return Err(AdoptError::UnderSize {
                    name: name.to_owned(),
                    have: u.pages(),
                    want: pages,
                });
            }
            return Ok(Rc::clone(u));
        }
        let file = self.file(name)?;
        let u = Under::open(file, pages).map_err(|e| AdoptError::ReadMirror(name.to_owned(), e))?;
        self.unders.insert(name.to_owned(), Rc::clone(&u));
        Ok(u)
    }

    /// The table of `pages` pages its mirror holds, writing into it from
    /// now on: the mirror `table`, or the overlay `over` of its under.
    pub(super) fn table(
        &mut self,
        table: &str,
        over: Option<&TableOver>,
        pages: u64,
    ) -> Result<PageTable> {
        match over {
            None => Mirror::open(self.file(table)?, pages)
                .map(PageTable::from_mirror)
                .map_err(|e| AdoptError::ReadMirror(table.to_owned(), e)),
            Some(o) => {
                let under = self.under(&o.under, pages)?;
                PageTable::from_overlay(self.file(&o.table)?, under)
                    .map_err(|e| AdoptError::ReadMirror(o.table.clone(), e))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::FdName;

    #[test]
    fn fd_names_are_valid_and_tell_memories_on_two_filesystems_apart() {
        // A journal names each fd in its records, and adoption takes the
        // names from there: those of earlier journals (`mem-5`, memories
        // by inode number alone) are read as they are.
        assert_eq!(FdName::Mem(0x10, 5).to_string(), "mem-10-5");
        assert_ne!(
            FdName::Mem(0x10, 5).to_string(),
            FdName::Mem(0x1, 5).to_string(),
            "a hugetlb memfd and a shmem one with one inode number"
        );
        assert_eq!(FdName::Table(7, 12345).to_string(), "table-7-12345");
        assert_eq!(FdName::Uffd(3).to_string(), "uffd-3");
        assert_eq!(FdName::Under(9).to_string(), "under-9");
        for n in [
            FdName::Mem(u64::MAX, u64::MAX),
            FdName::Table(u32::MAX, u64::MAX),
            FdName::Under(u64::MAX),
            FdName::Uffd(u32::MAX),
        ] {
            assert!(crate::fdstore::fdname_is_valid(&n.to_string()), "{n}");
        }
    }
}
