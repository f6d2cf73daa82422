//! Firecracker listeners: a socket bound to a memory source (a file, a
//! compressed image, a snapshot) that Firecracker processes connect to
//! with their Uffd handshake; the accept thread is `conn/firecracker.rs`.

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use proto::api::{CreateListener, ListenerDeleted, ListenerInfo, ListenerList, MemorySource};
use shared::PAGE_SIZE;
use tracing::info;

use super::state::FcListener;
use crate::conn::firecracker::ListenerStats;
use crate::core::error::{Error, Result};
use crate::core::settings::fault_around_kib;
use crate::core::sources::{open_snapshot_memory, open_zstd};
use crate::core::state::Core;
use crate::pages::{FileSource, PageSource, ZstdSource};

/// Start a Firecracker listener.
pub(crate) fn add_fc_listener(core: &Rc<Core>, req: CreateListener) -> Result<ListenerInfo> {
    let path = req.memory_source.describe();
    let (source, len, data) = open_listener_source(core, &req.memory_source)?;
    let socket = PathBuf::from(&req.socket);
    let fault_around = req
        .fault_around_kib
        .map(crate::pages::FaultAround::from_kib);
    let fault_around_pages = match fault_around {
        Some(Ok(f)) => f.pages(),
        Some(Err(e)) => return Err(Error::BadRequest(format!("fault_around_kib {e}"))),
        None => core.settings.fault_around_pages,
    };
    let readahead_pages = match req.readahead_kib {
        Some(k) if k % 4 == 0 && k <= 64 * 1024 => k / 4,
        Some(_) => {
            return Err(Error::BadRequest(
                "readahead_kib must be a multiple of 4 up to 65536 (0 = off)".into(),
            ))
        }
        None => core.settings.readahead_pages,
    };
    if socket.symlink_metadata().is_ok() {
        return Err(Error::SocketExists { path: socket });
    }
    let listen_err = |source| Error::Listen {
        path: socket.clone(),
        source,
    };
    let sock = std::os::unix::net::UnixListener::bind(&socket).map_err(listen_err)?;
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600));
    let accept = sock.try_clone().map_err(listen_err)?;
    let stats = Arc::new(ListenerStats::default());
    let mut reg = core.reg.borrow_mut();
    let id = reg.next_listener_id();
    let source = reg.arena.insert(source);
    let ctx = crate::conn::firecracker::ListenerCtx {
        id,
        socket: socket.clone(),
        source_len: len,
        stats: stats.clone(),
        events: core.events.clone(),
    };
    std::thread::Builder::new()
        .name("fc-accept".into())
        .spawn(move || crate::conn::firecracker::accept_loop(accept, ctx))
        .map_err(|source| Error::SpawnThread {
            what: "accept Firecracker connections",
            source,
        })?;
    reg.fc_listeners.insert(
        id,
        FcListener {
            id,
            socket: socket.clone(),
            memory_source: req.memory_source.clone(),
            source,
            source_len: len,
            data: Rc::new(data),
            fault_around_pages,
            readahead_pages,
            working_set: req.working_set,
            recorded: None,
            stats,
            sock,
        },
    );
    info!(
        "firecracker listener fc-{id} on {} serving {path}",
        socket.display()
    );
    drop(reg);
    // In the journal, its socket in the fd store: it outlives a crash.
    crate::core::restart::journal::sync(core, false);
    fc_listener_info(core, id)
}

