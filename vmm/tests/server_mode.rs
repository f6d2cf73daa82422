//! Runs the VMM in server mode against a minimal fake page server: the
//! handshake, the uffd it sends, guest faults served by UFFDIO_COPY, the
//! requests, a fork child restored from captured state, and a VMM mapping
//! its guest RAM private over a shared base (MINOR faults served by
//! UFFDIO_CONTINUE, its writes private, a rebase onto another base).
//!
//! Skips with a printed reason when /dev/kvm is unusable, except under
//! `CI=true`, where a missing /dev/kvm is a failure.

// Test images are small; their sizes fit usize on every test host.
#![allow(clippy::cast_possible_truncation)]

use std::ffi::c_void;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use proto::vmm::{LaunchConfig, MemoryKind, Reply, Request, ServerMsg, VmmMsg};
use shared::{pattern, GuestOp, GuestRegion, VmId, VmState, PAGE_SIZE};
use userfaultfd::{Event, FaultKind, Uffd};

mod common;
use common::kvm_available;

const PAGES: u64 = 1024;
const SEED: u64 = 3;

/// The bytes the fake server serves for page `p`.
fn source_page(p: u64) -> Vec<u8> {
    let mut page = vec![0u8; PAGE_SIZE as usize];
    pattern::fill_page(&mut page, p, SEED);
    page
}

/// Serve MISSING faults with UFFDIO_COPY until `stop`; count them.
fn serve_faults(
    uffd: Uffd,
    base: u64,
    stop: Arc<AtomicBool>,
    served: Arc<AtomicU64>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            let mut fds = [PollFd::new(uffd.as_fd(), PollFlags::POLLIN)];
            if poll(&mut fds, PollTimeout::from(50u16)).unwrap_or(0) == 0 {
                continue;
            }
            while let Ok(Some(ev)) = uffd.read_event() {
                let Event::Pagefault { kind, addr, .. } = ev else {
                    continue;
                };
                let page_addr = (addr as u64) & !(PAGE_SIZE - 1);
                if kind == FaultKind::Minor {
                    // The base holds the page: map it from there (counted
                    // first: the continue lets the guest go on).
                    served.fetch_add(1, Ordering::SeqCst);
                    let _ = uffd_abi::continue_range(&uffd, page_addr, PAGE_SIZE, 0);
                    continue;
                }
                if kind == FaultKind::WriteProtected {
                    let _ = uffd.remove_write_protection(
                        page_addr as *mut c_void,
                        PAGE_SIZE as usize,
                        true,
                    );
                    continue;
                }
                let src = source_page((page_addr - base) / PAGE_SIZE);
                // Counted before the copy: its wake lets the guest go on,
                // and the test reads the count as soon as the guest answers.
                served.fetch_add(1, Ordering::SeqCst);
                // SAFETY: `src` is a live page-sized buffer; the destination
                // is a page of the VMM's registered range (UFFDIO_COPY only
                // writes into that process's page cache, never into ours).
                let res = unsafe {
                    uffd.copy(
                        src.as_ptr().cast(),
                        page_addr as *mut c_void,
                        PAGE_SIZE as usize,
                        true,
                    )
                };
                if res.is_err() {
                    let _ = uffd.wake(page_addr as *mut c_void, PAGE_SIZE as usize);
                }
            }
        }
    })
}

struct FakeServer {
    sock: UnixStream,
    child: Child,
    seq: u64,
}

impl FakeServer {
    /// Spawn a VMM, greet it with `memfd` as its RAM, return the uffd.
    fn launch(
        dir: &std::path::Path,
        name: &str,
        memfd: &OwnedFd,
        vm_id: u32,
        start: Option<VmState>,
        memory: MemoryKind,
    ) -> (Self, Uffd, u64) {
        let path = dir.join(name);
        let listener = UnixListener::bind(&path).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_vmm"))
            .args(["--socket", path.to_str().unwrap(), "--token", "tok"])
            .spawn()
            .unwrap();
        let (sock, _) = listener.accept().unwrap();
        let (hello, _) = proto::vmm::recv::<VmmMsg>(&sock).unwrap();
        assert!(
            matches!(hello, VmmMsg::Hello { ref token, .. } if token == "tok"),
            "{hello:?}"
        );
        let config = LaunchConfig {
            regions: vec![GuestRegion {
                guest_phys: 0,
                size: PAGES * PAGE_SIZE,
            }],
            vcpus: 1,
            disk_bytes: None,
            start_state: start,
            memory,
        };
        proto::vmm::send(
            &sock,
            &ServerMsg::Welcome {
                vm_id: VmId(vm_id),
                config,
            },
            &[memfd.as_raw_fd()],
        )
        .unwrap();
        let (ready, mut fds) = proto::vmm::recv::<VmmMsg>(&sock).unwrap();
        let VmmMsg::UffdReady { bases } = ready else {
            panic!("expected UffdReady, got {ready:?}")
        };
        assert_eq!(fds.len(), 1);
        // SAFETY: the fd just arrived with the message and is owned by us.
        let uffd = unsafe { Uffd::from_raw_fd(fds.remove(0).into_raw_fd()) };
        (
            FakeServer {
                sock,
                child,
                seq: 0,
            },
            uffd,
            bases[0],
        )
    }

