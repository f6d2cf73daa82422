//! The demo's steps that show what a page server on shared bases and under
//! a keeper does: restores that add one copy of memory, not one each; a
//! fork child that outlives its parent's VMM; every VM exact after the
//! serving process is SIGKILLed; VMs writing twice their memory limit with
//! nothing OOM-killed. Each step measures one figure and checks it: a
//! wrong figure fails the demo.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use proto::api;

use super::super::body;
use super::super::vm::call;
use super::common::{exec, step, DemoArgs, Server};
use crate::client::Client;
use crate::{CliError, Result};

/// Restores in the shared-base step.
pub const RESTORES: u64 = 8;
/// What each restore reads, at most (less when the VM is smaller).
const READ_MIB: u64 = 64;
/// The cgroup v1 memory controller.
const MEMCG_ROOT: &str = "/sys/fs/cgroup/memory";
/// The smallest memory limit of the cgroup step: the server and its VMMs
/// need some room of their own besides guest memory.
const MEMCG_MIN_LIMIT_MIB: u64 = 256;

/// One measured figure, for the table at the end.
pub struct Figure {
    pub step: u32,
    pub what: &'static str,
    pub value: String,
    pub check: String,
}

/// Fail the demo with `why` unless `ok`.
fn check(ok: bool, why: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(CliError::Check(why()))
    }
}

fn answer<T: serde::de::DeserializeOwned>(what: &str, v: serde_json::Value) -> Result<T> {
    serde_json::from_value(v).map_err(|e| CliError::Answer(format!("{what}: {e}")))
}

/// Create a VM of `memory_mib` (from `snapshot` if given) and return its id.
pub fn create(
    c: &Client,
    memory_mib: u64,
    snapshot: Option<&str>,
    hugepages: Option<bool>,
) -> Result<String> {
    create_info(c, memory_mib, snapshot, hugepages).map(|v| v.id)
}

/// [`create`], returning the new VM as the API shows it.
pub fn create_info(
    c: &Client,
    memory_mib: u64,
    snapshot: Option<&str>,
    hugepages: Option<bool>,
) -> Result<api::VmInfo> {
    let v = call(
        c,
        "POST",
        "/v1/vms",
        Some(&body(&api::CreateVm {
            memory_mib,
            from_snapshot: snapshot.map(str::to_owned),
            vcpus: 1,
            memory_source: None,
            volume: None,
            fault_around_kib: None,
            readahead_kib: None,
            prefetch: false,
            hugepages,
            reclaim: None,
        })),
    )?;
    answer("POST /v1/vms", v)
}

fn vm_info(c: &Client, id: &str) -> Result<api::VmInfo> {
    answer(
        &format!("GET /v1/vms/{id}"),
        call(c, "GET", &format!("/v1/vms/{id}"), None)?,
    )
}

fn health(c: &Client) -> Result<api::Health> {
    answer("GET /v1/health", call(c, "GET", "/v1/health", None)?)
}

/// The digest of every byte of `id`'s first `pages` pages (the guest's
/// `checksum` samples one word a page; this reads them all).
pub fn digest(c: &Client, id: &str, pages: u64) -> Result<u64> {
    exec(
        c,
        id,
        api::ExecRequest::Digest {
            start_page: Some(0),
            pages: Some(pages),
        },
    )
}

fn sigkill(pid: u32, what: &str) -> Result<()> {
    let raw = i32::try_from(pid).map_err(|_| CliError::Answer(format!("{what}: pid {pid}")))?;
    kill(Pid::from_raw(raw), Signal::SIGKILL).map_err(|e| CliError::Local {
        what: format!("SIGKILL {what} (pid {pid})"),
        source: e.into(),
    })
}

