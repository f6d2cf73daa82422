//! Nothing a client or a VMM does may stall the server (issue 18, items 3,
//! 4, 8, 9 and 13): idle or half-sent API connections are
//! closed and capped, a stopped VMM gets a deadline and a bounded queue
//! while health and every other VM keep being served, and the state the
//! API shows is what the guest does, also when a pause meets a fork.
//!
//! "What the guest does" is observed with a long `fill` in flight: while
//! it runs the guest takes page faults (`faults.missing` grows); while its
//! vCPUs are paused the count stands still.
//!
//! Deadlines here are liveness checks with wide margins, not speed checks.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use pagefork_tests::{
    body, new_vm, op, pages_of, request_within, require_kvm_uffd, signal, TestServer,
};
use proto::api::{ExecRequest, ForkRequest, RunState};

/// `GET /v1/health` must answer 200 within 10 s.
fn assert_health_answers(s: &TestServer, when: &str) {
    match request_within(
        &s.api_sock(),
        "GET",
        "/v1/health",
        None,
        Duration::from_secs(10),
    ) {
        Some((200, _)) => {}
        other => panic!("{when}: health did not answer 200 within 10 s: {other:?}"),
    }
}

/// Whether the server has closed `c`: a read returns EOF (after any
/// answer it sent first). `false` if it is still open after `wait`.
fn closed_by_server(c: &mut UnixStream, wait: Duration) -> bool {
    c.set_read_timeout(Some(wait)).expect("set_read_timeout");
    let mut buf = [0u8; 4096];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// Sends SIGCONT to a stopped VMM when dropped, so a failing test does not
/// leave it stopped.
struct Stopped(u32);

impl Stopped {
    fn new(pid: u32) -> Self {
        signal(pid, Signal::SIGSTOP);
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(self.0).unwrap_or(0)),
            Signal::SIGCONT,
        );
    }
}

fn missing_faults(s: &TestServer, id: &str) -> u64 {
    s.vm(id).faults.missing
}

/// The state `GET` shows for `id` once it stops changing, and whether the
/// guest made progress (took faults) over the 600 ms after that.
fn state_and_progress(s: &TestServer, id: &str) -> (RunState, bool) {
    let mut state = s.vm(id).state;
    for _ in 0..20 {
        thread::sleep(Duration::from_millis(100));
        let now = s.vm(id).state;
        if now == state {
            break;
        }
        state = now;
    }
    let m1 = missing_faults(s, id);
    thread::sleep(Duration::from_millis(600));
    let v = s.vm(id);
    assert_eq!(v.state, state, "state changed while observed: {v:?}");
    (state, v.faults.missing > m1)
}

/// Pages of `[start, start+pages)` that `verify(seed)` rejects, found by
/// bisection (reads materialize pages: diagnosis only).
fn bad_pages(s: &TestServer, id: &str, start: u64, pages: u64, seed: u64) -> Vec<u64> {
    if pages == 0 || s.verify(id, start, pages, seed) == 0 {
        return Vec::new();
    }
    if pages == 1 {
        return vec![start];
    }
    let half = pages / 2;
    let mut bad = bad_pages(s, id, start, half, seed);
    bad.extend(bad_pages(s, id, start + half, pages - half, seed));
    bad
}

// ---------------------------------------------------------------------------
// Item 3: API connections

/// A connection that has sent half a request: headers never finished.
/// Beyond the cap the server may answer 503 and close before the client
/// writes; the write then fails with EPIPE and the test counts the
/// connection as closed by the server, which it is.
fn half_request(sock: &Path) -> UnixStream {
    let mut c = UnixStream::connect(sock).expect("connect");
    if let Err(e) = c.write_all(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n") {
        assert!(
            matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset),
            "send half a request: {e}"
        );
    }
    c
}

