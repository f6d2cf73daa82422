//! Requests to a VM's VMM: sent without waiting (the VMM answers in
//! order, so several can be in flight), answered through a oneshot the
//! VMM's `Reply` fulfils (`messages.rs`), with a deadline.
//!
//! The VMM's queue is bounded (`--vmm-queue`): a VMM that stops answering
//! makes requests to that VM alone fail with 503, never the core wait.

use std::time::Duration;

use proto::vmm::{Reply, Request, ServerMsg};
use shared::VmId;
use tokio::sync::oneshot;

use super::error::LinkError;
use super::state::PendingReply;
use crate::conn::QueueError;
use crate::core::error::{Error, Result};
use crate::core::state::Core;
use crate::core::vm::RunState;

/// Send a request to `vm`'s VMM and wait for the reply.
pub(crate) async fn request(
    core: &Core,
    vm: VmId,
    request: Request,
    timeout: Duration,
) -> Result<Reply> {
    let rx = send_request(core, vm, request)?;
    await_reply(vm, rx, timeout).await
}

/// Send a request to `vm`'s VMM without waiting; the VMM answers its
/// requests in order, so several can be in flight.
pub(crate) fn send_request(core: &Core, vm: VmId, request: Request) -> Result<PendingReply> {
    send_request_with_fds(core, vm, request, Vec::new())
}

/// [`send_request`] with fds in the frame (a rebase's bases).
pub(crate) fn send_request_with_fds(
    core: &Core,
    vm: VmId,
    request: Request,
    fds: Vec<std::os::fd::OwnedFd>,
) -> Result<PendingReply> {
    let (tx, rx) = oneshot::channel();
    let mut reg = core.reg.borrow_mut();
    let v = reg.vm_mut(vm)?;
    let writer = match (&v.link.writer, v.state()) {
        (Some(w), RunState::Running | RunState::Paused) => w.clone(),
        (None, RunState::Running | RunState::Paused) if v.adopted.is_some() => {
            // Taken back after a restart; its VMM rejoins in a moment.
            if v.link.pending.len() >= core.settings.vmm_queue {
                return Err(LinkError::QueueFull {
                    vm,
                    queued: v.link.pending.len(),
                }
                .into());
            }
            v.link.next_seq += 1;
            let seq = v.link.next_seq;
            v.link.held.push((seq, request, fds));
            v.link.pending.insert(seq, tx);
            return Ok(rx);
        }
        (_, state) => {
            return Err(Error::WrongState {
                vm,
                state,
                action: request.name(),
            })
        }
    };
    if v.link.pending.len() >= core.settings.vmm_queue {
        return Err(LinkError::QueueFull {
            vm,
            queued: v.link.pending.len(),
        }
        .into());
    }
    v.link.next_seq += 1;
    let seq = v.link.next_seq;
    if let Err(e) = writer.send(ServerMsg::Request { seq, request }, fds) {
        return Err(Error::from(match e {
            QueueError::Full => LinkError::QueueFull {
                vm,
                queued: v.link.pending.len(),
            },
            QueueError::Closed => LinkError::VmmGone { vm },
        }));
    }
    v.link.pending.insert(seq, tx);
    Ok(rx)
}

/// Wait for the answer to a request sent with [`send_request`].
pub(crate) async fn await_reply(vm: VmId, rx: PendingReply, timeout: Duration) -> Result<Reply> {
    match tokio::time::timeout(timeout, rx).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(LinkError::VmmGone { vm }.into()),
        Err(_) => Err(LinkError::VmmTimeout { vm, after: timeout }.into()),
    }
}
