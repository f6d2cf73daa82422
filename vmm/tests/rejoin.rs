//! A VMM outlives its server: against a minimal fake server whose
//! listening socket stays open (as the real server's keeper holds it),
//! the VMM whose connection closes connects again, rejoins with
//! `Rejoin{version, vm, pid}` and serves the new connection once
//! `Rejoined`; the answer to a request of the old connection never reaches
//! the new one. It exits when the new server refuses it, or when nobody
//! holds the socket any more.
//!
//! Skips with a printed reason when /dev/kvm is unusable, except under
//! `CI=true`, where a missing /dev/kvm is a failure.

// Test images are small; their sizes fit usize on every test host.
#![allow(clippy::cast_possible_truncation)]

use std::ffi::c_void;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use proto::vmm::{LaunchConfig, MemoryKind, Reply, Request, ServerMsg, VmmMsg};
use shared::{pattern, GuestOp, GuestRegion, VmId, PAGE_SIZE};
use userfaultfd::{Event, Uffd};

mod common;
use common::kvm_available;

const PAGES: u64 = 256;
const SEED: u64 = 3;
const VM: u32 = 5;

/// Serve MISSING faults with the pattern of `SEED` until `stop`; while
/// `hold`, faults wait (the guest with them), as while no server runs.
fn serve_faults(
    uffd: Uffd,
    base: u64,
    hold: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut page = vec![0u8; PAGE_SIZE as usize];
        while !stop.load(Ordering::SeqCst) {
            if hold.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            let mut fds = [PollFd::new(uffd.as_fd(), PollFlags::POLLIN)];
            if poll(&mut fds, PollTimeout::from(20u16)).unwrap_or(0) == 0 {
                continue;
            }
            while let Ok(Some(ev)) = uffd.read_event() {
                let Event::Pagefault { addr, .. } = ev else {
                    continue;
                };
                let at = (addr as u64) & !(PAGE_SIZE - 1);
                pattern::fill_page(&mut page, (at - base) / PAGE_SIZE, SEED);
                // SAFETY: `page` is a live page-sized buffer; the
                // destination is a page of the VMM's registered range
                // (UFFDIO_COPY writes only into that process's memory).
                let copied = unsafe {
                    uffd.copy(
                        page.as_ptr().cast(),
                        at as *mut c_void,
                        PAGE_SIZE as usize,
                        true,
                    )
                };
                if copied.is_err() {
                    let _ = uffd.wake(at as *mut c_void, PAGE_SIZE as usize);
                }
            }
        }
    })
}

/// The fake server: its listening socket (which outlives connections, as
/// the keeper's does), the VMM's process and the connection to it now.
struct Server {
    path: PathBuf,
    listener: Option<UnixListener>,
    child: Child,
    sock: Option<UnixStream>,
    seq: u64,
    hold: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    faults: Option<JoinHandle<()>>,
    _memfd: OwnedFd,
}