#[test]
fn idle_and_half_sent_connections_cannot_lock_clients_out() {
    if !require_kvm_uffd() {
        return;
    }
    let cap = 64;
    let s = TestServer::start_with_args(&[
        "--api-max-connections",
        &cap.to_string(),
        "--api-header-timeout-ms",
        "1000",
        "--api-idle-timeout-ms",
        "2000",
    ]);
    let sock = s.api_sock();
    // 300 connections, half of them silent, half with half a request; the
    // client keeps every one open for the whole test.
    let opened = 300;
    let t0 = Instant::now();
    let mut conns: Vec<UnixStream> = (0..opened)
        .map(|i| {
            if i % 2 == 0 {
                UnixStream::connect(&sock).expect("connect")
            } else {
                half_request(&sock)
            }
        })
        .collect();
    // Health answers again once the server has closed the ones it held,
    // although the client still holds all 300.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut refused_meanwhile = 0;
    let health_after = loop {
        match request_within(&sock, "GET", "/v1/health", None, Duration::from_secs(5)) {
            Some((200, _)) => break t0.elapsed(),
            Some((503, _)) => refused_meanwhile += 1,
            // No answer within 5 s (a busy machine): try again until the
            // deadline below.
            None => {}
            other => panic!("health answered {other:?}"),
        }
        assert!(
            Instant::now() < deadline,
            "health still refused 20 s after {opened} idle connections were opened"
        );
        thread::sleep(Duration::from_millis(100));
    };
    // Every one of the 300 is closed by the server: at once with a 503
    // beyond the cap, after the header or idle timeout otherwise.
    let mut still_open = 0;
    for c in &mut conns {
        if !closed_by_server(c, Duration::from_secs(10)) {
            still_open += 1;
        }
    }
    let all_closed = t0.elapsed();
    eprintln!(
        "{opened} idle/half-sent connections (cap {cap}, header timeout 1 s, idle timeout 2 s): \
         health answered again after {health_after:?} ({refused_meanwhile} health requests got \
         503 before), all closed by the server after {all_closed:?}, {still_open} still open"
    );
    assert_eq!(still_open, 0, "connections the server never closed");
    // The server is healthy and not holding them: a VM still works.
    let id = s.create_vm(&new_vm(4));
    s.fill(&id, 0, 4, 1);
}

#[test]
fn connections_idle_longer_than_the_idle_timeout_are_closed() {
    if !require_kvm_uffd() {
        return;
    }
    // A header timeout far beyond the idle timeout: only the idle timeout
    // can close these.
    let s = TestServer::start_with_args(&[
        "--api-header-timeout-ms",
        "60000",
        "--api-idle-timeout-ms",
        "1000",
    ]);
    let sock = s.api_sock();
    let mut silent = UnixStream::connect(&sock).expect("connect");
    // A keep-alive connection that made one request and then sits idle.
    let mut kept = UnixStream::connect(&sock).expect("connect");
    kept.write_all(b"GET /v1/health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .expect("send");
    let t = Instant::now();
    assert!(
        closed_by_server(&mut silent, Duration::from_secs(15)),
        "a silent connection is still open after 15 s (idle timeout 1 s)"
    );
    assert!(
        closed_by_server(&mut kept, Duration::from_secs(15)),
        "an idle keep-alive connection is still open after 15 s (idle timeout 1 s)"
    );
    eprintln!(
        "idle connections closed after {:?} (idle timeout 1 s)",
        t.elapsed()
    );
    assert_health_answers(&s, "after closing idle connections");
}

// ---------------------------------------------------------------------------
// Items 4 and 8: a stopped VMM

/// `GET` says what the guest of `id` does: `running` while its fill (run
/// by `filler`) progresses or has finished, `paused` while it stands still
/// (then it is resumed, so the fill can finish).
fn assert_state_is_what_the_guest_does(
    s: &TestServer,
    id: &str,
    filler: &thread::ScopedJoinHandle<'_, ()>,
    when: &str,
) {
    let (state, progress) = state_and_progress(s, id);
    eprintln!("{when}: state {state}, guest progressing: {progress}");
    match state {
        RunState::Running => assert!(
            progress || filler.is_finished(),
            "{when}: GET says running but the guest's fill does not progress"
        ),
        RunState::Paused => {
            assert!(
                !progress,
                "{when}: GET says paused but the guest's fill progresses"
            );
            s.resume(id);
        }
        other => panic!("{id} is {other} {when}: {:?}", s.vm(id)),
    }
}

/// Pause, then fork, a VM whose VMM is stopped: both answer 504 within a
/// few seconds, and once the VMM runs again the state `GET` shows is what
/// the guest does (a fill in flight progresses exactly when it says
/// running), and no child appears from the fork that failed.
#[test]
fn requests_to_a_stopped_vmm_answer_504_and_the_state_stays_true() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start_with_args(&["--vmm-deadline-ms", "1500"]);
    let mib = 512;
    let pages = pages_of(mib);
    let id = s.create_vm(&new_vm(mib));
    let pid = s.vmm_pid(&id);
    thread::scope(|sc| {
        let filler = sc.spawn(|| s.fill(&id, 0, pages, 3));
        thread::sleep(Duration::from_millis(300));
        assert!(missing_faults(&s, &id) > 0, "the fill did not start");
        let stopped = Stopped::new(pid);

        let t = Instant::now();
        let v = s.try_pause(&id).unwrap_err();
        let pause_took = t.elapsed();
        assert_eq!(v.status, 504, "pause of a stopped VMM: {v}");
        assert!(
            pause_took < Duration::from_secs(10),
            "pause answered after {pause_took:?} (deadline 1.5 s)"
        );
        let t = Instant::now();
        let v = s.try_fork(&id, &ForkRequest { count: 1 }).unwrap_err();
        let fork_took = t.elapsed();
        let status = v.status;
        assert!(status == 504 || status == 409, "fork of a stopped VMM: {v}");
        assert!(
            fork_took < Duration::from_secs(10),
            "fork answered after {fork_took:?} (deadline 1.5 s)"
        );
        eprintln!(
            "stopped VMM: pause answered 504 after {pause_took:?}, fork {status} after {fork_took:?}"
        );
        assert_health_answers(&s, "with a stopped VMM");

        drop(stopped);
        assert_state_is_what_the_guest_does(&s, &id, &filler, "after SIGCONT");
        filler.join().expect("the fill failed");
    });
    assert_eq!(s.verify(&id, 0, pages, 3), 0, "the fill completed");
    assert_eq!(
        s.vm_ids(),
        vec![id.clone()],
        "a fork that answered an error left a child"
    );
}