/// Host memory in use, in bytes: `MemTotal - MemAvailable` of
/// `/proc/meminfo` (guest memory in memfds counts, clean file cache does
/// not).
fn host_used_bytes() -> Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|source| CliError::Local {
        what: "read /proc/meminfo".into(),
        source,
    })?;
    let kib = |key: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(key)?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse()
                    .ok()
            })
            .ok_or_else(|| CliError::Answer(format!("no {key} in /proc/meminfo")))
    };
    let total: u64 = kib("MemTotal:")?;
    let available: u64 = kib("MemAvailable:")?;
    Ok(total.saturating_sub(available) << 10)
}

/// `bytes` in MiB, for display.
fn mib(bytes: impl Into<i128>) -> f64 {
    bytes.into() as f64 / 1048576.0
}

/// Step: snapshot `parent`, start [`RESTORES`] VMs from it, each reading
/// up to [`READ_MIB`]; check that the host memory they added is under half
/// of what private copies would take. Returns the restores' ids.
pub fn restores(
    c: &Client,
    args: &DemoArgs,
    parent: &str,
    n: u32,
    figures: &mut Vec<Figure>,
) -> Result<Vec<String>> {
    step(
        n,
        &format!(
            "{RESTORES} restores of one snapshot, each reading {} MiB: the host memory they add",
            READ_MIB.min(args.memory_mib)
        ),
    );
    call(
        c,
        "POST",
        &format!("/v1/vms/{parent}/snapshots"),
        Some(&body(&api::CreateSnapshot {
            name: "demo-base".into(),
            mode: api::SnapshotMode::Full,
            compress: false,
        })),
    )?;
    let read_mib = READ_MIB.min(args.memory_mib);
    let before = host_used_bytes()?;
    let t = Instant::now();
    let mut ids = Vec::new();
    for _ in 0..RESTORES {
        // 4 KiB pages: hugetlb pages come from a reserved pool that
        // /proc/meminfo counts as used whether a VM holds them or not.
        let id = create(c, args.memory_mib, Some("demo-base"), Some(false))?;
        exec(
            c,
            &id,
            api::ExecRequest::Touch {
                start_page: Some(0),
                pages: Some(read_mib * 256),
                write: false,
            },
        )?;
        ids.push(id);
    }
    // Signed: the rest of the host may give back more than the restores
    // take meanwhile.
    let added = i128::from(host_used_bytes()?) - i128::from(before);
    let base = ids
        .first()
        .map(|id| vm_info(c, id))
        .transpose()?
        .and_then(|v| v.memory.base)
        .unwrap_or_else(|| "none".into());
    let private = (RESTORES * read_mib) << 20;
    // Private copies would add `private`; one shared copy adds a
    // `read_mib`, plus each VMM's own few MiB. Half of `private` separates
    // the two with room for the host's noise.
    let bound = private / 2;
    println!(
        "    {RESTORES} VMs started from demo-base and read in {:.1} s (base {base})",
        t.elapsed().as_secs_f64()
    );
    println!(
        "    host memory added: {:.1} MiB (private copies: {:.0} MiB; bound {:.0} MiB)",
        mib(added),
        mib(private),
        mib(bound)
    );
    check(added < i128::from(bound), || {
        format!(
            "{RESTORES} restores reading {read_mib} MiB each added {:.1} MiB of host memory, not under {:.0} MiB: they do not share one base",
            mib(added),
            mib(bound)
        )
    })?;
    figures.push(Figure {
        step: n,
        what: "host memory added by the restores",
        value: format!("{:.1} MiB", mib(added)),
        check: format!("< {:.0} MiB (8 copies: {:.0})", mib(bound), mib(private)),
    });
    Ok(ids)
}

