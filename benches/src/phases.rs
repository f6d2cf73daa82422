//! The server's fault-path timing by phase, as the benches report it: the
//! `faults.phases` object of `GET /v1/vms/{id}` (p50 and p99 of reading
//! the uffd, resolving, installing, waking, the loop's own work and the
//! whole service of an event, and what the poll window found).

use proto::api::{FaultPhases, PhaseTimes, VmInfo};

/// A phase of [`FaultPhases`].
type Phase = fn(&FaultPhases) -> &PhaseTimes;

/// The phases, as the API names them, how a note names them, and where
/// they are.
const PHASES: [(&str, &str, Phase); 6] = [
    ("read", "read", |p| &p.read),
    ("resolve", "resolve", |p| &p.resolve),
    ("install", "install", |p| &p.install),
    ("wake", "wake", |p| &p.wake),
    ("loop_overhead", "loop", |p| &p.loop_overhead),
    ("service", "service", |p| &p.service),
];

/// p50 and p99 of `phase` (as the API names it) in `vm`'s fault timing,
/// in µs; NaN for a phase the API does not name.
pub fn p50_p99_us(vm: &VmInfo, phase: &str) -> (f64, f64) {
    PHASES
        .iter()
        .find(|(key, _, _)| *key == phase)
        .map_or((f64::NAN, f64::NAN), |(_, _, get)| {
            let t = get(&vm.faults.phases);
            (t.p50_ns as f64 / 1e3, t.p99_ns as f64 / 1e3)
        })
}

/// One line: `read 0.5/1.1, resolve ..., service 3.2/9.0 µs (p50/p99);
/// N of M events found by polling, idle polling X ms`.
pub fn describe(vm: &VmInfo) -> String {
    let p = &vm.faults.phases;
    let parts: Vec<String> = PHASES
        .iter()
        .filter(|(_, _, get)| get(p).count > 0)
        .map(|(key, name, _)| {
            let (p50, p99) = p50_p99_us(vm, key);
            format!("{name} {p50:.1}/{p99:.1}")
        })
        .collect();
    let (polled, woken) = (p.polled_events, p.woken_events);
    let idle_ms = p.poll_idle_us as f64 / 1e3;
    format!(
        "server µs p50/p99: {}; {polled} of {} events read by polling, {idle_ms:.1} ms polling idle",
        parts.join(", "),
        polled + woken
    )
}
