//! Creating a VM: validate the request, create its memory and table, spawn
//! its `vmm` process with a launch token, and wait until the guest agent
//! runs. Stopping a VMM.

use std::fs::File;
use std::io::Read;
use std::process::Stdio;
use std::rc::Rc;
use std::time::Duration;

use proto::api::{CreateVm, MemorySource, VmDeleted, VmInfo};
use proto::vmm::{LaunchConfig, Request};
use shared::{GuestRegion, VmId, PAGE_SIZE};
use tokio::sync::oneshot;
use tracing::{info, warn};

use super::vm::{RunState, Vm, VmParts};
use super::{Core, Error, Result};
use crate::conn::{Binding, PendingLaunch};
use crate::memory::PageSize;
use crate::pages::{FileSource, PageSource, PageTable, UNINITIALIZED};

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

fn new_token() -> String {
    let mut b = [0u8; 16];
    if File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        // Fall back to time and pid; tokens are also bound to the pid.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        b = (t ^ u128::from(std::process::id())).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The launch config for `v` and its disk file, if any.
pub(super) fn launch_config(
    v: &Vm,
    volumes: Option<&crate::volume::VolumeEngine>,
) -> Result<(LaunchConfig, Option<File>)> {
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
    };
    Ok((config, disk))
}

impl Core {
    /// The page size a new VM of `size` bytes gets: `hugepages` of the
    /// request, else the server's default; a size that is no whole number
    /// of huge pages is a bad request.
    pub(super) fn page_size_for(&self, req: &CreateVm, size: u64) -> Result<PageSize> {
        let page_size = PageSize::huge(req.hugepages.unwrap_or(self.settings.hugepages));
        if !size.is_multiple_of(page_size.bytes()) {
            return Err(Error::BadRequest(format!(
                "hugepages needs memory_mib to be a multiple of {}",
                page_size.bytes() >> 20
            )));
        }
        Ok(page_size)
    }

    /// `POST /v1/vms`.
    pub(super) async fn create_vm(self: Rc<Self>, req: CreateVm) -> Result<VmInfo> {
        let (id, ready_rx) = match &req.from_snapshot {
            Some(name) => self.prepare_restore(&req, name)?,
            None => self.prepare_vm(&req)?,
        };
        if req.prefetch {
            if let Err(e) = self.prefetch(id).await {
                self.reg.borrow_mut().forget(id);
                return Err(e);
            }
        }
        let started = match self.spawn_vmm(id).await {
            Ok(()) => self.wait_ready(id, ready_rx).await,
            Err(e) => Err(e),
        };
        if let Err(e) = started {
            self.discard_vms(&[id]);
            return Err(e);
        }
        self.log_after_answer(match &req.from_snapshot {
            Some(name) => format!("{id}: running, restored from snapshot {name}"),
            None => format!("{id}: running"),
        });
        self.info(id)
    }

