//! Creating a VM (`POST /v1/vms`): admit the fds it will hold
//! (`core::fd_budget`), validate the request, make its memory
//! and table (or, `from_snapshot`, restore it: `snapshot::restore`, or
//! `remote::restore` for a snapshot in the object store),
//! install every page first if asked (`prefetch`), start its VMM (from the
//! warm pool when one is ready) and wait until the guest agent runs.

use std::rc::Rc;

use proto::api::{CreateVm, MemorySource, VmInfo};
use shared::VmId;
use tokio::sync::oneshot;

use super::delete::discard_vms;
use crate::conn::Binding;
use crate::core::error::{Error, Result};
use crate::core::fd_budget::FdKind;
use crate::core::launch::make::{make, reserve, Origin, VmSpec};
use crate::core::link::process::{launch_process, stop_vmm};
use crate::core::pool::take::launch_from_pool;
use crate::core::snapshot::restore::prepare_restore;
use crate::core::sources::{open_image, open_zstd};
use crate::core::state::Core;
use crate::pages::PageSource;

/// Largest guest the host can hold, from /proc/meminfo.
fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb / 1024)
        .unwrap_or(u64::MAX)
}

/// `POST /v1/vms`.
pub(crate) async fn create_vm(core: Rc<Core>, req: CreateVm) -> Result<VmInfo> {
    // Its fds are promised to it until it has started (or failed).
    let _fds = core.fds.admit(fd_kind(&req), 1)?;
    let (id, ready_rx) = match &req.from_snapshot {
        Some(name) => match name.strip_prefix(proto::api::REMOTE_PREFIX) {
            Some(remote) => crate::core::remote::restore::prepare(&core, &req, remote).await?,
            None => prepare_restore(&core, &req, name)?,
        },
        None => prepare_vm(&core, &req)?,
    };
    if req.prefetch {
        if let Err(e) = prefetch(&core, id).await {
            core.reg.borrow_mut().forget(id);
            return Err(e);
        }
    }
    let started = match spawn_vmm(&core, id).await {
        Ok(()) => wait_ready(&core, id, ready_rx).await,
        Err(e) => Err(e),
    };
    if let Err(e) = started {
        core.worksets.borrow_mut().pending.remove(&id);
        discard_vms(&core, &[id]);
        return Err(e);
    }
    crate::core::workset::after_start(&core, id);
    core.log_after_answer(match &req.from_snapshot {
        Some(name) => format!("{id}: running, restored from snapshot {name}"),
        None => format!("{id}: running"),
    });
    crate::core::ops::info(&core, id)
}

/// What a create starts, for the fds it will hold.
fn fd_kind(req: &CreateVm) -> FdKind {
    match &req.from_snapshot {
        Some(name) if name.starts_with(proto::api::REMOTE_PREFIX) => FdKind::RemoteRestore,
        Some(_) => FdKind::Restore,
        None => FdKind::Create,
    }
}

/// Install every page of `id` before its VMM starts. Frames of a
/// compressed image are decoded by the frame pool while this waits;
/// other VMs' faults are served meanwhile.
async fn prefetch(core: &Core, id: VmId) -> Result<()> {
    let pages = core
        .reg
        .borrow()
        .vms
        .get(&id)
        .map_or(0, |v| v.memory.pages());
    let mut p = 0;
    while p < pages {
        let result = crate::core::fault::materialize::materialize(
            &mut core.reg.borrow_mut(),
            id,
            p,
            crate::observe::access::By::Prefetch,
        );
        match result {
            Ok((first, n)) => p = p.max(first + n),
            Err(crate::pages::ResolveError::NotDecoded { image, frames }) => {
                // Queue this frame and the next ones, then wait for it.
                let ahead = frames.end..frames.end + 8;
                let ready = crate::images::zst::FramePool::wait(&image, frames);
                crate::images::zst::FramePool::prefetch(&image, ahead);
                for r in ready {
                    let _ = r.await;
                }
            }
            Err(e) => {
                return Err(Error::Prefetch {
                    vm: id,
                    page: p,
                    reason: e.to_string(),
                })
            }
        }
    }
    Ok(())
}

