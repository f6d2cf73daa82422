//! The fault engine's counters of one VM (both kinds), which the VM's
//! `GET /v1/vms/{id}` answer and `/metrics` report, and the server's
//! totals of VMs that are gone.

/// Counters of the fault engine for one VM.
#[derive(Debug, Clone, Copy, Default)]
pub struct FaultStats {
    /// MISSING faults resolved.
    pub missing: u64,
    /// WP faults resolved.
    pub write_protect: u64,
    /// MINOR faults resolved (pages a rollback discarded, and pages the
    /// VMM does not map once MINOR is registered).
    pub minor: u64,
    /// Pages installed into the memfd by the server.
    pub pages_installed: u64,
    /// Pages mapped from the VM's shared base (UFFDIO_CONTINUE), not
    /// copied.
    pub pages_shared: u64,
    /// REMOVE events handled.
    pub removes: u64,
    /// Installs deferred by EAGAIN (a pending non-cooperative event).
    pub deferred: u64,
    /// Faults that waited for frames of a compressed image to be decoded.
    pub frame_waits: u64,
    /// Faults that waited for chunks of a snapshot in the object store.
    pub chunk_waits: u64,
    /// Pre-write copies this VM's writes gave to the VMs reading from it.
    pub wp_copies: u64,
    /// Events by service time: bucket i counts those served in
    /// [2^i, 2^(i+1)) µs (bucket 0 also under 1 µs, the last everything
    /// longer).
    pub service_us_log2: [u64; SERVICE_BUCKETS],
}

/// Buckets of [`FaultStats::service_us_log2`]: up to ~32 ms apart.
pub const SERVICE_BUCKETS: usize = 16;

/// The service-time bucket of an event that took `took`.
pub fn service_bucket(took: std::time::Duration) -> usize {
    let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX) | 1;
    (63 - us.leading_zeros() as usize).min(SERVICE_BUCKETS - 1)
}

impl FaultStats {
    /// Add `other`'s counts to these.
    pub fn add(&mut self, other: &FaultStats) {
        self.missing += other.missing;
        self.write_protect += other.write_protect;
        self.pages_installed += other.pages_installed;
        self.pages_shared += other.pages_shared;
        self.removes += other.removes;
        self.deferred += other.deferred;
        self.frame_waits += other.frame_waits;
        self.chunk_waits += other.chunk_waits;
        self.wp_copies += other.wp_copies;
        self.minor += other.minor;
        for (a, b) in self.service_us_log2.iter_mut().zip(other.service_us_log2) {
            *a += b;
        }
    }
}
