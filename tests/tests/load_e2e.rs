//! Load, soak and kill storms through the real server, VMMs, KVM and uffd.
//!
//! - 50 VMs of 32 MiB fill and verify at once, with forks and deletes mixed
//!   in; a model predicts every verify. Afterwards every VM is deleted and
//!   the server's fds, Shmem and VMM processes are back where they started.
//! - VMMs killed (SIGKILL) and stopped (SIGSTOP, then SIGCONT) in the middle
//!   of faults, copy-on-write copies and forks: the survivors' memory stays
//!   exact and the page-source invariant holds.
//! - The server killed with SIGKILL: its VMMs die with it within a second,
//!   and a server restarted on the same state directory comes up with ids
//!   that do not repeat.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use pagefork_tests::{
    body, from_snapshot, new_vm, op, process_exists, require_kvm_uffd, signal, vm_num, wait_for,
    Api, TestServer,
};
use proto::api::{CreateSnapshot, ForkRequest, RunState, SnapshotMode};

const VMS: usize = 50;
const MIB: u64 = 32;
const PAGES: u64 = MIB * 256;
/// A VM's memory is cut into chunks the model tracks one seed each.
const CHUNKS: usize = 8;
const CHUNK: u64 = PAGES / CHUNKS as u64;
/// Mixed operations per worker thread.
const OPS_PER_WORKER: usize = 60;
const WORKERS: usize = 6;

/// What each VM's chunks were last filled with (0: never, reads zero).
type Model = HashMap<String, [u64; CHUNKS]>;

/// What the server holds that a leak would grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Footprint {
    fds: usize,
    shmem_kib: u64,
    /// The server's private memory (heap, tables, stacks).
    anon_kib: u64,
    vmms: usize,
}

fn footprint(pid: u32) -> Footprint {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(Iterator::count)
        .unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |field: &str| {
        status
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    Footprint {
        fds,
        shmem_kib: kib("RssShmem:"),
        anon_kib: kib("RssAnon:"),
        vmms: vmm_children(pid),
    }
}

/// `vmm` processes whose parent is `pid`.
fn vmm_children(pid: u32) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| {
            let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            // "pid (comm) state ppid ..."
            let Some((comm, rest)) = stat.split_once(") ") else {
                return false;
            };
            comm.ends_with("(vmm")
                && rest
                    .split_whitespace()
                    .nth(1)
                    .and_then(|pp| pp.parse::<u32>().ok())
                    == Some(pid)
        })
        .count()
}

/// A tiny deterministic RNG (xorshift) per worker.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).expect("below n")
    }
}

fn verify_chunk(s: &TestServer, id: &str, chunk: usize, seed: u64) {
    let start = chunk as u64 * CHUNK;
    if seed == 0 {
        assert_eq!(
            s.checksum(id, start, CHUNK),
            0,
            "{id} chunk {chunk} not zero"
        );
    } else {
        assert_eq!(
            s.verify(id, start, CHUNK, seed),
            0,
            "{id} chunk {chunk} lost seed {seed}"
        );
    }
}

