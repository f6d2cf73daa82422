//! The memory limits that apply to the server: its memory cgroup (v1 or
//! v2), the host's memory (`/proc/meminfo`), and a pressure-stall (PSI)
//! trigger that says when tasks stall on memory.
//!
//! Nothing is cached: every call reads the kernel's files again, so a
//! limit changed while the server runs is seen by the next read. What
//! counts against a limit for guest RAM is anonymous memory and shmem
//! ([`MemoryCgroup::anon_and_shmem_bytes`]): guest RAM is shmem (memfds),
//! and page cache is the kernel's to reclaim by itself.
//!
//! Where the group is found, from the server's line in `/proc/self/cgroup`:
//!
//! ```text
//! 4:memory:/a/b     (v1; or a line whose controller list holds "memory")
//!                   -> /sys/fs/cgroup/memory/a/b        memory.limit_in_bytes
//! 0::/a/b           (v2, if no v1 memory line)
//!                   -> /sys/fs/cgroup/a/b               memory.max
//!                   -> /sys/fs/cgroup/unified/a/b       memory.max (hybrid)
//! ```

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

/// Where cgroup file systems are mounted.
const CGROUP_MOUNT: &str = "/sys/fs/cgroup";

/// The host-wide memory pressure file.
const HOST_PRESSURE: &str = "/proc/pressure/memory";

/// A v1 limit at or above this is "no limit": the kernel shows an unset
/// limit as `PAGE_COUNTER_MAX` pages in bytes (2^63 - 4096 on x86-64).
const V1_NO_LIMIT: u64 = 1 << 62;

/// Errors of this module; each names the file it is about.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cannot read {}", .0.display())]
    Read(PathBuf, #[source] std::io::Error),
    #[error("{} has no `{key}` line (is the kernel too old to report it?)", path.display())]
    MissingKey { path: PathBuf, key: String },
    #[error("{}: {value:?} is not a number of bytes", path.display())]
    Parse { path: PathBuf, value: String },
    #[error(
        "cannot open {} for a pressure trigger (the kernel needs PSI: \
         CONFIG_PSI=y, and psi=1 on the command line if it is off by default)",
        .0.display()
    )]
    OpenPressure(PathBuf, #[source] std::io::Error),
    #[error(
        "cannot set the pressure trigger {trigger:?} on {}: windows are 500 ms to 10 s, \
         and a process without CAP_SYS_RESOURCE may only use whole multiples of 2 s \
         (Linux 6.5 and later)",
        path.display()
    )]
    SetTrigger {
        path: PathBuf,
        trigger: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot poll the pressure trigger on {}", .0.display())]
    PollPressure(PathBuf, #[source] nix::Error),
    #[error("the pressure trigger on {} is gone (its cgroup was removed)", .0.display())]
    PressureGone(PathBuf),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, CgroupError>;

/// Which cgroup hierarchy a memory cgroup is in; the two name their files
/// differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

impl CgroupVersion {
    /// The file holding the group's hard limit.
    fn limit_file(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "memory.limit_in_bytes",
            CgroupVersion::V2 => "memory.max",
        }
    }

    /// The file holding the group's charged memory now.
    fn usage_file(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "memory.usage_in_bytes",
            CgroupVersion::V2 => "memory.current",
        }
    }

    /// The file with the `oom_kill N` line.
    fn oom_file(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "memory.oom_control",
            CgroupVersion::V2 => "memory.events",
        }
    }
}

/// One memory cgroup's directory, read on demand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryCgroup {
    dir: PathBuf,
    version: CgroupVersion,
}

/// The memory cgroup lines of one `/proc/PID/cgroup`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcCgroup {
    /// The path of the v1 hierarchy that has the memory controller.
    pub v1_memory: Option<String>,
    /// The path in the v2 (unified) hierarchy (`0::/path`).
    pub v2: Option<String>,
}

impl MemoryCgroup {
    /// The memory cgroup of this process, or None if it is in none that
    /// can be read (no memory controller mounted where expected).
    pub fn of_self() -> Result<Option<MemoryCgroup>> {
        let path = Path::new("/proc/self/cgroup");
        let text = read(path)?;
        Ok(Self::find(
            &parse_proc_cgroup(&text),
            Path::new(CGROUP_MOUNT),
        ))
    }

