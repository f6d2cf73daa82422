//! Firecracker listeners and clients survive the serving process: a
//! SIGKILL of it mid-touch, then `POST /v1/server/upgrade` mid-touch, with
//! real `fc_client` processes (what Firecracker's "Uffd" memory backend
//! does) on a listener made through the API and one given with
//! `--firecracker`.
//!
//! Each client compares every byte it read with the image
//! (`check:IMAGE`), so a fault the dead process read and never answered
//! (a hang), a page served from the wrong offset or a table that forgot a
//! page shows up. The listeners keep their ids and sockets (no duplicate
//! of the `--firecracker` one), the clients their VM ids, and new clients
//! connect to the listeners taken back.
//!
//! Needs /dev/userfaultfd (no KVM): without it the test skips with a
//! printed reason, and fails under `CI=true`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use pagefork_tests::{file_source, signal, FcClient, RandomImage, TestServer};
use proto::api::Health;
use serde_json::Value;

/// How long a client command or a restart may take before the test fails.
const TIMEOUT: Duration = Duration::from_secs(120);
/// Guest memory of each client (and the image), MiB: a random touch of
/// every page takes long enough, one fault per page, to be cut by a
/// restart.
const MIB: u64 = 256;
const PAGE: u64 = 4096;
/// Percent of its pages each client (in turn) is given before it is
/// stopped to wait for the restart that cuts its touch.
const CUT_AT: [u64; 3] = [5, 20, 40];

fn require_uffd() -> bool {
    let why = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")
    {
        Ok(_) => return true,
        Err(e) => format!("/dev/userfaultfd is not usable: {e}"),
    };
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but a prerequisite of the Firecracker restart test is missing: {why}");
    }
    eprintln!("skipping: {why} (this test needs userfaultfd)");
    false
}

/// Poll `GET /v1/health` until it answers with a pid other than `old`.
fn wait_new_pid(s: &TestServer, old: u32) -> Health {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        if let Some(h) = s.health_now().filter(|h| h.pid != old) {
            return h;
        }
        assert!(
            Instant::now() < deadline,
            "no serving process other than pid {old} within {TIMEOUT:?}\n{}",
            s.server_log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A client that touches every page in random order and checks every
/// byte once released.
fn toucher(sock: &Path, image: &str, seed: u64) -> FcClient {
    FcClient::spawn(
        sock,
        &["--mib", &MIB.to_string()],
        &[
            "hold",
            &format!("touch-random:{seed}"),
            &format!("check:{image}"),
        ],
    )
}

fn line_of<'a>(lines: &'a [Value], cmd: &str) -> &'a Value {
    lines
        .iter()
        .find(|l| l["cmd"] == cmd)
        .unwrap_or_else(|| panic!("no output of {cmd} in {lines:?}"))
}

/// A [`toucher`] on each socket with its seed, each with its VM id once
/// the server lists it.
fn touchers(s: &TestServer, on: &[(&PathBuf, u64)], image: &str) -> Vec<(FcClient, String)> {
    on.iter()
        .map(|(sock, seed)| {
            let c = toucher(sock, image, *seed);
            let id = s.wait_firecracker_vm(c.pid(), TIMEOUT).id;
            (c, id)
        })
        .collect()
}

/// Pages each client VM was given (its table's `vm` pages), by id.
fn installed(s: &TestServer) -> std::collections::HashMap<String, u64> {
    s.firecracker_vms()
        .into_iter()
        .map(|v| (v.id, v.pages.get("vm").copied().unwrap_or(0)))
        .collect()
}