/// Step: fork the running restore `parent`, SIGKILL the parent's VMM, and
/// check that the child's every byte is what the parent held. Returns the
/// child's id.
pub fn orphan(
    c: &Client,
    args: &DemoArgs,
    parent: &str,
    n: u32,
    figures: &mut Vec<Figure>,
) -> Result<String> {
    step(
        n,
        "fork a running restore, SIGKILL the parent's VMM: the child stays exact",
    );
    let pages = args.memory_mib * 256;
    let want = digest(c, parent, pages)?;
    let fork: api::ForkResponse = answer(
        "fork",
        call(
            c,
            "POST",
            &format!("/v1/vms/{parent}/fork"),
            Some(&body(&api::ForkRequest { count: 1 })),
        )?,
    )?;
    let child = fork
        .children
        .first()
        .cloned()
        .ok_or_else(|| CliError::Answer("a fork without a child".into()))?;
    let pid = vm_info(c, parent)?
        .pid
        .ok_or_else(|| CliError::Answer(format!("{parent} has no VMM pid")))?;
    sigkill(pid, &format!("{parent}'s VMM"))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut state = vm_info(c, parent)?.state;
    while matches!(state, api::RunState::Running) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        state = vm_info(c, parent)?.state;
    }
    let got = digest(c, &child, pages)?;
    println!(
        "    {child} forked from {parent}; {parent}'s VMM (pid {pid}) killed, now {}",
        state.name()
    );
    println!(
        "    {child}: digest of every byte {got:#018x}, {parent}'s before the kill {want:#018x}"
    );
    check(got == want, || {
        format!("{child}'s memory changed when its parent's VMM died: digest {got:#018x}, want {want:#018x}")
    })?;
    figures.push(Figure {
        step: n,
        what: "child digest after parent VMM SIGKILL",
        value: "equal".into(),
        check: "every byte equal".into(),
    });
    // The parent is dead; the server may have let it go already.
    let _ = call(c, "DELETE", &format!("/v1/vms/{parent}"), None);
    Ok(child)
}