    /// The memory cgroup that `lines` name under the cgroup mount `mount`
    /// (`/sys/fs/cgroup`): the v1 memory hierarchy's if it is there, else
    /// the v2 group if it has `memory.max` (not the root group, which has
    /// no limit of its own).
    pub fn find(lines: &ProcCgroup, mount: &Path) -> Option<MemoryCgroup> {
        let v1 = lines
            .v1_memory
            .as_deref()
            .map(|p| (under(&mount.join("memory"), p), CgroupVersion::V1));
        let v2 = lines.v2.as_deref().into_iter().flat_map(|p| {
            [mount.to_owned(), mount.join("unified")]
                .into_iter()
                .map(move |m| (under(&m, p), CgroupVersion::V2))
        });
        v1.into_iter()
            .chain(v2)
            .find(|(dir, version)| dir.join(version.limit_file()).is_file())
            .map(|(dir, version)| MemoryCgroup { dir, version })
    }

    /// The memory cgroup at `dir`, of hierarchy `version` (no check that
    /// it is one: a read says so).
    pub fn at(dir: &Path, version: CgroupVersion) -> MemoryCgroup {
        MemoryCgroup {
            dir: dir.to_owned(),
            version,
        }
    }

    /// The group's directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The group's hierarchy.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// "cgroup v1 /sys/fs/cgroup/memory/x", for logs and the API.
    pub fn describe(&self) -> String {
        let v = match self.version {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        };
        format!("cgroup {v} {}", self.dir.display())
    }

    /// The group's own hard limit in bytes, None if it has none.
    pub fn limit_bytes(&self) -> Result<Option<u64>> {
        let path = self.dir.join(self.version.limit_file());
        let text = read(&path)?;
        parse_limit(&text, self.version).ok_or_else(|| parse_error(&path, &text))
    }

    /// The smallest hard limit of the group and of the groups above it
    /// (a parent's limit caps its children), None if none has one.
    pub fn effective_limit_bytes(&self) -> Result<Option<u64>> {
        match self.version {
            CgroupVersion::V1 => {
                let path = self.dir.join("memory.stat");
                let v = flat_key(&path, "hierarchical_memory_limit")?;
                Ok((v < V1_NO_LIMIT).then_some(v))
            }
            CgroupVersion::V2 => {
                let mut limit = self.limit_bytes()?;
                let mut dir = self.dir.parent();
                // The root group has no memory.max: the walk ends there.
                while let Some(d) = dir.filter(|d| d.join("memory.max").is_file()) {
                    let up = MemoryCgroup::at(d, CgroupVersion::V2).limit_bytes()?;
                    limit = match (limit, up) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                    dir = d.parent();
                }
                Ok(limit)
            }
        }
    }

    /// Bytes charged to the group now (page cache included).
    pub fn usage_bytes(&self) -> Result<u64> {
        let path = self.dir.join(self.version.usage_file());
        let text = read(&path)?;
        text.trim().parse().map_err(|_| parse_error(&path, &text))
    }

    /// Bytes of anonymous memory and shmem charged to the group (and, on
    /// v1, its children): guest RAM, which only its owner can give back,
    /// unlike page cache.
    pub fn anon_and_shmem_bytes(&self) -> Result<u64> {
        let path = self.dir.join("memory.stat");
        let text = read(&path)?;
        let sum = |anon: &str, shmem: &str| {
            Some(parse_flat_keyed(&text, anon)? + parse_flat_keyed(&text, shmem)?)
        };
        let found = match self.version {
            CgroupVersion::V1 => sum("total_rss", "total_shmem").or_else(|| sum("rss", "shmem")),
            CgroupVersion::V2 => sum("anon", "shmem"),
        };
        found.ok_or_else(|| CgroupError::MissingKey {
            path,
            key: "anon/rss and shmem".into(),
        })
    }

