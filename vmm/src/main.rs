//! `vmm`: pagefork's minimal KVM VMM.
//!
//! Server mode (`vmm --socket PATH --token TOKEN`): guest RAM comes from the
//! page server as memfds and faults through a userfaultfd the server serves
//! (see [`server`]). `vmm standalone` runs the same VM over anonymous RAM to
//! test the guest agent without a server (see [`standalone`]).

mod agent;
mod anchor;
mod block;
mod cli;
mod connection;
mod devices;
mod error;
mod fixed;
mod kvm;
mod layout;
mod logging;
mod memory;
mod ops;
mod server;
mod standalone;
mod state;
mod uffd;

use crate::error::Error;
use clap::Parser;
use shared::error_chain;

fn main() -> std::process::ExitCode {
    // One malloc arena for all threads: the VMM has a handful of threads
    // that allocate little, and each extra arena costs every pooled VMM
    // its own dirty pages (a host runs a thousand of them).
    // A free leaves up to 1 MiB at the heap's top instead of 128 KiB:
    // trimming it when the start's state was dropped cost ~0.02 ms on the
    // start's path. The VMM hands free memory back itself, with
    // `malloc_trim`, once it has started (see `server::run`).
    // SAFETY: mallopt only tunes the allocator; called before any thread.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 20);
    }
    logging::init();
    let cli = cli::Cli::parse();
    let res = match &cli.command {
        Some(cli::Command::Standalone(args)) => standalone::run(args),
        None => match (&cli.server.socket, &cli.server.token) {
            (Some(socket), Some(token)) => {
                if cli.server.anchor {
                    if let Err(e) = anchor::make() {
                        eprintln!("vmm: cannot make an anchor: {e}");
                        return std::process::ExitCode::FAILURE;
                    }
                }
                server::run(socket, token, cli.server.ram_hint_mib, cli.server.ram_fd)
            }
            _ => Err(Error::Usage),
        },
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vmm: {}", error_chain(&e));
            std::process::ExitCode::FAILURE
        }
    }
}
