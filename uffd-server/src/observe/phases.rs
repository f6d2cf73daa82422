//! Where the time of a uffd event goes: per-phase timing of the fault path.
//!
//! The serving loops (`core/fault/serve.rs` `serve_faults`,
//! `core/firecracker/serve.rs` `serve_fc`) time one wake-up of a VM's uffd
//! in phases:
//!
//! ```text
//!   uffd readable ─▶ read ─▶ resolve ─▶ install ─▶ wake ─▶ loop ─▶ (poll | epoll)
//!                    read(2)  table,    UFFDIO_    UFFDIO_  counters,
//!                    of the   source,   COPY /     WAKE     trace, GC,
//!                    events   bytes     ZEROPAGE            retries
//! ```
//!
//! A thread-local lap clock ([`start`], [`lap`], [`take`]) lets the code
//! deep in the install path (the `uffd_abi` calls of the installer,
//! `core/fault/install/`) close a phase without threading a timer
//! through every call: each lap charges the time since the previous one to
//! the phase it names. Nothing is timed while no clock is started (API
//! requests that install pages, prefetch). The laps are added to the VM's
//! [`PhaseHists`], histograms with four buckets per power of two of
//! nanoseconds, from which the API reports p50 and p99 of each phase.
//!
//! Cost: one clock read (`CLOCK_MONOTONIC` through the vDSO) per phase
//! boundary and a few thread-local stores; measured in `benches/`.

use std::cell::Cell;
use std::time::Instant;

/// A phase of serving one wake-up of a uffd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Reading the pending events (`read(2)` of the uffd).
    Read = 0,
    /// From an event to its install: table lookup, plan, the bytes.
    Resolve = 1,
    /// The install ioctl (UFFDIO_COPY, UFFDIO_ZEROPAGE, UFFDIO_POISON,
    /// UFFDIO_WRITEPROTECT).
    Install = 2,
    /// UFFDIO_WAKE (only when the install did not wake the faulter).
    Wake = 3,
    /// The loop's own work after the events: counters, trace, garbage
    /// collection, parked retries.
    Loop = 4,
}

/// Phases timed per wake-up, in [`Phase`] order.
pub const PHASES: usize = 5;

/// Time charged to each phase since [`start`], in nanoseconds.
pub type Laps = [u64; PHASES];

thread_local! {
    static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
    static LAPS: Cell<Laps> = const { Cell::new([0; PHASES]) };
}

/// Start timing a wake-up: laps from now on are charged to phases.
pub fn start() {
    LAST.with(|l| l.set(Some(Instant::now())));
    LAPS.with(|l| l.set([0; PHASES]));
}

/// Charge the time since the previous lap (or [`start`]) to `phase`. A
/// no-op while no clock is started.
pub fn lap(phase: Phase) {
    LAST.with(|last| {
        if let Some(t) = last.get() {
            let now = Instant::now();
            let ns = u64::try_from(now.duration_since(t).as_nanos()).unwrap_or(u64::MAX);
            LAPS.with(|l| {
                let mut laps = l.get();
                laps[phase as usize] = laps[phase as usize].saturating_add(ns);
                l.set(laps);
            });
            last.set(Some(now));
        }
    });
}

/// The laps since the previous `take` (or [`start`]), which restart at
/// zero; the clock keeps running.
pub fn take() -> Laps {
    LAPS.with(|l| l.replace([0; PHASES]))
}

/// Stop timing: later laps are not charged until the next [`start`].
pub fn stop() {
    LAST.with(|l| l.set(None));
}

/// Buckets per power of two of a [`Hist`].
const SUB: usize = 4;
/// Powers of two covered: up to 2^32 ns (~4.3 s).
const OCTAVES: usize = 32;
/// Buckets of a [`Hist`].
const BUCKETS: usize = SUB * OCTAVES;

/// A histogram of nanosecond durations with four buckets per power of two
/// (the quantiles it gives are within ~10% of the true value).
#[derive(Clone, PartialEq, Eq)]
pub struct Hist {
    counts: Box<[u64; BUCKETS]>,
}

impl Default for Hist {
    fn default() -> Self {
        Hist {
            counts: Box::new([0; BUCKETS]),
        }
    }
}

impl std::fmt::Debug for Hist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hist")
            .field("count", &self.count())
            .finish()
    }
}

/// The bucket of `ns`: below 4 ns one bucket per ns, then four per power of
/// two (`4..8` → 4..=7, `8..16` → 8..=11, ...), the last bucket open-ended.
fn bucket(ns: u64) -> usize {
    if ns < SUB as u64 {
        return shared::geometry::usize_of(ns);
    }
    let octave = 63 - ns.leading_zeros() as usize; // ≥ 2
    let sub = shared::geometry::usize_of((ns >> (octave - 2)) & 3);
    (octave * SUB + sub - SUB).min(BUCKETS - 1)
}