/// Step: SIGKILL the serving process while `vms` run, wait for the one the
/// keeper starts, and check that each VM's every byte is as before.
pub fn crash(
    c: &Client,
    args: &DemoArgs,
    vms: &[String],
    n: u32,
    figures: &mut Vec<Figure>,
) -> Result<()> {
    step(
        n,
        "kill -9 the serving process while VMs run: the keeper restarts it",
    );
    let before = health(c)?;
    if !before.kept {
        println!("    skipped: the server runs without a keeper (--no-keeper)");
        return Ok(());
    }
    let pages = args.memory_mib * 256;
    let want = vms
        .iter()
        .map(|id| digest(c, id, pages))
        .collect::<Result<Vec<_>>>()?;
    let t = Instant::now();
    sigkill(before.pid, "the serving process")?;
    let deadline = t + Duration::from_secs(60);
    let after = loop {
        if let Ok(h) = health(c) {
            if h.pid != before.pid {
                break h;
            }
        }
        if Instant::now() > deadline {
            return Err(CliError::Check(
                "no new serving process answered within 60 s of the kill".into(),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    println!(
        "    pid {} killed; pid {} answers after {:.0} ms. uffdctl server status:",
        before.pid,
        after.pid,
        t.elapsed().as_secs_f64() * 1e3
    );
    super::super::server::print_health(&after);
    check(after.lost_vms.is_empty(), || {
        format!("VMs lost in the restart: {:?}", after.lost_vms)
    })?;
    let mut equal = 0;
    for (id, want) in vms.iter().zip(&want) {
        let got = digest(c, id, pages)?;
        check(got == *want, || {
            format!("{id} changed across the restart: digest {got:#018x}, want {want:#018x}")
        })?;
        equal += 1;
    }
    println!(
        "    {equal} of {} VMs: every byte as before the kill",
        vms.len()
    );
    let ms = after.recovery_ms.ok_or_else(|| {
        CliError::Check("the restarted server does not say how long its recovery took".into())
    })?;
    check(after.start == "crash", || {
        format!(
            "the new process says it started on {:?}, not after a crash",
            after.start
        )
    })?;
    figures.push(Figure {
        step: n,
        what: "recovery after kill -9 of the server",
        value: format!("{ms:.1} ms"),
        check: format!("{equal} VMs exact, none lost"),
    });
    Ok(())
}

/// A memory cgroup of the demo, emptied and removed when dropped.
struct Memcg {
    dir: PathBuf,
}

impl Memcg {
    fn new(limit: u64) -> Result<Memcg> {
        let dir = Path::new(MEMCG_ROOT).join(format!("pagefork-demo-{}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|source| CliError::Local {
            what: format!("create {}", dir.display()),
            source,
        })?;
        let g = Memcg { dir };
        g.write("memory.limit_in_bytes", &limit.to_string())?;
        Ok(g)
    }

    fn write(&self, file: &str, value: &str) -> Result<()> {
        let path = self.dir.join(file);
        std::fs::write(&path, value).map_err(|source| CliError::Local {
            what: format!("write {value} to {}", path.display()),
            source,
        })
    }

    fn oom_kills(&self) -> Result<u64> {
        let path = self.dir.join("memory.oom_control");
        let text = std::fs::read_to_string(&path).map_err(|source| CliError::Local {
            what: format!("read {}", path.display()),
            source,
        })?;
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            .ok_or_else(|| CliError::Answer(format!("no oom_kill in {}", path.display())))
    }

    /// Run `f` (which spawns processes) with this thread in the group, so
    /// what it spawns starts (and is charged) there; the thread goes back
    /// to its own group afterwards.
    fn spawn_inside<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let home = thread_memcg();
        let tid = nix::unistd::gettid().to_string();
        self.write("tasks", &tid)?;
        let r = f();
        let back = std::fs::write(home.join("tasks"), &tid).map_err(|source| CliError::Local {
            what: format!("move thread {tid} back to {}", home.display()),
            source,
        });
        let out = r?;
        back?;
        Ok(out)
    }
}

impl Drop for Memcg {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let tasks = std::fs::read_to_string(self.dir.join("tasks")).unwrap_or_default();
            for t in tasks.split_whitespace() {
                let _ = std::fs::write(Path::new(MEMCG_ROOT).join("tasks"), t);
            }
            if std::fs::remove_dir(&self.dir).is_ok() || Instant::now() > deadline {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The memory cgroup of the calling thread.
fn thread_memcg() -> PathBuf {
    let text = std::fs::read_to_string("/proc/thread-self/cgroup").unwrap_or_default();
    let rel = text
        .lines()
        .find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, ctl, path) = (f.next()?, f.next()?, f.next()?);
            ctl.split(',')
                .any(|c| c == "memory")
                .then(|| path.to_owned())
        })
        .unwrap_or_default();
    Path::new(MEMCG_ROOT).join(rel.trim_start_matches('/'))
}

/// Why the cgroup step cannot run here, if it cannot.
fn memcg_missing() -> Option<String> {
    let control = Path::new(MEMCG_ROOT).join("memory.oom_control");
    if !control.exists() {
        return Some(format!(
            "no cgroup v1 memory controller ({} is missing)",
            control.display()
        ));
    }
    if nix::unistd::access(MEMCG_ROOT, nix::unistd::AccessFlags::W_OK).is_err() {
        return Some(format!(
            "cannot make memory cgroups in {MEMCG_ROOT} (not root)"
        ));
    }
    None
}

/// Step: a second server in a memory cgroup of a small limit; VMs write
/// twice the limit; check that nothing was OOM-killed, each VM reads back
/// exact, and the server gave memory back. `start` starts a server in a
/// state directory.
pub fn memcg(
    args: &DemoArgs,
    dir: &Path,
    start: impl FnOnce(&Path) -> Result<Server>,
    n: u32,
    figures: &mut Vec<Figure>,
) -> Result<()> {
    let limit_mib = MEMCG_MIN_LIMIT_MIB.max(args.memory_mib);
    let vms = (2 * limit_mib).div_ceil(args.memory_mib);
    step(
        n,
        &format!(
            "{vms} VMs write {} MiB under a {limit_mib} MiB memory limit: the server gives memory back, nothing is OOM-killed",
            vms * args.memory_mib
        ),
    );
    let group = match memcg_missing() {
        None => Memcg::new(limit_mib << 20).map_err(|e| chain(&e)),
        Some(why) => Err(why),
    };
    let group = match group {
        Ok(g) => g,
        Err(why) => return skip_memcg(n, why, figures),
    };
    let server = group.spawn_inside(|| start(&dir.join("memcg")))?;
    let c = Client::new(server.dir.join("api.sock"));
    let written = write_and_read_back(&c, args.memory_mib, vms);
    // An OOM kill shows first as a VM that stopped answering: say so.
    let oom = group.oom_kills()?;
    check(oom == 0, || {
        let what = written
            .as_ref()
            .err()
            .map(|e| format!(" ({e})"))
            .unwrap_or_default();
        format!("the kernel OOM-killed {oom} process(es) under the {limit_mib} MiB limit{what}")
    })?;
    let (ids, wrong) = written?;
    let m: api::MemoryStatus = answer("GET /v1/memory", call(&c, "GET", "/v1/memory", None)?)?;
    println!(
        "    {vms} VMs written and read back: {wrong} mismatches; given back {:.0} MiB; OOM kills {oom}",
        mib(m.given_back_bytes)
    );
    check(wrong == 0, || {
        format!("{wrong} pages read back wrong after reclaim")
    })?;
    check(m.given_back_bytes > 0, || {
        format!(
            "VMs wrote {} MiB under a {limit_mib} MiB limit but the server gave nothing back",
            vms * args.memory_mib
        )
    })?;
    figures.push(Figure {
        step: n,
        what: "OOM kills writing 2x the limit",
        value: oom.to_string(),
        check: format!(
            "0 (given back {:.0} MiB, {wrong} mismatches)",
            mib(m.given_back_bytes)
        ),
    });
    for id in &ids {
        call(&c, "DELETE", &format!("/v1/vms/{id}"), None)?;
    }
    drop(server);
    drop(group);
    Ok(())
}

/// Start `vms` VMs of `memory_mib` (4 KiB pages: hugetlb pages are not
/// charged like a memfd's), each filling all its memory with a seed of its
/// own, then read each back; returns their ids and the pages that were
/// wrong.
fn write_and_read_back(c: &Client, memory_mib: u64, vms: u64) -> Result<(Vec<String>, u64)> {
    let mut ids = Vec::new();
    for i in 0..vms {
        let id = create(c, memory_mib, None, Some(false))?;
        exec(
            c,
            &id,
            api::ExecRequest::Fill {
                start_page: None,
                pages: None,
                seed: 100 + i,
            },
        )?;
        ids.push(id);
    }
    let mut wrong = 0;
    for (id, i) in ids.iter().zip(0..) {
        wrong += exec(
            c,
            id,
            api::ExecRequest::Verify {
                start_page: Some(0),
                pages: Some(memory_mib * 256),
                seed: 100 + i,
            },
        )?;
    }
    Ok((ids, wrong))
}

/// The memcg step cannot run here, for `why`.
fn skip_memcg(n: u32, why: String, figures: &mut Vec<Figure>) -> Result<()> {
    println!("    skipped: {why}");
    figures.push(Figure {
        step: n,
        what: "OOM kills writing 2x the limit",
        value: "skipped".into(),
        check: why,
    });
    Ok(())
}

/// `e` and its sources, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(&format!(": {s}"));
        source = s.source();
    }
    text
}

/// Print the figures as a table.
pub fn table(figures: &[Figure]) {
    let rows: Vec<Vec<String>> = figures
        .iter()
        .map(|f| {
            vec![
                format!("[{}]", f.step),
                f.what.to_owned(),
                f.value.clone(),
                f.check.clone(),
            ]
        })
        .collect();
    print!(
        "{}",
        super::super::table::render(&["STEP", "FIGURE", "VALUE", "CHECKED"], &rows)
    );
}
