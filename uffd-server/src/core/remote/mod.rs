//! Snapshots in the object store (`--remote`), the core's side: push a
//! local snapshot in the background ([`push`]: progress in the snapshot's
//! `GET`), list, show, delete and collect the store's garbage ([`store`]),
//! pull a snapshot into the local catalog ([`pull`]), restore a VM from
//! one lazily ([`restore`], `"from_snapshot": "remote:NAME"`) and clone(n)
//! from one ([`clone`]).
//!
//! The store's requests run on the `remote-io` runtime and chunk reads on
//! the fetcher threads (`crate::remote`); this module decides what to ask
//! and awaits the answers, so the core thread never waits for the
//! network. A VM restored from the store reads a `Remote` page source: a
//! fault on a chunk not yet here waits for it, parked, as a fault on a
//! compressed frame does; a chunk that cannot be had (the store down past
//! the fetch deadline, the chunk missing or damaged) fails that VM alone,
//! with the reason.

pub mod clone;
pub mod error;
pub mod pull;
pub mod push;
pub mod restore;
pub mod state;
pub mod store;