#[test]
fn fifty_vms_under_mixed_load_predict_every_verify_and_leak_nothing() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let base = footprint(s.pid());

    let t0 = Instant::now();
    let model: Mutex<Model> = Mutex::default();
    let ids: Vec<String> = (0..VMS).map(|_| s.create_vm(&new_vm(MIB))).collect();
    for id in &ids {
        model.lock().unwrap().insert(id.clone(), [0; CHUNKS]);
    }
    let ops = std::sync::atomic::AtomicU64::new(0);
    // Each worker owns a slice of the VMs (and the children it forks), so
    // the model of a VM is only changed by the worker driving it.
    std::thread::scope(|scope| {
        for (w, mine) in ids.chunks(VMS.div_ceil(WORKERS)).enumerate() {
            let (s, model, ops) = (&s, &model, &ops);
            let mut mine: Vec<String> = mine.to_vec();
            scope.spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (w as u64 + 1));
                for _ in 0..OPS_PER_WORKER {
                    let id = mine[rng.below(mine.len())].clone();
                    let chunk = rng.below(CHUNKS);
                    match rng.below(10) {
                        0..=3 => {
                            let seed = rng.next() | 1;
                            s.fill(&id, chunk as u64 * CHUNK, CHUNK, seed);
                            model.lock().unwrap().get_mut(&id).unwrap()[chunk] = seed;
                        }
                        4..=7 => {
                            let seed = model.lock().unwrap()[&id][chunk];
                            verify_chunk(s, &id, chunk, seed);
                        }
                        8 => {
                            let child = s.fork_one(&id);
                            let mut m = model.lock().unwrap();
                            let seeds = m[&id];
                            m.insert(child.clone(), seeds);
                            mine.push(child);
                        }
                        _ if mine.len() > 2 => {
                            let i = rng.below(mine.len());
                            let gone = mine.swap_remove(i);
                            s.delete_vm(&gone);
                            model.lock().unwrap().remove(&gone);
                        }
                        _ => {}
                    }
                    ops.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                // Every chunk of every VM this worker still drives is as
                // the model says.
                for id in &mine {
                    let seeds = model.lock().unwrap()[id];
                    for (c, seed) in seeds.iter().enumerate() {
                        verify_chunk(s, id, c, *seed);
                    }
                }
            });
        }
    });
    let elapsed = t0.elapsed();
    let n = ops.load(std::sync::atomic::Ordering::Relaxed);
    s.assert_invariant("after the load");
    eprintln!(
        "load: {VMS} VMs of {MIB} MiB, {WORKERS} clients at once, {n} mixed ops + final verifies \
         in {:.1} s ({:.0} ops/s)",
        elapsed.as_secs_f64(),
        n as f64 / elapsed.as_secs_f64()
    );

    for id in s.vm_ids() {
        s.delete_vm(&id);
    }
    // Frozen parents go with their last child; VMMs are reaped.
    let after = wait_for(Duration::from_secs(10), || {
        let f = footprint(s.pid());
        (f.vmms == 0 && f.fds <= base.fds && s.vm_ids().is_empty()).then_some(f)
    });
    let now = footprint(s.pid());
    eprintln!("load: footprint before {base:?}, after {now:?}");
    assert!(after.is_some(), "leak: before {base:?}, after {now:?}");
    assert!(
        now.shmem_kib <= base.shmem_kib + 1024,
        "guest memory left mapped: before {base:?}, after {now:?}"
    );
    // Tables, sources and buffers of the gone VMs are freed (the
    // allocator may keep some of it: 16 MiB of slack against the 1.6 GiB
    // of guest memory the run served).
    assert!(
        now.anon_kib <= base.anon_kib + (16 << 10),
        "server memory grew: before {base:?}, after {now:?}"
    );
    s.assert_healthy();
}

