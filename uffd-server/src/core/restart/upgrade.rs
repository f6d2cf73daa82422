//! A graceful handover (`POST /v1/server/upgrade`): this process stops
//! taking requests, lets those under way finish, writes the journal a
//! last time, asks the keeper to start the next binary once it is gone,
//! answers, and exits. Faults go on being served until the exit; those
//! that come after it wait in their uffds until the next process serves
//! them. API clients that connect meanwhile wait in the listener's
//! backlog (the keeper holds it), VMMs in vmm.sock's, Firecracker
//! processes in their listener's (listeners stop accepting before the
//! journal is written last).
//!
//! If the next binary dies before it serves, the keeper starts this one
//! again, which takes every VM back the same way.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use proto::api::{Upgrade, UpgradeStarted};
use tracing::info;

use super::journal::sync;
use crate::core::error::{Error, Result};
use crate::core::state::Core;

/// Requests under way at most this long before a handover gives up.
const DRAIN: Duration = Duration::from_secs(30);

/// `POST /v1/server/upgrade`.
pub(crate) async fn upgrade(core: Rc<Core>, req: Upgrade) -> Result<UpgradeStarted> {
    let r = &core.restart;
    let Some(store) = r.store() else {
        return Err(Error::CannotUpgrade(
            "nothing holds this server's VMs while it restarts: start it without \
             --no-keeper (or under systemd with its fd store) to upgrade it"
                .into(),
        ));
    };
    if r.handing_over.get() {
        return Err(Error::HandingOver);
    }
    let binary = match req.binary {
        Some(b) => PathBuf::from(b),
        None => r.binary.clone(),
    };
    let meta = std::fs::metadata(&binary)
        .map_err(|e| Error::BadRequest(format!("binary {}: {e}", binary.display())))?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(Error::BadRequest(format!(
            "binary {} is not an executable file",
            binary.display()
        )));
    }
    let binary = std::fs::canonicalize(&binary).unwrap_or(binary);
    r.handing_over.set(true);
    // Let the requests under way finish (this one is one of them), and
    // every operation that pauses a VM.
    let t0 = Instant::now();
    loop {
        let busy = core.reg.borrow().vms.values().any(|v| v.busy.is_busy());
        if r.jobs.get() <= 1 && !busy {
            break;
        }
        if t0.elapsed() > DRAIN {
            r.handing_over.set(false);
            return Err(Error::CannotUpgrade(format!(
                "requests still under way after {} s; try again",
                DRAIN.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Firecracker listeners stop accepting (connections wait in their
    // backlogs for the next process), and each handshake accepted already
    // makes its client before the journal is written.
    crate::conn::firecracker::pause(true);
    while crate::conn::in_flight_handshakes() > 0 {
        if t0.elapsed() > DRAIN {
            crate::conn::firecracker::pause(false);
            r.handing_over.set(false);
            return Err(Error::CannotUpgrade(format!(
                "Firecracker handshakes still under way after {} s; try again",
                DRAIN.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    sync(&core, true);
    if store.is_keeper() {
        store.request_upgrade(&binary).map_err(|e| {
            crate::conn::firecracker::pause(false);
            r.handing_over.set(false);
            Error::CannotUpgrade(format!("cannot reach the keeper: {e}"))
        })?;
    }
    let vms = core.reg.borrow().vms.len() as u64;
    info!(
        "handing {vms} VM(s) over to {} after {:.1} ms of draining",
        binary.display(),
        t0.elapsed().as_secs_f64() * 1e3
    );
    // Exit once the answer is out, without running the VMs' clean-up:
    // they go on, in the next process.
    tokio::task::spawn_local(async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        #[allow(clippy::exit)]
        std::process::exit(0);
    });
    Ok(UpgradeStarted {
        pid: std::process::id(),
        binary: binary.display().to_string(),
        vms,
    })
}