    /// The group's working set: what it is charged (kernel memory
    /// included) less the page cache the kernel would drop first (its
    /// inactive file pages). This is what must stay under the limit: the
    /// OOM killer runs when the charge cannot be reclaimed, and of it
    /// only guest RAM is ours to give back.
    pub fn working_set_bytes(&self) -> Result<u64> {
        let usage = self.usage_bytes()?;
        let path = self.dir.join("memory.stat");
        let text = read(&path)?;
        let inactive = match self.version {
            CgroupVersion::V1 => parse_flat_keyed(&text, "total_inactive_file")
                .or_else(|| parse_flat_keyed(&text, "inactive_file")),
            CgroupVersion::V2 => parse_flat_keyed(&text, "inactive_file"),
        }
        .ok_or_else(|| CgroupError::MissingKey {
            path,
            key: "inactive_file".into(),
        })?;
        Ok(usage.saturating_sub(inactive))
    }

    /// How many tasks the kernel's OOM killer has killed in the group.
    pub fn oom_kills(&self) -> Result<u64> {
        flat_key(&self.dir.join(self.version.oom_file()), "oom_kill")
    }

    /// The group's own pressure file (v2), or None: v1 groups have none.
    pub fn pressure_file(&self) -> Option<PathBuf> {
        let path = self.dir.join("memory.pressure");
        (self.version == CgroupVersion::V2 && path.is_file()).then_some(path)
    }
}

/// The host's `MemAvailable` in bytes: what can be allocated without
/// swapping.
pub fn mem_available_bytes() -> Result<u64> {
    meminfo_bytes("MemAvailable")
}

/// The host's `MemTotal` in bytes.
pub fn mem_total_bytes() -> Result<u64> {
    meminfo_bytes("MemTotal")
}

fn meminfo_bytes(field: &str) -> Result<u64> {
    let path = Path::new("/proc/meminfo");
    parse_meminfo(&read(path)?, field).ok_or_else(|| CgroupError::MissingKey {
        path: path.to_owned(),
        key: field.to_owned(),
    })
}

// ---------------------------------------------------------------- PSI --

/// Which tasks a pressure trigger counts: `Some` while at least one task
/// stalls on memory, `Full` while all non-idle tasks do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stall {
    Some,
    Full,
}

/// The shortest window a process without `CAP_SYS_RESOURCE` may set (and
/// every such window is a whole multiple of it); a 1 s window from such a
/// process is refused with EINVAL.
pub const UNPRIVILEGED_WINDOW: Duration = Duration::from_secs(2);

/// A PSI trigger: a file descriptor that polls `POLLPRI` when tasks
/// stalled on memory for `stall` or more within a `window`.
///
/// The kernel takes windows of 500 ms to 10 s (Linux 6.5 dropped the lower
/// bound for privileged processes), a stall shorter than the window, and
/// from a process without `CAP_SYS_RESOURCE` only a window that is a whole
/// multiple of 2 s ([`UNPRIVILEGED_WINDOW`]; Linux 6.5 and later, earlier
/// kernels refuse such a process a trigger at all). One event at most per window.
///
/// A v2 cgroup has a pressure file of its own (`memory.pressure`, stalls
/// of its tasks only); a v1 cgroup has none, so the host-wide
/// `/proc/pressure/memory` is used there ([`PressureTrigger::for_cgroup`]).
#[derive(Debug)]
pub struct PressureTrigger {
    file: File,
    path: PathBuf,
}

