//! Server mode: the handshake of [`proto::vmm`], then serving requests.
//!
//! ```text
//!  control thread: recv Request ──▶ Dispatcher ──▶ Pause/Resume/Capture: reply now
//!                                              └─▶ Exec: queued; the vCPU or digest
//!                                                  thread replies when done
//! ```
//! The control thread never waits for an op, so a Pause can arrive in the
//! middle of a long fill.
//!
//! The VMM outlives its server: the server's keeper holds on to the
//! socket, guest RAM and the userfaultfd when the server dies or hands
//! over to a new version. When the server hangs up, the control thread
//! rejoins the next one ([`Connection::rejoin`]) while the vCPUs wait on
//! their next fault for it to serve; requests in flight are lost with the
//! old server. Only when nobody holds the socket any more, the new server
//! does not know the VM, or none takes it back within [`REJOIN_WAIT`],
//! does the VMM exit.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::frame::FrameError;
use proto::vmm::{ServerMsg, VmmMsg};
use shared::VmId;

use crate::connection::{Connection, ConnectionError};
use crate::devices::Disk;
use crate::error::{Error, Result};
use crate::kvm::{FirstVcpu, Machine, MachineConfig, Prewarmed, VcpuEvent};
use crate::memory::{GuestRam, RamMapping};
use crate::ops::{Dispatcher, Flow};
use crate::uffd;
use crate::uffd::RamControl;

/// Tell the server why we exit (best effort), then exit.
fn exit_with(conn: &Connection, code: i32, reason: String) -> ! {
    let _ = conn.send(&VmmMsg::Exited { code, reason }, &[]);
    exit_now(code)
}

/// How long a VMM whose server hung up tries to rejoin the next one.
const REJOIN_WAIT: Duration = Duration::from_secs(120);

/// How long it waits between attempts that failed for a passing reason.
const REJOIN_RETRY: Duration = Duration::from_millis(100);

/// End the process at once. The VMM's only exits go through here: they
/// come from the control thread (stopped, or the server hung up and no
/// server took the VMM back) or from a vCPU thread that hit a fatal error,
/// while other threads may sit in KVM_RUN or on a fault; unwinding those
/// would only delay the moment the server sees the VMM gone. Guest memory
/// belongs to the server and the disk is written through, so nothing is
/// lost.
#[allow(clippy::exit)]
fn exit_now(code: i32) -> ! {
    std::process::exit(code)
}

