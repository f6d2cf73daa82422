//! What a VM keeps of shared bases: the base its guest RAM maps, if any,
//! and, for a paused VM forked as a template, the base its own memfd
//! became (it moves onto it before it runs again).

use std::rc::Rc;

use crate::bases::Base;
use crate::pages::SourceId;

/// The base a VM's guest RAM maps, and the id its table reads the base's
/// pages by.
#[derive(Debug, Clone)]
pub struct OnBase {
    pub base: Rc<Base>,
    /// Table entries of this id are pages of the base: mapped from it
    /// (UFFDIO_CONTINUE), filled into it first if it lacks them. For an
    /// image base, the VM's own source of that image; for a template base,
    /// the template's frozen memfd.
    pub src: SourceId,
}

/// One VM's shared-base state.
#[derive(Debug, Default)]
pub struct BaseState {
    /// The base its guest RAM maps (private over it, in its VMM); `None`
    /// for a VM whose guest RAM is its own memfd.
    pub on: Option<OnBase>,
    /// Its own memfd is the base of children forked while it was paused:
    /// the VM must move onto that base (`Request::Rebase`) before it runs
    /// or anything writes its memfd again.
    pub frozen_for: Option<Rc<Base>>,
}

impl BaseState {
    /// Whether the VM's guest RAM maps a base.
    pub fn is_based(&self) -> bool {
        self.on.is_some()
    }
}
