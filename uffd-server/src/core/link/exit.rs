//! A VM's VMM going away: marked exited (its memory stays for the VMs
//! that read from it), its waiting requests failed with the reason, and
//! why it failed appended to its log.

use proto::vmm::ServerMsg;
use shared::VmId;
use tracing::{info, warn};

use crate::core::state::Core;

/// Append why `vm` failed to its log, next to its VMM's last words.
pub(crate) fn log_failure(core: &Core, vm: VmId, reason: &str) {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = core.settings.log_path(vm);
    let appended = std::fs::OpenOptions::new()
        .append(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .and_then(|mut f| writeln!(f, "uffd-server: {vm} failed: {reason}"));
    if let Err(e) = appended {
        warn!("{vm}: cannot note the failure in {}: {e}", path.display());
    }
}

/// Record that `vm`'s VMM is gone; its memory stays for dependents.
pub(crate) fn mark_exited(core: &Core, vm: VmId, reason: &str) {
    let mut reg = core.reg.borrow_mut();
    let Some(v) = reg.vms.get_mut(&vm) else {
        return;
    };
    if v.exited() {
        info!("{vm}: exited: {reason}");
    }
    v.link.exit_reason.get_or_insert_with(|| reason.to_owned());
    if let (Some(name), Some(engine)) = (&v.volume, &core.volumes) {
        engine.detach(name);
    }
    if let Some(w) = v.link.writer.take() {
        w.shutdown();
    }
    v.faults.uffd = None;
    // Its anchor goes, unless a layer being filled from it holds it.
    v.link.anchor = None;
    if let Some(crate::pages::VmPages::Process(p)) = reg.arena.memory_of(vm) {
        p.let_go_anchor();
    }
    let Some(v) = reg.vms.get_mut(&vm) else {
        return;
    };
    // Writes waiting for its uffd go on: nothing runs in it any more.
    v.faults.on_uffd.clear();
    v.faults.closed.notify_one();
    v.log.tap.close();
    // A VM that failed tells its waiting requests why, not just that
    // its VMM went away.
    let why = v.failure().map(str::to_owned);
    v.fail_pending(why.as_deref().unwrap_or(reason));
}

/// `vm`'s VMM broke the protocol: tell it why, hang up, and count it as
/// exited.
pub(crate) fn protocol_error(core: &Core, vm: VmId, why: &str) {
    warn!("{vm}: protocol error: {why}");
    let writer = core
        .reg
        .borrow()
        .vms
        .get(&vm)
        .and_then(|v| v.link.writer.clone());
    if let Some(w) = writer {
        let _ = w.send(
            ServerMsg::Error {
                message: why.to_owned(),
            },
            Vec::new(),
        );
        w.shutdown();
    }
    mark_exited(core, vm, &format!("protocol error: {why}"));
}
