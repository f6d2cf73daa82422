//! Live fork: turn one running VM into n+1 without copying its memory
//! ([`live`] runs the steps, [`children`] makes the children).
//!
//! 1. Write-protect the parent's materialized pages (its `Vm(parent)`
//!    extents) while it still runs. Pages it has not materialized need no
//!    protection: a write to them raises MISSING first, and resolving it
//!    never changes what a child reads (the child reads that page from the
//!    same source).
//! 2. Pause the parent and capture its vCPU/device state; re-protect the
//!    pages it wrote or materialized since step 1 (`snapshot/arm.rs`), so at the
//!    pause every materialized page is protected.
//! 3. Each child's table := the parent's table (shared chunks), so for the
//!    child `Vm(parent)` means "read it from the parent".
//! 4. Reflink the parent's disk volume for each child (still paused).
//! 5. Resume the parent; start each child's VMM from the captured state.
//!
//! A later WP fault on the parent copies the pre-write page into every VM
//! whose table still reads it from the parent (see `fault/dependents.rs`).
//!
//! A paused parent forks as a template: steps 1 and 5 skip the pause and
//! the resume, and step 2 runs only on the first fork after the template
//! last ran or changed (`ForkState::protected_paused`), so forking a template again
//! and again costs the table fork and the children's start only.

pub mod children;
pub mod error;
pub mod layer;
pub mod layering;
pub mod live;
pub mod state;
