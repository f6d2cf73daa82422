//! The write groups of the snapshot operations ([`crate::ops`]), named so
//! a failure hook can stop an operation after any of them (the crash tests)
//! and [`crate::error::Error::Injected`] can say where it stopped.

/// The end of a write group (the point after its fsync).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// create: the snapshot's L1 copy is written and refcounts raised.
    CopiedL1,
    /// create/delete: the new snapshot table is written, not yet used.
    TableWritten,
    /// create/delete: the header points at the new table (commit).
    HeaderCommitted,
    /// create: the old snapshot table is freed.
    OldTableFreed,
    /// delete: the snapshot's clusters are released.
    Released,
    /// apply: the snapshot's clusters carry one more reference.
    RefcountsRaised,
    /// apply: the active L1 table is the snapshot's (commit).
    ActiveL1Replaced,
    /// apply: the old active clusters are released.
    OldActiveReleased,
}