    fn expect_running(&self) {
        let (m, _) = proto::vmm::recv::<VmmMsg>(&self.sock).unwrap();
        assert_eq!(m, VmmMsg::Running);
    }

    fn request(&mut self, request: Request) -> Result<Reply, proto::vmm::RequestError> {
        self.request_with_fds(request, &[])
    }

    fn request_with_fds(
        &mut self,
        request: Request,
        fds: &[std::os::fd::RawFd],
    ) -> Result<Reply, proto::vmm::RequestError> {
        self.seq += 1;
        proto::vmm::send(
            &self.sock,
            &ServerMsg::Request {
                seq: self.seq,
                request,
            },
            fds,
        )
        .unwrap();
        loop {
            match proto::vmm::recv::<VmmMsg>(&self.sock).unwrap().0 {
                VmmMsg::Reply { seq, result } if seq == self.seq => return result,
                other => eprintln!("ignoring {other:?}"),
            }
        }
    }

    fn exec(&mut self, op: GuestOp) -> u64 {
        match self.request(Request::Exec(op)) {
            Ok(Reply::Op(r)) => r.value,
            other => panic!("{op:?}: {other:?}"),
        }
    }
}

#[test]
fn guest_faults_reach_the_server_and_a_fork_child_restores() {
    if !kvm_available() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("vmm-server-mode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let memfd: OwnedFd =
        nix::sys::memfd::memfd_create(c"guest-ram", nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC)
            .unwrap();
    std::fs::File::from(memfd.try_clone().unwrap())
        .set_len(PAGES * PAGE_SIZE)
        .unwrap();

    let (mut parent, uffd, base) =
        FakeServer::launch(&dir, "parent.sock", &memfd, 5, None, MemoryKind::Own);
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let faults = serve_faults(uffd, base, stop.clone(), served.clone());
    parent.expect_running();

    let mut image = Vec::new();
    for p in 0..PAGES {
        image.extend_from_slice(&source_page(p));
    }
    assert_eq!(
        parent.exec(GuestOp::Verify {
            start_page: 0,
            pages: PAGES,
            seed: SEED
        }),
        0
    );
    assert!(
        served.load(Ordering::SeqCst) >= PAGES,
        "every page was served through the uffd"
    );
    assert_eq!(
        parent.exec(GuestOp::Digest {
            start_page: 0,
            pages: PAGES
        }),
        pattern::digest(&image, 0, 0, PAGES)
    );
    assert_eq!(parent.exec(GuestOp::Identity), 5);
    assert!(
        parent.request(Request::CaptureState).is_err(),
        "capture needs a pause"
    );
    assert_eq!(
        parent.exec(GuestOp::Fill {
            start_page: 0,
            pages: PAGES,
            seed: 4
        }),
        0
    );
    assert_eq!(parent.request(Request::Pause), Ok(Reply::Done));
    let Ok(Reply::State(state)) = parent.request(Request::CaptureState) else {
        panic!("no state")
    };
    assert_eq!(parent.request(Request::Resume), Ok(Reply::Done));

    // A "fork child" over the same memfd (every page is present, so it
    // needs no faults) starts from the parent's state.
    let (mut child, _child_uffd, _) =
        FakeServer::launch(&dir, "child.sock", &memfd, 6, Some(state), MemoryKind::Own);
    child.expect_running();
    assert_eq!(
        child.exec(GuestOp::Verify {
            start_page: 0,
            pages: PAGES,
            seed: 4
        }),
        0
    );
    assert_eq!(child.exec(GuestOp::Identity), 6);
    assert_eq!(parent.exec(GuestOp::Identity), 5);

    assert_eq!(child.request(Request::Stop), Ok(Reply::Done));
    assert!(child.child.wait().unwrap().success());
    // Hang-up: the parent exits when the server goes away.
    drop(parent.sock);
    assert!(parent.child.wait().unwrap().success());
    stop.store(true, Ordering::SeqCst);
    faults.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A memfd of `PAGES` pages holding the pattern of `seed`.
fn base_memfd(name: &std::ffi::CStr, seed: u64) -> OwnedFd {
    use std::os::unix::fs::FileExt;
    let fd: OwnedFd =
        nix::sys::memfd::memfd_create(name, nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC).unwrap();
    let file = std::fs::File::from(fd.try_clone().unwrap());
    let mut image = vec![0u8; (PAGES * PAGE_SIZE) as usize];
    for p in 0..PAGES {
        let at = (p * PAGE_SIZE) as usize;
        pattern::fill_page(&mut image[at..at + PAGE_SIZE as usize], p, seed);
    }
    file.write_all_at(&image, 0).unwrap();
    fd
}

#[test]
fn a_vmm_on_a_base_maps_its_pages_from_it_and_keeps_its_writes_private() {
    use std::os::unix::fs::FileExt;
    if !kvm_available() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("vmm-base-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = base_memfd(c"base", SEED);
    let (mut vm, uffd, at) = FakeServer::launch(&dir, "vm.sock", &base, 7, None, MemoryKind::Base);
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let faults = serve_faults(uffd, at, stop.clone(), served.clone());
    vm.expect_running();

    // Every page is read from the base through MINOR faults.
    let verify = |vm: &mut FakeServer, start: u64, pages: u64, seed: u64| {
        vm.exec(GuestOp::Verify {
            start_page: start,
            pages,
            seed,
        })
    };
    assert_eq!(verify(&mut vm, 0, PAGES, SEED), 0);
    assert!(served.load(Ordering::SeqCst) >= PAGES);
    let pid = vm.child.id();
    let pagemap = uffd_abi::pagemap::Pagemap::open(pid).unwrap();
    let end = at + PAGES * PAGE_SIZE;
    assert_eq!(
        pagemap.private_runs(at, end).unwrap(),
        Vec::<(u64, u64)>::new(),
        "pages read from the base are the base's, not the VMM's own"
    );

    // Writes to the first half stay in the VMM; the base keeps its bytes.
    let half = PAGES / 2;
    assert_eq!(
        vm.exec(GuestOp::Fill {
            start_page: 0,
            pages: half,
            seed: 9
        }),
        0
    );
    assert_eq!(verify(&mut vm, 0, half, 9), 0);
    assert_eq!(verify(&mut vm, half, PAGES - half, SEED), 0);
    assert_eq!(
        pagemap.private_runs(at, end).unwrap(),
        vec![(at, half * PAGE_SIZE)],
        "exactly the pages the guest wrote are the VMM's own"
    );
    let file = std::fs::File::from(base.try_clone().unwrap());
    let mut first = vec![0u8; PAGE_SIZE as usize];
    file.read_exact_at(&mut first, 0).unwrap();
    assert_eq!(first, source_page(0), "the base keeps its bytes");

    // A rebase needs a pause, then maps the new base in place of all of it.
    let other = base_memfd(c"other", 11);
    assert_eq!(
        vm.request_with_fds(Request::Rebase, &[other.as_raw_fd()]),
        Err(proto::vmm::RequestError::NotPaused)
    );
    assert_eq!(vm.request(Request::Pause), Ok(Reply::Done));
    assert_eq!(
        vm.request_with_fds(Request::Rebase, &[other.as_raw_fd()]),
        Ok(Reply::Done)
    );
    assert_eq!(
        pagemap.private_runs(at, end).unwrap(),
        Vec::<(u64, u64)>::new(),
        "a rebase drops the VMM's own pages"
    );
    assert_eq!(vm.request(Request::Resume), Ok(Reply::Done));
    assert_eq!(verify(&mut vm, 0, PAGES, 11), 0);

    assert_eq!(vm.request(Request::Stop), Ok(Reply::Done));
    assert!(vm.child.wait().unwrap().success());
    stop.store(true, Ordering::SeqCst);
    faults.join().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
