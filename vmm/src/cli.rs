//! Command line: server mode (`vmm --socket PATH --token TOKEN`, spawned by
//! uffd-server) and `vmm standalone`, a self-test over anonymous RAM.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use proto::vmm::Request;
use serde::Deserialize;

/// pagefork's minimal KVM VMM.
#[derive(Debug, Parser)]
#[command(name = "vmm", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub server: ServerArgs,
}

/// Server mode arguments.
#[derive(Debug, Args)]
pub struct ServerArgs {
    /// The page server's VMM socket.
    #[arg(long, env = "PAGEFORK_VMM_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Launch token issued by the server.
    #[arg(long, env = "PAGEFORK_VMM_TOKEN")]
    pub token: Option<String>,
    /// Given to a pooled VMM only: the guest RAM size (MiB) to prepare
    /// KVM's memory slot for before the server's Welcome (0 = none); RAM of
    /// another size costs one slot change at start.
    #[arg(long)]
    pub ram_hint_mib: Option<u64>,
    /// Given to a pooled VMM only: an inherited fd of the guest RAM memfd
    /// the server made ahead for it; it is mapped, and KVM's slot set over
    /// it, before the Welcome (which then brings the same memfd).
    #[arg(long, requires = "ram_hint_mib")]
    pub ram_fd: Option<i32>,
    /// Make an anchor at start (see `anchor`) and report it to the server.
    #[arg(long)]
    pub anchor: bool,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a VM over anonymous RAM without a server and execute steps.
    Standalone(StandaloneArgs),
}

/// `vmm standalone` arguments.
#[derive(Debug, Args)]
pub struct StandaloneArgs {
    /// Guest RAM size in MiB (one region at guest-physical 0).
    #[arg(long)]
    pub memory_mib: u64,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    pub vcpus: u8,
    /// Attach a zeroed disk of this many MiB (an anonymous memfd).
    #[arg(long)]
    pub disk_mib: Option<u64>,
    /// The VM id the identity port answers.
    #[arg(long, default_value_t = 0)]
    pub vm_id: u32,
    /// A step as JSON, run in order; repeatable. A step is a server request
    /// (`{"Exec":{"Fill":{"start_page":0,"pages":16,"seed":7}}}`, `"Pause"`,
    /// `"CaptureState"`, `"Resume"`, `"Stop"`), `{"Async":<request>}` (do
    /// not wait for its reply), `"Wait"` (for all replies), `{"Sleep":ms}`,
    /// or `"Restore"`: rebuild the VM from the last captured state over the
    /// same RAM, as a fork child would start.
    #[arg(long = "exec", value_name = "JSON")]
    pub steps: Vec<String>,
}

/// One standalone step.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Step {
    /// A server request; wait for its reply.
    Request(Request),
    /// A standalone-only step.
    Extra(Extra),
}

/// Steps that only standalone mode knows.
#[derive(Debug, Clone, Deserialize)]
pub enum Extra {
    /// Dispatch a request without waiting for its reply.
    Async(Request),
    /// Wait for every outstanding reply.
    Wait,
    /// Sleep this many milliseconds.
    Sleep(u64),
    /// Rebuild the VM from the last captured state.
    Restore,
}

#[cfg(test)]
mod tests {
    use super::*;
    use shared::GuestOp;

    #[test]
    fn steps_parse_from_json() {
        let s: Step =
            serde_json::from_str(r#"{"Exec":{"Fill":{"start_page":1,"pages":2,"seed":3}}}"#)
                .unwrap();
        assert!(matches!(
            s,
            Step::Request(Request::Exec(GuestOp::Fill {
                start_page: 1,
                pages: 2,
                seed: 3
            }))
        ));
        assert!(matches!(
            serde_json::from_str::<Step>(r#""Pause""#).unwrap(),
            Step::Request(Request::Pause)
        ));
        assert!(matches!(
            serde_json::from_str::<Step>(r#""Restore""#).unwrap(),
            Step::Extra(Extra::Restore)
        ));
        assert!(matches!(
            serde_json::from_str::<Step>(r#"{"Async":{"Exec":"Identity"}}"#).unwrap(),
            Step::Extra(Extra::Async(Request::Exec(GuestOp::Identity)))
        ));
    }
}