#[test]
fn vmms_killed_and_stopped_mid_fault_and_fork_leave_the_rest_exact() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start_with_args(&["--vmm-deadline-ms", "1500"]);
    let parent = s.create_vm(&new_vm(16));
    s.fill(&parent, 0, 4096, 11);
    let keep = s.create_vm(&new_vm(16));
    s.fill(&keep, 0, 4096, 22);
    let keep_digest = s.digest(&keep, 0, 4096);

    let mut victims = Vec::new();
    for round in 0..6u64 {
        // Children share the parent's pages; writing them is a WP copy.
        let kids = s.fork(&parent, 2).children;
        let pid = |id: &str| s.vm(id).pid.unwrap();
        let (a, b) = (kids[0].clone(), kids[1].clone());
        let (pa, pb) = (pid(&a), pid(&b));
        std::thread::scope(|scope| {
            // One child faults and copies, and is killed in the middle.
            scope.spawn(|| {
                let _ = s.try_exec(&a, &op::fill(0, 4096, 100 + round));
            });
            // The other is stopped in the middle of its faults, and a fork
            // of the parent happens meanwhile.
            scope.spawn(|| {
                let _ = s.try_exec(&b, &op::touch(0, 4096, true));
            });
            std::thread::sleep(Duration::from_millis(5 + 7 * round));
            signal(pa, Signal::SIGKILL);
            signal(pb, Signal::SIGSTOP);
            let f = s
                .try_fork(&parent, &ForkRequest { count: 1 })
                .unwrap_or_else(|v| panic!("fork while a sibling is stopped: {v}"));
            victims.push(f.children[0].clone());
            signal(pb, Signal::SIGCONT);
        });
        assert!(
            wait_for(Duration::from_secs(5), || (!process_exists(pa))
                .then_some(()))
            .is_some(),
            "killed VMM {pa} still there"
        );
        victims.push(b);
        // The killed child can be deleted; nothing else notices.
        if let Err(v) = s.try_delete_vm(&a) {
            panic!("delete killed {a}: {v}");
        }
    }
    // The parent, every surviving child and the bystander are exact.
    assert_eq!(s.verify(&parent, 0, 4096, 11), 0);
    assert_eq!(s.digest(&keep, 0, 4096), keep_digest);
    for id in &victims {
        if s.vm(id).state == RunState::Running {
            // A child of the parent reads its pages (the stopped one only
            // rewrote them unchanged).
            assert_eq!(s.verify(id, 0, 4096, 11), 0, "{id} lost the parent's pages");
        }
    }
    s.assert_invariant("after the kills");
    s.assert_healthy();
}

/// Whether `pid` exists and is not a zombie (an orphan's zombie lingers
/// until whoever adopted it reaps it).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

fn start_server(state: &Path, log: &Path) -> std::process::Child {
    std::process::Command::new(pagefork_tests::bin("uffd-server"))
        .arg("--state-dir")
        .arg(state)
        .arg("--vmm-bin")
        .arg(pagefork_tests::bin("vmm"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log).expect("server log"))
        .spawn()
        .expect("cannot start uffd-server")
}

/// Entries under `dir` (recursively) whose name marks an unfinished
/// operation: `.tmp-*` (snapshots, volumes) and `*.pagefork-export`.
fn leftovers(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".tmp-") || name.ends_with(".pagefork-export") {
            out.push(path.clone());
        }
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            out.extend(leftovers(&path));
        }
    }
    out
}

