//! What the restart feature keeps: the fd store the server hands what
//! must outlive it to, the journal, what was written to both, and how
//! this process came to serve (first start, after a crash, after a
//! handover) with what it adopted.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use serde::Serialize;

use super::record::{BaseRec, FcListenerRec, FcVmRec, Fds, SourceRec, VmFds, VmRec};
use crate::fdstore::FdStore;
use crate::memory::FileId;
use crate::pages::table::Under;

/// Why this process started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StartKind {
    /// Nothing to adopt.
    First,
    /// The process before it died.
    Crash,
    /// The process before it handed over.
    Upgrade,
}

impl StartKind {
    /// From `$PAGEFORK_START` (set by the keeper), or from whether fds
    /// were handed over (systemd).
    pub fn from_env(handed_fds: bool) -> Self {
        match std::env::var("PAGEFORK_START").as_deref() {
            Ok("upgrade") => StartKind::Upgrade,
            Ok("crash") => StartKind::Crash,
            Ok(_) => StartKind::First,
            Err(_) if handed_fds => StartKind::Crash,
            Err(_) => StartKind::First,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            StartKind::First => "first",
            StartKind::Crash => "crash",
            StartKind::Upgrade => "upgrade",
        }
    }
}

/// What has been written to the journal, by key, so that only changes
/// are appended. In key order, as the registry and the arena hold them,
/// so that a sync walks both side by side.
#[derive(Debug, Default)]
pub(super) struct Written {
    /// Sources, each with the address of the `Rc` it was made of.
    pub sources: BTreeMap<u32, (usize, SourceRec)>,
    /// VMs' memories, each with its memfd's device and inode number.
    pub memories: BTreeMap<u32, (FileId, (String, bool))>,
    pub bases: BTreeMap<u32, BaseRec>,
    pub vms: BTreeMap<u32, (VmFds, VmRec)>,
    /// Firecracker listeners, each with the address of the working set
    /// it recorded (0: none), which is turned into runs only when it
    /// changes.
    pub fc_listeners: BTreeMap<u32, (usize, FcListenerRec)>,
    pub fc_vms: BTreeMap<u32, FcVmRec>,
    /// Layers still being filled, by source id.
    pub fills: BTreeMap<u32, super::record::FillRec>,
    /// Names of the fds in the store.
    pub stored: HashSet<String>,
    /// Which fds the records above name.
    pub names: Names,
    /// An fd could not be handed to the store: the next sync writes the
    /// journal afresh, handing every fd it names again.
    pub retry: bool,
}

/// How many written records name each fd in the store.
#[derive(Debug, Default)]
pub(super) struct Names {
    /// The count of each fd named, by its name.
    pub named: HashMap<String, u32>,
    /// Names no record names any more since the last sync: out of the
    /// store once the records that stopped naming them are written
    /// (unless named again by then).
    pub unnamed: Vec<String>,
}

impl Names {
    /// `rec` is written under `key` of `map`, replacing what was there:
    /// the fds it names are named once more, those the old one named
    /// once less.
    pub fn put<K: Ord, V: Fds>(&mut self, map: &mut BTreeMap<K, V>, key: K, rec: V) {
        for n in rec.fds() {
            match self.named.get_mut(n) {
                Some(c) => *c += 1,
                None => {
                    self.named.insert(n.to_owned(), 1);
                }
            }
        }
        if let Some(old) = map.insert(key, rec) {
            self.unname(&old);
        }
    }

    /// The record under `key` of `map` is gone.
    pub fn drop<K: Ord, V: Fds>(&mut self, map: &mut BTreeMap<K, V>, key: &K) {
        if let Some(old) = map.remove(key) {
            self.unname(&old);
        }
    }

    fn unname(&mut self, old: &impl Fds) {
        for n in old.fds() {
            if let Some(c) = self.named.get_mut(n) {
                *c -= 1;
                if *c == 0 {
                    self.named.remove(n);
                    self.unnamed.push(n.to_owned());
                }
            }
        }
    }

    /// Whether a record names `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.named.contains_key(name)
    }
}

