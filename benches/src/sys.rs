//! Host counters and machine facts read from /proc.

use std::collections::HashSet;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

/// The XFS (reflink=1) directory a bench runs on: its first argument that
/// is not a `--flag`, else `$PAGEFORK_XFS_DIR`.
pub fn xfs_dir_arg() -> Option<PathBuf> {
    std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("PAGEFORK_XFS_DIR").map(PathBuf::from))
}

/// What a bench of VMs on the XFS needs before it starts: the directory
/// ([`xfs_dir_arg`]), `/dev/kvm` and userfaultfd, and `TMPDIR` pointed
/// there (the harness makes its state directories under it). Otherwise
/// it says what is missing and gives the exit code to end with.
pub fn start_on_xfs(bench: &str) -> Result<PathBuf, std::process::ExitCode> {
    let Some(xfs) = xfs_dir_arg() else {
        eprintln!("{bench}: give an XFS (reflink=1) directory or set PAGEFORK_XFS_DIR");
        return Err(std::process::ExitCode::from(2));
    };
    if !pagefork_tests::require_kvm_uffd() {
        eprintln!("{bench}: needs /dev/kvm and /dev/userfaultfd");
        return Err(std::process::ExitCode::FAILURE);
    }
    std::env::set_var("TMPDIR", &xfs);
    Ok(xfs)
}

/// A field of /proc/meminfo in KiB (`Shmem`, `MemTotal`, ...).
pub fn meminfo_kib(field: &str) -> Option<u64> {
    let text = fs::read_to_string("/proc/meminfo").ok()?;
    status_field(&text, field)
}

/// A field of /proc/PID/status in KiB (`VmRSS`, `RssAnon`, ...).
pub fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status_field(&text, field)
}

/// Memory that a set of processes holds, read from /proc.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Held {
    /// Pages of every memfd they have open (each memfd counted once), KiB.
    pub memfd_kib: u64,
    /// Their anonymous pages (RssAnon), KiB.
    pub anon_kib: u64,
}

impl Held {
    /// Both, KiB.
    pub fn total_kib(&self) -> f64 {
        (self.memfd_kib + self.anon_kib) as f64
    }
}

/// The memory `pids` hold: the host's `Shmem` + `AnonPages` restricted
/// to them. Exact, and blind to other work on the machine, which moves
/// the host-wide counters by hundreds of MiB. A process that exits
/// meanwhile counts as nothing.
pub fn held(pids: &[u32]) -> Held {
    let mut seen = HashSet::new();
    let mut h = Held::default();
    for &pid in pids {
        h.anon_kib += proc_status_kib(pid, "RssAnon").unwrap_or(0);
        let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let is_memfd =
                fs::read_link(fd.path()).is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:"));
            if !is_memfd {
                continue;
            }
            if let Ok(m) = fs::metadata(fd.path()) {
                if seen.insert((m.dev(), m.ino())) {
                    // st_blocks counts 512-byte blocks.
                    h.memfd_kib += m.blocks() / 2;
                }
            }
        }
    }
    h
}

/// `Name:   1234 kB` → 1234.
fn status_field(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (name, rest) = l.split_once(':')?;
        if name.trim() != field {
            return None;
        }
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// The CPU model from /proc/cpuinfo.
pub fn cpu_model() -> String {
    fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .and_then(|r| r.split_once(':'))
                    .map(|(_, m)| m.trim().to_owned())
            })
        })
        .unwrap_or_else(|| "unknown".into())
}

/// The kernel release (`uname -r`).
pub fn kernel_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".into())
}

/// Online CPUs.
pub fn cpus() -> usize {
    std::thread::available_parallelism()
        .map(usize::from)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_field_reads_the_named_kib_value() {
        let t = "MemTotal:       24684084 kB\nShmem:            205480 kB\n";
        assert_eq!(status_field(t, "Shmem"), Some(205_480));
        assert_eq!(status_field(t, "Mem"), None);
    }
}
