//! `POST /v1/remote/snapshots/{name}/pull`: a whole snapshot from the
//! object store into the local catalog, as a short list of steps:
//!
//! 1. reserve the local name (a `.tmp-` directory, as a snapshot being
//!    written has) and read the manifest;
//! 2. pull it on the store's runtime (the crate's pull: every chunk
//!    fetched and checked, memory.img written sparse, state.json, one
//!    rename: the commit of the files), its volume snapshot into a
//!    temporary file beside it;
//! 3. on a blocking thread: make the volume snapshot a snapshot of the
//!    local volume engine (`<name>.disk`, a reflink of the pulled file),
//!    name it in state.json, write the working set the manifest carries;
//! 4. read the snapshot back and add it to the catalog.
//!
//! A failure anywhere removes what was made: the catalog never lists a
//! snapshot that is not whole.

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use pagefork_remote::{Manifest, PullTarget};
use proto::api::{PullProgress, PullSnapshot, SnapshotPulled};
use tracing::{info, warn};
use volume::VolumeEngine;

use super::error::RemoteError;
use super::restore::manifest;
use crate::core::error::{Error, Result};
use crate::core::state::Core;
use crate::snapshot::SnapshotError;

/// The temporary directory a pulled volume snapshot is written to.
fn volume_tmp_dir(root: &Path, local: &str) -> PathBuf {
    root.join(format!(".tmp-vol-{local}"))
}

/// Pull remote snapshot `name` as local snapshot `req.name` (default the
/// same name).
pub(crate) async fn pull(core: &Rc<Core>, name: &str, req: PullSnapshot) -> Result<SnapshotPulled> {
    let service = Arc::clone(core.remote.service()?);
    let local = req.name.unwrap_or_else(|| name.to_owned());
    let t0 = Instant::now();
    let m = manifest(&service, name).await?;
    if m.volume.is_some() && core.volumes.is_none() {
        return Err(Error::NoVolumes);
    }
    core.snapshots.borrow_mut().reserve(&local)?;
    let (root, dir) = {
        let cat = core.snapshots.borrow();
        (cat.root().to_owned(), cat.dir_of(&local))
    };
    let progress = Arc::new(Mutex::new(PullProgress {
        name: local.clone(),
        remote: name.to_owned(),
        ..PullProgress::default()
    }));
    core.remote
        .pulls
        .borrow_mut()
        .insert(local.clone(), Arc::clone(&progress));
    let result = pull_files(core, &service, &m, &local, &root, &dir, progress).await;
    core.remote.pulls.borrow_mut().remove(&local);
    let vol_dir = volume_tmp_dir(&root, &local);
    let _ = std::fs::remove_dir_all(&vol_dir);
    match result {
        Ok((report, state)) => {
            let volume_snapshot = state.volume_snapshot.clone();
            core.snapshots.borrow_mut().insert(state);
            info!(
                "snapshot {local} pulled from remote snapshot {name}: {} chunks fetched ({} bytes) in {:?}",
                report.fetched,
                report.fetched_bytes,
                t0.elapsed()
            );
            Ok(SnapshotPulled {
                name: local,
                remote: name.to_owned(),
                chunks: report.chunks,
                chunks_fetched: report.fetched,
                fetched_bytes: report.fetched_bytes,
                fetched_raw_bytes: report.fetched_raw_bytes,
                volume_snapshot,
                duration_us: u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX),
            })
        }
        Err(e) => {
            core.snapshots.borrow_mut().abandon(&local);
            if dir.exists() {
                if let Err(err) = std::fs::remove_dir_all(&dir) {
                    warn!("cannot remove {}: {err}", dir.display());
                }
            }
            Err(e)
        }
    }
}

