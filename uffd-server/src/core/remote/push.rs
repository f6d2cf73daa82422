//! `POST /v1/snapshots/{name}/push`: a local snapshot into the object
//! store, in the background on the store's runtime (the crate's push:
//! chunks the store lacks, then the manifest, the commit point). The
//! answer comes at once; the push's progress is in the snapshot's
//! `GET /v1/snapshots/{name}` (`push`), updated after every chunk, as a
//! save's is in its VM's. It carries the snapshot's volume snapshot and
//! its recorded working set.

use std::path::PathBuf;
use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use pagefork_remote::{Progress, PushSource};
use proto::api::{PushState, PushStatus, SnapshotInfo};
use tracing::{info, warn};

use super::error::RemoteError;
use crate::core::error::{Error, Result};
use crate::core::state::Core;

fn us(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Start pushing local snapshot `name`; answers the snapshot with the
/// push's status.
pub(crate) fn push(core: &Rc<Core>, name: &str) -> Result<SnapshotInfo> {
    let service = Arc::clone(core.remote.service()?);
    let (dir, volume_snapshot, pages) = {
        let cat = core.snapshots.borrow();
        let st = cat.get(name)?;
        (
            cat.dir_of(name),
            st.volume_snapshot.clone(),
            st.memory_bytes / shared::PAGE_SIZE,
        )
    };
    if core
        .remote
        .push_status(name)
        .is_some_and(|p| p.state == PushState::Running)
    {
        return Err(RemoteError::PushRunning {
            name: name.to_owned(),
        }
        .into());
    }
    let volume = match &volume_snapshot {
        Some(vs) => Some(volume_snapshot_path(core, vs)?),
        None => None,
    };
    let working_set = match crate::snapshot::workset::read(&dir, pages) {
        Ok(ws) => ws,
        Err(e) => {
            warn!(
                "snapshot {name}: pushed without its working set: {}",
                shared::error_chain(&e)
            );
            None
        }
    };
    let src = PushSource {
        dir,
        volume,
        working_set,
    };
    let cell = Arc::new(Mutex::new(PushStatus {
        state: PushState::Running,
        url: service.url(),
        chunks_done: 0,
        chunks_total: 0,
        bytes_done: 0,
        bytes_total: 0,
        chunks_uploaded: 0,
        uploaded_bytes: 0,
        chunks_present: 0,
        started: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        elapsed_us: 0,
        error: None,
    }));
    core.remote
        .pushes
        .borrow_mut()
        .insert(name.to_owned(), Arc::clone(&cell));
    let remote = service.remote.clone();
    let name_owned = name.to_owned();
    let t0 = Instant::now();
    let progress_cell = Arc::clone(&cell);
    let progress = move |p: &Progress| {
        let mut s = progress_cell.lock().unwrap_or_else(PoisonError::into_inner);
        s.chunks_done = p.chunks_done;
        s.chunks_total = p.chunks_total;
        s.bytes_done = p.bytes_done;
        s.bytes_total = p.bytes_total;
        s.chunks_uploaded = p.chunks_moved;
        s.uploaded_bytes = p.stored_bytes_moved;
        s.chunks_present = p.chunks_present;
        s.elapsed_us = us(t0);
    };
    drop(service.spawn(async move {
        let result = remote.push(&src, &progress).await;
        let mut s = cell.lock().unwrap_or_else(PoisonError::into_inner);
        s.elapsed_us = us(t0);
        match result {
            Ok(r) => {
                s.state = PushState::Done;
                s.chunks_uploaded = r.uploaded;
                s.chunks_present = r.present;
                s.uploaded_bytes = r.uploaded_bytes;
                info!(
                    "snapshot {name_owned} pushed to {}: {} chunks uploaded ({} bytes), {} present, {} holes, in {:?}",
                    s.url, r.uploaded, r.uploaded_bytes, r.present, r.holes, r.elapsed
                );
            }
            Err(e) => {
                let why = shared::error_chain(&e);
                warn!("push of snapshot {name_owned} failed: {why}");
                s.state = PushState::Failed;
                s.error = Some(why);
            }
        }
    }));
    crate::core::snapshot::catalog::snapshot_info(core, name)
}

/// The file of volume snapshot `vs`.
fn volume_snapshot_path(core: &Core, vs: &str) -> Result<PathBuf> {
    let engine = core.volumes.as_ref().ok_or(Error::NoVolumes)?;
    let info = engine.snapshot_info(vs)?;
    Ok(engine.root().join("volumes").join(&info.volume).join(vs))
}