/// Hand the heap's free pages back to the kernel. Set-up (argument
/// parsing, the log filter, assembling the agent, the private image)
/// allocates and frees several hundred KiB that would otherwise stay
/// resident in every VMM for its whole life; a host running a thousand
/// VMs pays that a thousand times.
fn release_free_heap() {
    // SAFETY: malloc_trim only returns free memory of the allocator's own
    // arenas to the kernel; it touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Run in server mode until stopped or the server hangs up.
pub fn run(
    socket: &Path,
    token: &str,
    ram_hint_mib: Option<u64>,
    ram_fd: Option<i32>,
) -> Result<()> {
    // No parent-death signal: the server owns this VM's memory, but when
    // it dies (even by SIGKILL) its keeper holds on to the memory and the
    // uffd, and this process rejoins the next server (see `serve`). A VMM
    // not yet welcomed exits when its connection closes.
    // Everything that does not depend on guest RAM is made before saying
    // hello: a VMM the server keeps in its pool waits here ready, and the
    // Welcome finds only memory to map and state to load.
    // Only a pooled VMM is given a RAM hint (0 for none).
    let pooled = ram_hint_mib.is_some();
    let ram_hint = ram_hint_mib.filter(|m| *m > 0).map(|m| m << 20);
    let ram_file = ram_fd.map(take_inherited_fd).transpose()?;
    let pre = Prewarmed::new(1, ram_hint, ram_file.as_ref(), true, pooled)?;
    // Mapped: the file itself is not needed any more.
    drop(ram_file);
    let mut guest_uffd = uffd::create()?;
    // Guest RAM mapped ahead is registered now too, off the start's path
    // (UFFDIO_REGISTER of 256 MiB took ~0.02 ms here). Nothing touches
    // guest RAM before the server holds the uffd: the vCPU's warm-up run
    // above stays in the private region.
    if let Some(r) = pre.ram().filter(|r| r.file.is_some()) {
        let len = usize::try_from(r.size).unwrap_or(usize::MAX);
        if let Err(e) = guest_uffd.register_ahead(r.host as *mut u8, len) {
            tracing::debug!(error = %shared::error_chain(&e), "guest RAM is registered at the Welcome instead");
        }
    }
    let control = Control::spawn(socket.to_owned())?;
    release_free_heap();
    let (conn, welcome) = Connection::connect(socket, token)?;
    let conn = Arc::new(conn);
    let vm_id = welcome.vm_id;
    let config = welcome.config;
    let first = match setup(
        &conn,
        vm_id.0,
        config,
        welcome.fds,
        pre,
        &guest_uffd,
        control,
    ) {
        Ok(first) => first,
        Err(e) => exit_with(&conn, 1, shared::error_chain(&e)),
    };
    // This thread goes straight into KVM_RUN as vCPU 0. It returns only
    // when the vCPU stops, and the control thread ends the process then
    // (a fatal vCPU error ends it at once).
    first.run();
    loop {
        std::thread::park();
    }
}

/// Take the fd `fd` this process was started with (the guest RAM the
/// server made ahead for a pooled VMM), closed on exec from now on. The
/// server passes it as stdin, which is then pointed at /dev/null again.
fn take_inherited_fd(fd: i32) -> Result<File> {
    use nix::fcntl::{fcntl, FcntlArg};
    // A copy above stdio, closed on exec; the original goes.
    let own = fcntl(fd, FcntlArg::F_DUPFD_CLOEXEC(3)).map_err(|_| Error::RamFd(fd))?;
    // SAFETY: `own` was just made by F_DUPFD_CLOEXEC for this process
    // alone; nothing else owns it.
    let file = File::from(unsafe { std::os::fd::OwnedFd::from_raw_fd(own) });
    let null = File::open("/dev/null").map_err(|_| Error::RamFd(fd))?;
    // SAFETY: dup2 onto `fd` closes the original, which nothing else
    // here uses (it was only ever the memfd's copy).
    unsafe {
        libc::dup2(null.as_raw_fd(), fd);
    }
    Ok(file)
}

/// The control thread, started before the Welcome: it serves the server's
/// requests once it has the machine.
struct Control(std::sync::mpsc::SyncSender<ControlStart>);

/// What the control thread serves: the VM's connection and id, its
/// machine, and its guest RAM's controls.
type ControlStart = (Arc<Connection>, VmId, Machine, Option<RamControl>);

impl Control {
    /// `socket`: the server socket, to rejoin a new server on.
    fn spawn(socket: std::path::PathBuf) -> Result<Self> {
        let (give, take) = std::sync::mpsc::sync_channel::<ControlStart>(1);
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                // Without a machine (the set-up failed), the process is on
                // its way out already.
                if let Ok((conn, vm, machine, ram_control)) = take.recv() {
                    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        control(&conn, &socket, vm, machine, ram_control)
                    }));
                    match served {
                        Ok(Ok(())) => exit_now(0),
                        Ok(Err(e)) => exit_with(&conn, 1, shared::error_chain(&e)),
                        Err(_) => exit_with(&conn, 1, "the control thread panicked".into()),
                    }
                }
            })
            .map_err(Error::SpawnControl)?;
        Ok(Self(give))
    }
}

/// Serve requests for VM `vm`'s `machine` over `conn` until stopped,
/// rejoining a new server on `socket` if this one hangs up.
fn control(
    conn: &Arc<Connection>,
    socket: &Path,
    vm: VmId,
    machine: Machine,
    ram_control: Option<RamControl>,
) -> Result<()> {
    let mut dispatcher = Dispatcher::new(machine);
    if let Some(c) = ram_control {
        dispatcher = dispatcher.with_ram_control(c);
    }
    release_free_heap();
    serve(conn, &dispatcher, socket, vm)
}