/// Send `method path` with a JSON `body` on a new API connection and hang
/// up after `wait`, before any answer is read.
fn send_and_leave(s: &TestServer, method: &str, path: &str, body: &str, wait: Duration) {
    let mut c = UnixStream::connect(s.api_sock()).expect("connect");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    c.write_all(req.as_bytes()).expect("send");
    thread::sleep(wait);
    drop(c);
}

/// Clients that hang up on a pause and a fork of a stopped VMM before any
/// answer: once the VMM runs again, `GET` says what the guest does (a
/// pause that hit its deadline did not take effect behind everyone's
/// back, or if it did, `GET` says paused and the guest is still), and no
/// child appears that the server did not finish.
#[test]
fn requests_whose_clients_left_do_not_take_effect_unseen() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start_with_args(&["--vmm-deadline-ms", "1000"]);
    let mib = 256;
    let pages = pages_of(mib);
    let id = s.create_vm(&new_vm(mib));
    let pid = s.vmm_pid(&id);
    thread::scope(|sc| {
        let filler = sc.spawn(|| s.fill(&id, 0, pages, 4));
        thread::sleep(Duration::from_millis(200));
        let stopped = Stopped::new(pid);
        send_and_leave(
            &s,
            "POST",
            &format!("/v1/vms/{id}/pause"),
            "",
            Duration::from_millis(200),
        );
        send_and_leave(
            &s,
            "POST",
            &format!("/v1/vms/{id}/fork"),
            r#"{"count": 1}"#,
            Duration::from_millis(200),
        );
        // Past both deadlines, with the VMM still stopped.
        thread::sleep(Duration::from_millis(2500));
        assert_health_answers(&s, "after clients left");
        drop(stopped);
        thread::sleep(Duration::from_millis(500));
        assert_state_is_what_the_guest_does(&s, &id, &filler, "after the clients left and SIGCONT");
        filler.join().expect("the fill failed");
    });
    assert_eq!(s.verify(&id, 0, pages, 4), 0, "the fill completed");
    let vms = s.vm_ids();
    for child in vms.iter().filter(|v| **v != id) {
        // A fork that finished is a whole VM, visible and running.
        assert_eq!(
            s.vm(child).state,
            RunState::Running,
            "{child}: {:?}",
            s.vm(child)
        );
    }
    assert!(vms.len() <= 2, "{vms:?}");
    s.assert_healthy();
}

