//! The machine a test runs on: the built binaries, whether KVM,
//! userfaultfd, huge pages and the XFS mount are there (skipping with a
//! printed reason, or failing under `CI=true`), and what a process holds
//! (fds, memory, children), read from `/proc`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Directory holding the built `uffd-server` and `vmm` binaries.
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PAGEFORK_BIN_DIR") {
        return PathBuf::from(d);
    }
    // The test executable is target/<profile>/deps/<name>-<hash>.
    let exe = std::env::current_exe().expect("cannot find the test executable's path");
    let deps = exe
        .parent()
        .expect("test executable has no parent directory");
    if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().expect("deps/ has no parent").to_owned()
    } else {
        deps.to_owned()
    }
}

/// Path of a built workspace binary; panics with what to do if missing.
pub fn bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build --workspace` before the end-to-end tests \
         (or point PAGEFORK_BIN_DIR at the directory holding uffd-server and vmm)",
        p.display()
    );
    p
}

/// Why device `path` cannot be opened read-write, if it cannot.
fn device_unusable(path: &str) -> Option<String> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .err()
        .map(|e| format!("{path} is not usable: {e}"))
}

/// Whether this machine can run KVM guests served through userfaultfd.
///
/// Without `/dev/kvm` or `/dev/userfaultfd`: panics if `CI=true` (CI must
/// run these tests), else prints `skipping: ...` and returns false.
pub fn require_kvm_uffd() -> bool {
    let missing: Vec<String> = ["/dev/kvm", "/dev/userfaultfd"]
        .iter()
        .filter_map(|d| device_unusable(d))
        .collect();
    if missing.is_empty() {
        return true;
    }
    let why = missing.join("; ");
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but a prerequisite of the end-to-end tests is missing: {why}");
    }
    eprintln!("skipping: {why} (these tests need KVM and userfaultfd)");
    false
}

/// Free 2 MiB huge pages on this host (`HugePages_Free`).
pub fn free_hugepages() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("HugePages_Free:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Whether at least `pages` 2 MiB huge pages are free for hugepage guest
/// RAM (`scripts/test.sh` reserves them). Otherwise: panics if `CI=true`,
/// else prints `skipping: ...` and returns false.
pub fn require_hugepages(pages: u64) -> bool {
    if !require_kvm_uffd() {
        return false;
    }
    let free = free_hugepages();
    if free >= pages {
        return true;
    }
    let why = format!(
        "{free} free 2 MiB huge pages, {pages} needed (echo N > /proc/sys/vm/nr_hugepages)"
    );
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but a prerequisite of the hugepage tests is missing: {why}");
    }
    eprintln!("skipping: {why}");
    false
}

/// Pages of `ranges` (first, count), each widened to whole units of
/// `unit` pages, counted once: what a server tracking `unit`-page blocks
/// (hugepage guest RAM: 512) reports for writes to those ranges.
pub fn pages_in_units(ranges: &[(u64, u64)], unit: u64) -> u64 {
    let mut units: Vec<u64> = ranges
        .iter()
        .flat_map(|(first, n)| first / unit..(first + n).div_ceil(unit))
        .collect();
    units.sort_unstable();
    units.dedup();
    units.len() as u64 * unit
}

/// True (and says so on stderr) when the servers of this run back guest
/// RAM with huge pages by default (`PAGEFORK_HUGEPAGES=true`, the hugepage
/// pass of `scripts/test.sh`) and the calling test counts 4 KiB pages
/// exactly in a way 2 MiB blocks cannot reproduce (`why`); such a test
/// stops there. Block-granular counting is `hugepages_e2e`'s.
pub fn counts_4k_pages_only(why: &str) -> bool {
    let on = std::env::var("PAGEFORK_HUGEPAGES").is_ok_and(|v| v == "true");
    if on {
        eprintln!("not run with PAGEFORK_HUGEPAGES=true: {why}");
    }
    on
}

/// The loop-mounted XFS (reflink=1) named by `PAGEFORK_XFS_DIR`, which
/// `scripts/test.sh` sets up. Without it: panics if `CI=true` (CI must run
/// these tests), else prints `skipping: ...` and returns None.
pub fn xfs_dir() -> Option<PathBuf> {
    match std::env::var_os("PAGEFORK_XFS_DIR") {
        Some(d) => Some(PathBuf::from(d)),
        None if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("CI=true but PAGEFORK_XFS_DIR is not set: run the tests through scripts/test.sh")
        }
        None => {
            eprintln!("skipping: PAGEFORK_XFS_DIR is not set (scripts/test.sh sets up a loop-mounted XFS)");
            None
        }
    }
}

/// Call `f` every 50 ms until it gives a value or `within` has passed.
pub fn wait_for<T>(within: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Call `f` every 10 ms until it gives a value; panics after `within`,
/// saying it was waiting for `what`.
pub fn wait_until<T>(what: &str, within: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(x) = f() {
            return x;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {within:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether process `pid` exists (`kill(pid, 0)` succeeds).
pub fn process_exists(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

/// Send `sig` to `pid`.
pub fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    let pid = i32::try_from(pid).expect("pid fits in i32");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig)
        .unwrap_or_else(|e| panic!("cannot send {sig} to pid {pid}: {e}"));
}

/// Last `n` lines of a text file ("" if unreadable).
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Targets of the open fds of process `pid`.
pub fn open_fds(pid: u32) -> Vec<PathBuf> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .collect()
        })
        .unwrap_or_default()
}

/// A `kB` field of `/proc/<pid>/status` (`VmRSS`, `RssShmem`, ...).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("cannot read /proc/{pid}/status: {e}"));
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// Pids of the direct children of `pid` (zombies included).
pub fn child_pids(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            // Fields after the parenthesized command: state, ppid, ...
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    let rest = &s[s.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

/// Regular files (and links) under `dir`, recursively.
pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => todo.push(e.path()),
                Ok(_) => out.push(e.path()),
                Err(_) => {}
            }
        }
    }
    out.sort();
    out
}

/// What a server process holds, to compare before and after a workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holdings {
    pub fds: usize,
    pub userfaultfds: usize,
    pub rss_kib: u64,
    pub rss_shmem_kib: u64,
    pub children: usize,
}

impl Holdings {
    /// The figures of process `pid` now.
    pub fn of(pid: u32) -> Self {
        let fds = open_fds(pid);
        Holdings {
            fds: fds.len(),
            userfaultfds: fds
                .iter()
                .filter(|p| p.to_string_lossy().contains("userfaultfd"))
                .count(),
            rss_kib: status_kib(pid, "VmRSS"),
            rss_shmem_kib: status_kib(pid, "RssShmem"),
            children: child_pids(pid).len(),
        }
    }
}

/// The VMM processes serving the server of `state_dir` (by the socket on
/// their command line), their anchors apart (see [`anchor_processes`]).
pub fn vmm_processes(state_dir: &Path) -> Vec<u32> {
    vmm_like(state_dir)
        .into_iter()
        .filter(|pid| !is_anchor(*pid))
        .collect()
}

/// The anchors of those VMMs (`vmm/src/anchor.rs`: a process that shares
/// its VMM's address space, and so its command line), each with its
/// parent's pid.
pub fn anchor_processes(state_dir: &Path) -> Vec<(u32, u32)> {
    vmm_like(state_dir)
        .into_iter()
        .filter(|pid| is_anchor(*pid))
        .map(|pid| (pid, parent_of(pid)))
        .collect()
}

fn is_anchor(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "vmm-anchor")
}

fn parent_of(pid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = s[s.rfind(')')? + 1..].to_owned();
            rest.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0)
}

/// Processes whose command line is a `vmm` of `state_dir`'s socket.
fn vmm_like(state_dir: &Path) -> Vec<u32> {
    use std::os::unix::ffi::OsStrExt;
    let sock = state_dir.join("vmm.sock");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            let mut args = cmdline.split(|b| *b == 0);
            let is_vmm = args
                .next()
                .is_some_and(|a| Path::new(std::ffi::OsStr::from_bytes(a)).ends_with("vmm"));
            is_vmm && args.any(|a| a == sock.as_os_str().as_bytes())
        })
        .collect()
}