impl Server {
    /// Launch a VMM for VM `VM` over a fresh memfd and serve its faults.
    fn launch(dir: &Path) -> Self {
        let path = dir.join("vmm.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_vmm"))
            .args(["--socket", path.to_str().unwrap(), "--token", "tok"])
            .spawn()
            .unwrap();
        let (sock, _) = listener.accept().unwrap();
        let (hello, _) = proto::vmm::recv::<VmmMsg>(&sock).unwrap();
        assert!(matches!(hello, VmmMsg::Hello { .. }), "{hello:?}");
        let memfd: OwnedFd = nix::sys::memfd::memfd_create(
            c"guest-ram",
            nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC,
        )
        .unwrap();
        std::fs::File::from(memfd.try_clone().unwrap())
            .set_len(PAGES * PAGE_SIZE)
            .unwrap();
        let config = LaunchConfig {
            regions: vec![GuestRegion {
                guest_phys: 0,
                size: PAGES * PAGE_SIZE,
            }],
            vcpus: 1,
            disk_bytes: None,
            start_state: None,
            memory: MemoryKind::Own,
        };
        proto::vmm::send(
            &sock,
            &ServerMsg::Welcome {
                vm_id: VmId(VM),
                config,
            },
            &[memfd.as_raw_fd()],
        )
        .unwrap();
        let (ready, mut fds) = proto::vmm::recv::<VmmMsg>(&sock).unwrap();
        let VmmMsg::UffdReady { bases } = ready else {
            panic!("expected UffdReady, got {ready:?}")
        };
        // SAFETY: the fd just arrived with the message and is ours alone.
        let uffd = unsafe { Uffd::from_raw_fd(fds.remove(0).into_raw_fd()) };
        let (hold, stop): (Arc<AtomicBool>, Arc<AtomicBool>) = Default::default();
        let faults = serve_faults(uffd, bases[0], Arc::clone(&hold), Arc::clone(&stop));
        let (m, _) = proto::vmm::recv::<VmmMsg>(&sock).unwrap();
        assert_eq!(m, VmmMsg::Running);
        Server {
            path,
            listener: Some(listener),
            child,
            sock: Some(sock),
            seq: 0,
            hold,
            stop,
            faults: Some(faults),
            _memfd: memfd,
        }
    }

    fn sock(&self) -> &UnixStream {
        self.sock.as_ref().expect("connected")
    }

    /// Send a request; returns its sequence number.
    fn send(&mut self, request: Request) -> u64 {
        self.seq += 1;
        proto::vmm::send(
            self.sock(),
            &ServerMsg::Request {
                seq: self.seq,
                request,
            },
            &[],
        )
        .unwrap();
        self.seq
    }

    /// The next reply on the connection, whatever its sequence number.
    fn next_reply(&self) -> (u64, Result<Reply, proto::vmm::RequestError>) {
        loop {
            match proto::vmm::recv::<VmmMsg>(self.sock()).unwrap().0 {
                VmmMsg::Reply { seq, result } => return (seq, result),
                other => eprintln!("ignoring {other:?}"),
            }
        }
    }

    fn exec(&mut self, op: GuestOp) -> (u64, u64) {
        let sent = self.send(Request::Exec(op));
        match self.next_reply() {
            (seq, Ok(Reply::Op(r))) => {
                assert_eq!(seq, sent, "the reply answers the request");
                (seq, r.value)
            }
            other => panic!("{op:?}: {other:?}"),
        }
    }

    /// The server goes: the VMM's connection closes, the socket stays.
    fn hang_up(&mut self) {
        drop(self.sock.take());
    }

    /// A new server takes the connection the VMM makes again and reads
    /// its rejoin.
    fn accept_rejoin(&mut self) {
        let listener = self.listener.as_ref().expect("listening");
        let (sock, _) = listener.accept().unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let (m, fds) = proto::vmm::recv::<VmmMsg>(&sock).unwrap();
        assert_eq!(
            m,
            VmmMsg::Rejoin {
                version: proto::frame::VERSION,
                vm: VmId(VM),
                pid: self.child.id(),
            }
        );
        assert!(fds.is_empty(), "a rejoin carries no fds");
        sock.set_read_timeout(None).unwrap();
        self.sock = Some(sock);
        // Numbers start again with the new server.
        self.seq = 0;
    }

    /// Wait up to 10 s for the VMM to exit; its exit status.
    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < until, "the VMM did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stop.store(true, Ordering::SeqCst);
        if let Some(f) = self.faults.take() {
            let _ = f.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn test_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vmm-rejoin-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_vmm_rejoins_a_new_server_and_drops_the_old_ones_answers() {
    if !kvm_available() {
        return;
    }
    let dir = test_dir("ok");
    let mut s = Server::launch(&dir);
    assert_eq!(s.exec(GuestOp::Identity).1, u64::from(VM));

    // A request in flight when the server goes: the guest waits on a
    // fault nobody serves yet.
    s.hold.store(true, Ordering::SeqCst);
    let old = s.send(Request::Exec(GuestOp::Checksum {
        start_page: 0,
        pages: PAGES,
    }));
    std::thread::sleep(Duration::from_millis(100));
    s.hang_up();
    s.accept_rejoin();
    proto::vmm::send(s.sock(), &ServerMsg::Rejoined, &[]).unwrap();
    // The new server serves the faults; the old request completes, and
    // its answer must not reach the new server, whose first request has
    // the same number.
    s.seq = old - 1;
    s.hold.store(false, Ordering::SeqCst);
    let (seq, vm) = s.exec(GuestOp::Identity);
    assert_eq!((seq, vm), (old, u64::from(VM)));
    assert_eq!(
        s.exec(GuestOp::Verify {
            start_page: 0,
            pages: PAGES,
            seed: SEED
        })
        .1,
        0,
        "guest RAM is whole"
    );

    // Once more, then nobody holds the socket: the VMM exits at once.
    s.hang_up();
    s.accept_rejoin();
    proto::vmm::send(s.sock(), &ServerMsg::Rejoined, &[]).unwrap();
    assert_eq!(s.exec(GuestOp::Identity).1, u64::from(VM));
    drop(s.listener.take());
    std::fs::remove_file(&s.path).unwrap();
    let start = Instant::now();
    s.hang_up();
    assert!(s.wait_exit().success());
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "exited without waiting for a server: {:?}",
        start.elapsed()
    );
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_vmm_the_new_server_refuses_exits() {
    if !kvm_available() {
        return;
    }
    let dir = test_dir("refused");
    let mut s = Server::launch(&dir);
    assert_eq!(s.exec(GuestOp::Identity).1, u64::from(VM));
    s.hang_up();
    s.accept_rejoin();
    proto::vmm::send(
        s.sock(),
        &ServerMsg::Error {
            message: format!("no VM vm-{VM} here"),
        },
        &[],
    )
    .unwrap();
    assert!(s.wait_exit().success());
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_busy_server_is_asked_again() {
    if !kvm_available() {
        return;
    }
    let dir = test_dir("busy");
    let mut s = Server::launch(&dir);
    s.hang_up();
    s.accept_rejoin();
    proto::vmm::send(
        s.sock(),
        &ServerMsg::Error {
            message: proto::vmm::BUSY.into(),
        },
        &[],
    )
    .unwrap();
    s.hang_up();
    s.accept_rejoin();
    proto::vmm::send(s.sock(), &ServerMsg::Rejoined, &[]).unwrap();
    assert_eq!(s.exec(GuestOp::Identity).1, u64::from(VM));
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}
