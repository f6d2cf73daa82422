//! Memory cgroups (v1) of a test's own: [`Memcg`] makes one under
//! `/sys/fs/cgroup/memory`, puts a server and its VMMs in it, limits it,
//! reads its counters (usage, peak, OOM kills), and removes it when
//! dropped, whatever the test did. [`require_memcg_v1`] decides whether a
//! test that needs one runs.
//!
//! A process spawned by a task in a group starts in that group, so a
//! server spawned inside ([`Memcg::spawn_inside`]) has its serving process
//! and every VMM it starts there too, charged from their first page on.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::host::require_kvm_uffd;

/// Where the cgroup v1 memory controller is mounted.
pub const MEMCG_ROOT: &str = "/sys/fs/cgroup/memory";

/// Whether the cgroup v1 memory controller is there to use (and this test
/// may make groups in it). Otherwise: panics if `CI=true` (CI must not
/// skip), else prints `skipping: ...`.
pub fn require_memcg_v1() -> bool {
    if !require_kvm_uffd() {
        return false;
    }
    let control = Path::new(MEMCG_ROOT).join("memory.oom_control");
    let why = if !control.exists() {
        format!(
            "no cgroup v1 memory controller ({} is missing)",
            control.display()
        )
    } else if nix::unistd::access(MEMCG_ROOT, nix::unistd::AccessFlags::W_OK).is_err() {
        format!("cannot make memory cgroups in {MEMCG_ROOT} (not root)")
    } else {
        return true;
    };
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but a prerequisite of the memory cgroup test is missing: {why}");
    }
    eprintln!("skipping: {why}");
    false
}

/// A memory cgroup of this test, removed (its tasks moved back to the
/// root first) when dropped, whatever the test did.
#[derive(Debug)]
pub struct Memcg(PathBuf);

impl Memcg {
    /// A fresh group `name` under [`MEMCG_ROOT`] (one left over by an
    /// earlier run is emptied and replaced).
    pub fn new(name: &str) -> Self {
        let dir = Path::new(MEMCG_ROOT).join(name);
        if dir.exists() {
            Memcg(dir.clone()).release();
            let _ = std::fs::remove_dir(&dir);
        }
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        Memcg(dir)
    }

    /// The group's directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Write `value` to the group's `file`; panics if the kernel refuses.
    pub fn set(&self, file: &str, value: &str) {
        let path = self.0.join(file);
        std::fs::write(&path, value)
            .unwrap_or_else(|e| panic!("{value} > {}: {e}", path.display()));
    }

    /// The text of the group's `file` ("" if unreadable).
    pub fn get(&self, file: &str) -> String {
        std::fs::read_to_string(self.0.join(file)).unwrap_or_default()
    }

    /// The number in the group's `file`; panics if there is none.
    pub fn number(&self, file: &str) -> u64 {
        let text = self.get(file);
        text.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{}/{file} holds {text:?}", self.0.display()))
    }

    /// The value of `key` in the group's flat keyed `file` (`key N` lines:
    /// `memory.stat`, `memory.oom_control`); panics if it is missing.
    pub fn keyed(&self, file: &str, key: &str) -> u64 {
        let text = self.get(file);
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no `{key}` in {}/{file}: {text:?}", self.0.display()))
    }

    /// Limit the group to `bytes` (`memory.limit_in_bytes`).
    pub fn limit(&self, bytes: u64) {
        self.set("memory.limit_in_bytes", &bytes.to_string());
    }

    /// Bytes charged to the group now.
    pub fn usage(&self) -> u64 {
        self.number("memory.usage_in_bytes")
    }

    /// The most bytes ever charged to the group at once.
    pub fn max_usage(&self) -> u64 {
        self.number("memory.max_usage_in_bytes")
    }

    /// Tasks of the group the kernel's OOM killer killed
    /// (`memory.oom_control`'s `oom_kill`).
    pub fn oom_kills(&self) -> u64 {
        self.keyed("memory.oom_control", "oom_kill")
    }

    /// Times a charge hit the limit (`memory.failcnt`).
    pub fn failcnt(&self) -> u64 {
        self.number("memory.failcnt")
    }

    /// Move every thread of `pid` into this group.
    pub fn take(&self, pid: u32) {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap_or_else(|e| panic!("the threads of pid {pid}: {e}"));
        for t in tasks.flatten() {
            self.set("tasks", &t.file_name().to_string_lossy());
        }
    }

    /// Move `pid` and every process below it (each with all its threads)
    /// into this group; what they spawn later starts in it too.
    pub fn take_process_tree(&self, pid: u32) {
        let mut todo = vec![pid];
        while let Some(p) = todo.pop() {
            self.take(p);
            todo.extend(crate::host::child_pids(p));
        }
    }

    /// Run `f` (which spawns processes) with the calling thread in this
    /// group, so what it spawns starts here. Afterwards every thread of
    /// this test process goes back to its own group (the calling one, and
    /// any `f` started), also if `f` panics: the OOM killer would take the
    /// test for a process of the group. The test process's memory stays
    /// charged where it was (v1 charges a process's pages to its main
    /// thread's group).
    pub fn spawn_inside<T>(&self, f: impl FnOnce() -> T) -> T {
        let tid = nix::unistd::gettid().to_string();
        let _back = MoveBack {
            group: self.0.clone(),
            home: thread_memcg(),
        };
        self.set("tasks", &tid);
        f()
    }

    /// No limit, and tasks back to the root group.
    pub fn release(&self) {
        let _ = std::fs::write(self.0.join("memory.oom_control"), "0");
        let _ = std::fs::write(self.0.join("memory.limit_in_bytes"), "-1");
        for t in self.get("tasks").split_whitespace() {
            let _ = std::fs::write(Path::new(MEMCG_ROOT).join("tasks"), t);
        }
    }
}

impl Drop for Memcg {
    fn drop(&mut self) {
        // A task killed a moment ago may still be leaving the group.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            self.release();
            if std::fs::remove_dir(&self.0).is_ok() || Instant::now() > deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Puts the threads of this process that are in `group` back into
/// `home` when dropped.
struct MoveBack {
    group: PathBuf,
    home: PathBuf,
}

impl Drop for MoveBack {
    fn drop(&mut self) {
        let tasks = std::fs::read_to_string(self.group.join("tasks")).unwrap_or_default();
        let ours = tasks
            .split_whitespace()
            .filter(|t| Path::new("/proc/self/task").join(t).exists());
        for tid in ours {
            let home = self.home.join("tasks");
            if let Err(e) = std::fs::write(&home, tid) {
                eprintln!("cannot move thread {tid} back to {}: {e}", home.display());
            }
        }
    }
}

/// The memory cgroup directory of the calling thread.
fn thread_memcg() -> PathBuf {
    let text = std::fs::read_to_string("/proc/thread-self/cgroup")
        .unwrap_or_else(|e| panic!("cannot read /proc/thread-self/cgroup: {e}"));
    let path = text
        .lines()
        .find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            controllers
                .split(',')
                .any(|c| c == "memory")
                .then_some(path)
        })
        .unwrap_or_else(|| panic!("no memory cgroup in /proc/thread-self/cgroup: {text:?}"));
    Path::new(MEMCG_ROOT).join(path.trim_start_matches('/'))
}

/// Set process `pid`'s `oom_score_adj` (-1000: the OOM killer never picks
/// it; 0: by its size alone). Children inherit it.
pub fn set_oom_score_adj(pid: u32, adj: i32) {
    let path = format!("/proc/{pid}/oom_score_adj");
    std::fs::write(&path, adj.to_string()).unwrap_or_else(|e| panic!("{adj} > {path}: {e}"));
}