/// Map guest RAM, hand the userfaultfd to the server and start the
/// machine; the control thread gets it, and vCPU 0 is returned to run on
/// this thread.
fn setup(
    conn: &Arc<Connection>,
    vm_id: u32,
    config: proto::vmm::LaunchConfig,
    mut fds: Vec<std::os::fd::OwnedFd>,
    pre: Prewarmed,
    guest_uffd: &uffd::GuestUffd,
    control: Control,
) -> Result<FirstVcpu> {
    let want = config.regions.len() + usize::from(config.disk_bytes.is_some());
    if fds.len() != want {
        return Err(Error::FdCount {
            want,
            got: fds.len(),
        });
    }
    let disk = match config.disk_bytes {
        Some(bytes) => fds.pop().map(|fd| Disk {
            file: File::from(fd),
            bytes,
        }),
        None => None,
    };
    let kind = config.memory;
    let mem = Arc::new(GuestRam::from_memfds(
        &config.regions,
        fds,
        pre.ram(),
        kind,
    )?);
    for (addr, len) in mem.ram_host_ranges() {
        // The mapping made ahead and registered before the hello is the
        // one guest RAM uses; any other mapping is new and unregistered.
        let ahead = mem.mapping == RamMapping::Ahead && guest_uffd.registered_ahead(addr, len);
        if !ahead {
            guest_uffd.register(addr, len, kind)?;
        }
    }
    // Without it, a rollback punches its pages out of the memfd instead,
    // and the VM cannot be rebased.
    let ram_control = match guest_uffd.control(mem.ram_host_ranges(), kind) {
        Ok(c) => Some(c),
        Err(e) => {
            tracing::warn!(error = %e, "no discard or rebase for this VM");
            None
        }
    };
    let bases = mem
        .ram_host_ranges()
        .iter()
        .map(|(a, _)| *a as u64)
        .collect();
    if let Some(pid) = crate::anchor::report() {
        conn.send(&VmmMsg::Anchor { pid }, &[])?;
    }
    conn.send(&VmmMsg::UffdReady { bases }, &[guest_uffd.uffd.as_raw_fd()])?;

    let events_conn = conn.clone();
    let announced = Arc::new(AtomicBool::new(false));
    let (regions, vcpus, ram) = (config.regions.len(), config.vcpus, mem.mapping);
    let features = guest_uffd.features;
    let events = Arc::new(move |e| match e {
        VcpuEvent::Ready => {
            if !announced.swap(true, Ordering::SeqCst) {
                if let Err(e) = events_conn.send(&VmmMsg::Running, &[]) {
                    tracing::error!(error = %shared::error_chain(&e), "cannot report Running");
                }
                // Logged only now: writing a log line takes 0.02-0.04 ms,
                // which at the Welcome was on the start's path.
                tracing::info!(
                    vm_id,
                    regions,
                    vcpus,
                    ?ram,
                    uffd_features = format_args!("{features:#x}"),
                    "welcomed by the server; running"
                );
            }
        }
        VcpuEvent::Fatal(reason) => exit_with(&events_conn, 1, reason),
    });
    let cfg = MachineConfig {
        vcpus: usize::from(config.vcpus.max(1)),
        vm_id,
        disk,
        start_state: config.start_state,
    };
    let (machine, first) = Machine::start(pre, mem, cfg, events)?;
    let first = first.ok_or_else(|| Error::Guest("vCPU 0 has a thread of its own".into()))?;
    control
        .0
        .send((conn.clone(), VmId(vm_id), machine, ram_control))
        .map_err(|_| Error::SpawnControl(std::io::Error::other("the control thread is gone")))?;
    Ok(first)
}

