//! Guest ops and server requests: validation, encoding into agent jobs,
//! the VMM-side digest, and the dispatcher both modes share.
//!
//! Nothing here blocks behind a running op: agent ops are queued for vCPU 0
//! and digests run on a worker thread; each answers through its callback.

use std::sync::mpsc;
use std::time::Instant;

use proto::vmm::{Reply, Request, RequestError};
use shared::pattern::MAX_SECTORS_PER_IO;
use shared::{GuestOp, OpResult};

use crate::agent::opcode;
use crate::kvm::{Job, Machine};
use crate::memory::GuestRam;

/// Callback that receives a request's answer.
pub type ReplyFn = Box<dyn FnOnce(Result<Reply, RequestError>) + Send>;

/// Whether the caller should keep serving requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

type HostJob = (u64, u64, Instant, ReplyFn);

/// Dispatches server requests to the VM.
pub struct Dispatcher {
    machine: Machine,
    /// The digest worker's queue, made with the worker at the first
    /// digest: most VMs never ask for one, and a thread started with the
    /// machine competed with vCPU 0's first run for the host's CPUs and
    /// kept its own pages in every VMM.
    digests: std::sync::Mutex<Option<mpsc::Sender<HostJob>>>,
    /// Serves `Request::Discard` and `Request::Rebase` (server mode only).
    ram_control: Option<crate::uffd::RamControl>,
}

fn elapsed_us(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX)
}

fn digest_worker(mem: std::sync::Arc<GuestRam>, rx: mpsc::Receiver<HostJob>) {
    for (start_page, pages, t0, reply) in rx {
        let r = mem
            .digest(start_page, pages)
            .map_err(|e| RequestError::Memory(shared::error_chain(&e)));
        reply(r.map(|value| {
            Reply::Op(OpResult {
                value,
                elapsed_us: elapsed_us(t0),
            })
        }));
    }
}

/// Check an op against the VM before running it.
pub fn validate(
    mem: &GuestRam,
    disk_sectors: Option<u64>,
    op: &GuestOp,
) -> Result<(), RequestError> {
    if let Some((start, pages)) = op.page_range() {
        mem.check_pages(start, pages)?;
    }
    if let Some(per_io) = op.sectors_per_io() {
        if !(1..=MAX_SECTORS_PER_IO).contains(&per_io) {
            return Err(RequestError::InvalidOp(format!(
                "sectors_per_io is {per_io}; use 1 to {MAX_SECTORS_PER_IO}"
            )));
        }
    }
    if let Some((sector, count)) = op.sector_range() {
        let total =
            disk_sectors.ok_or_else(|| RequestError::InvalidOp("the VM has no disk".into()))?;
        if sector.checked_add(count).is_none_or(|end| end > total) {
            return Err(RequestError::InvalidOp(format!(
                "sectors {sector}..{} are past the end of the disk ({total} sectors)",
                sector.saturating_add(count)
            )));
        }
    }
    Ok(())
}

/// The agent op code and mailbox arguments of an op run by the guest.
pub fn encode(op: &GuestOp) -> Option<(u32, [u64; 4])> {
    let per_io = op.sectors_per_io().unwrap_or(0);
    Some(match *op {
        GuestOp::Fill {
            start_page,
            pages,
            seed,
        } => (opcode::FILL, [start_page, pages, seed, 0]),
        GuestOp::Touch {
            start_page,
            pages,
            write,
        } => (opcode::TOUCH, [start_page, pages, u64::from(write), 0]),
        GuestOp::Checksum { start_page, pages } => (opcode::CHECKSUM, [start_page, pages, 0, 0]),
        GuestOp::Verify {
            start_page,
            pages,
            seed,
        } => (opcode::VERIFY, [start_page, pages, seed, 0]),
        GuestOp::Identity => (opcode::IDENTITY, [0; 4]),
        GuestOp::DiskFill {
            sector,
            count,
            seed,
            ..
        } => (opcode::DISK_FILL, [sector, count, seed, per_io]),
        GuestOp::DiskChecksum { sector, count, .. } => {
            (opcode::DISK_CHECKSUM, [sector, count, 0, per_io])
        }
        GuestOp::DiskWritePages {
            start_page,
            pages,
            sector,
            ..
        } => (
            opcode::DISK_WRITE_PAGES,
            [
                sector,
                pages * (shared::PAGE_SIZE / shared::pattern::SECTOR_SIZE),
                start_page << shared::PAGE_SHIFT,
                per_io,
            ],
        ),
        GuestOp::Digest { .. } => return None,
    })
}