/// SIGKILL of the server, three times, with VMs (one stopped), a volume
/// attached and snapshots taken, the last kill in the middle of a
/// snapshot's save: its VMMs are gone within a second each time, nothing
/// is mounted or left running, and the server restarted on the same state
/// directory serves, lists every volume and every finished snapshot
/// (restorable), continues VM ids, and has removed the leftovers of the
/// interrupted snapshot.
#[test]
fn a_killed_server_takes_its_vmms_and_restarts_clean_on_its_state_dir() {
    if !require_kvm_uffd() {
        return;
    }
    // On the XFS when there is one (CI always has it): then volumes and
    // snapshots are part of what must survive.
    let xfs = pagefork_tests::xfs_dir();
    let dir = match &xfs {
        Some(x) => tempfile::tempdir_in(x),
        None => tempfile::tempdir(),
    }
    .expect("temp dir");
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    let mounts_before = std::fs::read_to_string("/proc/mounts").expect("mounts");
    let api = Api::new(state.join("api.sock"));
    let healthy =
        |c: &Api| wait_for(Duration::from_secs(15), || c.answers_health().then_some(())).is_some();

    let mut max_id = 0u64;
    let rounds = 3;
    for round in 0..rounds {
        let mut server = start_server(&state, &dir.path().join(format!("server-{round}.log")));
        assert!(healthy(&api), "server did not come up in round {round}");
        let volume = format!("vol-{round}");
        if xfs.is_some() {
            api.create_volume(&volume, 4);
        }
        let mut pids = Vec::new();
        let mut ids = Vec::new();
        for i in 0..3 {
            let mut body = new_vm(8);
            if xfs.is_some() && i == 0 {
                body.volume = Some(volume.clone());
            }
            let v = api.try_create_vm(&body).unwrap_or_else(|v| panic!("{v}"));
            let id = vm_num(&v.id);
            assert!(
                id > max_id,
                "vm id {id} repeats an earlier one (<= {max_id})"
            );
            max_id = id;
            ids.push(v.id);
            pids.push(v.pid.unwrap());
        }
        if xfs.is_some() {
            api.snapshot(&ids[0], &format!("snap-{round}"), SnapshotMode::Full);
        }
        // A stopped VMM never reads its socket's hang-up; only the
        // parent-death signal ends it.
        signal(pids[1], Signal::SIGSTOP);
        if xfs.is_some() && round == rounds - 1 {
            // The last kill lands while a snapshot is being saved: a
            // larger VM, written all over, so the save takes a while.
            let v = api
                .try_create_vm(&new_vm(256))
                .unwrap_or_else(|v| panic!("{v}"));
            let big = v.id;
            pids.push(v.pid.unwrap());
            api.fill(&big, 0, 65536, 5);
            let sock = state.join("api.sock");
            let req = body(&CreateSnapshot {
                name: "interrupted".into(),
                mode: SnapshotMode::Full,
                compress: false,
            });
            let saver = std::thread::spawn(move || {
                // Its answer never comes: the server dies under it (so the
                // plain client, which may fail without panicking).
                let _ = uffdctl::client::Client::new(sock).request(
                    "POST",
                    &format!("/v1/vms/{big}/snapshots"),
                    Some(&req),
                );
            });
            let t = Instant::now();
            while leftovers(&state).is_empty() {
                assert!(
                    t.elapsed() < Duration::from_secs(10),
                    "the snapshot never started"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            signal(server.id(), Signal::SIGKILL);
            let _ = server.wait();
            let _ = saver.join();
        } else {
            signal(server.id(), Signal::SIGKILL);
            let _ = server.wait();
        }
        let gone = wait_for(Duration::from_secs(1), || {
            pids.iter().all(|p| !running(*p)).then_some(())
        });
        assert!(gone.is_some(), "VMMs {pids:?} outlived their server by 1 s");
    }
    // Nothing of the dead servers is left running, and the last restart
    // serves what they made.
    let mut server = start_server(&state, &dir.path().join("server-last.log"));
    assert!(healthy(&api));
    let v = api.vms();
    assert!(v.is_empty(), "{v:?}");
    let v = api
        .try_create_vm(&new_vm(8))
        .unwrap_or_else(|v| panic!("{v}"));
    let id = vm_num(&v.id);
    assert!(id > max_id, "vm id {id} repeats an earlier one");
    if xfs.is_some() {
        let v = api.volumes();
        for round in 0..rounds {
            assert!(
                v.iter().any(|x| x.name == format!("vol-{round}")),
                "vol-{round} lost: {v:?}"
            );
        }
        let v = api.snapshots();
        let names: Vec<&str> = v.snapshots.iter().map(|s| s.name.as_str()).collect();
        // The interrupted one is gone; had the kill come after its
        // commit, it would be listed whole (and restorable) instead.
        let kept: Vec<&str> = names
            .iter()
            .copied()
            .filter(|n| *n != "interrupted")
            .collect();
        assert_eq!(kept, ["snap-0", "snap-1", "snap-2"], "{v:?}");
        if names.contains(&"interrupted") {
            eprintln!("the kill came after the snapshot's commit");
            if let Err(v) = api.try_create_vm(&from_snapshot("interrupted")) {
                panic!("a listed snapshot restores: {v}");
            }
        }
        if let Err(v) = api.try_create_vm(&from_snapshot("snap-2")) {
            panic!("restore after the kills: {v}");
        }
    }
    let left = leftovers(&state);
    assert!(
        left.is_empty(),
        "leftovers of interrupted operations: {left:?}"
    );
    let mounts_after = std::fs::read_to_string("/proc/mounts").expect("mounts");
    assert_eq!(mounts_before, mounts_after, "mounts changed");
    signal(server.id(), Signal::SIGTERM);
    let _ = server.wait();
}
