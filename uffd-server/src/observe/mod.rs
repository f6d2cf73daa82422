//! Seeing what the server does: Prometheus metrics ([`metrics`]).
//!
//! Nothing here touches the fault path except the fault-service-time
//! histogram (two clock reads and a few atomic adds per event); everything
//! else is read from the core's own counters when a scraper asks.

pub mod metrics;
