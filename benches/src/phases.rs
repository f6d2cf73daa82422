//! The server's fault-path timing by phase, as the benches report it: the
//! `faults.phases` object of `GET /v1/vms/{id}` (p50 and p99 of reading
//! the uffd, resolving, installing, waking, the loop's own work and the
//! whole service of an event, and what the poll window found).

use serde_json::Value;

/// The phases, as the API names them, and how a note names them.
const PHASES: [(&str, &str); 6] = [
    ("read", "read"),
    ("resolve", "resolve"),
    ("install", "install"),
    ("wake", "wake"),
    ("loop_overhead", "loop"),
    ("service", "service"),
];

/// p50 and p99 of `phase` in `vm`'s fault timing, in µs.
pub fn p50_p99_us(vm: &Value, phase: &str) -> (f64, f64) {
    let p = &vm["faults"]["phases"][phase];
    let us = |k: &str| p[k].as_f64().unwrap_or(f64::NAN) / 1e3;
    (us("p50_ns"), us("p99_ns"))
}

/// One line: `read 0.5/1.1, resolve ..., service 3.2/9.0 µs (p50/p99);
/// N of M events found by polling, idle polling X ms`.
pub fn describe(vm: &Value) -> String {
    let p = &vm["faults"]["phases"];
    let parts: Vec<String> = PHASES
        .iter()
        .filter(|(key, _)| p[key]["count"].as_u64().unwrap_or(0) > 0)
        .map(|(key, name)| {
            let (p50, p99) = p50_p99_us(vm, key);
            format!("{name} {p50:.1}/{p99:.1}")
        })
        .collect();
    let polled = p["polled_events"].as_u64().unwrap_or(0);
    let woken = p["woken_events"].as_u64().unwrap_or(0);
    let idle_ms = p["poll_idle_us"].as_f64().unwrap_or(0.0) / 1e3;
    format!(
        "server µs p50/p99: {}; {polled} of {} events read by polling, {idle_ms:.1} ms polling idle",
        parts.join(", "),
        polled + woken
    )
}