/// Serve the server's requests for VM `vm` until stopped; when the server
/// hangs up, rejoin the next one on `socket` and go on.
fn serve(conn: &Arc<Connection>, dispatcher: &Dispatcher, socket: &Path, vm: VmId) -> Result<()> {
    loop {
        let (msg, fds) = match conn.recv() {
            Ok(m) => m,
            Err(ConnectionError::Recv(e)) if hung_up(&e) => {
                tracing::info!(error = %shared::error_chain(&e), "the server hung up; rejoining");
                rejoin_or_exit(conn, socket, vm);
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        match msg {
            ServerMsg::Request { seq, request } => {
                tracing::debug!(seq, ?request, "request");
                let c = conn.clone();
                // The answer goes to the server that asked, or nowhere.
                let asked = conn.generation();
                let flow = dispatcher.handle(
                    request,
                    fds,
                    Box::new(move |result| {
                        match c.send_on(asked, &VmmMsg::Reply { seq, result }, &[]) {
                            Ok(()) => {}
                            Err(ConnectionError::Superseded) => {
                                tracing::info!(seq, "the server that asked is gone; answer dropped");
                            }
                            Err(e) => {
                                tracing::error!(seq, error = %shared::error_chain(&e), "cannot send a reply");
                            }
                        }
                    }),
                );
                if flow == Flow::Stop {
                    tracing::info!("stopped by the server");
                    exit_now(0);
                }
            }
            ServerMsg::Error { message } => return Err(ConnectionError::Refused(message).into()),
            ServerMsg::Welcome { .. } => {
                return Err(ConnectionError::Unexpected {
                    expected: "Request",
                    got: "a second Welcome".into(),
                }
                .into())
            }
            ServerMsg::Rejoined => {
                return Err(ConnectionError::Unexpected {
                    expected: "Request",
                    got: "Rejoined, without a rejoin".into(),
                }
                .into())
            }
        }
    }
}

/// Whether a receive failed because the server went: it closed the
/// connection, even in the middle of a frame, or died with messages of
/// this VMM unread (which the kernel reports as a reset).
fn hung_up(e: &FrameError) -> bool {
    matches!(
        e,
        FrameError::Closed
            | FrameError::Truncated
            | FrameError::Recv(nix::errno::Errno::ECONNRESET)
    )
}

/// The server hung up on VM `vm`'s VMM: rejoin the next server on
/// `socket`, trying again every [`REJOIN_RETRY`] while the failures may
/// pass, for up to [`REJOIN_WAIT`]. Exits if no server takes the VMM back.
/// The vCPUs run on meanwhile (they wait on their next fault until a
/// server serves it); replies sent meanwhile fail.
fn rejoin_or_exit(conn: &Connection, socket: &Path, vm: VmId) {
    let start = Instant::now();
    let deadline = start + REJOIN_WAIT;
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let e = match conn.rejoin(socket, vm, deadline) {
            Ok(()) => {
                tracing::info!(
                    attempts,
                    after_ms = start.elapsed().as_millis(),
                    "rejoined the server"
                );
                if let Some(pid) = crate::anchor::pid() {
                    if let Err(e) = conn.send(&VmmMsg::Anchor { pid }, &[]) {
                        tracing::warn!(error = %shared::error_chain(&e), "cannot report the anchor");
                    }
                }
                return;
            }
            Err(e) => e,
        };
        if e.is_definitive() {
            tracing::warn!(error = %shared::error_chain(&e), "cannot rejoin a server; exiting");
            crate::anchor::end();
            exit_now(0);
        }
        if Instant::now() + REJOIN_RETRY >= deadline {
            tracing::warn!(
                attempts,
                error = %shared::error_chain(&e),
                "no server took this VMM back within {} s; exiting",
                REJOIN_WAIT.as_secs()
            );
            crate::anchor::end();
            exit_now(0);
        }
        if attempts == 1 {
            tracing::info!(error = %shared::error_chain(&e), "cannot rejoin yet; trying again");
        } else {
            tracing::debug!(attempts, error = %shared::error_chain(&e), "cannot rejoin yet");
        }
        std::thread::sleep(REJOIN_RETRY);
    }
}
