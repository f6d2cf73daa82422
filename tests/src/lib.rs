//! Harness for end-to-end tests: real `uffd-server` and `vmm` processes,
//! real KVM and userfaultfd.
//!
//! - [`TestServer`] ([`server`]) starts a server on a fresh temporary state
//!   directory and stops it (and any VMM it leaves behind) when dropped.
//! - [`Api`] ([`api`]) is the one client of the REST API: requests built
//!   from the `proto::api` types the server parses, answers parsed into
//!   the types it answers with, and a raw escape hatch for tests of bad
//!   input. A [`TestServer`] derefs to its [`Api`].
//! - [`require_kvm_uffd`] and the other `require_*` ([`host`]) decide
//!   whether a test that needs `/dev/kvm`, userfaultfd, huge pages, root or
//!   the XFS mount runs: it skips with a printed reason on a machine
//!   without them, but fails loudly under `CI=true` (CI must not skip).
//! - [`Memcg`] ([`memcg`]) is a memory cgroup (v1) of a test's own, to
//!   run a server and its VMMs under a limit; [`require_memcg_v1`] says
//!   whether there is one to make.
//! - [`RandomImage`] and the `expected_*` helpers ([`memory`]) build raw
//!   memory images and compute what the guest must report, with the
//!   reference implementations in [`shared::pattern`].
//! - [`ScratchXfs`] ([`xfs`]) is a small XFS of a test's own;
//!   [`FcClient`] ([`fc`]) runs the Firecracker stand-in; [`uffdctl()`]
//!   ([`cli`]) runs the CLI against a server.
//! - [`require_store`] ([`store`]) is the object store (a real Ceph RGW)
//!   of the remote-snapshot tests, and [`Netns`] a second host's network.
//!
//! The binaries are not built here: the test command runs
//! `cargo build --workspace` first. They are found next to the test
//! executable's `deps/` directory, or in `$PAGEFORK_BIN_DIR`.

pub mod api;
pub mod cli;
pub mod fc;
pub mod host;
pub mod memcg;
pub mod memory;
pub mod rng;
pub mod server;
pub mod store;
pub mod xfs;

pub use api::*;
pub use cli::*;
pub use fc::*;
pub use host::*;
pub use memcg::*;
pub use memory::*;
pub use rng::Rng;
pub use server::*;
pub use store::*;
pub use xfs::*;
