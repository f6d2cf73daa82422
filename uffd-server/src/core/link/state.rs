//! A VM's link to its VMM process: the process, the connection's write
//! side, and the requests waiting for its answers.

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use proto::vmm::Reply;
use shared::VmId;
use tokio::sync::oneshot;

use super::error::LinkError;
use crate::conn::VmmWriter;
use crate::core::error::{Error, Result};
use crate::pages::anchor::Anchor;

/// A pending answer from the VMM.
pub type ReplySender = oneshot::Sender<Result<Reply>>;

/// Fulfilled when the VMM reports `Running`, or fails first.
pub type ReadySender = oneshot::Sender<Result<()>>;

/// The answer to a request in flight.
pub type PendingReply = oneshot::Receiver<Result<Reply>>;

/// One VM's VMM link.
#[derive(Debug, Default)]
pub struct VmmLink {
    /// The VMM's process, once launched.
    pub pid: Option<u32>,
    /// The VMM's anchor, once it reported one (see `pages::anchor`):
    /// killed when the VMM goes and nothing else holds it.
    pub anchor: Option<Rc<Anchor>>,
    /// Where messages to the VMM go, once it said hello.
    pub writer: Option<Arc<VmmWriter>>,
    /// Requests sent and not answered yet, by sequence number.
    pub pending: HashMap<u64, ReplySender>,
    pub next_seq: u64,
    /// Fulfilled when the VMM reports `Running` (or fails first).
    pub ready: Option<ReadySender>,
    /// Why the VMM went, as it or the server saw it.
    pub exit_reason: Option<String>,
    /// Requests sent while the VMM of a VM taken back after a restart of
    /// the server has not rejoined yet: sent, in order, when it does.
    pub held: Vec<(u64, proto::vmm::Request, Vec<std::os::fd::OwnedFd>)>,
}

impl VmmLink {
    /// The anchor VMM `pid` reported, if the kernel says it is one.
    pub fn take_anchor(&mut self, vm: VmId, anchor: u32) -> Result<()> {
        let Some(vmm) = self.pid else {
            return Err(LinkError::Anchor {
                vm,
                why: "no VMM process is known".into(),
            }
            .into());
        };
        let a = Anchor::of_vmm(anchor, vmm).map_err(|e| LinkError::Anchor {
            vm,
            why: shared::error_chain(&e),
        })?;
        self.anchor = Some(Rc::new(a));
        Ok(())
    }

    /// A link waiting for its VMM; `ready` fires when it runs.
    pub fn new(ready: ReadySender) -> Self {
        VmmLink {
            ready: Some(ready),
            ..VmmLink::default()
        }
    }

    /// Fail every request of `vm` still waiting for the VMM: it exited for
    /// `reason`.
    pub fn fail_pending(&mut self, vm: VmId, reason: &str) {
        let exited = || {
            Error::from(LinkError::VmmExited {
                vm,
                reason: reason.to_owned(),
            })
        };
        for (_, tx) in self.pending.drain() {
            let _ = tx.send(Err(exited()));
        }
        if let Some(tx) = self.ready.take() {
            let _ = tx.send(Err(exited()));
        }
    }
}
