//! What a live fork keeps per VM: the VM it was forked from, and, for a
//! paused VM forked as a template, that its pages are protected and its
//! captured state, so forking it again costs no pass over its memory.

use std::rc::Rc;

use shared::VmId;

use super::layering::Layering;

/// One VM's fork state.
#[derive(Debug, Default)]
pub struct ForkState {
    /// The VM this one was forked from.
    pub parent: Option<VmId>,
    /// Every page this VM holds is write-protected and it has neither run
    /// nor changed since: set by a fork of the paused VM, cleared by a
    /// resume and by any other operation on it. A further fork skips the
    /// write-protect pass (a template forked again and again).
    pub protected_paused: bool,
    /// The state a fork of this paused VM captured, reused by later forks
    /// until it runs or changes (cleared with `protected_paused`).
    pub paused_state: Option<Rc<shared::VmState>>,
    /// A layer a fork of this VM is filling (see `fork::layer`); its
    /// fill task and the layer's source hold it too.
    pub layering: Option<Rc<Layering>>,
}

impl ForkState {
    /// The VM ran or changed: a template fork must protect and capture it
    /// again.
    pub fn forget_template(&mut self) {
        self.protected_paused = false;
        self.paused_state = None;
    }

    /// Before `page` is written or discarded (its table names `src` for
    /// it): a layer being filled from this VM saves it first, if it is
    /// one of the layer's pages.
    pub fn save_before_write(&self, page: u64, src: crate::pages::SourceId) {
        if let Some(l) = &self.layering {
            if l.frozen() == src {
                l.save(page);
            }
        }
    }
}