impl PressureTrigger {
    /// A trigger on the pressure file `path`.
    pub fn new(path: &Path, kind: Stall, stall: Duration, window: Duration) -> Result<Self> {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| CgroupError::OpenPressure(path.to_owned(), e))?;
        let trigger = trigger_line(kind, stall, window);
        // One write, ending in NUL: the kernel takes the trigger from a
        // single write and overwrites the last byte written with NUL.
        let mut bytes = trigger.clone().into_bytes();
        bytes.push(0);
        let set_trigger = |source: std::io::Error| CgroupError::SetTrigger {
            path: path.to_owned(),
            trigger: trigger.clone(),
            source,
        };
        match file.write(&bytes) {
            Ok(n) if n == bytes.len() => {}
            Ok(_) => return Err(set_trigger(std::io::ErrorKind::WriteZero.into())),
            Err(e) => return Err(set_trigger(e)),
        }
        Ok(PressureTrigger {
            file,
            path: path.to_owned(),
        })
    }

    /// A trigger on the host's memory pressure.
    pub fn host(kind: Stall, stall: Duration, window: Duration) -> Result<Self> {
        Self::new(Path::new(HOST_PRESSURE), kind, stall, window)
    }

    /// A trigger on `cgroup`'s memory pressure: its own on v2, the host's
    /// on v1.
    pub fn for_cgroup(
        cgroup: &MemoryCgroup,
        kind: Stall,
        stall: Duration,
        window: Duration,
    ) -> Result<Self> {
        match cgroup.pressure_file() {
            Some(path) => Self::new(&path, kind, stall, window),
            None => Self::host(kind, stall, window),
        }
    }

    /// The pressure file this trigger is set on.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the trigger fired since the last call (without waiting); a
    /// poll consumes the event.
    pub fn fired(&self) -> Result<bool> {
        let mut fds = [PollFd::new(self.file.as_fd(), PollFlags::POLLPRI)];
        poll(&mut fds, PollTimeout::ZERO)
            .map_err(|e| CgroupError::PollPressure(self.path.clone(), e))?;
        let revents = fds[0].revents().unwrap_or_else(PollFlags::empty);
        if revents.contains(PollFlags::POLLERR) {
            return Err(CgroupError::PressureGone(self.path.clone()));
        }
        Ok(revents.contains(PollFlags::POLLPRI))
    }
}

impl AsFd for PressureTrigger {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl AsRawFd for PressureTrigger {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// The text written to a pressure file to set a trigger:
/// `"some 100000 1000000"` (stall and window in µs).
pub fn trigger_line(kind: Stall, stall: Duration, window: Duration) -> String {
    let kind = match kind {
        Stall::Some => "some",
        Stall::Full => "full",
    };
    format!("{kind} {} {}", stall.as_micros(), window.as_micros())
}

// ------------------------------------------------------------ parsing --

/// The memory cgroup lines of a `/proc/PID/cgroup` text
/// (`hierarchy-ID:controller-list:path` per line).
pub fn parse_proc_cgroup(text: &str) -> ProcCgroup {
    let mut out = ProcCgroup::default();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            out.v2 = Some(path.to_owned());
        } else if controllers.split(',').any(|c| c == "memory") {
            out.v1_memory = Some(path.to_owned());
        }
    }
    out
}

/// The value of `key` in a flat keyed file (`key value` per line, as
/// `memory.stat`, `memory.events`, `memory.oom_control`).
pub fn parse_flat_keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(char::is_whitespace)?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Field `field` of a `/proc/meminfo` text in bytes (`MemAvailable:
/// 123 kB`).
pub fn parse_meminfo(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(field)?.strip_prefix(':')?;
        let mut words = rest.split_whitespace();
        let n: u64 = words.next()?.parse().ok()?;
        match words.next() {
            Some("kB") => n.checked_mul(1024),
            None => Some(n),
            Some(_) => None,
        }
    })
}

/// A hard-limit file's text: `Some(None)` for no limit (`max` on v2, a
/// number of 2^62 or more on v1), None for text that is no limit at all.
fn parse_limit(text: &str, version: CgroupVersion) -> Option<Option<u64>> {
    let t = text.trim();
    if version == CgroupVersion::V2 && t == "max" {
        return Some(None);
    }
    let v: u64 = t.parse().ok()?;
    Some((v < V1_NO_LIMIT).then_some(v))
}

/// `path` (a cgroup path such as `/a/b`) under the hierarchy at `mount`.
fn under(mount: &Path, path: &str) -> PathBuf {
    mount.join(path.trim_start_matches('/'))
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| CgroupError::Read(path.to_owned(), e))
}

fn parse_error(path: &Path, text: &str) -> CgroupError {
    CgroupError::Parse {
        path: path.to_owned(),
        value: text.trim().to_owned(),
    }
}

