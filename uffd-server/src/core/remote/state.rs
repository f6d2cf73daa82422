//! The object-store feature's state on the core: the store (if the server
//! has one) and the pushes it ran since it started.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use proto::api::{PullProgress, PushStatus};

use super::error::RemoteError;
use crate::remote::RemoteService;

/// A push's status, written by the push on the store's runtime and read by
/// `GET /v1/snapshots/{name}` on the core.
pub type PushCell = Arc<Mutex<PushStatus>>;

/// The object store and its pushes.
#[derive(Debug, Default)]
pub struct RemoteState {
    /// The store (`--remote`), if any.
    pub service: Option<Arc<RemoteService>>,
    /// The last push of each local snapshot since the server started.
    pub pushes: RefCell<HashMap<String, PushCell>>,
    /// Pulls under way, by the local snapshot they make.
    pub pulls: RefCell<HashMap<String, Arc<Mutex<PullProgress>>>>,
}

impl RemoteState {
    /// The store, or why there is none.
    pub fn service(&self) -> Result<&Arc<RemoteService>, RemoteError> {
        self.service.as_ref().ok_or(RemoteError::NotConfigured)
    }

    /// The status of snapshot `name`'s last push, if any.
    pub fn push_status(&self, name: &str) -> Option<PushStatus> {
        self.pushes.borrow().get(name).map(|c| {
            c.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
        })
    }
}
