//! The Welcome a VM's VMM gets once it said hello: the VM's guest RAM
//! (its memfd, or the shared base it maps private), its disk, and the
//! launch config (vCPUs, the state to start from).

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::rc::Rc;
use std::sync::Arc;

use proto::vmm::{LaunchConfig, ServerMsg};
use shared::{GuestRegion, VmId};
use tracing::warn;

use crate::conn::{Binding, QueueError, VmmWriter};
use crate::core::error::{Error, Result};
use crate::core::state::Core;
use crate::core::vm::{RunState, Vm};
use volume::VolumeEngine;

/// `vm`'s VMM said hello (or a pooled VMM was bound to it): send it its
/// Welcome, with the memfd and the disk, and keep its writer.
pub(crate) fn welcome(core: &Core, vm: VmId, writer: Arc<VmmWriter>, pid: u32) {
    let mut reg = core.reg.borrow_mut();
    let Some(v) = reg.vms.get_mut(&vm) else {
        writer.shutdown();
        return;
    };
    let config = launch_config(v, core.volumes.as_deref());
    if let (Ok((_, Some(_))), Some(name), Some(engine)) = (&config, &v.volume, &core.volumes) {
        // While this VMM holds the disk, the volume may not be deleted
        // or rolled back underneath it.
        engine.attach(name, &vm.to_string());
    }
    let sent = match config {
        // A VM on a shared base maps the base (private); any other, its
        // own memfd.
        Ok((cfg, disk)) => match v
            .base
            .on
            .as_ref()
            .map_or(v.memory.memfd(), |on| on.base.memory.memfd())
            .try_clone()
        {
            Ok(memfd) => {
                let mut fds = vec![OwnedFd::from(memfd)];
                fds.extend(disk.map(OwnedFd::from));
                writer.send(
                    ServerMsg::Welcome {
                        vm_id: vm,
                        config: cfg,
                    },
                    fds,
                )
            }
            Err(e) => {
                warn!("{vm}: cannot share its memfd: {e}");
                Err(QueueError::Closed)
            }
        },
        Err(e) => {
            let message = e.message();
            let _ = writer.send(
                ServerMsg::Error {
                    message: message.clone(),
                },
                Vec::new(),
            );
            writer.shutdown();
            v.fail_pending(&message);
            return;
        }
    };
    if let Err(e) = sent {
        warn!("{vm}: cannot send welcome: {e}");
    }
    v.link.pid = Some(pid);
    v.link.writer = Some(writer);
}

/// A VMM that was serving `vm` when its server went asks this one to take
/// it back: read its connection and answer `Rejoined` if `vm` is here and
/// the VMM is the one it knows, else an error.
pub(crate) fn rejoin(
    core: &Rc<Core>,
    vm: VmId,
    writer: Arc<VmmWriter>,
    pid: u32,
    stream: UnixStream,
    binding: Binding,
) {
    let refusal = match core.reg.borrow().vms.get(&vm) {
        None => Some(format!("no VM {vm} here")),
        Some(v) if v.link.pid.is_some_and(|p| p != pid) || v.link.writer.is_some() => Some(
            format!("{vm} has a vmm already; pid {pid} may not rejoin it"),
        ),
        Some(_) => None,
    };
    if let Some(message) = refusal {
        // Refused before its frames are read: its hang-up must not reach
        // the VM it named (the core would count that VM's VMM as gone).
        warn!("{vm}: vmm pid {pid} may not rejoin: {message}");
        let _ = writer.send(ServerMsg::Error { message }, Vec::new());
        writer.shutdown();
        return;
    }
    let c = core.clone();
    tokio::task::spawn_local(crate::conn::vmm::read_frames(stream, binding, move |ev| {
        c.on_conn_event(ev)
    }));
    // adoption: attach the link
    if let Err(e) = writer.send(ServerMsg::Rejoined, Vec::new()) {
        warn!("{vm}: cannot answer the rejoin: {e}");
    }
    if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
        // A crash in the middle of an operation that paused it (a fork,
        // a snapshot) left its vCPUs paused; it was running before that
        // operation, and runs again (a resume of running vCPUs does
        // nothing). First: a request held for it below may be the pause
        // of an operation this process began since, which this resume
        // must not undo.
        if let Some(snapshot) = v
            .rollback
            .under_way()
            .filter(|_| v.state() == RunState::Running)
        {
            // A rollback the crash cut short: finished now (it resumes
            // the VM), with the link attached below.
            let snapshot = snapshot.to_owned();
            tokio::task::spawn_local(crate::core::rollback::reset::finish_cut_short(
                core.clone(),
                vm,
                snapshot,
            ));
        } else if v.state() == RunState::Running {
            v.link.next_seq += 1;
            let seq = v.link.next_seq;
            if let Err(e) = writer.send(
                ServerMsg::Request {
                    seq,
                    request: proto::vmm::Request::Resume,
                },
                Vec::new(),
            ) {
                warn!("{vm}: cannot resume it: {e}");
            }
            // Its answer is expected, and nobody waits for it.
            let (tx, _) = tokio::sync::oneshot::channel();
            v.link.pending.insert(seq, tx);
        }
        // Requests made while it was away go out now, in order.
        for (seq, request, fds) in v.link.held.drain(..) {
            if let Err(e) = writer.send(ServerMsg::Request { seq, request }, fds) {
                warn!("{vm}: cannot send a held request: {e}");
            }
        }
        v.link.pid = Some(pid);
        v.link.writer = Some(writer);
    }
}

/// The launch config for `v` and its disk file, if any.
fn launch_config(v: &Vm, volumes: Option<&VolumeEngine>) -> Result<(LaunchConfig, Option<File>)> {
    let (disk_bytes, disk) = match (&v.volume, volumes) {
        (Some(name), Some(engine)) => {
            let (f, size) = engine.open_for_vm(name)?;
            (Some(size), Some(f))
        }
        (Some(_), None) => return Err(Error::NoVolumes),
        (None, _) => (None, None),
    };
    let config = LaunchConfig {
        regions: vec![GuestRegion {
            guest_phys: 0,
            size: v.memory.size(),
        }],
        vcpus: v.vcpus,
        disk_bytes,
        start_state: v.start_state.as_deref().cloned(),
        memory: if v.base.is_based() {
            proto::vmm::MemoryKind::Base
        } else {
            proto::vmm::MemoryKind::Own
        },
    };
    Ok((config, disk))
}
