//! Seeing what the server does: Prometheus metrics ([`metrics`]), the live
//! fault trace ([`trace`]), each VM's page log ([`access`]: how every page
//! got there, what the VM touched) and pictures of page maps ([`map`]), and the server's fds against
//! its limit ([`fds`]).
//!
//! The fault path pays for: the fault-service-time histogram (two clock
//! reads and a few atomic adds per event), the page log (a clock read and a
//! few stores per event), and one relaxed atomic load per event for the
//! trace while nobody listens, and the per-phase timing ([`phases`]: one
//! clock read per phase boundary). Everything else is read from the core's own
//! state when a client asks.

pub mod access;
pub mod fds;
pub mod map;
pub mod metrics;
pub mod phases;
pub mod stats;
pub mod trace;
pub mod vm;
