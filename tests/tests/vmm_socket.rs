//! The VMM socket against hostile or broken peers: raw connections to
//! `DIR/vmm.sock` that send garbage, a wrong launch token or the wrong
//! number of fds. Each must get a `ServerMsg::Error` and a closed
//! connection, and nothing else may be disturbed: the server stays healthy
//! and a running VM (when KVM is available) keeps answering.

use std::io::{IoSlice, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use pagefork_tests::{new_vm, op, require_kvm_uffd, TestServer};
use proto::api::RunState;
use proto::frame::{send_frame, Header, VERSION};
use proto::vmm::{encode, recv, send, ServerMsg, VmmMsg};

fn connect(s: &TestServer) -> UnixStream {
    let c = UnixStream::connect(s.vmm_sock()).expect("cannot connect to vmm.sock");
    c.set_read_timeout(Some(Duration::from_secs(15)))
        .expect("set_read_timeout");
    c
}

/// Read the server's answer: it must be an Error frame, and then the
/// connection must be closed. Returns the error message.
fn expect_error_then_close(c: &UnixStream, what: &str) -> String {
    let msg = match recv::<ServerMsg>(c) {
        Ok((ServerMsg::Error { message }, fds)) => {
            assert!(fds.is_empty(), "{what}: error frame carried fds");
            message
        }
        Ok((other, _)) => panic!("{what}: expected an error frame, got {other:?}"),
        Err(e) => panic!("{what}: expected an error frame, got {e}"),
    };
    let mut rest = Vec::new();
    let mut c2 = c;
    match c2.read_to_end(&mut rest) {
        Ok(_) => assert!(
            rest.is_empty(),
            "{what}: bytes after the error frame: {rest:?}"
        ),
        Err(e) => assert_ne!(
            e.kind(),
            std::io::ErrorKind::WouldBlock,
            "{what}: connection left open after the error"
        ),
    }
    msg
}

fn hello(token: &str) -> VmmMsg {
    VmmMsg::Hello {
        version: VERSION,
        token: token.into(),
        pid: std::process::id(),
    }
}

/// Send a frame whose header declares `declared` fds while `fds` travel.
fn send_with_fd_count(c: &UnixStream, payload: &[u8], declared: u8, fds: &[i32]) {
    let len = u32::try_from(payload.len()).expect("payload fits");
    let header = Header {
        version: VERSION,
        flags: 0,
        len,
        nfds: declared,
    }
    .encode();
    let iov = [IoSlice::new(&header), IoSlice::new(payload)];
    let cmsg = [ControlMessage::ScmRights(fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &cmsg };
    let n = sendmsg::<()>(c.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None).expect("sendmsg");
    assert_eq!(n, header.len() + payload.len());
}

/// A VM whose liveness the test checks after each bad peer, if KVM is here.
struct Bystander {
    id: Option<String>,
}

impl Bystander {
    fn new(s: &TestServer) -> Self {
        if !require_kvm_uffd() {
            return Bystander { id: None };
        }
        let id = s.create_vm(&new_vm(16));
        s.exec(&id, &op::fill(0, 4096, 99));
        Bystander { id: Some(id) }
    }

    fn assert_unaffected(&self, s: &TestServer, after: &str) {
        s.assert_healthy();
        if let Some(id) = &self.id {
            assert_eq!(s.vm(id).state, RunState::Running, "after {after}");
            let v = s.exec(id, &op::verify(0, 4096, 99));
            assert_eq!(v, 0, "{id} lost memory after {after}");
        }
    }
}

#[test]
fn malformed_frame_gets_an_error_and_only_that_connection_closes() {
    let s = TestServer::start();
    let bystander = Bystander::new(&s);
    // A second, idle peer must survive the first one's garbage.
    let idle = connect(&s);

    let mut c = connect(&s);
    c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("write garbage");
    let msg = expect_error_then_close(&c, "garbage bytes");

    assert!(msg.contains("magic"), "error names the problem: {msg}");
    bystander.assert_unaffected(&s, "garbage bytes");
    // The idle peer's connection is still open and still judged on its own.
    send(&idle, &hello("not-a-token"), &[]).expect("idle peer can still send");
    expect_error_then_close(&idle, "idle peer's bad hello");
}

#[test]
fn bad_headers_get_errors_and_the_server_keeps_serving() {
    let s = TestServer::start();
    let bystander = Bystander::new(&s);
    let payload = encode(&hello("whatever")).expect("encode");
    let mut wrong_version = Header {
        version: VERSION,
        flags: 0,
        len: 0,
        nfds: 0,
    }
    .encode();
    wrong_version[4..6].copy_from_slice(&(VERSION + 1).to_le_bytes());
    let too_large = Header {
        version: VERSION,
        flags: 0,
        len: proto::frame::MAX_PAYLOAD + 1,
        nfds: 0,
    }
    .encode();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("wrong protocol version", wrong_version.to_vec(), "version"),
        ("oversized payload", too_large.to_vec(), "exceeds"),
        (
            "payload that is not a message",
            {
                let mut f = Header {
                    version: VERSION,
                    flags: 0,
                    len: 3,
                    nfds: 0,
                }
                .encode()
                .to_vec();
                f.extend_from_slice(&[0xff, 0xff, 0xff]);
                f
            },
            "decode",
        ),
        (
            "message other than hello first",
            {
                let p = encode(&VmmMsg::Running).expect("encode");
                let mut f = Header {
                    version: VERSION,
                    flags: 0,
                    len: u32::try_from(p.len()).unwrap(),
                    nfds: 0,
                }
                .encode()
                .to_vec();
                f.extend_from_slice(&p);
                f
            },
            "hello",
        ),
    ];
    for (what, bytes, needle) in cases {
        let mut c = connect(&s);
        c.write_all(&bytes).expect("write");
        let msg = expect_error_then_close(&c, what);
        assert!(
            msg.to_lowercase().contains(needle),
            "{what}: error {msg:?} should mention {needle:?}"
        );
        bystander.assert_unaffected(&s, what);
    }
    // A peer that hangs up in the middle of a frame gets no answer, but
    // costs the server nothing either.
    let mut c = connect(&s);
    c.write_all(
        &Header {
            version: VERSION,
            flags: 0,
            len: u32::try_from(payload.len()).unwrap(),
            nfds: 0,
        }
        .encode(),
    )
    .expect("write header");
    c.write_all(&payload[..1]).expect("write part");
    drop(c);
    bystander.assert_unaffected(&s, "a hang-up mid-frame");
}

#[test]
fn hello_with_a_wrong_token_is_refused() {
    let s = TestServer::start();
    let bystander = Bystander::new(&s);

    let c = connect(&s);
    send(&c, &hello("0123456789abcdef0123456789abcdef"), &[]).expect("send hello");
    let msg = expect_error_then_close(&c, "wrong token");

    assert!(msg.contains("token"), "error names the token: {msg}");
    bystander.assert_unaffected(&s, "a wrong token");
}

#[test]
fn frame_with_the_wrong_number_of_fds_is_refused() {
    let s = TestServer::start();
    let bystander = Bystander::new(&s);
    let payload = encode(&hello("whatever")).expect("encode");
    let null = std::fs::File::open("/dev/null").expect("open /dev/null");
    let fd = null.as_raw_fd();

    // Declares one fd, carries none.
    let c = connect(&s);
    send_with_fd_count(&c, &payload, 1, &[]);
    let msg = expect_error_then_close(&c, "1 fd declared, 0 sent");
    assert!(msg.contains("declares 1 fds but 0 arrived"), "{msg}");
    bystander.assert_unaffected(&s, "1 fd declared, 0 sent");

    // Declares one fd, carries two.
    let c = connect(&s);
    send_with_fd_count(&c, &payload, 1, &[fd, fd]);
    let msg = expect_error_then_close(&c, "1 fd declared, 2 sent");
    assert!(msg.contains("declares 1 fds but 2 arrived"), "{msg}");
    bystander.assert_unaffected(&s, "1 fd declared, 2 sent");

    // A consistent frame, but a hello must carry no fds at all.
    let c = connect(&s);
    send_frame(c.as_raw_fd(), &payload, &[fd]).expect("send");
    let msg = expect_error_then_close(&c, "hello with an fd");
    assert!(msg.contains("no fds"), "{msg}");
    bystander.assert_unaffected(&s, "hello with an fd");
}

#[test]
fn sockets_are_created_mode_0600() {
    let s = TestServer::start();
    for path in [s.api_sock(), s.vmm_sock()] {
        let mode = std::fs::metadata(&path)
            .expect("stat socket")
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o777,
            0o600,
            "{} has mode {:o}",
            path.display(),
            mode & 0o777
        );
    }
}