/// Steps 2 to 4: the files, then the snapshot's state as it is on disk.
async fn pull_files(
    core: &Core,
    service: &Arc<crate::remote::RemoteService>,
    m: &Manifest,
    local: &str,
    root: &Path,
    dir: &Path,
    progress: Arc<Mutex<PullProgress>>,
) -> Result<(pagefork_remote::PullReport, proto::snapshot::StateFile)> {
    let volume = match &m.volume {
        Some(_) => {
            let vd = volume_tmp_dir(root, local);
            let _ = std::fs::remove_dir_all(&vd);
            std::fs::create_dir(&vd).map_err(SnapshotError::io("create", &vd))?;
            Some(vd.join("volume.disk"))
        }
        None => None,
    };
    let target = PullTarget {
        dir: dir.to_owned(),
        volume: volume.clone(),
    };
    let remote = service.remote.clone();
    let name = m.name.clone();
    let report = service
        .spawn(async move {
            let report = |p: &pagefork_remote::Progress| {
                let mut s = progress.lock().unwrap_or_else(PoisonError::into_inner);
                s.chunks_done = p.chunks_done;
                s.chunks_total = p.chunks_total;
                s.bytes_done = p.bytes_done;
                s.bytes_total = p.bytes_total;
            };
            remote.pull(&name, &target, &report).await
        })
        .await
        .map_err(|e| RemoteError::Worker(e.to_string()))?
        .map_err(RemoteError::from)?;
    let engine = core.volumes.clone();
    let (m, local, dir) = (m.clone(), local.to_owned(), dir.to_owned());
    let state = service
        .spawn_blocking(move || adopt(engine.as_deref(), &m, &local, &dir, volume.as_deref()))
        .await
        .map_err(|e| RemoteError::Worker(e.to_string()))??;
    Ok((report, state))
}

/// Step 3 and 4 (blocking): the volume snapshot into the engine, the
/// working set beside the image, the state as written.
fn adopt(
    engine: Option<&VolumeEngine>,
    m: &Manifest,
    local: &str,
    dir: &Path,
    volume: Option<&Path>,
) -> Result<proto::snapshot::StateFile> {
    let state_path = dir.join(crate::snapshot::STATE_FILE);
    let mut state = read_state(&state_path)?;
    if let (Some(file), Some(engine)) = (volume, engine) {
        let vs = format!("{local}.disk");
        adopt_volume(engine, file, local, &vs)?;
        state.volume_snapshot = Some(vs);
        let text = serde_json::to_vec_pretty(&state).map_err(|e| SnapshotError::BadState {
            path: state_path.clone(),
            reason: e.to_string(),
        })?;
        let tmp = dir.join(".state.json.tmp");
        std::fs::write(&tmp, &text)
            .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
            .and_then(|()| std::fs::rename(&tmp, &state_path))
            .map_err(SnapshotError::io("write", &state_path))?;
    }
    if let Some(ws) = &m.working_set {
        if let Err(e) = crate::snapshot::workset::write(dir, ws) {
            warn!(
                "snapshot {local}: its working set is not kept: {}",
                shared::error_chain(&e)
            );
        }
    }
    crate::snapshot::catalog::sync_dir(dir)?;
    Ok(state)
}

fn read_state(path: &Path) -> Result<proto::snapshot::StateFile> {
    let bytes = std::fs::read(path).map_err(SnapshotError::io("read", path))?;
    proto::snapshot::parse_state(&bytes).map_err(|e| {
        Error::from(SnapshotError::BadState {
            path: path.to_owned(),
            reason: shared::error_chain(&e),
        })
    })
}

/// Make pulled volume file `file` the engine's snapshot `vs`: a volume
/// reflinked from it, snapshotted, then deleted (its directory stays as
/// the snapshot's home, as for any volume deleted with snapshots left).
fn adopt_volume(engine: &VolumeEngine, file: &Path, local: &str, vs: &str) -> Result<()> {
    let size = std::fs::metadata(file)
        .map_err(SnapshotError::io("stat", file))?
        .len();
    let vol = format!("{local}-pulled");
    engine.create(&vol, size)?;
    let cloned = std::fs::File::open(file).and_then(|src| {
        let dst = std::fs::OpenOptions::new()
            .write(true)
            .open(engine.volume_path(&vol))?;
        reflink::ficlone(&dst, &src)?;
        dst.sync_all()
    });
    let snap = cloned
        .map_err(|e| Error::from(SnapshotError::io("reflink", file)(e)))
        .and_then(|()| engine.snapshot(&vol, vs).map_err(Error::from));
    if let Err(e) = engine.delete(&vol) {
        warn!("cannot delete volume {vol}: {}", e.chain());
    }
    snap.map(|_| ())
}