/// The journal and the fd store: shared with the arena's hook, which
/// journals each new source the moment it is made (`journal::log_source`).
#[derive(Debug)]
pub struct Log {
    pub(super) store: Option<FdStore>,
    pub(super) file: RefCell<Option<File>>,
    pub(super) path: PathBuf,
    pub(super) written: RefCell<Written>,
}

/// The restart feature's state.
#[derive(Debug)]
pub struct Restart {
    pub(super) log: std::rc::Rc<Log>,
    pub(super) started: SystemTime,
    pub(super) start: Cell<StartKind>,
    pub(super) adopted: Cell<u64>,
    pub(super) lost: RefCell<Vec<String>>,
    pub(super) took: Cell<Option<Duration>>,
    /// A handover is under way: new requests are refused (503) and the
    /// process exits once the journal is written.
    pub(super) handing_over: Cell<bool>,
    /// API requests under way.
    pub(super) jobs: Cell<usize>,
    /// The binary a handover starts by default: the one this process was
    /// started as.
    pub(super) binary: PathBuf,
    /// The under each VM's children made last overlay (see
    /// `pages::mirror`), by parent: the children of its next fork share
    /// it while its table has not changed much.
    pub(super) unders: RefCell<HashMap<shared::VmId, std::rc::Rc<Under>>>,
}

impl Restart {
    /// Nothing kept (no fd store): what a server without a keeper or
    /// systemd has; it restarts with no VM.
    pub fn new(state_dir: &std::path::Path) -> Self {
        Restart {
            log: std::rc::Rc::new(Log {
                store: None,
                file: RefCell::new(None),
                path: state_dir.join("restart.journal"),
                written: RefCell::new(Written::default()),
            }),
            started: SystemTime::now(),
            start: Cell::new(StartKind::First),
            adopted: Cell::new(0),
            lost: RefCell::new(Vec::new()),
            took: Cell::new(None),
            handing_over: Cell::new(false),
            jobs: Cell::new(0),
            binary: std::env::current_exe().unwrap_or_default(),
            unders: RefCell::new(HashMap::new()),
        }
    }

    /// Keep what must outlive this process in `store`.
    pub fn with_store(mut self, store: Option<FdStore>, start: StartKind) -> Self {
        if let Some(log) = std::rc::Rc::get_mut(&mut self.log) {
            log.store = store;
        }
        self.start.set(start);
        self
    }

    /// Whether anything outlives this process (a keeper or systemd holds
    /// its fds).
    pub fn kept(&self) -> bool {
        self.log.store.is_some()
    }

    /// Whether a handover is under way.
    pub fn handing_over(&self) -> bool {
        self.handing_over.get()
    }

    /// An API request starts (see `Core::run`); `None` while handing
    /// over, when new requests are refused.
    pub fn job_started(&self) -> Option<JobGuard<'_>> {
        if self.handing_over.get() {
            return None;
        }
        self.jobs.set(self.jobs.get() + 1);
        Some(JobGuard(self))
    }

    /// When this process started serving.
    pub fn started(&self) -> SystemTime {
        self.started
    }

    /// Why it started.
    pub fn start_kind(&self) -> StartKind {
        self.start.get()
    }

    /// VMs adopted at start.
    pub fn adopted(&self) -> u64 {
        self.adopted.get()
    }

    /// VMs that could not be adopted, each with why.
    pub fn lost(&self) -> Vec<String> {
        self.lost.borrow().clone()
    }

    /// How long adoption took, from process start to serving.
    pub fn took(&self) -> Option<Duration> {
        self.took.get()
    }

    /// `GET /v1/health`.
    pub fn health(&self) -> proto::api::Health {
        let ms = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        };
        proto::api::Health {
            status: "ok".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            started_unix_ms: ms(self.started),
            start: self.start.get().as_str().into(),
            kept: self.kept(),
            adopted_vms: self.adopted.get(),
            lost_vms: self.lost(),
            recovery_ms: self.took.get().map(|d| d.as_secs_f64() * 1e3),
        }
    }

    /// For `/metrics`.
    pub fn sample(&self) -> crate::observe::metrics::StartSample {
        crate::observe::metrics::StartSample {
            adopted: self.adopted.get(),
            lost: self.lost.borrow().len() as u64,
            recovery_seconds: self.took.get().map_or(0.0, |d| d.as_secs_f64()),
            kind: match self.start.get() {
                StartKind::First => 0,
                StartKind::Crash => 1,
                StartKind::Upgrade => 2,
            },
        }
    }

    /// The fd store, if any.
    pub fn store(&self) -> Option<&FdStore> {
        self.log.store.as_ref()
    }
}

