//! A VMM process: started with a launch token it presents in its hello
//! (for a VM, or for the warm pool), logging to its own file, watched
//! until it exits; stopped on request, killed if it does not stop.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::rc::Rc;
use std::time::Duration;

use proto::vmm::Request;
use shared::VmId;
use tracing::warn;

use super::error::LinkError;
use crate::conn::{Binding, ConnEvent, PendingLaunch};
use crate::core::error::Result;
use crate::core::state::Core;
use crate::core::vm::RunState;

/// Keep the newest `keep_logs` logs of VMs that are gone; remove the
/// rest. Logs of VMs still registered (running or frozen) stay.
pub(crate) fn prune_logs(core: &Core) {
    let dir = core.settings.state_dir.join("logs");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return;
    };
    let reg = core.reg.borrow();
    let mut gone: Vec<(std::time::SystemTime, PathBuf)> = entries
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
    if gone.len() <= core.settings.keep_logs {
        return;
    }
    gone.sort();
    let excess = gone.len() - core.settings.keep_logs;
    for (_, path) in gone.into_iter().take(excess) {
        let _ = std::fs::remove_file(path);
    }
}

/// Start a vmm process speaking for `binding` (a VM, or a pool id)
/// and logging to `path`; register its launch token and watch for its
/// exit. Returns its pid.
pub(crate) fn launch_process(
    core: &Rc<Core>,
    id: VmId,
    binding: Binding,
    path: &Path,
    pooled: Option<(u64, Option<&std::fs::File>)>,
) -> Result<u32> {
    let token = new_token();
    let log_err = |source| LinkError::CreateLog {
        vm: id,
        path: path.to_owned(),
        source,
    };
    let log = create_log(path).map_err(log_err)?;
    let log2 = log.try_clone().map_err(log_err)?;
    // Hold the pending-launch lock across the spawn so the token is
    // registered with the child's pid before the child can connect.
    let mut pending = core.pending.lock().unwrap_or_else(|p| p.into_inner());
    let mut cmd = tokio::process::Command::new(&core.settings.vmm_bin);
    cmd.arg("--socket")
        .arg(core.settings.state_dir.join("vmm.sock"))
        .arg("--token")
        .arg(&token)
        // Every VMM may come to hold pages a fork's children need (it is
        // on a shared base, or moves onto one): see `pages::anchor`.
        .arg("--anchor");
    // A pooled VMM learns the RAM size to prepare for, and gets the
    // memfd made for it as its stdin (so the spawn stays a plain
    // posix_spawn, with no code run between fork and exec).
    let mut stdin = Stdio::null();
    if let Some((mib, ram)) = pooled {
        cmd.arg("--ram-hint-mib").arg(mib.to_string());
        if let Some(file) = ram {
            let dup = file.try_clone().map_err(|source| LinkError::SpawnVmm {
                bin: core.settings.vmm_bin.clone(),
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
        .map_err(|source| LinkError::SpawnVmm {
            bin: core.settings.vmm_bin.clone(),
            source,
        })?;
    let pid = child.id().unwrap_or(0);
    // The OOM killer must pick a VMM before the server, which holds
    // every VM's memory: a server that could lower its own score gives
    // its VMMs the default back; one that could not (no
    // CAP_SYS_RESOURCE) raises theirs instead, which needs no privilege.
    let adj = vmm_oom_score_adj();
    if let Err(e) = std::fs::write(format!("/proc/{pid}/oom_score_adj"), adj.to_string()) {
        warn!("{id}: cannot set the vmm's oom_score_adj to {adj}: {e}");
    }
    pending.insert(
        token.clone(),
        PendingLaunch {
            vm: binding.clone(),
            pid,
        },
    );
    drop(pending);
    let core = core.clone();
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
        // The event loop handles it as it handles the VMM's connection
        // closing (for a VM: `exit::mark_exited`).
        let _ = core.events.send(ConnEvent::Closed { vm: now, reason });
    });
    Ok(pid)
}

/// Ask `id`'s VMM to stop; kill it if it does not within a few seconds.
pub(crate) async fn stop_vmm(core: &Rc<Core>, id: VmId) {
    let (state, pid) = match core.reg.borrow().vms.get(&id) {
        Some(v) => (v.state(), v.link.pid),
        None => return,
    };
    // The process is known by its pid and its start time, taken while it
    // still speaks for the VM: once it is gone its pid may be another
    // process's (pids wrap at 32,768 on these hosts, and a busy host goes
    // round in minutes), which must be neither waited for nor killed. A VM
    // whose VMM went before (exited, killed) has nothing left to stop.
    let live = matches!(state, RunState::Running | RunState::Paused);
    let started = pid
        .filter(|_| live)
        .and_then(crate::pages::anchor::start_time);
    if live {
        let _ = super::requests::request(core, id, Request::Stop, Duration::from_secs(3)).await;
    }
    // Wait for the process to go, then make sure. The state turns
    // Exited as soon as the VMM closes its socket, which is before its
    // process is gone: also wait until `launch_process`'s wait task (which
    // runs while we sleep) has reaped it.
    let alive = || {
        pid.zip(started)
            .is_some_and(|(p, t)| crate::pages::anchor::start_time(p) == Some(t))
    };
    // Polled finely: a rollback waits here with its guest stopped.
    for _ in 0..1500 {
        let exited = core
            .reg
            .borrow()
            .vms
            .get(&id)
            .is_none_or(|v| v.state() == RunState::Exited);
        if exited && !alive() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    if let Some(pid) = pid.filter(|_| alive()).and_then(|p| i32::try_from(p).ok()) {
        warn!("{id}: vmm pid {pid} did not stop; killing it");
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
    }
    super::exit::mark_exited(core, id, "stopped");
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

/// The `oom_score_adj` a VMM gets: the default if the server's own is
/// lowered, else one that makes the OOM killer prefer the VMM.
pub(crate) fn vmm_oom_score_adj() -> i32 {
    let own = std::fs::read_to_string("/proc/self/oom_score_adj")
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .unwrap_or(0);
    if own < 0 {
        0
    } else {
        500
    }
}