    /// Install every page of `id` before its VMM starts. Frames of a
    /// compressed image are decoded by the frame pool while this waits;
    /// other VMs' faults are served meanwhile.
    async fn prefetch(&self, id: VmId) -> Result<()> {
        let pages = self
            .reg
            .borrow()
            .vms
            .get(&id)
            .map_or(0, |v| v.memory.pages());
        let mut p = 0;
        while p < pages {
            let result = super::fault::materialize::materialize(
                &mut self.reg.borrow_mut(),
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
    pub(super) async fn wait_ready(
        self: &Rc<Self>,
        id: VmId,
        ready_rx: oneshot::Receiver<Result<()>>,
    ) -> Result<()> {
        let timeout = self.settings.start_timeout;
        let reason = match tokio::time::timeout(timeout, ready_rx).await {
            Ok(Ok(Ok(()))) => return Ok(()),
            Ok(Ok(Err(e))) => e.message(),
            Ok(Err(_)) => "its vmm went away".to_owned(),
            Err(_) => {
                self.stop_vmm(id).await;
                return Err(Error::StartTimeout {
                    vm: id,
                    after: timeout,
                });
            }
        };
        let log = self.log_path(id);
        // The log is the VMM's own output, in our private state directory.
        let tail = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = tail.lines().rev().take(5).collect();
        self.stop_vmm(id).await;
        Err(Error::StartFailed {
            vm: id,
            reason,
            log_tail: tail.into_iter().rev().collect::<Vec<_>>().join(" | "),
            log,
        })
    }

    /// Keep the newest `keep_logs` logs of VMs that are gone; remove the
    /// rest. Logs of VMs still registered (running or frozen) stay.
    fn prune_logs(&self) {
        let dir = self.settings.state_dir.join("logs");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        let reg = self.reg.borrow();
        let mut gone: Vec<(std::time::SystemTime, std::path::PathBuf)> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let id: VmId = name.strip_suffix(".log")?.parse().ok()?;
                if reg.vms.contains_key(&id) {
                    return None;
                }
                let modified = e.metadata().and_then(|m| m.modified()).ok()?;
                Some((modified, e.path()))
            })
            .collect();
        drop(reg);
        if gone.len() <= self.settings.keep_logs {
            return;
        }
        gone.sort();
        let excess = gone.len() - self.settings.keep_logs;
        for (_, path) in gone.into_iter().take(excess) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Where `id`'s VMM writes its log.
    pub(super) fn log_path(&self, id: VmId) -> std::path::PathBuf {
        self.settings
            .state_dir
            .join("logs")
            .join(format!("{id}.log"))
    }

    /// Validate `req` and register the VM with its memory and table.
    fn prepare_vm(&self, req: &CreateVm) -> Result<(VmId, oneshot::Receiver<Result<()>>)> {
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
            let engine = self.volumes.as_ref().ok_or(Error::NoVolumes)?;
            engine
                .open_for_vm(name)
                .map_err(|source| Error::AttachVolume {
                    name: name.clone(),
                    source,
                })?;
        }
        let size = req.memory_mib << 20;
        let page_size = self.page_size_for(req, size)?;
        let image = match &req.memory_source {
            None => None,
            Some(MemorySource::File { path }) => {
                Some(PageSource::File(open_image(path, size, &self.settings)?))
            }
            Some(MemorySource::Zstd { path }) => {
                let image = self.open_zstd(path, None)?;
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
                Some(PageSource::Zstd(crate::pages::ZstdSource { image }))
            }
            Some(MemorySource::Snapshot { .. }) => {
                return bad(
                    "a VM starts from a snapshot with \"from_snapshot\", not a memory_source"
                        .into(),
                )
            }
        };
        let mut reg = self.reg.borrow_mut();
        reg.admit(&self.settings, 1, size)?;
        let id = reg.alloc_id(&self.settings.state_dir);
        let (memory, pooled) = self
            .new_guest_memory(id, size, page_size)
            .map_err(Error::CreateMemory)?;
        let memory = Rc::new(memory);
        let self_src = reg.arena.vm_with_memory(id, Rc::clone(&memory));
        let pages = size / PAGE_SIZE;
        // A compressed image's zero frames read as zero without it.
        let data = image
            .as_ref()
            .and_then(PageSource::zstd)
            .map(|z| z.data_pages());
        let initial = match image {
            None => UNINITIALIZED,
            Some(source) => reg.arena.insert(source),
        };
        let mut table = PageTable::new(
            pages,
            if data.is_some() {
                UNINITIALIZED
            } else {
                initial
            },
        );
        for (first, n) in data.unwrap_or_default() {
            table.set_range(first, n.min(pages.saturating_sub(first)), initial);
        }
        let (ready_tx, ready_rx) = oneshot::channel();
        let fault_around_pages =
            fault_around.map_or(self.settings.fault_around_pages, |f| f.pages());
        let readahead_pages = match req.readahead_kib {
            Some(k) => k / 4,
            None => self.settings.readahead_pages,
        };
        let mut vm = Vm::new(VmParts {
            id,
            memory,
            table,
            self_src,
            vcpus: req.vcpus,
            fault_around_pages,
            readahead_pages,
            ready: ready_tx,
        });
        vm.volume = req.volume.clone();
        vm.pooled = pooled;
        reg.vms.insert(id, vm);
        Ok((id, ready_rx))
    }

    /// Start a VMM for `id`: a ready one from the pool, else a new
    /// process with its launch token.
    pub(super) async fn spawn_vmm(self: &Rc<Self>, id: VmId) -> Result<()> {
        if self.launch_from_pool(id) {
            return Ok(());
        }
        // `launch_from_pool` took any VMM set aside for this VM; RAM made
        // for one that is gone is mapped by this VMM like any other memfd.
        let pid = self.launch_process(id, Binding::new(id), &self.log_path(id), None)?;
        if let Some(v) = self.reg.borrow_mut().vms.get_mut(&id) {
            v.link.pid = Some(pid);
        }
        Ok(())
    }

    /// Start a vmm process speaking for `binding` (a VM, or a pool id)
    /// and logging to `path`; register its launch token and watch for its
    /// exit. Returns its pid.
    pub(super) fn launch_process(
        self: &Rc<Self>,
        id: VmId,
        binding: Binding,
        path: &std::path::Path,
        pooled: Option<(u64, Option<&std::fs::File>)>,
    ) -> Result<u32> {
        let token = new_token();
        let log_err = |source| Error::CreateLog {
            vm: id,
            path: path.to_owned(),
            source,
        };
        let log = create_log(path).map_err(log_err)?;
        let log2 = log.try_clone().map_err(log_err)?;
        // Hold the pending-launch lock across the spawn so the token is
        // registered with the child's pid before the child can connect.
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let mut cmd = tokio::process::Command::new(&self.settings.vmm_bin);
        cmd.arg("--socket")
            .arg(self.settings.state_dir.join("vmm.sock"))
            .arg("--token")
            .arg(&token);
        // A pooled VMM learns the RAM size to prepare for, and gets the
        // memfd made for it as its stdin (so the spawn stays a plain
        // posix_spawn, with no code run between fork and exec).
        let mut stdin = Stdio::null();
        if let Some((mib, ram)) = pooled {
            cmd.arg("--ram-hint-mib").arg(mib.to_string());
            if let Some(file) = ram {
                let dup = file.try_clone().map_err(|source| Error::SpawnVmm {
                    bin: self.settings.vmm_bin.clone(),
                    source,
                })?;
                stdin = Stdio::from(dup);
                cmd.arg("--ram-fd").arg("0");
            }
        }
        let child = cmd
            .stdin(stdin)
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| Error::SpawnVmm {
                bin: self.settings.vmm_bin.clone(),
                source,
            })?;
        let pid = child.id().unwrap_or(0);
        // The server lowered its own OOM score; a VMM is an ordinary
        // process the OOM killer may pick before the server.
        if let Err(e) = std::fs::write(format!("/proc/{pid}/oom_score_adj"), "0") {
            warn!("{id}: cannot reset the vmm's oom_score_adj: {e}");
        }
        pending.insert(
            token.clone(),
            PendingLaunch {
                vm: binding.clone(),
                pid,
            },
        );
        drop(pending);
        let core = self.clone();
        tokio::task::spawn_local(async move {
            let mut child = child;
            let status = child.wait().await;
            core.pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&token);
            let reason = match status {
                Ok(s) => format!("vmm process exited: {s}"),
                Err(e) => format!("vmm process lost: {e}"),
            };
            // Whom it spoke for when it went: a pooled VMM may have been
            // bound to a VM since its launch.
            let now = binding.get();
            if super::pool::is_pool_id(now) {
                core.pool_gone(now, &reason);
            } else {
                core.mark_exited(now, &reason);
            }
        });
        Ok(pid)
    }

    /// Ask `id`'s VMM to stop; kill it if it does not within a few seconds.
    pub(super) async fn stop_vmm(self: &Rc<Self>, id: VmId) {
        let (state, pid) = match self.reg.borrow().vms.get(&id) {
            Some(v) => (v.state, v.link.pid),
            None => return,
        };
        if matches!(state, RunState::Running | RunState::Paused) {
            let _ = self
                .request(id, Request::Stop, Duration::from_secs(3))
                .await;
        }
        // Wait for the process to go, then make sure. The state turns
        // Exited as soon as the VMM closes its socket, which is before its
        // process is gone: also wait until `spawn_vmm`'s wait task (which
        // runs while we sleep) has reaped it.
        let alive = || {
            pid.and_then(|p| i32::try_from(p).ok()).is_some_and(|p| {
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), None).is_ok()
            })
        };
        // Polled finely: a rollback waits here with its guest stopped.
        for _ in 0..1500 {
            let exited = self
                .reg
                .borrow()
                .vms
                .get(&id)
                .is_none_or(|v| v.state == RunState::Exited);
            if exited && !alive() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
            warn!("{id}: vmm pid {pid} did not stop; killing it");
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
        }
        self.mark_exited(id, "stopped");
    }

    /// `DELETE /v1/vms/{id}`.
    pub(super) async fn delete_vm(self: Rc<Self>, id: VmId) -> Result<VmDeleted> {
        if let Some(v) = self.delete_fc_vm(id) {
            return Ok(v);
        }
        if !self.reg.borrow().vms.contains_key(&id) {
            return Err(Error::NoSuchVm(id));
        }
        self.stop_vmm(id).await;
        let frozen = {
            let mut reg = self.reg.borrow_mut();
            if let Some(v) = reg.vms.get_mut(&id) {
                v.deleted = true;
                forget_borrowed_pages(v);
                if let (Some(vol), Some(engine)) = (v.volume.take(), self.volumes.as_ref()) {
                    if v.owns_volume
                        || (v.fork.parent.is_some() && vol.ends_with(&format!("-{id}")))
                    {
                        // A fork child's (or a restored VM's) own reflinked
                        // disk goes with it.
                        let _ = engine.delete(&vol);
                    }
                }
            }
            reg.collect_garbage();
            reg.vms.contains_key(&id)
        };
        if frozen {
            info!("{id}: deleted; memory kept while other VMs read from it");
        } else {
            info!("{id}: deleted");
        }
        self.prune_logs();
        Ok(VmDeleted {
            id: id.to_string(),
            deleted: true,
            frozen,
        })
    }
}

