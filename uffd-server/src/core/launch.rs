//! Creating a VM: validate the request, create its memory and table, spawn
//! its `vmm` process with a launch token, and wait until the guest agent
//! runs. Stopping a VMM.

use std::fs::File;
use std::io::Read;
use std::process::Stdio;
use std::rc::Rc;
use std::time::Duration;

use proto::api::{CreateVm, MemorySource};
use proto::vmm::{LaunchConfig, Request};
use serde_json::Value;
use shared::{GuestRegion, VmId, PAGE_SIZE};
use tokio::sync::oneshot;
use tracing::{info, warn};

use super::vm::{RunState, Vm, VmParts};
use super::{not_found, ApiError, ApiResult, Core};
use crate::memory::GuestMemory;
use crate::pages::{FileSource, PageSource, PageTable, UNINITIALIZED};
use crate::vmm_conn::PendingLaunch;

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
) -> Result<(LaunchConfig, Option<File>), String> {
    let (disk_bytes, disk) = match (&v.volume, volumes) {
        (Some(name), Some(engine)) => {
            let (f, size) = engine.open_for_vm(name).map_err(|e| super::chain(&e))?;
            (Some(size), Some(f))
        }
        (Some(name), None) => {
            return Err(format!(
                "volume {name} requested but volumes are unavailable"
            ))
        }
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
    /// `POST /v1/vms`.
    pub(super) async fn create_vm(self: Rc<Self>, req: CreateVm) -> ApiResult<Value> {
        let (id, ready_rx) = self.prepare_vm(&req)?;
        if let Err(e) = self.spawn_vmm(id).await {
            self.reg.borrow_mut().vms.remove(&id);
            return Err(e);
        }
        if let Err(e) = self.wait_ready(id, ready_rx).await {
            self.reg.borrow_mut().vms.remove(&id);
            return Err(e);
        }
        info!("{id}: running");
        self.vm_info(id)
    }

    /// Wait until `id`'s guest agent runs; on failure stop its VMM and
    /// return an error that quotes the end of its log.
    pub(super) async fn wait_ready(
        self: &Rc<Self>,
        id: VmId,
        ready_rx: oneshot::Receiver<Result<(), String>>,
    ) -> ApiResult<()> {
        let timeout = self.settings.start_timeout;
        let outcome = tokio::time::timeout(timeout, ready_rx).await;
        let failure = match outcome {
            Ok(Ok(Ok(()))) => None,
            Ok(Ok(Err(e))) => Some(ApiError::vmm(format!("{id} failed to start: {e}"))),
            Ok(Err(_)) => Some(ApiError::vmm(format!("{id} failed to start"))),
            Err(_) => Some(ApiError::timeout(format!(
                "{id}'s vmm did not start within {timeout:?}"
            ))),
        };
        if let Some(err) = failure {
            let log = self
                .settings
                .state_dir
                .join("logs")
                .join(format!("{id}.log"));
            let tail = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(5).collect();
            self.stop_vmm(id).await;
            let detail = tail.into_iter().rev().collect::<Vec<_>>().join(" | ");
            return Err(ApiError {
                status: err.status,
                message: format!("{}; vmm log {}: {detail}", err.message, log.display()),
            });
        }
        Ok(())
    }

    /// Validate `req` and register the VM with its memory and table.
    fn prepare_vm(
        &self,
        req: &CreateVm,
    ) -> ApiResult<(VmId, oneshot::Receiver<Result<(), String>>)> {
        if req.memory_mib == 0 {
            return Err(ApiError::bad_request("memory_mib must be at least 1"));
        }
        let host = host_memory_mib();
        if req.memory_mib > host {
            return Err(ApiError::bad_request(format!(
                "memory_mib {} is more than this host's {host} MiB of RAM; ask for less",
                req.memory_mib
            )));
        }
        if req.vcpus == 0 || req.vcpus > 32 {
            return Err(ApiError::bad_request("vcpus must be between 1 and 32"));
        }
        let fault_around = req
            .fault_around_kib
            .map(crate::pages::FaultAround::from_kib)
            .transpose()
            .map_err(|e| ApiError::bad_request(format!("fault_around_kib {e}")))?;
        if let Some(k) = req.readahead_kib {
            if k % 4 != 0 || k > 64 * 1024 {
                return Err(ApiError::bad_request(
                    "readahead_kib must be a multiple of 4 up to 65536 (0 = off)",
                ));
            }
        }
        if let Some(name) = &req.volume {
            match &self.volumes {
                None => {
                    return Err(ApiError::bad_request(
                        "this server has no volume engine (its state directory cannot reflink); create the VM without a volume",
                    ))
                }
                Some(engine) => {
                    engine.open_for_vm(name).map_err(|e| ApiError::bad_request(super::chain(&e)))?;
                }
            }
        }
        let size = req.memory_mib << 20;
        let file = match &req.memory_source {
            None => None,
            Some(MemorySource::File { path }) => Some(open_image(path, size)?),
        };
        let mut reg = self.reg.borrow_mut();
        reg.next_id += 1;
        let id = VmId(reg.next_id);
        let memory = GuestMemory::create(&format!("pagefork-{id}"), size).map_err(|e| {
            ApiError::internal(format!("cannot create guest memory: {}", super::chain(&e)))
        })?;
        let self_src = reg.arena.vm(id);
        let initial = match file {
            None => UNINITIALIZED,
            Some(f) => reg.arena.insert(PageSource::File(f)),
        };
        let pages = size / PAGE_SIZE;
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
            table: PageTable::new(pages, initial),
            self_src,
            vcpus: req.vcpus,
            fault_around_pages,
            readahead_pages,
            ready: ready_tx,
        });
        vm.volume = req.volume.clone();
        reg.vms.insert(id, vm);
        if req.prefetch {
            for p in 0..pages {
                if let Err(e) = reg.materialize(id, p) {
                    reg.vms.remove(&id);
                    return Err(ApiError::internal(format!(
                        "prefetch failed at page {p}: {e}"
                    )));
                }
            }
        }
        Ok((id, ready_rx))
    }

    /// Start `id`'s vmm process and register its launch token.
    pub(super) async fn spawn_vmm(self: &Rc<Self>, id: VmId) -> ApiResult<()> {
        let token = new_token();
        let logs = self.settings.state_dir.join("logs");
        let _ = std::fs::create_dir_all(&logs);
        let log = File::create(logs.join(format!("{id}.log"))).map_err(|e| {
            ApiError::internal(format!("cannot create vmm log in {}: {e}", logs.display()))
        })?;
        let log2 = log
            .try_clone()
            .map_err(|e| ApiError::internal(e.to_string()))?;
        // Hold the pending-launch lock across the spawn so the token is
        // registered with the child's pid before the child can connect.
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let child = tokio::process::Command::new(&self.settings.vmm_bin)
            .arg("--socket")
            .arg(self.settings.state_dir.join("vmm.sock"))
            .arg("--token")
            .arg(&token)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                ApiError::internal(format!(
                    "cannot start the vmm binary {}: {e}; pass --vmm-bin",
                    self.settings.vmm_bin.display()
                ))
            })?;
        let pid = child.id().unwrap_or(0);
        pending.insert(token.clone(), PendingLaunch { vm: id, pid });
        drop(pending);
        if let Some(v) = self.reg.borrow_mut().vms.get_mut(&id) {
            v.pid = Some(pid);
        }
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
            core.mark_exited(id, &reason);
        });
        Ok(())
    }

    /// Ask `id`'s VMM to stop; kill it if it does not within a few seconds.
    pub(super) async fn stop_vmm(self: &Rc<Self>, id: VmId) {
        let (state, pid) = match self.reg.borrow().vms.get(&id) {
            Some(v) => (v.state, v.pid),
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
        for _ in 0..150 {
            let exited = self
                .reg
                .borrow()
                .vms
                .get(&id)
                .is_none_or(|v| v.state == RunState::Exited);
            if exited && !alive() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
            warn!("{id}: vmm pid {pid} did not stop; killing it");
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
        }
        self.mark_exited(id, "stopped");
    }

    /// `DELETE /v1/vms/{id}`.
    pub(super) async fn delete_vm(self: Rc<Self>, id: VmId) -> ApiResult<Value> {
        if let Some(v) = self.delete_fc_vm(id) {
            return Ok(v);
        }
        if !self.reg.borrow().vms.contains_key(&id) {
            return Err(not_found(id));
        }
        self.stop_vmm(id).await;
        let frozen = {
            let mut reg = self.reg.borrow_mut();
            if let Some(v) = reg.vms.get_mut(&id) {
                v.deleted = true;
                forget_borrowed_pages(v);
                if let (Some(vol), Some(engine)) = (v.volume.take(), self.volumes.as_ref()) {
                    if v.parent.is_some() && vol.ends_with(&format!("-{id}")) {
                        // A fork child's own reflinked disk goes with it.
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
        Ok(serde_json::json!({ "id": id.to_string(), "deleted": true, "frozen": frozen }))
    }
}

/// Open an image file and check it covers `size` bytes of guest RAM.
fn open_image(path: &str, size: u64) -> ApiResult<FileSource> {
    let file = File::open(path).map_err(|e| {
        ApiError::bad_request(format!(
            "cannot open memory image {path}: {e}; give the path of a readable raw image"
        ))
    })?;
    let meta = file
        .metadata()
        .map_err(|e| ApiError::bad_request(format!("cannot stat {path}: {e}")))?;
    if !meta.is_file() {
        return Err(ApiError::bad_request(format!(
            "memory image {path} is not a regular file"
        )));
    }
    if meta.len() < size {
        return Err(ApiError::bad_request(format!(
            "memory image {path} is {} bytes, smaller than the {size} bytes of guest memory asked for; \
             use a smaller memory_mib or a larger image",
            meta.len()
        )));
    }
    Ok(FileSource {
        path: path.into(),
        file,
        len: meta.len(),
    })
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
