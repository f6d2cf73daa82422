//! The warm VMM pool (`--vmm-pool N`): `vmm` processes started ahead of
//! need, each connected, authenticated and holding its KVM VM and first
//! vCPU (see the VMM's `Prewarmed`), waiting for guest RAM.
//!
//! ```text
//!  refill ──launch──▶ pooled vmm (pool id) ──hello──▶ idle, writer kept
//!  create / fork / restore / clone: spawn_vmm(id)
//!        └─ an idle VMM? bind it to id, send its Welcome now
//!           (else launch one as before); refill later, off the critical path
//! ```
//!
//! With `--vmm-pool-memory-mib` (default 256), each pooled VMM is launched
//! with guest RAM of that size that the server made for it: an empty
//! memfd, which the VMM maps and sets KVM's slot over while it waits. A VM
//! of that size (4 KiB pages) gets such a memfd as its guest RAM when it is
//! created, and the VMM that mapped it is set aside for the VM's launch
//! (`state::SetAside`): the Welcome then brings RAM the VMM has mapped already.
//! (Mapping other RAM over a KVM slot costs KVM a walk of the whole slot:
//! 0.13–0.18 ms for 256 MiB on this kind of host.)
//!
//! A pooled VMM is launched under a pool id (at or above `state::POOL_BASE`,
//! never a VM's id) with its own log, `logs/pool-N.log`. Taking it binds
//! its connection to the VM (see `crate::conn::Binding`) and renames the
//! log to the VM's. Only VMMs whose hello the core has handled are taken;
//! one still starting stays in the pool. A pooled VMM that exits before it
//! is used leaves the pool; after `state::MAX_FAILURES` in a row the pool stops
//! refilling (and says so) until a VM launch asks for a VMM again, so a
//! broken `vmm` binary cannot make the server spawn processes in a loop.

pub mod refill;
pub mod state;
pub mod take;