/// Open a memory image a client named, without following a symlink and
/// without blocking (a FIFO opens at once and is refused); only a regular
/// file covering `size` bytes of guest RAM is accepted. Errors never quote
/// the file's size, so a client learns nothing about a file it could not
/// read itself. The image is pinned (see [`crate::images::pin`]) so it
/// cannot change under the VM.
fn open_image(path: &str, size: u64, settings: &super::Settings) -> Result<FileSource> {
    let (file, len) =
        crate::images::open_regular(std::path::Path::new(path), settings.image_dir.as_deref())?;
    if len < size {
        return Err(Error::Image {
            path: path.into(),
            reason: format!(
                "it is smaller than the {size} bytes of guest memory asked for; \
                 use a smaller memory_mib or a larger image"
            ),
        });
    }
    let (file, pin) = crate::images::pin(file, &settings.state_dir).map_err(|source| {
        Error::OpenImageFile(crate::images::ImageError::Open {
            path: path.into(),
            source,
        })
    })?;
    Ok(FileSource::new(path.into(), file, len, pin))
}

impl Core {
    /// Open a compressed image a client names (or a snapshot's
    /// `memory.zst`, `snapshot` set, trusted: in our state directory) and
    /// read its header and frame table.
    pub(super) fn open_zstd(
        &self,
        path: &str,
        snapshot: Option<&str>,
    ) -> Result<std::sync::Arc<crate::images::zst::ZstdImage>> {
        let p = std::path::Path::new(path);
        let confine = match snapshot {
            Some(_) => None,
            None => self.settings.image_dir.as_deref(),
        };
        let (file, _) = crate::images::open_regular(p, confine)?;
        let open_err = |source| {
            Error::OpenImageFile(crate::images::ImageError::Open {
                path: path.into(),
                source,
            })
        };
        let (file, pin) = match snapshot {
            // Snapshot files never change once committed.
            Some(_) => {
                let stamp = crate::images::Stamp::of(&file).map_err(open_err)?;
                (file, crate::images::Pin::Stamp(stamp))
            }
            None => crate::images::pin(file, &self.settings.state_dir).map_err(open_err)?,
        };
        self.frames
            .open(file, p.to_owned(), pin, snapshot.map(str::to_owned))
            .map_err(|e| Error::Image {
                path: path.into(),
                reason: format!("not a usable memory.zst image: {}", shared::error_chain(&e)),
            })
    }
}

/// Create `id`'s log: 0600, never through a symlink. A leftover file of
/// the same name (ids do not repeat, so only a crash or someone else could
/// have left it) is unlinked first: the unlink removes a planted link, not
/// its target, and `O_EXCL | O_NOFOLLOW` then creates a fresh file.
fn create_log(path: &std::path::Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::remove_file(path) {
        Ok(()) => warn!("removed a stale log at {}", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// A deleted VM serves only the pages it holds; its entries that point
/// elsewhere are read by nobody (a fork child reads from the holder
/// directly), so drop them: otherwise a frozen VM would keep the VMs it
/// read from alive, and WP faults would still copy pages into it.
fn forget_borrowed_pages(v: &mut Vm) {
    let mut table = PageTable::new(v.table.pages(), UNINITIALIZED);
    for (start, pages) in v.table.ranges_of(v.self_src) {
        table.set_range(start, pages, v.self_src);
    }
    v.table = table;
}
