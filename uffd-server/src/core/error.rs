//! The errors the core answers API requests with, named after what failed,
//! and the one function that maps them to an HTTP status. A feature with
//! failures of its own has its own enum (`link::error::LinkError`,
//! `snapshot::error::ArmError`), wrapped here with its message unchanged.
//!
//! 4xx means the client can fix the request; 5xx is the server's (or its
//! VMM's) own failure. The message says what to do; [`shared::error_chain`]
//! adds the sources.

use std::path::PathBuf;
use std::time::Duration;

use proto::api::RunState;
use shared::VmId;

use crate::core::link::error::LinkError;
use crate::core::remote::error::RemoteError;
use crate::core::rollback::error::FitError;
use crate::core::snapshot::error::ArmError;
use crate::memory::MemoryError;
use crate::snapshot::ErrorKind as SnapshotKind;
use volume::{ErrorKind, VolumeError};

/// An error for an API client.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request body or a parameter is invalid.
    #[error("{0}")]
    BadRequest(String),
    #[error("no VM {0}; list VMs with GET /v1/vms")]
    NoSuchVm(VmId),
    #[error("'{0}' is not a VM id; ids look like vm-1")]
    BadVmId(String),
    #[error("no listener {0}; list them with GET /v1/firecracker/listeners")]
    NoSuchListener(String),
    #[error("no such route; see GET /v1/openapi.json")]
    NoSuchRoute,
    #[error("page {page} is outside {vm}'s {pages} pages")]
    PageOutOfRange { vm: VmId, page: u64, pages: u64 },
    #[error("cannot {action} {vm}: it is {state}{}", hint(*state))]
    WrongState {
        vm: VmId,
        state: RunState,
        action: &'static str,
    },
    #[error("cannot {action} {vm} while it runs {running}; retry when that finishes")]
    Busy {
        vm: VmId,
        action: &'static str,
        running: &'static str,
    },
    #[error("{vm} has no disk; create the VM with a volume to run disk ops")]
    NoDisk { vm: VmId },
    #[error("cannot use memory image {path}: {reason}")]
    Image { path: String, reason: String },
    #[error(transparent)]
    OpenImageFile(#[from] crate::images::ImageError),
    #[error("{path} already exists; remove it or pick another path")]
    SocketExists { path: PathBuf },
    #[error("cannot listen on {path}")]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("this server has no volume engine (its state directory cannot reflink); create the VM without a volume")]
    NoVolumes,
    #[error(transparent)]
    Volume(#[from] VolumeError),
    #[error("cannot attach volume {name}")]
    AttachVolume {
        name: String,
        #[source]
        source: VolumeError,
    },
    #[error("cannot create guest memory")]
    CreateMemory(#[source] MemoryError),
    #[error("cannot prefetch page {page} of {vm}: {reason}")]
    Prefetch { vm: VmId, page: u64, reason: String },
    #[error("cannot start a thread to {what}")]
    SpawnThread {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{vm} failed to start: {reason}; vmm log {}: {log_tail}", log.display())]
    StartFailed {
        vm: VmId,
        reason: String,
        log: PathBuf,
        log_tail: String,
    },
    #[error("{vm}'s vmm did not start within {after:?}")]
    StartTimeout { vm: VmId, after: Duration },
    #[error("cannot give {vm} its own copy of volume {volume}")]
    ForkVolume {
        vm: VmId,
        volume: String,
        #[source]
        source: VolumeError,
    },
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("the server is handing over to a new process; retry in a moment")]
    HandingOver,
    #[error("{0}")]
    CannotUpgrade(String),
    #[error(
        "not enough memory: {asked_mib} MiB asked, {promised_mib} MiB of the {budget_mib} MiB \
         budget promised already; delete VMs or start the server with a larger --memory-budget-mib"
    )]
    OverBudget {
        asked_mib: u64,
        promised_mib: u64,
        budget_mib: u64,
    },
    #[error("the server runs {0} VMs already, its --max-vms; delete some first")]
    TooManyVms(usize),
    #[error(
        "memory pressure: {0}; retry once VMs are deleted or idle, or give the server more \
         memory (GET /v1/memory)"
    )]
    MemoryPressure(String),
    #[error("cannot reclaim {vm}'s memory: {why}")]
    ReclaimRefused { vm: VmId, why: String },
    #[error(
        "cannot start {}: the server holds {in_use} of its {limit} file descriptors \
         (RLIMIT_NOFILE); {} about {need} more, and {reserve} stay free for running VMs and \
         the API; raise the limit (ulimit -n, LimitNOFILE=) or delete VMs",
        vms(*count),
        if *count == 1 { "it needs" } else { "they need" }
    )]
    OverFdLimit {
        count: u64,
        need: u64,
        in_use: u64,
        reserve: u64,
        limit: u64,
    },
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error(transparent)]
    Arm(#[from] ArmError),
    #[error("clone {index} of {count} of {vm} failed, so none was kept: {source}")]
    CloneFailed {
        vm: VmId,
        index: u32,
        count: u32,
        source: Box<Error>,
    },
    #[error(transparent)]
    RollbackFit(#[from] FitError),
    #[error("{vm} failed: {reason}")]
    RollbackFailed { vm: VmId, reason: String },
    #[error("cannot save the snapshot of {vm}: {reason}")]
    SaveSnapshot { vm: VmId, reason: String },
    #[error(transparent)]
    Base(#[from] crate::bases::BaseError),
    #[error("cannot tell which pages of {vm} are its own")]
    BaseSync {
        vm: VmId,
        #[source]
        source: crate::pages::ResolveError,
    },
    #[error(transparent)]
    Layer(#[from] crate::core::fork::error::LayerError),
    #[error("{vm} forked, but a page it wrote could not be kept for its children: {why}")]
    LayerLost { vm: VmId, why: String },
    #[error(transparent)]
    Remote(#[from] RemoteError),
    #[error("snapshot {name} cannot be restored on this host: {reason}")]
    Incompatible { name: String, reason: String },
    #[error(
        "clone {index} of {count} of remote snapshot {name} failed, so none was kept: {source}"
    )]
    RemoteCloneFailed {
        name: String,
        index: u32,
        count: u32,
        source: Box<Error>,
    },
}

/// Result alias for core operations.
pub type Result<T> = std::result::Result<T, Error>;

/// "1 VM", "4 VMs".
fn vms(count: u64) -> String {
    match count {
        1 => "1 VM".to_owned(),
        n => format!("{n} VMs"),
    }
}

fn hint(state: RunState) -> &'static str {
    match state {
        RunState::Paused => "; resume it first",
        RunState::Starting => "; wait until it runs",
        RunState::Exited | RunState::Failed | RunState::Deleted => "; delete it",
        RunState::Running => "",
    }
}

impl Error {
    /// The HTTP status of this error: the one place that decides it.
    ///
    /// 507 Insufficient Storage is the server without the room for what was
    /// asked, which the client can free or ask less of: admission (the
    /// memory budget, the VM limit) and a full disk or quota: an `ENOSPC`
    /// or `EDQUOT` anywhere in the error's sources, whatever failed on it
    /// (a snapshot's files, a volume, a log), is 507 before anything else.
    ///
    /// 503 is the server short of something it gets back as VMs go: fds
    /// (their admission, or an `EMFILE`/`ENFILE` anywhere in the sources
    /// of whatever could not open a file all the same).
    pub fn status(&self) -> u16 {
        use Error::*;
        if self.out_of_space() {
            return 507;
        }
        if self.out_of_fds() {
            return 503;
        }
        match self {
            BadRequest(_)
            | PageOutOfRange { .. }
            | NoDisk { .. }
            | Image { .. }
            | OpenImageFile(_)
            | Listen { .. }
            | NoVolumes => 400,
            NoSuchVm(_) | BadVmId(_) | NoSuchListener(_) | NoSuchRoute => 404,
            WrongState { .. }
            | Busy { .. }
            | SocketExists { .. }
            | Incompatible { .. }
            | RollbackFit(_) => 409,
            AttachVolume { source, .. } => match source.kind() {
                ErrorKind::Io => 500,
                ErrorKind::Unavailable => 503,
                _ => 400,
            },
            Volume(e) => match e.kind() {
                ErrorKind::BadRequest => 400,
                ErrorKind::NotFound => 404,
                ErrorKind::Conflict => 409,
                ErrorKind::Unavailable => 503,
                ErrorKind::Io => 500,
            },
            CreateMemory(_) | Prefetch { .. } | SpawnThread { .. } | Arm(_) => 500,
            ForkVolume { source, .. } => match source.kind() {
                ErrorKind::Conflict => 409,
                _ => 500,
            },
            Link(e) => e.status(),
            Remote(e) => e.status(),
            StartFailed { .. } => 502,
            ShuttingDown | HandingOver => 503,
            CannotUpgrade(_) => 409,
            OverBudget { .. } | TooManyVms(_) => 507,
            // Fds come back as VMs go: the server is short of them for
            // now, the request itself is fine.
            OverFdLimit { .. } => 503,
            // Memory comes back as reclaim catches up or VMs go.
            MemoryPressure(_) => 503,
            ReclaimRefused { .. } => 409,
            StartTimeout { .. } => 504,
            Snapshot(e) => match e.kind() {
                SnapshotKind::BadRequest => 400,
                SnapshotKind::NotFound => 404,
                SnapshotKind::Conflict => 409,
                SnapshotKind::NoSpace => 507,
                SnapshotKind::Io => 500,
            },
            SaveSnapshot { .. } | RollbackFailed { .. } | Base(_) | BaseSync { .. } => 500,
            // The parent's VMM went while its pages were being copied.
            Layer(crate::core::fork::error::LayerError::Read { .. }) | LayerLost { .. } => 502,
            Layer(_) => 500,
            CloneFailed { source, .. } | RemoteCloneFailed { source, .. } => source.status(),
        }
    }

    /// Whether a filesystem was full: an I/O error of `ENOSPC` or `EDQUOT`
    /// among the error's sources.
    fn out_of_space(&self) -> bool {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = cause {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                if matches!(io.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
                    || io.kind() == std::io::ErrorKind::StorageFull
                {
                    return true;
                }
            }
            cause = e.source();
        }
        false
    }

    /// Whether the server or the host was out of fds: an `EMFILE` or
    /// `ENFILE` among the error's sources.
    fn out_of_fds(&self) -> bool {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = cause {
            let errno = match e.downcast_ref::<std::io::Error>() {
                Some(io) => io.raw_os_error(),
                None => e.downcast_ref::<nix::errno::Errno>().map(|n| *n as i32),
            };
            if matches!(errno, Some(libc::EMFILE | libc::ENFILE)) {
                return true;
            }
            cause = e.source();
        }
        false
    }

    /// The message with its sources, as the client sees it.
    pub fn message(&self) -> String {
        shared::error_chain(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_mistakes_are_4xx_and_server_failures_5xx() {
        let vm = VmId(1);
        let io = || std::io::Error::from_raw_os_error(libc::EIO);
        let full = || std::io::Error::from_raw_os_error(libc::ENOSPC);
        for (e, want) in [
            (Error::BadRequest("x".into()), 400),
            (Error::NoDisk { vm }, 400),
            (Error::NoSuchVm(vm), 404),
            (Error::NoSuchRoute, 404),
            (
                Error::WrongState {
                    vm,
                    state: RunState::Paused,
                    action: "exec",
                },
                409,
            ),
            (
                Error::Busy {
                    vm,
                    action: "fork",
                    running: "an exec",
                },
                409,
            ),
            (
                LinkError::SpawnVmm {
                    bin: "vmm".into(),
                    source: io(),
                }
                .into(),
                500,
            ),
            (LinkError::VmmGone { vm }.into(), 502),
            (
                LinkError::Vmm {
                    vm,
                    source: proto::vmm::RequestError::InvalidOp("sectors past the end".into()),
                }
                .into(),
                400,
            ),
            (
                LinkError::Vmm {
                    vm,
                    source: proto::vmm::RequestError::VcpuGone,
                }
                .into(),
                502,
            ),
            (ArmError::NotArmed { vm }.into(), 500),
            (
                Error::Snapshot(crate::snapshot::SnapshotError::InUse {
                    name: "s".into(),
                    vms: vec!["vm-2".into()],
                }),
                409,
            ),
            (
                Error::Snapshot(crate::snapshot::SnapshotError::NotFound("s".into())),
                404,
            ),
            (
                Error::Snapshot(crate::snapshot::SnapshotError::io(
                    "write",
                    std::path::Path::new("memory.img"),
                )(std::io::Error::from_raw_os_error(
                    libc::ENOSPC,
                ))),
                507,
            ),
            (
                FitError::Vcpus {
                    vm,
                    snapshot: "s".into(),
                    snapshot_vcpus: 31,
                    vm_vcpus: 1,
                }
                .into(),
                409,
            ),
            (Error::ShuttingDown, 503),
            (
                LinkError::VmmTimeout {
                    vm,
                    after: Duration::from_secs(1),
                }
                .into(),
                504,
            ),
            (Error::Volume(VolumeError::VolumeNotFound("v".into())), 404),
            (
                Error::Volume(VolumeError::InUse {
                    name: "v".into(),
                    holder: "vm-1".into(),
                }),
                409,
            ),
            (
                Error::Volume(VolumeError::ReflinkUnsupported {
                    root: "/".into(),
                    fs: "ext4".into(),
                }),
                503,
            ),
            // Out of room is the client's to free: admission, and a full
            // disk or quota under whatever wrote to it.
            (
                Error::OverBudget {
                    asked_mib: 64,
                    promised_mib: 1024,
                    budget_mib: 1024,
                },
                507,
            ),
            (Error::TooManyVms(12), 507),
            (
                Error::OverFdLimit {
                    count: 4,
                    need: 40,
                    in_use: 19_800,
                    reserve: 1024,
                    limit: 20_000,
                },
                503,
            ),
            (
                Error::Snapshot(crate::snapshot::SnapshotError::Io {
                    what: "write",
                    path: "memory.img".into(),
                    source: full(),
                }),
                507,
            ),
            (
                Error::Volume(VolumeError::Create {
                    name: "v".into(),
                    source: std::io::Error::from_raw_os_error(libc::EDQUOT),
                }),
                507,
            ),
            (
                Error::Link(LinkError::CreateLog {
                    vm,
                    path: "logs/vm-1.log".into(),
                    source: full(),
                }),
                507,
            ),
            (
                Error::CloneFailed {
                    vm,
                    index: 2,
                    count: 4,
                    source: Box::new(Error::Snapshot(crate::snapshot::SnapshotError::Io {
                        what: "write",
                        path: "memory.img".into(),
                        source: full(),
                    })),
                },
                507,
            ),
            // Out of fds all the same, past admission: for now.
            (
                Error::Snapshot(crate::snapshot::SnapshotError::Io {
                    what: "open",
                    path: "memory.img".into(),
                    source: std::io::Error::from_raw_os_error(libc::EMFILE),
                }),
                503,
            ),
            // Other I/O failures stay the server's.
            (
                Error::Snapshot(crate::snapshot::SnapshotError::Io {
                    what: "write",
                    path: "memory.img".into(),
                    source: io(),
                }),
                500,
            ),
        ] {
            assert_eq!(e.status(), want, "{e}");
        }
    }

    #[test]
    fn wrong_state_says_what_to_do() {
        let e = Error::WrongState {
            vm: VmId(3),
            state: RunState::Paused,
            action: "exec",
        };
        assert_eq!(
            e.message(),
            "cannot exec vm-3: it is paused; resume it first"
        );
    }

    #[test]
    fn over_fd_limit_names_the_limit_and_what_to_do() {
        let e = Error::OverFdLimit {
            count: 4,
            need: 36,
            in_use: 19_800,
            reserve: 1024,
            limit: 20_000,
        };
        assert_eq!(
            e.message(),
            "cannot start 4 VMs: the server holds 19800 of its 20000 file descriptors \
             (RLIMIT_NOFILE); they need about 36 more, and 1024 stay free for running VMs and \
             the API; raise the limit (ulimit -n, LimitNOFILE=) or delete VMs"
        );
    }
}