/// The source a listener serves, the memory size it covers and the
/// runs of its pages that hold data.
fn open_listener_source(core: &Core, memory: &MemorySource) -> Result<ListenerSource> {
    match memory {
        MemorySource::File { path } => {
            let (file, len) = crate::images::open_regular(
                std::path::Path::new(path),
                core.settings.image_dir.as_deref(),
            )?;
            if len == 0 || len % PAGE_SIZE != 0 {
                return Err(Error::Image {
                    path: path.clone(),
                    reason: "a memory snapshot must be a non-empty multiple of 4096 bytes".into(),
                });
            }
            let (file, pin) =
                crate::images::pin(file, &core.settings.state_dir).map_err(|source| {
                    Error::OpenImageFile(crate::images::ImageError::Open {
                        path: path.clone(),
                        source,
                    })
                })?;
            let source = PageSource::File(FileSource::new(PathBuf::from(path), file, len, pin));
            Ok((source, len, vec![(0, len / PAGE_SIZE)]))
        }
        MemorySource::Zstd { path } => {
            let image = open_zstd(core, path, None)?;
            let len = image.header().memory_bytes;
            let data = image.data_pages();
            Ok((PageSource::Zstd(ZstdSource { image }), len, data))
        }
        MemorySource::Snapshot { name } => {
            let (bytes, compressed, path) = {
                let cat = core.snapshots.borrow();
                let st = cat.get(name)?;
                (
                    st.memory_bytes,
                    st.files.contains_key(crate::snapshot::ZSTD_FILE),
                    cat.image_of(name),
                )
            };
            let (source, data) = open_snapshot_memory(core, name, compressed, &path)?;
            Ok((source, bytes, data))
        }
    }
}

/// `GET /v1/firecracker/listeners/{id}` body.
pub(crate) fn fc_listener_info(core: &Core, id: u32) -> Result<ListenerInfo> {
    let reg = core.reg.borrow();
    let l = reg
        .fc_listeners
        .get(&id)
        .ok_or_else(|| Error::NoSuchListener(format!("fc-{id}")))?;
    let vms: Vec<String> = reg
        .fc_vms
        .values()
        .filter(|v| v.listener == id)
        .map(|v| v.id.to_string())
        .collect();
    let last_refusal = l
        .stats
        .last_refusal
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    Ok(ListenerInfo {
        id: format!("fc-{id}"),
        socket: l.socket.display().to_string(),
        memory_source: l.memory_source.clone(),
        fault_around_kib: fault_around_kib(l.fault_around_pages),
        readahead_kib: l.readahead_pages * PAGE_SIZE / 1024,
        working_set: l.working_set,
        recorded_pages: l.recorded.as_ref().map_or(0, |r| r.len() as u64),
        accepted: l.stats.accepted.load(Ordering::Relaxed),
        refused: l.stats.refused.load(Ordering::Relaxed),
        last_refusal,
        vms,
    })
}

/// `GET /v1/firecracker/listeners`.
pub(crate) fn fc_listeners(core: &Core) -> ListenerList {
    let ids: Vec<u32> = core.reg.borrow().fc_listeners.keys().copied().collect();
    ListenerList {
        listeners: ids
            .into_iter()
            .filter_map(|id| fc_listener_info(core, id).ok())
            .collect(),
    }
}

/// `DELETE /v1/firecracker/listeners/{id}`: stop accepting; connected
/// VMs keep being served.
pub(crate) fn delete_fc_listener(core: &Core, id: u32) -> Result<ListenerDeleted> {
    let mut reg = core.reg.borrow_mut();
    let l = reg
        .fc_listeners
        .remove(&id)
        .ok_or_else(|| Error::NoSuchListener(format!("fc-{id}")))?;
    reg.release_unused_sources();
    drop(reg);
    // SAFETY: shutdown(2) on our own listening socket; it makes the
    // accept thread's accept() fail with EINVAL so it exits.
    unsafe { libc::shutdown(l.sock.as_raw_fd(), libc::SHUT_RDWR) };
    let _ = std::fs::remove_file(&l.socket);
    Ok(ListenerDeleted {
        id: format!("fc-{id}"),
        deleted: true,
    })
}

/// What a listener serves: the source, the memory size it covers and the
/// runs of its pages that hold data.
type ListenerSource = (PageSource, u64, Vec<(u64, u64)>);