/// The smallest value of bucket `i` (inverse of [`bucket`]).
fn bucket_low(i: usize) -> u64 {
    if i < SUB {
        return i as u64;
    }
    let octave = (i + SUB) / SUB;
    let sub = ((i + SUB) % SUB) as u64;
    (1u64 << octave) + (sub << (octave - 2))
}

impl Hist {
    /// Count one duration of `ns` nanoseconds.
    pub fn record(&mut self, ns: u64) {
        self.counts[bucket(ns)] += 1;
    }

    /// Durations counted.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// Add `other`'s counts to these.
    pub fn add(&mut self, other: &Hist) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
    }

    /// The `q` quantile (0 < q ≤ 1) in nanoseconds: the middle of the
    /// bucket holding it; 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        let n = self.count();
        if n == 0 {
            return 0;
        }
        // Nearest rank, as the benches' statistics.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let lo = bucket_low(i);
                let hi = if i + 1 < BUCKETS {
                    bucket_low(i + 1)
                } else {
                    lo
                };
                return lo + (hi - lo) / 2;
            }
        }
        0
    }
}

/// One VM's fault-path timing: a histogram per [`Phase`], the whole
/// service time of each event, and what the poll window did.
#[derive(Debug, Clone, Default)]
pub struct PhaseHists {
    pub phases: [Hist; PHASES],
    /// Whole time the server spent on one event (what `service_us_log2`
    /// counts, at a finer grain).
    pub service: Hist,
    /// Events read from the uffd while polling it after a served fault
    /// (without waiting for the event loop to report it readable).
    pub polled_events: u64,
    /// Events read after the event loop reported the uffd readable.
    pub woken_events: u64,
    /// Time spent polling the uffd and finding nothing, in nanoseconds (the
    /// CPU the poll window costs).
    pub poll_idle_ns: u64,
}

impl PhaseHists {
    /// Count one wake-up's `laps`: every phase that took any time.
    pub fn record(&mut self, laps: &Laps) {
        for (h, ns) in self.phases.iter_mut().zip(laps) {
            if *ns > 0 {
                h.record(*ns);
            }
        }
    }

    /// Add `other`'s counts to these.
    pub fn add(&mut self, other: &PhaseHists) {
        for (a, b) in self.phases.iter_mut().zip(&other.phases) {
            a.add(b);
        }
        self.service.add(&other.service);
        self.polled_events += other.polled_events;
        self.woken_events += other.woken_events;
        self.poll_idle_ns += other.poll_idle_ns;
    }

    /// The API's view: p50 and p99 of each phase.
    pub fn to_api(&self) -> proto::api::FaultPhases {
        let t = |h: &Hist| proto::api::PhaseTimes {
            count: h.count(),
            p50_ns: h.quantile(0.5),
            p99_ns: h.quantile(0.99),
        };
        proto::api::FaultPhases {
            read: t(&self.phases[Phase::Read as usize]),
            resolve: t(&self.phases[Phase::Resolve as usize]),
            install: t(&self.phases[Phase::Install as usize]),
            wake: t(&self.phases[Phase::Wake as usize]),
            loop_overhead: t(&self.phases[Phase::Loop as usize]),
            service: t(&self.service),
            polled_events: self.polled_events,
            woken_events: self.woken_events,
            poll_idle_us: self.poll_idle_ns / 1000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_monotonic_and_invert() {
        let mut prev = 0;
        for ns in [
            0u64,
            1,
            3,
            4,
            5,
            7,
            8,
            9,
            15,
            16,
            100,
            1000,
            123_456,
            1 << 31,
        ] {
            let b = bucket(ns);
            assert!(b >= prev, "bucket({ns}) = {b} < {prev}");
            assert!(bucket_low(b) <= ns, "low of bucket({ns}) above it");
            if b + 1 < BUCKETS {
                assert!(bucket_low(b + 1) > ns, "bucket({ns}) too low");
            }
            prev = b;
        }
        assert_eq!(bucket(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn quantiles_are_within_a_bucket() {
        let mut h = Hist::default();
        for ns in 1..=1000u64 {
            h.record(ns * 10);
        }
        let p50 = h.quantile(0.5);
        let p99 = h.quantile(0.99);
        assert!((4_500..=5_700).contains(&p50), "p50 {p50}");
        assert!((8_800..=11_000).contains(&p99), "p99 {p99}");
        assert_eq!(Hist::default().quantile(0.5), 0);
    }

    #[test]
    fn laps_charge_the_named_phase_only_while_started() {
        stop();
        lap(Phase::Install);
        assert_eq!(take(), [0; PHASES]);
        start();
        std::thread::sleep(std::time::Duration::from_millis(1));
        lap(Phase::Install);
        let laps = take();
        assert!(laps[Phase::Install as usize] >= 1_000_000, "{laps:?}");
        assert_eq!(laps[Phase::Read as usize], 0);
        stop();
    }
}