#[test]
fn silent_connections_are_capped_and_a_vm_still_starts() {
    let s = TestServer::start();
    // Peers that connect and say nothing hold a slot each until the hello
    // timeout; beyond the cap a new one is refused at once.
    // (The socket is 0600 in a 0700 directory: only the server's user can
    // connect at all; the cap bounds the threads such peers can hold.)
    let mut silent: Vec<UnixStream> = (0..uffd_server::conn::vmm::MAX_UNAUTHENTICATED)
        .map(|_| connect(&s))
        .collect();
    let extra = connect(&s);
    let msg = expect_error_then_close(&extra, "connection beyond the cap");
    assert!(msg.contains("too many connections"), "{msg}");
    // Freed slots are counted back: with a few silent peers gone, a VM's
    // own VMM gets in and the VM runs, next to the rest still waiting.
    silent.truncate(uffd_server::conn::vmm::MAX_UNAUTHENTICATED - 8);
    std::thread::sleep(Duration::from_millis(100));
    let bystander = Bystander::new(&s);
    bystander.assert_unaffected(&s, "silent connections");
    drop(silent);
}

/// The `--token` argument of the running process whose command line
/// starts with `prog`, with its pid.
fn launch_token_of(prog: &std::path::Path) -> Option<(u32, String)> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        // `sh WRAPPER ARGS...` once the kernel has run the script.
        if !args.iter().take(2).any(|a| a == prog.to_str().unwrap()) {
            continue;
        }
        let at = args.iter().position(|a| a == "--token")?;
        return Some((pid, args.get(at + 1)?.clone()));
    }
    None
}

