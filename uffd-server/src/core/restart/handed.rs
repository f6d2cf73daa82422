//! What the journal's writer, its reader and the adoption of VMs and
//! Firecracker clients share: the fds one sync found ([`Found`]), a
//! journal replayed ([`Replayed`]), and the fds handed back at start
//! ([`Handed`]).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;

use super::record::{
    BaseRec, FcListenerRec, FcVmRec, FileRec, IdentityRec, PinRec, Record, SourceRec, VmRec,
};
use crate::images::{Identity, Pin};
use crate::memory::{GuestMemory, PageSize};
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
        self.fd(format!("mem-{}", m.ino()), m.memfd().as_raw_fd())
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
}

/// The fds handed over, by name; each is taken once.
pub(super) struct Handed {
    pub(super) fds: HashMap<String, OwnedFd>,
    pub(super) memories: HashMap<String, Rc<GuestMemory>>,
}

impl Handed {
    /// Fd `name`, taken.
    pub(super) fn fd(&mut self, name: &str) -> Result<OwnedFd, String> {
        self.fds
            .remove(name)
            .ok_or_else(|| format!("the fd store did not hand back {name}"))
    }

    pub(super) fn file(&mut self, name: &str) -> Result<File, String> {
        self.fd(name).map(File::from)
    }

    pub(super) fn memory(&mut self, name: &str, huge: bool) -> Result<Rc<GuestMemory>, String> {
        if let Some(m) = self.memories.get(name) {
            return Ok(Rc::clone(m));
        }
        let file = self.file(name)?;
        let m = GuestMemory::adopt(file, name, PageSize::huge(huge))
            .map_err(|e| format!("cannot map {name}: {e}"))?;
        let m = Rc::new(m);
        self.memories.insert(name.to_owned(), Rc::clone(&m));
        Ok(m)
    }
}
