//! This host's [`Origin`]: what a snapshot taken here records of the host
//! and software that took it, and what a restore here checks a snapshot's
//! origin against (a snapshot may come from another host, through the
//! object store). Read once: the CPU does not change under the server.

use std::sync::OnceLock;

use proto::snapshot::{Origin, MAX_CPU_FLAGS};

/// This host's origin: the pagefork version, the VMM protocol version
/// and the CPU's feature flags (`/proc/cpuinfo`'s first `flags` line,
/// sorted; empty if it cannot be read).
pub fn this_host() -> Origin {
    static HOST: OnceLock<Origin> = OnceLock::new();
    HOST.get_or_init(|| Origin {
        pagefork_version: env!("CARGO_PKG_VERSION").to_owned(),
        vmm_protocol: proto::frame::VERSION,
        cpu_flags: std::fs::read_to_string("/proc/cpuinfo")
            .map(|text| cpu_flags(&text))
            .unwrap_or_default(),
    })
    .clone()
}

/// The feature flags of the first CPU in `cpuinfo`'s text, sorted.
fn cpu_flags(cpuinfo: &str) -> Vec<String> {
    let mut flags: Vec<String> = cpuinfo
        .lines()
        .find_map(|l| {
            let (key, value) = l.split_once(':')?;
            (key.trim() == "flags").then_some(value)
        })
        .unwrap_or_default()
        .split_whitespace()
        .filter(|f| f.len() <= 64 && f.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        .map(str::to_owned)
        .collect();
    flags.sort();
    flags.dedup();
    flags.truncate(MAX_CPU_FLAGS);
    flags
}

/// Why snapshot state `state` cannot be restored on this host, if it
/// cannot (a snapshot without an origin, from an older server, is taken
/// for this host's).
pub fn mismatch(state: &proto::snapshot::StateFile) -> Option<String> {
    state.origin.as_ref()?.mismatch(&this_host())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_come_from_the_first_cpu_sorted() {
        let text = "processor\t: 0\nflags\t\t: sse2 fpu avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n";
        assert_eq!(cpu_flags(text), ["avx2", "fpu", "sse2"]);
        assert!(cpu_flags("no flags here").is_empty());
        let host = this_host();
        assert_eq!(host.pagefork_version, env!("CARGO_PKG_VERSION"));
        let mut st_origin = host.clone();
        assert_eq!(st_origin.mismatch(&host), None);
        st_origin.cpu_flags.push("pagefork_no_such_flag".into());
        assert!(st_origin
            .mismatch(&host)
            .is_some_and(|w| w.contains("pagefork_no_such_flag")));
    }
}
