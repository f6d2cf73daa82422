//! A snapshot's commit, the core's side: once its last page is queued,
//! gather what the commit needs (the description, the writer's fsync and
//! streamed digests, the parent's digests of untouched chunks), run the
//! blocking commit of the files off the core thread
//! ([`crate::snapshot::commit`]), and list the snapshot.

use std::collections::BTreeMap;
use std::path::Path;
use std::rc::Rc;
use std::time::Instant;

use proto::api::{CreateSnapshot, SnapshotCreated};
use shared::{VmId, PAGE_SIZE};
use tracing::{info, warn};

use super::pause::Paused;
use super::plan::Plan;
use super::window::Saved;
use crate::core::error::{Error, Result};
use crate::core::state::Core;
use crate::snapshot::commit::{finish_files, Written};
use crate::snapshot::{checksum, image, writer, SnapshotError, StateFile};

fn us(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The times before the pause, for the answer.
pub(crate) struct Before {
    /// When the request began.
    pub t0: Instant,
    pub plan_us: u64,
    pub armed_ahead_us: u64,
    pub writer_us: u64,
}

/// What the steps before the commit produced.
pub(crate) struct Taken {
    pub plan: Plan,
    pub paused: Paused,
    pub saved: Saved,
    pub before: Before,
}

/// Commit snapshot `req.name` of `vm` under `tmp`: everything is saved,
/// the pause went as `taken` says. Returns the answer.
pub(crate) async fn commit(
    core: &Rc<Core>,
    vm: VmId,
    req: &CreateSnapshot,
    tmp: &Path,
    taken: Taken,
) -> Result<SnapshotCreated> {
    let Taken {
        plan,
        paused,
        saved,
        before,
    } = taken;
    let t_handoff = Instant::now();
    let Saved {
        saving,
        report,
        save_us,
    } = saved;
    let (bytes_written, streamed, synced) =
        (report.bytes_written, report.chunk_digests, report.synced);
    let (pages_written, early, touched) = {
        let mut s = saving.borrow_mut();
        let touched = std::mem::take(&mut s.touched);
        (s.pages_written, s.saved_before_write, touched)
    };
    drop(saving);
    let mut state = describe(core, vm, req, &plan, paused.state, paused.volume_snapshot);
    let file = plan
        .image
        .file
        .try_clone()
        .map_err(SnapshotError::io("reopen", &plan.image.path))?;
    let fallback_reason = plan.fallback_reason.clone();
    let state_file = plan.state_file;
    drop(plan.image);
    let root = core.snapshots.borrow().root().to_owned();
    let tmp = tmp.to_owned();
    let parent_chunks = parent_chunks(core, state.parent.as_deref());
    let compress = req.compress.then(|| zst::CompressOptions {
        threads: core.settings.compress_threads,
        ..zst::CompressOptions::default()
    });
    let (state, extents, mut after_pause_us) = tokio::task::spawn_blocking(move || {
        // The digests of the chunks written whole are waited for on the
        // checksum's side, while the image's fsync already runs.
        let streamed = std::cell::Cell::new(Some(streamed));
        let digests = std::cell::OnceCell::new();
        let reuse = |c: u64| {
            let digests = digests.get_or_init(|| {
                streamed
                    .take()
                    .map(writer::Digests::wait)
                    .unwrap_or_default()
            });
            if let Some(d) = digests.get(&c) {
                return Some(d.clone());
            }
            let pages = checksum::CHUNK_BYTES / PAGE_SIZE;
            let untouched = !touched.any_in(c * pages, (c + 1) * pages);
            parent_chunks
                .as_ref()
                .filter(|_| untouched)
                .and_then(|ch| ch.get(shared::geometry::usize_of(c)).cloned())
        };
        // From the last write to here: the commit's inputs gathered and
        // this thread woken.
        let mut phases = BTreeMap::from([("handoff".to_owned(), us(t_handoff))]);
        finish_files(
            &root,
            &tmp,
            Written {
                image: file,
                synced,
                state_file,
            },
            &mut state,
            &reuse,
            compress,
            &mut phases,
        )
        .map(|n| (state, n, phases))
    })
    .await
    .map_err(|_| Error::ShuttingDown)??;
    after_pause_us.insert("save".to_owned(), save_us);
    let compressed_bytes = state.files.get(crate::snapshot::ZSTD_FILE).map(|f| f.bytes);
    let mode_used = state.mode;
    core.snapshots.borrow_mut().insert(state);
    if core.settings.rewrite_extents > 0 && extents > core.settings.rewrite_extents {
        rewrite_in_background(core, &req.name, extents);
    }
    let duration_us = us(before.t0);
    let pause_us = paused.pause_us;
    info!(
        "{vm}: snapshot {} ({mode_used}): {pages_written} pages, pause {pause_us} us, \
         {early} saved ahead of guest writes, {duration_us} us in all",
        req.name
    );
    Ok(SnapshotCreated {
        name: req.name.clone(),
        vm: vm.to_string(),
        mode_requested: req.mode,
        mode_used,
        fallback_reason,
        pages_written,
        bytes_written,
        pause_us,
        before_pause_us: [
            ("plan".to_owned(), before.plan_us),
            ("armed_ahead".to_owned(), before.armed_ahead_us),
            ("writer".to_owned(), before.writer_us),
        ]
        .into_iter()
        .collect(),
        phases_us: paused.phases_us,
        after_pause_us,
        duration_us,
        image_extents: extents,
        pages_saved_ahead: early,
        compressed_bytes,
    })
}

/// The snapshot's `state.json`, its files' checksums still to come.
fn describe(
    core: &Core,
    vm: VmId,
    req: &CreateSnapshot,
    plan: &Plan,
    vm_state: shared::VmState,
    volume_snapshot: Option<String>,
) -> StateFile {
    let (memory_bytes, hugepages) = core
        .reg
        .borrow()
        .vms
        .get(&vm)
        .map_or((0, false), |v| (v.memory.size(), v.memory.unit_pages() > 1));
    StateFile {
        format_version: crate::snapshot::FORMAT_VERSION,
        name: req.name.clone(),
        vm: vm.to_string(),
        mode: plan.mode,
        parent: plan.parent.clone(),
        created: now_secs(),
        memory_bytes,
        page_size: PAGE_SIZE,
        hugepages,
        vm_state,
        volume_snapshot,
        files: Default::default(),
        origin: Some(crate::snapshot::origin::this_host()),
    }
}

/// The parent image's chunk digests (only those, not its whole entry), if
/// it has any to lend: a parent checksummed with another hash has none.
fn parent_chunks(core: &Core, parent: Option<&str>) -> Option<Vec<String>> {
    let cat = core.snapshots.borrow();
    cat.get(parent?)
        .ok()?
        .files
        .get(crate::snapshot::MEMORY_FILE)
        .filter(|f| f.algorithm == checksum::WRITE_ALGORITHM)
        .map(|f| f.chunks.clone())
}

/// Rewrite snapshot `name`'s fragmented image sequentially on a blocking
/// thread (see [`image::rewrite_sequential`]); the snapshot stays usable
/// throughout.
fn rewrite_in_background(core: &Core, name: &str, extents: u64) {
    let path = core.snapshots.borrow().image_of(name);
    let name = name.to_owned();
    info!("snapshot {name}: image has {extents} extents; rewriting it sequentially");
    tokio::task::spawn_blocking(move || match image::rewrite_sequential(&path) {
        Ok((before, after)) => {
            info!("snapshot {name}: image rewritten, {before} -> {after} extents");
        }
        // A snapshot deleted meanwhile is not an error.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => warn!("snapshot {name}: cannot rewrite its image: {e}"),
    });
}