/// Release `clients` (each with its VM id) and stop each (SIGSTOP) once
/// it was given its share of [`CUT_AT`] of its pages, so that every one
/// is mid-touch, each at another point; let them all go on again, and
/// while they fault, run `restart` (which returns the new health). Then
/// check that the new process's table of each holds at least what the old
/// one said it was given, and that each finishes its touch with every
/// byte exact. Returns the new health, the restart's gap and how long the
/// clients took from release.
fn cut_touches(
    s: &TestServer,
    clients: Vec<(FcClient, String)>,
    image: &str,
    restart: impl FnOnce() -> Health,
) -> (Health, Duration, Duration) {
    let pages = MIB * (1 << 20) / PAGE;
    let t0 = Instant::now();
    let mut clients = clients;
    for (c, _) in &mut clients {
        c.release();
    }
    let mut stopped = vec![false; clients.len()];
    let deadline = Instant::now() + TIMEOUT;
    while stopped.iter().any(|s| !s) {
        let given = installed(s);
        for (i, (c, id)) in clients.iter().enumerate() {
            let n = given.get(id).copied().unwrap_or(0);
            if !stopped[i] && n >= pages * CUT_AT[i % CUT_AT.len()] / 100 {
                signal(c.pid(), Signal::SIGSTOP);
                stopped[i] = true;
            }
        }
        assert!(
            Instant::now() < deadline,
            "clients given {given:?} pages within {TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let before: Vec<u64> = {
        let given = installed(s);
        clients.iter().map(|(_, id)| given[id]).collect()
    };
    for (c, _) in &clients {
        signal(c.pid(), Signal::SIGCONT);
    }
    std::thread::sleep(Duration::from_millis(5));
    let t_restart = Instant::now();
    let h = restart();
    let gap = t_restart.elapsed();
    let given = installed(s);
    for ((_, id), was) in clients.iter().zip(&before) {
        let now = given.get(id).copied().unwrap_or_else(|| {
            panic!(
                "{id} is not listed after the restart\n{}",
                s.server_log_tail(40)
            )
        });
        assert!(
            now >= *was,
            "{id}: the new process's table holds {now} pages given, the old one's {was}"
        );
        assert!(now < pages, "{id} was given every page before the restart");
    }
    let check = format!("check:{image}");
    let done: Vec<_> = clients
        .into_iter()
        .map(|(c, _)| std::thread::spawn(move || c.finish()))
        .collect();
    for d in done {
        let lines = d.join().expect("a client thread");
        let c = line_of(&lines, &check);
        assert_eq!(c["mismatched_pages"], 0, "pages differ from the image: {c}");
    }
    eprintln!(
        "clients cut after {before:?} of {pages} pages; the new process answered after \
         {:.0} ms; clients done {:.0} ms after release",
        gap.as_secs_f64() * 1e3,
        t0.elapsed().as_secs_f64() * 1e3
    );
    (h, gap, t0.elapsed())
}

/// Listener ids and sockets, sorted.
fn listeners_of(s: &TestServer) -> Vec<(String, String)> {
    let mut l: Vec<_> = s
        .listeners()
        .into_iter()
        .map(|l| (l.id, l.socket))
        .collect();
    l.sort();
    l
}

#[test]
fn firecracker_clients_and_listeners_survive_a_crash_and_an_upgrade() {
    if !require_uffd() {
        return;
    }
    let image = RandomImage::new(MIB, 0xf1c0_5eed);
    let img = image.path();
    let dir = tempfile::Builder::new()
        .prefix("pagefork-fc-restart-")
        .tempdir()
        .expect("tempdir");
    let cli_sock = dir.path().join("cli.sock");
    let spec = format!("{}={img}", cli_sock.display());
    // One fault per page on both listeners (the one given on the command
    // line takes the server's defaults).
    let s = TestServer::start_with_args(&[
        "--firecracker",
        &spec,
        "--fault-around-kib",
        "4",
        "--readahead-kib",
        "0",
    ]);
    let h0 = s.health_now().expect("health");
    assert!(h0.kept, "the server runs without a keeper: {h0:?}");
    let api = s.add_listener(&s.listener_request("fc", file_source(&img)));
    let api_sock = PathBuf::from(&api.socket);
    let listeners = listeners_of(&s);
    assert_eq!(listeners.len(), 2, "{listeners:?}");

    // A client held through both restarts: its pages were all installed
    // by the first process; it discards half of them after the upgrade.
    let half = MIB * (1 << 20) / PAGE / 2;
    let mut held = FcClient::spawn(
        &api_sock,
        &["--mib", &MIB.to_string()],
        &[
            "touch-random:3",
            &format!("check:{img}"),
            "hold",
            &format!("remove:0:{half}"),
            &format!("zero:0:{half}"),
            &format!("check:{img}"),
        ],
    );
    let held_vm = s.wait_firecracker_vm(held.pid(), TIMEOUT).id;
    let first = held.until(&format!("check:{img}"));
    assert_eq!(first["mismatched_pages"], 0, "{first}");

    // 1. SIGKILL mid-touch.
    let clients = touchers(
        &s,
        &[(&api_sock, 11), (&api_sock, 12), (&cli_sock, 13)],
        &img,
    );
    let ids: Vec<(u32, String)> = clients
        .iter()
        .map(|(c, id)| (c.pid(), id.clone()))
        .collect();
    let before = s.pid();
    let (h, crash_gap, crash_total) = cut_touches(&s, clients, &img, || {
        signal(before, Signal::SIGKILL);
        let h = wait_new_pid(&s, before);
        // Every client is listed under its id, held by the new process.
        for (pid, id) in &ids {
            let v = s.firecracker_vm(*pid).unwrap_or_else(|| {
                panic!("fc_client {pid} not adopted\n{}", s.server_log_tail(40))
            });
            assert_eq!(&v.id, id);
        }
        h
    });
    assert_eq!(h.start, "crash", "{h:?}");
    assert!(h.lost_vms.is_empty(), "{h:?}");
    assert_eq!(h.adopted_vms, 4, "{h:?}");
    assert_eq!(listeners_of(&s), listeners, "listeners after the crash");
    assert_eq!(
        s.firecracker_vm(held.pid()).map(|v| v.id),
        Some(held_vm.clone())
    );

    // 2. An upgrade mid-touch, of clients that connected to the listeners
    // taken back, while more clients connect one after another: to the
    // old process, into the backlog, to the new one.
    let clients = touchers(
        &s,
        &[(&api_sock, 21), (&cli_sock, 22), (&api_sock, 23)],
        &img,
    );
    let before = s.pid();
    let mut arriving = None;
    let (h, upgrade_gap, upgrade_total) = cut_touches(&s, clients, &img, || {
        let socks = [api_sock.clone(), cli_sock.clone()];
        let image = img.clone();
        arriving = Some(std::thread::spawn(move || {
            (0..6u64)
                .map(|i| {
                    let c = FcClient::spawn(
                        &socks[usize::from(i % 2 == 1)],
                        &["--mib", "32"],
                        &[
                            &format!("touch-random:{}", 40 + i),
                            &format!("check:{image}"),
                        ],
                    );
                    std::thread::sleep(Duration::from_millis(15));
                    c
                })
                .collect::<Vec<_>>()
        }));
        std::thread::sleep(Duration::from_millis(20));
        let r = s.raw("POST", "/v1/server/upgrade", Some(serde_json::json!({})));
        assert_eq!(r.status, 200, "upgrade: {}", r.body);
        wait_new_pid(&s, before)
    });
    assert_eq!(h.start, "upgrade", "{h:?}");
    assert!(h.lost_vms.is_empty(), "{h:?}");
    assert!(h.adopted_vms >= 4, "{h:?}");
    assert_eq!(listeners_of(&s), listeners, "listeners after the upgrade");
    let arrived = arriving
        .expect("clients arrived")
        .join()
        .expect("the arriving clients");
    for c in arrived {
        let out = c.finish();
        let check = line_of(&out, &format!("check:{img}"));
        assert_eq!(
            check["mismatched_pages"], 0,
            "a client arriving during the upgrade: {check}"
        );
    }

    // 3. After both: a new client on each listener, and the held one,
    // whose discards and faults the third process serves.
    let t = Instant::now();
    for sock in [&api_sock, &cli_sock] {
        let c = toucher(sock, &img, 31);
        let out = c.finish();
        let check = line_of(&out, &format!("check:{img}"));
        assert_eq!(check["mismatched_pages"], 0, "{check}");
    }
    assert_eq!(s.firecracker_vm(held.pid()).map(|v| v.id), Some(held_vm));
    let out = held.finish();
    assert_eq!(
        line_of(&out, &format!("zero:0:{half}"))["nonzero_pages"],
        0,
        "{out:?}"
    );
    let last = out
        .iter()
        .rev()
        .find(|l| l["cmd"] == format!("check:{img}"))
        .expect("the last check");
    assert_eq!(last["mismatched_pages"], half, "{last}");
    assert_eq!(last["first_mismatch"], 0, "{last}");
    eprintln!(
        "crash: {:.0} ms to a new process, touches done in {:.0} ms; upgrade: {:.0} ms, {:.0} ms; \
         after: {:.0} ms",
        crash_gap.as_secs_f64() * 1e3,
        crash_total.as_secs_f64() * 1e3,
        upgrade_gap.as_secs_f64() * 1e3,
        upgrade_total.as_secs_f64() * 1e3,
        t.elapsed().as_secs_f64() * 1e3
    );
    s.assert_healthy();
}
