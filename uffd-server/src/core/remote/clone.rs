//! `POST /v1/remote/snapshots/{name}/clone`: clone(n, c) of a snapshot in
//! the object store: n VMs restored from it (each started before its
//! memory is here), at most c being created at once. All or nothing: if
//! one fails, every clone made is deleted. The clones read the same
//! chunks, which are fetched once and kept in memory for all of them.

use std::rc::Rc;
use std::time::Instant;

use proto::api::{CloneVm, ClonedVms, REMOTE_PREFIX};
use tracing::{info, warn};

use super::restore::check_name;
use crate::core::clone::{check_request, delete_clones, restore_all};
use crate::core::error::{Error, Result};
use crate::core::fd_budget::FdKind;
use crate::core::state::Core;

/// Clone remote snapshot `name` `req.count` times.
pub(crate) async fn clone_remote(core: &Rc<Core>, name: &str, req: CloneVm) -> Result<ClonedVms> {
    core.remote.service()?;
    check_name(name)?;
    check_request(&req)?;
    // Room for every clone up front; each restore claims its own as it
    // starts.
    core.fds
        .check(FdKind::RemoteRestore, u64::from(req.count))?;
    let t0 = Instant::now();
    let from = format!("{REMOTE_PREFIX}{name}");
    let made = match restore_all(core, &from, &req, None).await {
        Ok(made) => made,
        Err((index, made, e)) => {
            warn!(
                "clone {} of {} of remote snapshot {name} failed; deleting the {} made",
                index + 1,
                req.count,
                made.len()
            );
            delete_clones(core, &made).await;
            return Err(Error::RemoteCloneFailed {
                name: name.to_owned(),
                index: u32::try_from(index + 1).unwrap_or(u32::MAX),
                count: req.count,
                source: Box::new(e),
            });
        }
    };
    let us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
    info!("{} clones of remote snapshot {name} in {us} us", made.len());
    Ok(ClonedVms {
        snapshot: from,
        clones: made,
        duration_us: us,
        phases_us: [("create".to_owned(), us)].into_iter().collect(),
    })
}