impl Dispatcher {
    /// Dispatcher over a started VM.
    pub fn new(machine: Machine) -> Self {
        Dispatcher {
            machine,
            digests: std::sync::Mutex::new(None),
            ram_control: None,
        }
    }

    /// The digest worker's queue; the worker starts on first use.
    fn digest_queue(&self) -> Option<mpsc::Sender<HostJob>> {
        let mut queue = self.digests.lock().unwrap_or_else(|e| e.into_inner());
        if queue.is_none() {
            let (tx, rx) = mpsc::channel();
            let mem = self.machine.memory().clone();
            match std::thread::Builder::new()
                .name("digest".into())
                .spawn(move || digest_worker(mem, rx))
            {
                Ok(_) => *queue = Some(tx),
                Err(e) => tracing::error!(error = %e, "cannot start the digest worker thread"),
            }
        }
        queue.clone()
    }

    /// Run one op; `reply` gets its result.
    pub fn exec(&self, op: GuestOp, reply: ReplyFn) {
        let t0 = Instant::now();
        if let Err(e) = validate(self.machine.memory(), self.machine.disk_sectors(), &op) {
            return reply(Err(e));
        }
        match (op, encode(&op)) {
            (GuestOp::Digest { start_page, pages }, _) => match self.digest_queue() {
                Some(queue) => {
                    if let Err(mpsc::SendError((_, _, _, reply))) =
                        queue.send((start_page, pages, t0, reply))
                    {
                        reply(Err(RequestError::WorkerGone("digest".into())));
                    }
                }
                None => reply(Err(RequestError::WorkerGone("digest".into()))),
            },
            (_, Some((opcode, args))) => self.machine.queue(Job {
                opcode,
                args,
                reply: Box::new(move |r| {
                    reply(r.map(|value| {
                        Reply::Op(OpResult {
                            value,
                            elapsed_us: elapsed_us(t0),
                        })
                    }))
                }),
            }),
            (_, None) => reply(Err(RequestError::Unsupported(op.name().into()))),
        }
    }

    /// Serve `Request::Discard` and `Request::Rebase` with `control`.
    pub fn with_ram_control(mut self, control: crate::uffd::RamControl) -> Self {
        self.ram_control = Some(control);
        self
    }

    /// Map guest RAM of the paused VM over the bases `fds` and register it
    /// (`Request::Rebase`).
    fn rebase(&self, fds: Vec<std::os::fd::OwnedFd>) -> Result<Reply, RequestError> {
        let Some(control) = &self.ram_control else {
            return Err(RequestError::Unsupported("rebase".into()));
        };
        if !self.machine.is_paused() {
            return Err(RequestError::NotPaused);
        }
        self.machine
            .memory()
            .rebase(fds)
            .map_err(|e| RequestError::Memory(shared::error_chain(&e)))?;
        control.register_base()?;
        Ok(Reply::Done)
    }

    /// Handle one request. Pause returns once the vCPUs are parked; Exec
    /// answers later, from the vCPU or digest thread.
    pub fn handle(&self, request: Request, fds: Vec<std::os::fd::OwnedFd>, reply: ReplyFn) -> Flow {
        match request {
            Request::Pause => reply(self.machine.pause().map(|()| Reply::Done)),
            Request::Resume => {
                self.machine.resume();
                reply(Ok(Reply::Done));
            }
            Request::CaptureState => reply(self.machine.capture().map(Reply::State)),
            Request::Restore(state) => reply(self.machine.restore(&state).map(|()| Reply::Done)),
            Request::Discard(ranges) => reply(match &self.ram_control {
                Some(d) => d.discard(&ranges).map(|()| Reply::Done),
                None => Err(RequestError::Unsupported("discard".into())),
            }),
            Request::Rebase => reply(self.rebase(fds)),
            Request::Exec(op) => self.exec(op, reply),
            Request::Stop => {
                reply(Ok(Reply::Done));
                return Flow::Stop;
            }
        }
        Flow::Continue
    }

    /// Stop the VM and wait for its vCPU threads.
    pub fn shutdown(self) -> std::sync::Arc<GuestRam> {
        let mem = self.machine.memory().clone();
        self.machine.shutdown();
        mem
    }
}
