//! Working sets: the pages a guest touches first after a restore, in the
//! order it touches them. A snapshot's first restore records them
//! ([`record`]) into the snapshot's directory (`working-set.json`, see
//! [`crate::snapshot::workset`]); later restores, here or on another host
//! through the object store, install them ahead of the guest in that
//! order while it runs ([`prefetch`]), so its first touches find their
//! pages present instead of faulting one run at a time.
//!
//! The recording is the VM's page log (`observe/access.rs`): the pages it
//! installed from the snapshot, by fault or around one, ordered by when.
//! It ends when the VM is deleted or `--working-set-window-ms` after its
//! start, whichever comes first.

pub mod prefetch;
pub mod record;
pub mod state;

use std::rc::Rc;

use shared::VmId;

use crate::core::state::Core;

/// A VM that was just started runs: prefetch the working set its restore
/// left for it (a remote restore, [`state::WorkingSets::pending`]), or,
/// restored from a local snapshot, the snapshot's recorded working set,
/// or start recording one.
pub(crate) fn after_start(core: &Rc<Core>, id: VmId) {
    let pending = core.worksets.borrow_mut().pending.remove(&id);
    let runs = match pending {
        Some(runs) => Some(runs),
        None => match record::local_working_set(core, id) {
            Some(runs) => Some(runs),
            None => {
                record::start(core, id);
                None
            }
        },
    };
    if let Some(runs) = runs {
        if core.settings.prefetch_working_set && !runs.is_empty() {
            tokio::task::spawn_local(prefetch::prefetch(core.clone(), id, runs));
        }
    }
}