/// A launch token is bound to the process the server launched with it and
/// is good for one hello: another process presenting it while the VMM is
/// still starting is refused (and does not use it up: the VMM then
/// connects and its VM runs), and presenting it again after the VMM has
/// connected is refused as unknown.
#[test]
fn a_launch_token_works_once_and_only_for_the_process_it_was_given_to() {
    if !require_kvm_uffd() {
        return;
    }
    // A `vmm` that waits a moment before it starts, so that the test can
    // read its token from its command line and try it first.
    let dir = tempfile::tempdir().expect("tempdir");
    let wrapper = dir.path().join("slow-vmm");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nsleep 2\nexec '{}' \"$@\"\n",
            pagefork_tests::bin("vmm").display()
        ),
    )
    .expect("write wrapper");
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let s = TestServer::start_with_args(&["--vmm-bin", wrapper.to_str().unwrap()]);

    std::thread::scope(|scope| {
        let create = scope.spawn(|| s.create_vm(&new_vm(16)));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let (launched_pid, token) = loop {
            if let Some(found) = launch_token_of(&wrapper) {
                break found;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the launched vmm never showed up"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_ne!(launched_pid, std::process::id());

        // Stolen: the right token from the wrong process.
        let c = connect(&s);
        send(&c, &hello(&token), &[]).expect("send hello");
        let msg = expect_error_then_close(&c, "a stolen token");
        assert!(
            msg.contains(&format!("belongs to pid {launched_pid}")),
            "error names the token's process: {msg}"
        );

        // The rightful VMM still connects with it.
        let id = create.join().expect("create thread");
        assert_eq!(s.vm(&id).state, RunState::Running);
        s.exec(&id, &op::identity());

        // Used: the same token again is unknown, whoever presents it.
        let c = connect(&s);
        send(&c, &hello(&token), &[]).expect("send hello");
        let msg = expect_error_then_close(&c, "a used token");
        assert!(msg.contains("unknown launch token"), "{msg}");
        assert_eq!(s.vm(&id).state, RunState::Running, "the VM is undisturbed");
    });
    s.assert_healthy();
}

/// A connection that never says hello is told so and closed after the
/// hello timeout (10 s), so silent peers cannot pile up.
#[test]
fn a_connection_that_never_says_hello_is_closed_after_the_timeout() {
    let s = TestServer::start();
    let c = UnixStream::connect(s.vmm_sock()).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("set_read_timeout");
    let t = std::time::Instant::now();
    let msg = expect_error_then_close(&c, "a silent peer");
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(25),
        "closed after {waited:?}: {msg}"
    );
    s.assert_healthy();
}
