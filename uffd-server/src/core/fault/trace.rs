//! The live fault trace, core side: what one uffd event of a VM was (read
//! before it is handled), what it did (after), and subscribing to a VM's
//! trace. Only called while someone listens (see `observe/trace.rs`).

use std::time::Duration;

use proto::api::FaultKind;
use shared::{VmId, PAGE_SIZE};
use userfaultfd::{Event, FaultKind as UffdKind, ReadWrite};

use crate::core::error::{Error, Result};
use crate::core::registry::Registry;
use crate::core::state::Core;
use crate::observe::trace::{unix_us, RawEvent, Subscription, Tap};

/// An event read but not yet handled: its description, and the
/// installed-pages count before it.
#[derive(Debug)]
pub struct Begun {
    event: RawEvent,
    installed_before: u64,
}

/// Describe `event` of `vm` before it is handled (the page's source is the
/// one the fault will read), naming its source in `tap`.
pub fn begin(reg: &Registry, vm: VmId, event: &Event, tap: &Tap) -> Option<Begun> {
    let v = reg.vms.get(&vm)?;
    let (kind, page, write, source, pages) = match event {
        Event::Pagefault { kind, rw, addr, .. } => {
            let page = v.page_of(*addr as u64)?;
            let (kind, source) = match kind {
                UffdKind::WriteProtected => (FaultKind::Wp, v.self_src),
                UffdKind::Missing | UffdKind::Minor => (FaultKind::Missing, v.table.get(page)),
            };
            tap.name(source, || {
                reg.arena
                    .get(source)
                    .map_or_else(|| format!("source-{source}"), |s| s.describe())
            });
            (kind, page, *rw == ReadWrite::Write, Some(source), 0)
        }
        Event::Remove { start, end } => {
            let page = v.page_of(*start as u64)?;
            let pages = (*end as u64).saturating_sub(*start as u64) / PAGE_SIZE;
            (FaultKind::Remove, page, true, None, pages)
        }
        _ => return None,
    };
    Some(Begun {
        event: RawEvent {
            time_us: unix_us(),
            kind,
            page,
            write,
            source,
            pages,
            service_us: 0,
        },
        installed_before: reg.installed,
    })
}

/// The event `begun` was handled in `took`.
pub fn end(reg: &Registry, begun: Begun, took: Duration) -> RawEvent {
    let mut ev = begun.event;
    if ev.kind != FaultKind::Remove {
        ev.pages = reg.installed.saturating_sub(begun.installed_before);
    }
    ev.service_us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
    ev
}

/// Listen to `id`'s faults from now on.
pub fn subscribe(core: &Core, id: VmId) -> Result<Subscription> {
    let reg = core.reg.borrow();
    let Some(v) = reg.vms.get(&id) else {
        if reg.fc_vms.contains_key(&id) {
            return Err(Error::BadRequest(format!(
                "{id} is a Firecracker VM; the fault trace covers pagefork VMs"
            )));
        }
        return Err(Error::NoSuchVm(id));
    };
    v.log.tap.subscribe(id.to_string()).ok_or_else(|| {
        Error::BadRequest(format!(
            "{id} has no VMM any more (state {}): it takes no faults to trace",
            v.state()
        ))
    })
}
