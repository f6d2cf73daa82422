//! What the restart feature keeps: the fd store the server hands what
//! must outlive it to, the journal, what was written to both, and how
//! this process came to serve (first start, after a crash, after a
//! handover) with what it adopted.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use serde::Serialize;

use super::record::{BaseRec, FcListenerRec, FcVmRec, SourceRec, VmRec};
use crate::fdstore::FdStore;

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
/// are appended.
#[derive(Debug, Default)]
pub(super) struct Written {
    pub sources: HashMap<u32, (usize, SourceRec)>,
    pub memories: HashMap<u32, (String, bool)>,
    pub bases: HashMap<u32, BaseRec>,
    pub vms: HashMap<u32, VmRec>,
    /// Firecracker listeners, each with the address of the working set
    /// it recorded (0: none), which is turned into runs only when it
    /// changes.
    pub fc_listeners: HashMap<u32, (usize, FcListenerRec)>,
    pub fc_vms: HashMap<u32, FcVmRec>,
    /// Names of the fds in the store.
    pub stored: HashSet<String>,
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