#[test]
fn one_stopped_vmm_does_not_stop_health_or_other_vms() {
    if !require_kvm_uffd() {
        return;
    }
    // Room for every client below: this test is about the stopped VMM's
    // queue and deadline. With the default cap of 256 connections, 400
    // clients connecting faster than the queue refuses them would fill the
    // cap and health would rightly get the cap's 503 (that cap has its own
    // test, `beyond_the_connection_cap_a_503_says_why_and_slots_come_back`).
    let s = TestServer::start_with_args(&["--api-max-connections", "1024"]);
    let stuck = s.create_vm(&new_vm(4));
    let other = s.create_vm(&new_vm(64));
    let other_pages = pages_of(64);
    let pid = s.vmm_pid(&stuck);
    let stopped = Stopped::new(pid);
    let sock = s.api_sock();
    let requests = 400;
    let exec_path = format!("/v1/vms/{stuck}/exec");
    let identity = body(&op::identity());
    let answers: Vec<Option<u16>> = thread::scope(|sc| {
        let clients: Vec<_> = (0..requests)
            .map(|_| {
                let (sock, path, identity) = (&sock, &exec_path, &identity);
                sc.spawn(move || {
                    request_within(sock, "POST", path, Some(identity), Duration::from_secs(3))
                        .map(|(status, _)| status)
                })
            })
            .collect();
        // Meanwhile: health answers, and another VM's faults are served.
        for i in 0..3 {
            assert_health_answers(&s, &format!("health {i} with {requests} requests queued"));
        }
        let fill = request_within(
            &sock,
            "POST",
            &format!("/v1/vms/{other}/exec"),
            Some(&body(&ExecRequest::Fill {
                start_page: None,
                pages: None,
                seed: 9,
            })),
            Duration::from_secs(60),
        );
        assert!(
            matches!(fill, Some((200, _))),
            "the other VM's fill (page faults) did not complete: {fill:?}"
        );
        assert_health_answers(&s, "after the other VM's fill");
        clients
            .into_iter()
            .map(|c| c.join().expect("client thread"))
            .collect()
    });
    let count = |want: Option<u16>| answers.iter().filter(|a| **a == want).count();
    let (busy, no_answer) = (count(Some(503)), count(None));
    eprintln!(
        "{requests} exec requests to a stopped VMM: {busy} answered 503, {} 504, {no_answer} \
         unanswered within the client's 3 s",
        count(Some(504))
    );
    assert!(busy > 0, "no request was refused with 503: {answers:?}");
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, None | Some(503) | Some(504))),
        "unexpected answers: {answers:?}"
    );
    assert_eq!(
        s.verify(&other, 0, other_pages, 9),
        0,
        "the other VM's memory"
    );
    drop(stopped);
    // The stopped VM catches up and works again.
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Err(v) = s.try_exec(&stuck, &op::identity()) {
        assert!(
            v.status == 503 && Instant::now() < deadline,
            "the VM does not work again after SIGCONT: {v}"
        );
        thread::sleep(Duration::from_millis(200));
    }
    s.fill(&stuck, 0, 16, 4);
    assert_eq!(s.verify(&stuck, 0, 16, 4), 0);
}

// ---------------------------------------------------------------------------
// Items 9 and 13: pause and fork meeting other operations