/// Wait until `id`'s guest agent runs; on failure stop its VMM and
/// return an error that quotes the end of its log.
pub(crate) async fn wait_ready(
    core: &Rc<Core>,
    id: VmId,
    ready_rx: oneshot::Receiver<Result<()>>,
) -> Result<()> {
    let timeout = core.settings.start_timeout;
    let reason = match tokio::time::timeout(timeout, ready_rx).await {
        Ok(Ok(Ok(()))) => return Ok(()),
        Ok(Ok(Err(e))) => e.message(),
        Ok(Err(_)) => "its vmm went away".to_owned(),
        Err(_) => {
            stop_vmm(core, id).await;
            return Err(Error::StartTimeout {
                vm: id,
                after: timeout,
            });
        }
    };
    let log = core.settings.log_path(id);
    // The log is the VMM's own output, in our private state directory.
    let tail = std::fs::read_to_string(&log).unwrap_or_default();
    let tail: Vec<&str> = tail.lines().rev().take(5).collect();
    stop_vmm(core, id).await;
    Err(Error::StartFailed {
        vm: id,
        reason,
        log_tail: tail.into_iter().rev().collect::<Vec<_>>().join(" | "),
        log,
    })
}

/// Validate `req` and register the VM with its memory and table.
fn prepare_vm(core: &Core, req: &CreateVm) -> Result<(VmId, oneshot::Receiver<Result<()>>)> {
    let bad = |m: String| Err(Error::BadRequest(m));
    if req.memory_mib == 0 {
        return bad("memory_mib must be at least 1".into());
    }
    let host = host_memory_mib();
    if req.memory_mib > host {
        return bad(format!(
            "memory_mib {} is more than this host's {host} MiB of RAM; ask for less",
            req.memory_mib
        ));
    }
    if req.vcpus == 0 || req.vcpus > 32 {
        return bad("vcpus must be between 1 and 32".into());
    }
    let fault_around = req
        .fault_around_kib
        .map(crate::pages::FaultAround::from_kib)
        .transpose()
        .map_err(|e| Error::BadRequest(format!("fault_around_kib {e}")))?;
    if let Some(k) = req.readahead_kib {
        if k % 4 != 0 || k > 64 * 1024 {
            return bad("readahead_kib must be a multiple of 4 up to 65536 (0 = off)".into());
        }
    }
    if let Some(name) = &req.volume {
        let engine = core.volumes.as_ref().ok_or(Error::NoVolumes)?;
        engine
            .open_for_vm(name)
            .map_err(|source| Error::AttachVolume {
                name: name.clone(),
                source,
            })?;
    }
    let size = req.memory_mib << 20;
    let page_size = core.settings.page_size_for(req.hugepages, size)?;
    let origin = match &req.memory_source {
        None => None,
        Some(MemorySource::File { path }) => Some(Origin {
            source: PageSource::File(open_image(path, size, &core.settings)?),
            data: None,
        }),
        Some(MemorySource::Zstd { path }) => {
            let image = open_zstd(core, path, None)?;
            if image.header().memory_bytes < size {
                return Err(Error::Image {
                    path: path.clone(),
                    reason: format!(
                        "it holds {} bytes of memory, less than the {size} bytes asked for; \
                         use a smaller memory_mib",
                        image.header().memory_bytes
                    ),
                });
            }
            // Its zero frames read as zero without it.
            let data = Some(image.data_pages());
            Some(Origin {
                source: PageSource::Zstd(crate::pages::ZstdSource { image }),
                data,
            })
        }
        Some(MemorySource::Snapshot { .. }) => {
            return bad(
                "a VM starts from a snapshot with \"from_snapshot\", not a memory_source".into(),
            )
        }
    };
    let spec = VmSpec {
        size,
        page_size,
        vcpus: req.vcpus,
        origin,
        fault_around_pages: fault_around.map_or(core.settings.fault_around_pages, |f| f.pages()),
        readahead_pages: req
            .readahead_kib
            .map_or(core.settings.readahead_pages, |k| k / 4),
        start_state: None,
        volume: req.volume.clone().map(|v| (v, false)),
        restores: None,
        // A VM asked to have all its memory before it starts (`prefetch`)
        // holds it in its own memfd: pages of a base would still fault
        // once each, to be mapped.
        shared_base: !req.prefetch,
        reclaim: req.reclaim.clone(),
    };
    let mut reg = core.reg.borrow_mut();
    let id = reserve(core, &mut reg, size)?;
    let ready_rx = make(core, &mut reg, id, spec)?;
    Ok((id, ready_rx))
}

/// Start a VMM for `id`: a ready one from the pool, else a new
/// process with its launch token.
pub(crate) async fn spawn_vmm(core: &Rc<Core>, id: VmId) -> Result<()> {
    if launch_from_pool(core, id) {
        return Ok(());
    }
    // `launch_from_pool` took any VMM set aside for this VM; RAM made
    // for one that is gone is mapped by this VMM like any other memfd.
    let log = core.settings.log_path(id);
    let pid = launch_process(core, id, Binding::new(id), &log, None)?;
    if let Some(v) = core.reg.borrow_mut().vms.get_mut(&id) {
        v.link.pid = Some(pid);
    }
    Ok(())
}