/// One API request under way; counted until dropped.
#[derive(Debug)]
pub struct JobGuard<'a>(&'a Restart);

impl Drop for JobGuard<'_> {
    fn drop(&mut self) {
        self.0.jobs.set(self.0.jobs.get().saturating_sub(1));
    }
}

/// A VM this process took back from the one before it.
#[derive(Debug, Clone, Copy)]
pub struct AdoptedVm {
    at: SystemTime,
    first_fault: Option<SystemTime>,
}

impl AdoptedVm {
    /// Taken back now.
    pub fn now() -> Self {
        AdoptedVm {
            at: SystemTime::now(),
            first_fault: None,
        }
    }

    /// A fault of the VM was served: the first one since adoption ends
    /// its stall.
    #[inline]
    pub fn fault_served(&mut self) {
        if self.first_fault.is_none() {
            self.first_fault = Some(SystemTime::now());
        }
    }

    /// As `GET /v1/vms/{id}` shows it.
    pub fn to_api(&self) -> proto::api::Adopted {
        let us = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        };
        proto::api::Adopted {
            at_unix_us: us(self.at),
            first_fault_unix_us: self.first_fault.map(us),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::restart::record::{SourceRec, TableOver};

    fn vm(id: u32, memory: &str, table: &str, over: Option<(&str, &str)>) -> (VmFds, VmRec) {
        let fds = VmFds {
            memory: (0, 0),
            table: None,
            uffd: false,
        };
        let rec = VmRec {
            id,
            vcpus: 1,
            memory: memory.into(),
            huge: false,
            self_src: 1,
            table: table.into(),
            table_over: over.map(|(t, u)| TableOver {
                table: t.into(),
                under: u.into(),
            }),
            uffd: None,
            vmm_base: 0,
            pid: None,
            state: proto::api::RunState::Running,
            failure: None,
            volume: None,
            owns_volume: false,
            deleted: false,
            on_base: None,
            frozen_for: None,
            fault_around_pages: 0,
            readahead_pages: 0,
            parent: None,
            rollback_to: None,
            reclaim: None,
        };
        (fds, rec)
    }

    #[test]
    fn a_name_is_unnamed_when_its_last_record_goes() {
        let mut w = Written::default();
        let n = &mut w.names;
        n.put(
            &mut w.vms,
            1,
            vm(1, "mem-1", "", Some(("table-1-5", "under-9"))),
        );
        n.put(
            &mut w.vms,
            2,
            vm(2, "mem-2", "", Some(("table-2-6", "under-9"))),
        );
        n.put(
            &mut w.sources,
            3,
            (
                0,
                SourceRec::Frozen {
                    vm: 1,
                    layer: false,
                    fd: "mem-1".into(),
                    huge: false,
                },
            ),
        );
        assert_eq!(n.named.get("under-9"), Some(&2));
        assert_eq!(n.named.get("mem-1"), Some(&2));
        assert!(!n.contains(""));
        n.drop(&mut w.vms, &1);
        assert_eq!(n.unnamed, vec!["table-1-5".to_owned()]);
        assert!(n.contains("mem-1") && n.contains("under-9"));
        // Replaced: the new record's names first, so a name kept is never
        // unnamed.
        n.put(&mut w.vms, 2, vm(2, "mem-2", "table-2-7", None));
        assert!(n.contains("mem-2") && !n.contains("under-9"));
        assert_eq!(
            n.unnamed,
            vec![
                "table-1-5".to_owned(),
                "table-2-6".to_owned(),
                "under-9".to_owned()
            ]
        );
        n.drop(&mut w.sources, &3);
        assert!(!n.contains("mem-1"));
        n.drop(&mut w.vms, &2);
        assert!(n.named.is_empty(), "{:?}", n.named);
    }
}