/// A pause that arrives while the VM is being forked is refused with 409
/// (not answered success and then undone by the fork's resume); after
/// every attempt the state `GET` shows is what the guest does.
#[test]
fn a_pause_during_a_fork_is_refused_and_the_state_stays_true() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let parent = s.create_vm(&new_vm(4));
    s.fill(&parent, 0, 64, 1);
    let count = 32;
    let mut overlaps = 0;
    let mut delay = Duration::from_millis(30);
    let mut log = Vec::new();
    for attempt in 0..20 {
        let (fork, pause) = thread::scope(|sc| {
            let forker = sc.spawn(|| {
                let t = Instant::now();
                let r = s.try_fork(&parent, &ForkRequest { count });
                (r, t.elapsed())
            });
            thread::sleep(delay);
            let pause = s.try_pause(&parent);
            (forker.join().expect("fork thread"), pause)
        });
        let ((fork, fork_took), pause) = (fork, pause);
        let fork_status = fork.as_ref().map_or_else(|r| r.status, |_| 201);
        let pause_status = pause.as_ref().map_or_else(|r| r.status, |_| 200);
        log.push(format!(
            "attempt {attempt}: delay {delay:?}: fork {fork_status} in {fork_took:?}, pause {pause_status}"
        ));
        let state = s.vm(&parent).state;
        match &pause {
            Err(r) if r.status == 409 => {
                overlaps += 1;
                assert_eq!(fork_status, 201, "fork: {fork:?}");
                let msg = r.error();
                assert!(msg.contains("fork"), "409 without saying why: {r}");
                assert_eq!(
                    state,
                    RunState::Running,
                    "a refused pause left {parent} {state}"
                );
            }
            Ok(p) => {
                // No overlap: the pause came before the fork began (which
                // then found the VM paused) or after it ended.
                assert_eq!(state, RunState::Paused, "pause answered 200: {p:?}");
                assert!(fork_status == 201 || fork_status == 409, "fork: {fork:?}");
                // Paused means paused: the guest takes no command...
                let r = s.try_exec(&parent, &op::identity()).unwrap_err();
                assert_eq!(r.status, 409, "exec on a VM that GET shows paused");
                s.resume(&parent);
                delay = if fork_status == 409 {
                    delay + Duration::from_millis(20)
                } else {
                    delay.mul_f32(0.6)
                };
            }
            Err(r) => panic!("pause during a fork: {r}"),
        }
        // ...and running means running: a guest op completes.
        s.fill(&parent, 64, 8, attempt);
        assert_eq!(
            s.verify(&parent, 0, 64, 1),
            0,
            "parent memory, attempt {attempt}"
        );
        if let Ok(f) = &fork {
            for child in &f.children {
                s.delete_vm(child);
            }
        }
        if overlaps >= 3 {
            break;
        }
    }
    eprintln!("{}", log.join("\n"));
    assert!(
        overlaps >= 1,
        "no pause landed during a fork in 20 attempts:\n{}",
        log.join("\n")
    );
}

/// A fork issued while a long exec (a 256 MiB fill) runs in the VM answers
/// promptly with 201, and both VMs then work and hold the fill.
#[test]
fn a_fork_during_a_long_exec_answers_promptly() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let mib = 256;
    let pages = pages_of(mib);
    let parent = s.create_vm(&new_vm(mib));
    let (fork, fork_took, fill_running) = thread::scope(|sc| {
        let filler = sc.spawn(|| s.fill(&parent, 0, pages, 5));
        thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        let fork = s.try_fork(&parent, &ForkRequest { count: 1 });
        let took = t.elapsed();
        let running = !filler.is_finished();
        filler.join().expect("the fill failed");
        (fork, took, running)
    });
    eprintln!(
        "fork during a fill: after {fork_took:?}; fill still running: {fill_running}; {fork:?}"
    );
    let v = fork.unwrap_or_else(|v| panic!("fork during an exec: {v}"));
    assert!(
        fork_took < Duration::from_secs(20),
        "the fork waited {fork_took:?} behind the exec"
    );
    let child = v.children[0].clone();
    let sources = s.sources(&child);
    eprintln!("child's page sources: {:?}", sources.extents);
    for (id, what) in [(&parent, "parent"), (&child, "child")] {
        // The child resumed mid-fill and finished the fill itself.
        let bad = s.verify(id, 0, pages, 5);
        if bad != 0 {
            panic!(
                "the {what} {id} lost the fill on {bad} page(s): {:?}; child's sources at the \
                 fork: {:?}",
                bad_pages(&s, id, 0, pages, 5),
                sources.extents
            );
        }
    }
    s.fill(&child, 0, 16, 6);
    assert_eq!(
        s.verify(&parent, 0, 16, 5),
        0,
        "parent unaffected by the child"
    );
    assert_eq!(s.verify(&child, 0, 16, 6), 0);
}
