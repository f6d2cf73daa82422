//! A Firecracker process on a listener: its handshake (regions and uffd)
//! makes it a VM of the registry with a table over the listener's source,
//! served by its own task (`serve.rs`), with a recorded working set
//! installed in bulk; its hang-up ends it.

use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::rc::Rc;

use proto::api::VmDeleted;
use shared::{VmId, PAGE_SIZE};
use tokio::io::unix::AsyncFd;
use tracing::{info, warn};
use userfaultfd::Uffd;

use super::serve::{prefetch_working_set, serve_fc};
use super::vm::FcVm;
use crate::conn::FcHandshake;
use crate::core::state::Core;
use crate::core::vm::RunState;
use crate::observe::stats::FaultStats;
use crate::pages::{PageTable, UNINITIALIZED};

/// A Firecracker process completed its handshake: serve it.
pub(crate) fn on_fc_hello(core: &Rc<Core>, hs: FcHandshake) {
    let FcHandshake {
        listener,
        conn,
        regions,
        uffd,
        pid,
        stream,
        in_flight: _in_flight,
    } = hs;
    if let Err(e) = nix::fcntl::fcntl(
        uffd.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK),
    ) {
        warn!("firecracker: cannot make uffd non-blocking: {e}");
        return;
    }
    // SAFETY: `uffd` came from SCM_RIGHTS and is owned here; ownership
    // moves into the Uffd.
    let uffd = unsafe { Uffd::from_raw_fd(uffd.into_raw_fd()) };
    // SAFETY: the Uffd owns its fd until the AsyncFd drops it.
    let afd = match unsafe { AsyncFd::register_with_interest(uffd, tokio::io::Interest::READABLE) }
    {
        Ok(a) => Rc::new(a),
        Err(e) => {
            warn!("firecracker: cannot poll the uffd: {e}");
            return;
        }
    };
    let mut reg = core.reg.borrow_mut();
    let Some(l) = reg.fc_listeners.get(&listener) else {
        return;
    };
    let readahead_pages = l.readahead_pages;
    let data = Rc::clone(&l.data);
    let (file_src, fault_around, recorded) = (
        l.source,
        l.fault_around_pages,
        if l.working_set {
            l.recorded.clone()
        } else {
            None
        },
    );
    let pages = regions
        .iter()
        .map(|r| (r.offset + r.size) / PAGE_SIZE)
        .max()
        .unwrap_or(0);
    let mut table = PageTable::new(pages, UNINITIALIZED);
    for r in &regions {
        let (lo, hi) = (r.offset / PAGE_SIZE, (r.offset + r.size) / PAGE_SIZE);
        for &(first, n) in data.iter() {
            let (a, b) = (first.max(lo), (first + n).min(hi));
            if a < b {
                table.set_range(a, b - a, file_src);
            }
        }
    }
    let id = reg.alloc_id(&core.settings.state_dir);
    let self_src = reg.arena.vm(id);
    let closed = Rc::new(tokio::sync::Notify::new());
    reg.fc_vms.insert(
        id,
        FcVm {
            id,
            listener,
            conn,
            pid,
            regions,
            table,
            self_src,
            file_src,
            uffd: afd.clone(),
            state: RunState::Running,
            failure: None,
            warnings: Default::default(),
            stats: FaultStats::default(),
            fault_around_pages: fault_around,
            readahead: crate::pages::Readahead {
                next: u64::MAX,
                window: 0,
                max_pages: readahead_pages,
            },
            fault_order: Vec::new(),
            stream,
            closed: closed.clone(),
            phases: Default::default(),
            readahead_piece_pages: core.settings.readahead_piece_pages,
        },
    );
    drop(reg);
    // Its uffd and connection in the fd store, its table mirrored, before
    // any fault is served: the client outlives a crash from now on.
    crate::core::restart::journal::sync(core, false);
    info!("{id}: firecracker pid {pid} connected to fc-{listener}");
    tokio::task::spawn_local(serve_fc(core.clone(), id, afd, closed));
    if let Some(ws) = recorded {
        tokio::task::spawn_local(prefetch_working_set(core.clone(), id, ws));
    }
}

/// A Firecracker connection hung up: the VM is gone.
pub(crate) fn on_fc_closed(core: &Core, conn: u64) {
    let mut reg = core.reg.borrow_mut();
    let Some(id) = reg.fc_vms.values().find(|v| v.conn == conn).map(|v| v.id) else {
        return;
    };
    let Some(v) = reg.fc_vms.remove(&id) else {
        return;
    };
    info!(
        "{id}: firecracker pid {} disconnected after {} faults",
        v.pid, v.stats.missing
    );
    reg.retired.add(&v.stats);
    reg.arena.release(v.self_src);
    reg.release_unused_sources();
    // `notify_one` keeps a permit if the task is not waiting right now.
    v.closed.notify_one();
    if let Some(l) = reg.fc_listeners.get_mut(&v.listener) {
        if l.working_set && l.recorded.is_none() && !v.fault_order.is_empty() {
            let mut seen = std::collections::HashSet::new();
            let ws: Vec<u64> = v
                .fault_order
                .iter()
                .copied()
                .filter(|p| seen.insert(*p))
                .collect();
            info!("fc-{}: recorded a working set of {} pages", l.id, ws.len());
            l.recorded = Some(Rc::new(ws));
        }
    }
    drop(reg);
    // Its fds leave the store.
    crate::core::restart::journal::sync(core, false);
}

/// Drop a Firecracker VM on request: close its connection.
pub(crate) fn delete_fc_vm(core: &Core, id: VmId) -> Option<VmDeleted> {
    let reg = core.reg.borrow();
    let v = reg.fc_vms.get(&id)?;
    let _ = v.stream.shutdown(std::net::Shutdown::Both);
    Some(VmDeleted {
        id: id.to_string(),
        deleted: true,
        frozen: false,
        kept: Vec::new(),
    })
}
