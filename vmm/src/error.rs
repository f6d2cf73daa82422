//! The VMM binary's top-level error: what ends a run of `vmm`, printed as
//! one line by `main` and sent to the server as the exit reason.

/// Top-level errors of the VMM binary.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("server mode needs --socket and --token (or use `vmm standalone`)")]
    Usage,
    #[error("the server sent {got} fds, the launch config needs {want}")]
    FdCount { want: usize, got: usize },
    #[error("bad --exec step {step}")]
    Step {
        step: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("--ram-fd {0} is not an open fd this process was started with")]
    RamFd(i32),
    #[error("cannot start the control thread")]
    SpawnControl(#[source] std::io::Error),
    #[error("cannot set up the standalone disk")]
    Disk(#[source] std::io::Error),
    #[error("{0}")]
    Guest(String),
    #[error(transparent)]
    Connection(#[from] crate::connection::ConnectionError),
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
    #[error(transparent)]
    Uffd(#[from] crate::uffd::UffdError),
    #[error(transparent)]
    Vm(#[from] crate::kvm::vm::VmError),
}

/// Result alias of the binary.
pub type Result<T> = std::result::Result<T, Error>;