/// `key` of the flat keyed file at `path`.
fn flat_key(path: &Path, key: &str) -> Result<u64> {
    parse_flat_keyed(&read(path)?, key).ok_or_else(|| CgroupError::MissingKey {
        path: path.to_owned(),
        key: key.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROC_CGROUP_HYBRID: &str = "\
9:name=systemd:/
8:pids:/
4:memory:/process_api/e02b
3:cpu,cpuacct:/
0::/
";

    #[test]
    fn a_v1_memory_line_wins_over_the_unified_one() {
        let p = parse_proc_cgroup(PROC_CGROUP_HYBRID);
        assert_eq!(p.v1_memory.as_deref(), Some("/process_api/e02b"));
        assert_eq!(p.v2.as_deref(), Some("/"));
    }

    #[test]
    fn memory_is_found_in_a_shared_controller_list() {
        let p = parse_proc_cgroup("5:cpuset:/\n6:blkio,memory:/vms\n");
        assert_eq!(p.v1_memory.as_deref(), Some("/vms"));
        assert_eq!(p.v2, None);
        // A named hierarchy is no controller.
        let p = parse_proc_cgroup("1:name=memory:/x\n");
        assert_eq!(p.v1_memory, None);
    }

    #[test]
    fn a_pure_v2_host_has_only_the_unified_line() {
        let p = parse_proc_cgroup("0::/system.slice/pagefork.service\n");
        assert_eq!(p.v1_memory, None);
        assert_eq!(p.v2.as_deref(), Some("/system.slice/pagefork.service"));
    }

    #[test]
    fn flat_keyed_values_are_found_by_whole_key() {
        let stat = "rss 100\ntotal_rss 4096\nshmem 7\ntotal_shmem 8192\noom_kill 3\n";
        assert_eq!(parse_flat_keyed(stat, "rss"), Some(100));
        assert_eq!(parse_flat_keyed(stat, "total_rss"), Some(4096));
        assert_eq!(parse_flat_keyed(stat, "oom_kill"), Some(3));
        assert_eq!(parse_flat_keyed(stat, "oom"), None);
        assert_eq!(parse_flat_keyed("oom_kill x\n", "oom_kill"), None);
    }

    #[test]
    fn meminfo_fields_are_bytes() {
        let text = "MemTotal:       24684096 kB\nMemFree:  1 kB\nMemAvailable:   21369856 kB\nHugePages_Free:  3\n";
        assert_eq!(parse_meminfo(text, "MemTotal"), Some(24_684_096 * 1024));
        assert_eq!(parse_meminfo(text, "MemAvailable"), Some(21_369_856 * 1024));
        assert_eq!(parse_meminfo(text, "HugePages_Free"), Some(3));
        assert_eq!(parse_meminfo(text, "Mem"), None);
        assert_eq!(parse_meminfo(text, "SwapTotal"), None);
    }

    #[test]
    fn unset_limits_read_as_none() {
        let v1 = CgroupVersion::V1;
        assert_eq!(parse_limit("9223372036854771712\n", v1), Some(None));
        assert_eq!(parse_limit("536870912\n", v1), Some(Some(512 << 20)));
        assert_eq!(parse_limit("max\n", CgroupVersion::V2), Some(None));
        assert_eq!(
            parse_limit("1048576\n", CgroupVersion::V2),
            Some(Some(1 << 20))
        );
        assert_eq!(parse_limit("lots\n", v1), None);
    }

    #[test]
    fn trigger_lines_are_in_microseconds() {
        let line = trigger_line(
            Stall::Some,
            Duration::from_millis(100),
            Duration::from_secs(1),
        );
        assert_eq!(line, "some 100000 1000000");
        // The kernel reads at most 32 bytes, NUL included.
        let longest = trigger_line(
            Stall::Full,
            Duration::from_secs(10),
            Duration::from_secs(10),
        );
        assert!(longest.len() < 32, "{longest}");
    }

    /// A fake cgroup mount with the given files.
    fn mount(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        for (path, text) in files {
            let p = dir.path().join(path);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(&p, text).expect("write");
        }
        dir
    }

    #[test]
    fn a_v1_group_reads_its_limit_usage_guest_memory_and_oom_kills() {
        let m = mount(&[
            ("memory/vms/memory.limit_in_bytes", "536870912\n"),
            ("memory/vms/memory.usage_in_bytes", "300000000\n"),
            (
                "memory/vms/memory.stat",
                "cache 9\nrss 1\nshmem 2\ntotal_cache 99\ntotal_rss 4096\ntotal_shmem 8192\n\
                 hierarchical_memory_limit 268435456\n",
            ),
            (
                "memory/vms/memory.oom_control",
                "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
            ),
        ]);
        let lines = parse_proc_cgroup("4:memory:/vms\n0::/\n");
        let cg = MemoryCgroup::find(&lines, m.path()).expect("found");
        assert_eq!(cg.version(), CgroupVersion::V1);
        assert_eq!(cg.path(), m.path().join("memory/vms"));
        assert!(cg.describe().starts_with("cgroup v1 "), "{}", cg.describe());
        assert_eq!(cg.limit_bytes().expect("limit"), Some(512 << 20));
        assert_eq!(cg.effective_limit_bytes().expect("limit"), Some(256 << 20));
        assert_eq!(cg.usage_bytes().expect("usage"), 300_000_000);
        assert_eq!(cg.anon_and_shmem_bytes().expect("stat"), 4096 + 8192);
        assert_eq!(cg.oom_kills().expect("oom"), 2);
        assert_eq!(cg.pressure_file(), None);
    }

    #[test]
    fn an_old_v1_stat_without_totals_falls_back_to_the_groups_own() {
        let m = mount(&[("memory/memory.stat", "rss 4096\nshmem 4096\n")]);
        let cg = MemoryCgroup::at(&m.path().join("memory"), CgroupVersion::V1);
        assert_eq!(cg.anon_and_shmem_bytes().expect("stat"), 8192);
    }

    #[test]
    fn a_v2_group_takes_the_smallest_limit_above_it() {
        let m = mount(&[
            ("a/memory.max", "1073741824\n"),
            ("a/b/memory.max", "max\n"),
            ("a/b/memory.current", "12345\n"),
            ("a/b/memory.stat", "anon 100\nfile 5000\nshmem 20\n"),
            (
                "a/b/memory.events",
                "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n",
            ),
            ("a/b/memory.pressure", "some avg10=0.00\n"),
        ]);
        let lines = parse_proc_cgroup("0::/a/b\n");
        let cg = MemoryCgroup::find(&lines, m.path()).expect("found");
        assert_eq!(cg.version(), CgroupVersion::V2);
        assert_eq!(cg.limit_bytes().expect("limit"), None);
        assert_eq!(cg.effective_limit_bytes().expect("limit"), Some(1 << 30));
        assert_eq!(cg.usage_bytes().expect("usage"), 12345);
        assert_eq!(cg.anon_and_shmem_bytes().expect("stat"), 120);
        assert_eq!(cg.oom_kills().expect("oom"), 1);
        assert_eq!(
            cg.pressure_file(),
            Some(m.path().join("a/b/memory.pressure"))
        );
    }

    #[test]
    fn a_hybrid_host_finds_v2_groups_under_unified() {
        let m = mount(&[("unified/svc/memory.max", "max\n")]);
        let cg = MemoryCgroup::find(&parse_proc_cgroup("0::/svc\n"), m.path()).expect("found");
        assert_eq!(cg.path(), m.path().join("unified/svc"));
    }

    #[test]
    fn no_readable_group_is_none() {
        let m = mount(&[("cgroup.controllers", "cpu\n")]);
        // The v2 root has no memory.max; no v1 memory hierarchy here.
        assert_eq!(
            MemoryCgroup::find(&parse_proc_cgroup("0::/\n"), m.path()),
            None
        );
        assert_eq!(
            MemoryCgroup::find(&parse_proc_cgroup("4:memory:/x\n"), m.path()),
            None
        );
    }

    #[test]
    fn errors_name_the_file() {
        let m = mount(&[("g/memory.oom_control", "oom_kill_disable 0\n")]);
        let cg = MemoryCgroup::at(&m.path().join("g"), CgroupVersion::V1);
        let e = cg.oom_kills().expect_err("no oom_kill line");
        assert!(e.to_string().contains("memory.oom_control"), "{e}");
        let e = cg.usage_bytes().expect_err("no usage file");
        assert!(e.to_string().contains("memory.usage_in_bytes"), "{e}");
    }
}
