//! Restart without losing a VM: what must outlive the serving process is
//! held outside it, and a new process takes every VM back.
//!
//! ```text
//!   keeper (or systemd) ── holds ──▶ api/vmm listeners, memfds, uffds,
//!     │                              table mirrors, image fds, Firecracker
//!     │                              listeners and connections (fd store)
//!     └─ starts ─▶ uffd-server ── FDSTORE=1 ──▶ keeper
//!                      │ journal: sources, bases, VMs (restart.journal)
//!                      └─ dies / hands over ─▶ keeper starts the next one
//!                           with LISTEN_FDS ─▶ adopt: arena, bases, VMs,
//!                           tables from mirrors; wake every uffd range;
//!                           VMMs rejoin on vmm.sock
//! ```
//!
//! - [`state`]: what the feature keeps ([`state::Restart`] on the core).
//! - [`record`]: the journal's records.
//! - [`journal`]: writing the journal and the store as the server runs
//!   (`sync`), and reading it back.
//! - [`adopt`]: taking VMs back at start.
//! - [`firecracker`]: Firecracker listeners and clients, journaled and
//!   taken back the same way.
//! - [`upgrade`]: a graceful handover to a new binary.

pub mod adopt;
pub mod error;
pub mod firecracker;
pub mod handed;
pub mod journal;
pub mod reconcile;
pub mod record;
pub mod state;
pub mod upgrade;

use std::os::fd::OwnedFd;
use std::rc::Rc;

use tracing::warn;

use crate::core::state::Core;

/// Take back what the process before this one left (`fds`, handed over
/// by the keeper or systemd) and serve every adopted VM's uffd; on a
/// first start, write the journal afresh. From then on the arena
/// journals every source it takes.
pub fn start(core: &Rc<Core>, fds: Vec<(String, OwnedFd)>, since_start: std::time::Instant) {
    if core.restart.store().is_none() {
        return;
    }
    if core.restart.start_kind() == state::StartKind::First && fds.is_empty() {
        journal::sync(core, true);
    } else {
        adopt_all(core, fds, since_start);
    }
    let hook = journal::source_hook(Rc::clone(&core.restart.log));
    core.reg.borrow_mut().arena.set_hook(hook);
}

fn adopt_all(core: &Rc<Core>, fds: Vec<(String, OwnedFd)>, since_start: std::time::Instant) {
    for (vm, uffd, base) in adopt::adopt(core, fds) {
        if let Err(e) = crate::core::fault::serve::serve_uffd(core, vm, uffd, base, true) {
            warn!(
                "{vm}: cannot serve its uffd again: {}",
                shared::error_chain(&e)
            );
        }
    }
    // VMs whose VMM died while no server ran.
    let gone: Vec<_> = core
        .reg
        .borrow()
        .vms
        .values()
        .filter(|v| {
            v.faults.uffd.is_some()
                && v.link.pid.is_some_and(|p| {
                    nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(i32::try_from(p).unwrap_or(0)),
                        None,
                    )
                    .is_err()
                })
        })
        .map(|v| v.id)
        .collect();
    for vm in gone {
        crate::core::link::exit::mark_exited(core, vm, "its vmm died while no server ran");
    }
    core.restart.took.set(Some(since_start.elapsed()));
    // A VMM that has not rejoined after a while and is gone never will.
    let c = Rc::clone(core);
    tokio::task::spawn_local(async move {
        tokio::time::sleep(REJOIN_WITHIN).await;
        let absent: Vec<_> = c
            .reg
            .borrow()
            .vms
            .values()
            .filter(|v| v.adopted.is_some() && v.link.writer.is_none() && v.faults.uffd.is_some())
            .map(|v| (v.id, v.link.pid))
            .collect();
        for (vm, pid) in absent {
            let alive = pid.is_some_and(|p| {
                nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(i32::try_from(p).unwrap_or(0)),
                    None,
                )
                .is_ok()
            });
            if alive {
                warn!("{vm}: its vmm (pid {pid:?}) has not rejoined after {REJOIN_WITHIN:?}");
            } else {
                crate::core::link::exit::mark_exited(&c, vm, "its vmm died before it rejoined");
            }
        }
    });
}

/// How long adopted VMMs have to rejoin before one that is gone is
/// counted as exited.
const REJOIN_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// The pids of every VMM the server knows (its VMs' and its pool's).
pub fn vmm_pids(core: &Core) -> Vec<u32> {
    // Only VMs whose VMM still speaks for them: the pid of one that went is
    // free, and may be another process's by now.
    let mut pids: Vec<u32> = core
        .reg
        .borrow()
        .vms
        .values()
        .filter(|v| {
            matches!(
                v.state(),
                proto::api::RunState::Running | proto::api::RunState::Paused
            )
        })
        .filter_map(|v| v.link.pid)
        .collect();
    pids.extend(core.pool.borrow().pids());
    pids
}
