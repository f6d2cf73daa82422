//! The VM: KVM memory slots over [`GuestRam`], the private region's initial
//! image, vCPU creation (boot or restore), and pause/resume/capture/stop.

use proto::vmm::RequestError;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VmFd};
use shared::VmState;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use super::control::{Control, Job};
use super::event::EventSink;
use super::vcpu::{self, VcpuThread};
use crate::agent;
use crate::devices::{self, Devices, Disk};
use crate::layout;
use crate::memory::{GuestRam, Reserved};
use crate::state;

/// Errors of building or driving the VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("cannot open /dev/kvm")]
    OpenKvm(#[source] kvm_ioctls::Error),
    #[error("cannot create a KVM VM")]
    CreateVm(#[source] kvm_ioctls::Error),
    #[error("cannot add KVM memory slot {slot} at {guest_phys:#x}")]
    SetMemoryRegion {
        slot: u32,
        guest_phys: u64,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("cannot create vCPU {index}")]
    CreateVcpu {
        index: usize,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("cannot set CPUID of vCPU {index}")]
    SetCpuid {
        index: usize,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("the start state has {got} vCPUs, the VM has {want}")]
    StateVcpus { want: usize, got: usize },
    #[error("cannot install the vCPU kick signal handler")]
    Signal(#[source] vmm_sys_util::errno::Error),
    #[error("cannot start a vCPU thread")]
    SpawnThread(#[source] std::io::Error),
    #[error(transparent)]
    Layout(#[from] layout::LayoutError),
    #[error(transparent)]
    Memory(#[from] crate::memory::MemoryError),
    #[error(transparent)]
    Vcpu(#[from] vcpu::VcpuError),
    #[error(transparent)]
    State(#[from] state::StateError),
    #[error(transparent)]
    DeviceState(#[from] devices::DeviceStateError),
}

/// Result alias of this module.
pub type Result<T> = std::result::Result<T, VmError>;

/// How to build the VM.
#[derive(Debug)]
pub struct MachineConfig {
    /// Number of vCPUs (at least 1).
    pub vcpus: usize,
    /// The VM id the identity port answers.
    pub vm_id: u32,
    /// The disk volume, if any.
    pub disk: Option<Disk>,
    /// Restore this state instead of booting the agent (a fork child).
    pub start_state: Option<VmState>,
}

/// A running VM.
pub struct Machine {
    ctl: Arc<Control>,
    threads: Vec<Runner>,
    mem: Arc<GuestRam>,
    disk_sectors: Option<u64>,
    _vm: VmFd,
}

/// Where a vCPU runs.
enum Runner {
    /// A thread of its own.
    Thread(JoinHandle<()>),
    /// The thread that started the machine ([`FirstVcpu`]).
    Caller {
        thread: libc::pthread_t,
        done: Arc<AtomicBool>,
    },
}

impl Runner {
    /// Kick the vCPU out of KVM_RUN.
    fn kick(&self) {
        match self {
            Runner::Thread(t) => {
                let _ = t.kill(kick_signal());
            }
            Runner::Caller { thread, done } => {
                if !done.load(Ordering::Acquire) {
                    // SAFETY: the thread runs the vCPU until `done`, and
                    // the process ends before it would end (see
                    // `FirstVcpu::run`); the signal has a handler.
                    unsafe { libc::pthread_kill(*thread, kick_signal()) };
                }
            }
        }
    }

    fn is_finished(&self) -> bool {
        match self {
            Runner::Thread(t) => t.is_finished(),
            Runner::Caller { done, .. } => done.load(Ordering::Acquire),
        }
    }
}

/// vCPU 0 of a machine whose starting thread runs it ([`Prewarmed::new`]
/// with `first_here`): that thread goes from setting the VM up straight
/// into KVM_RUN, where waking another thread took from 0.02 to 3.5 ms on
/// this kind of host.
pub struct FirstVcpu {
    vcpu: VcpuThread,
    done: Arc<AtomicBool>,
}

impl std::fmt::Debug for FirstVcpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FirstVcpu").finish_non_exhaustive()
    }
}

impl FirstVcpu {
    /// Run the vCPU on this thread (the one that started the machine)
    /// until it stops.
    pub fn run(self) {
        self.vcpu.run();
        self.done.store(true, Ordering::Release);
    }
}

/// How long a pause may take before it is reported as failed.
const PAUSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Interval between kicks of vCPUs that have not parked yet.
const KICK_INTERVAL: Duration = Duration::from_millis(2);

extern "C" fn kick_handler(_: c_int, _: *mut libc::siginfo_t, _: *mut c_void) {}

/// The signal that kicks a vCPU out of KVM_RUN.
fn kick_signal() -> c_int {
    SIGRTMIN()
}

fn install_kick_handler() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut res = Ok(());
    ONCE.call_once(|| {
        res = register_signal_handler(kick_signal(), kick_handler).map_err(VmError::Signal)
    });
    res
}

/// The part of a VM that does not depend on its guest RAM: the KVM VM, its
/// first vCPUs with CPUID set, and the private region's fixed pages (see
/// [`crate::fixed::prepare`]). A VMM builds it
/// before it connects to the server, so a pooled VMM (see the server's
/// `--vmm-pool`) has it ready when its guest RAM arrives and only maps
/// memory, loads state and starts threads on the critical path.
pub struct Prewarmed {
    kvm: Kvm,
    vm: VmFd,
    cpuid: kvm_bindings::CpuId,
    vcpus: Vec<kvm_ioctls::VcpuFd>,
    /// The host address of the private region whose KVM slot
    /// ([`PRIVATE_SLOT`]) is set already.
    private: Option<u64>,
    /// Address space for guest RAM of the expected size, with its KVM slot
    /// ([`RAM_SLOT`]) set already.
    ram: Option<Reserved>,
    /// Threads started ahead for the first vCPUs, each waiting for its
    /// vCPU (see [`Prewarmed::start_threads`]).
    threads: Vec<Waiting>,
    /// vCPU 0 runs on the thread that starts the machine.
    first_here: bool,
}

/// Give the private region at `host` its own copies of the agent's state
/// pages now. The region maps the fixed content copy-on-write from the
/// executable; loading a VM's device state writes those pages, and copying
/// them there cost ~0.015 ms of a pooled start. Every start writes them,
/// so a pooled VMM holds no more memory once started. Only a speed-up: a
/// kernel without MADV_POPULATE_WRITE copies them at the start as before.
fn own_state_pages(host: u64) {
    let at = host + (devices::STATE_START - layout::PRIV_BASE);
    // SAFETY: the state pages lie inside the private region, a live
    // read-write mapping of this process; populating writes no byte.
    let r = unsafe {
        libc::madvise(
            at as *mut c_void,
            devices::STATE_LEN,
            libc::MADV_POPULATE_WRITE,
        )
    };
    if r != 0 {
        tracing::debug!(
            "cannot populate the agent's state pages ahead: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// A thread started ahead for a vCPU, which runs it once it arrives.
struct Waiting {
    handle: JoinHandle<()>,
    give: std::sync::mpsc::SyncSender<VcpuThread>,
}

impl Waiting {
    fn spawn(index: usize) -> Result<Self> {
        let (give, take) = std::sync::mpsc::sync_channel::<VcpuThread>(1);
        let handle = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            // A Prewarmed dropped unused drops `give`: the thread ends.
            .spawn(move || {
                if let Ok(v) = take.recv() {
                    v.run();
                }
            })
            .map_err(VmError::SpawnThread)?;
        Ok(Self { handle, give })
    }
}

/// The KVM slot of the private region; guest RAM takes the slots after it.
const PRIVATE_SLOT: u32 = 0;
/// The KVM slot of the first guest RAM region.
const RAM_SLOT: u32 = PRIVATE_SLOT + 1;

impl std::fmt::Debug for Prewarmed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prewarmed")
            .field("vcpus", &self.vcpus.len())
            .finish_non_exhaustive()
    }
}

impl Prewarmed {
    /// Create the KVM VM with `vcpus` vCPUs (more are added at start if
    /// the VM needs them).
    ///
    /// The private region is made too, and its KVM slot set: setting a
    /// slot took 0.1–0.3 ms on this kind of host (KVM sets up per-page
    /// bookkeeping: 0.15 ms per 256 MiB), and at times 3–4 ms, so a pooled
    /// VMM does it before it is needed.
    ///
    /// With `ram_hint`, the slot of guest RAM of that many bytes is set
    /// too, over reserved address space ([`Reserved`]); with `ram_file`
    /// (the memfd the server made ahead for this VMM), over that file,
    /// whatever its size. With
    /// `first_here`, vCPU 0 will run on the thread that starts the machine
    /// ([`Machine::start`] returns it as a [`FirstVcpu`]). With `pooled`,
    /// vCPU 0 is also run once ahead ([`Self::warm_up_first_vcpu`]).
    pub fn new(
        vcpus: usize,
        ram_hint: Option<u64>,
        ram_file: Option<&std::fs::File>,
        first_here: bool,
        pooled: bool,
    ) -> Result<Self> {
        crate::fixed::prepare();
        let mut pre = Self::without_region(vcpus, first_here)?;
        if let Some(host) = crate::fixed::prepared_addr() {
            // SAFETY: the prepared region is PRIV_SIZE bytes mapped for the
            // life of the process: `fixed` keeps it until guest memory
            // takes it, and guest memory lives as long as the VM.
            unsafe {
                set_slot(
                    &pre.vm,
                    PRIVATE_SLOT,
                    layout::PRIV_BASE,
                    layout::PRIV_SIZE,
                    host,
                )
            }?;
            pre.private = Some(host);
            if pooled {
                own_state_pages(host);
                pre.warm_up_first_vcpu();
            }
        }
        let reserved = match (ram_file, ram_hint.filter(|s| *s > 0)) {
            (Some(file), _) => Some(Reserved::with_file(file)),
            (None, Some(size)) => Some(Reserved::new(size)),
            (None, None) => None,
        };
        match reserved {
            Some(Ok(r)) => {
                // SAFETY: the reservation is never unmapped while a slot
                // covers it (see `Machine::start`).
                unsafe { set_slot(&pre.vm, RAM_SLOT, 0, r.size, r.host) }?;
                pre.ram = Some(r);
            }
            Some(Err(e)) => tracing::warn!("cannot reserve address space for guest RAM: {e}"),
            None => {}
        }
        pre.start_threads()?;
        Ok(pre)
    }

    /// Run vCPU 0 once, to its first exit, on the agent's `hlt` in the
    /// private region. A vCPU's first KVM_RUN here costs 0.13–0.2 ms
    /// beyond the guest code it runs (KVM builds the vCPU's MMU state and
    /// maps the pages the guest touches), and a pooled VMM pays that before
    /// its Welcome instead of on the start's path: the first run of a fork
    /// child went from 0.17–0.22 ms to 0.05–0.1 ms. A VMM launched for a
    /// VM does not: for it the warm-up is only one more step in line, and
    /// cold starts measured ~1 ms slower with it. Whatever the VM then
    /// is, its start sets every register again, and the `hlt` (with no
    /// in-kernel irqchip, an exit to this process) leaves nothing pending
    /// in the vCPU, unlike an exit on I/O, which KVM completes at the next
    /// run. Only a speed-up: a failure is logged and changes nothing else.
    fn warm_up_first_vcpu(&mut self) {
        let Some(fd) = self.vcpus.first_mut() else {
            return;
        };
        let warmed = vcpu::setup_long_mode(fd, agent::PARK)
            .map_err(|e| shared::error_chain(&e))
            .and_then(|()| fd.run().map_err(|e| e.to_string()))
            .and_then(|exit| match exit {
                kvm_ioctls::VcpuExit::Hlt => Ok(()),
                other => Err(format!("unexpected exit {other:?}")),
            });
        if let Err(e) = warmed {
            tracing::warn!("cannot warm up vCPU 0 (it starts cold): {e}");
        }
    }

    /// The address space reserved for guest RAM, if any.
    pub fn ram(&self) -> Option<Reserved> {
        self.ram
    }

    /// Start a thread now for each vCPU the starting thread will not run,
    /// waiting for its vCPU: creating threads is then off the start's
    /// path (a new thread took 0.1–0.2 ms to first run here, at times
    /// 3–4 ms).
    fn start_threads(&mut self) -> Result<()> {
        let first = usize::from(self.first_here);
        while first + self.threads.len() < self.vcpus.len() {
            self.threads
                .push(Waiting::spawn(first + self.threads.len())?);
        }
        Ok(())
    }

    /// The KVM VM and its vCPUs, with no memory slot set.
    fn without_region(vcpus: usize, first_here: bool) -> Result<Self> {
        install_kick_handler()?;
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        let vm = kvm.create_vm().map_err(VmError::CreateVm)?;
        let cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(VmError::OpenKvm)?;
        let mut pre = Prewarmed {
            kvm,
            vm,
            cpuid,
            vcpus: Vec::with_capacity(vcpus),
            private: None,
            ram: None,
            threads: Vec::new(),
            first_here,
        };
        pre.add_vcpus(vcpus)?;
        Ok(pre)
    }

    /// Create vCPUs until there are `want`.
    fn add_vcpus(&mut self, want: usize) -> Result<()> {
        for index in self.vcpus.len()..want {
            let fd = self
                .vm
                .create_vcpu(index as u64)
                .map_err(|source| VmError::CreateVcpu { index, source })?;
            fd.set_cpuid2(&self.cpuid)
                .map_err(|source| VmError::SetCpuid { index, source })?;
            self.vcpus.push(fd);
        }
        Ok(())
    }
}

impl Machine {
    /// Build the VM over `mem` on `pre` and start its vCPU threads.
    ///
    /// With a [`Prewarmed`] made for it (`first_here`), vCPU 0 is
    /// returned for the caller to run on this thread
    /// ([`FirstVcpu::run`]).
    pub fn start(
        mut pre: Prewarmed,
        mem: Arc<GuestRam>,
        cfg: MachineConfig,
        events: EventSink,
    ) -> Result<(Self, Option<FirstVcpu>)> {
        if pre.vcpus.len() > cfg.vcpus {
            // KVM cannot remove a vCPU; a VM with fewer starts afresh (its
            // private region is already in `mem`).
            let fresh = Prewarmed::without_region(cfg.vcpus, pre.first_here)?;
            let old = std::mem::replace(&mut pre, fresh);
            if let Some(r) = old.ram.filter(|r| !mem.uses(r)) {
                drop(old); // The VM and its slots go first.
                           // SAFETY: the VM whose slot covered it is gone, and guest
                           // RAM was not mapped in it.
                unsafe { r.release() };
            }
        }
        pre.add_vcpus(cfg.vcpus)?;
        let Prewarmed {
            kvm: _kvm,
            vm,
            cpuid: _,
            vcpus: vcpu_fds,
            private,
            ram,
            threads: waiting,
            first_here,
        } = pre;
        if let Some(r) = ram.filter(|r| !mem.uses(r)) {
            // Guest RAM of another size: its slot goes, and the slot loop
            // below sets the right one.
            tracing::info!(
                "the KVM slot prepared for {} MiB of guest RAM is not used: this VM has {} MiB",
                r.size >> 20,
                mem.ram_end() >> 20
            );
            // SAFETY: a zero-sized slot maps nothing.
            unsafe { set_slot(&vm, RAM_SLOT, 0, 0, r.host) }?;
            // SAFETY: no slot covers the reservation now, and guest RAM
            // was not mapped in it.
            unsafe { r.release() };
        }
        let mut ram_slots = RAM_SLOT..;
        for (guest_phys, size, host) in mem.slots() {
            let slot = if guest_phys == layout::PRIV_BASE {
                match private {
                    Some(p) if p == host => continue, // Set before the Welcome.
                    // Memory built with another region (standalone mode
                    // rebuilds a VM over the same memory): a slot cannot
                    // move, so it goes first.
                    // SAFETY: a zero-sized slot maps nothing.
                    Some(p) => unsafe { set_slot(&vm, PRIVATE_SLOT, guest_phys, 0, p) }?,
                    None => {}
                }
                PRIVATE_SLOT
            } else {
                let slot = ram_slots.next().unwrap_or(u32::MAX);
                if slot == RAM_SLOT && ram.is_some_and(|r| mem.uses(&r)) {
                    continue; // Set before the Welcome, over this mapping.
                }
                slot
            };
            // SAFETY: `host..host+size` is a live mapping owned by `mem`,
            // which this Machine keeps alive (Arc) at least as long as the VM.
            unsafe { set_slot(&vm, slot, guest_phys, size, host) }?;
        }

        if let Some(s) = &cfg.start_state {
            if s.vcpus.len() != cfg.vcpus {
                return Err(VmError::StateVcpus {
                    want: cfg.vcpus,
                    got: s.vcpus.len(),
                });
            }
            devices::restore(&mem, &s.devices)?;
        }

        let ctl = Arc::new(Control::new(cfg.vcpus));
        let disk_sectors = cfg.disk.as_ref().map(Disk::sectors);
        let mut devices = Some(Devices::new(cfg.vm_id, cfg.disk));
        let mut vcpus = Vec::with_capacity(cfg.vcpus);
        for (index, fd) in vcpu_fds.into_iter().enumerate() {
            match &cfg.start_state {
                Some(s) => state::restore(&fd, &s.vcpus[index])?,
                None => vcpu::setup_long_mode(&fd, entry_of(index))?,
            }
            vcpus.push(VcpuThread {
                index,
                fd,
                ctl: ctl.clone(),
                mem: mem.clone(),
                devices: if index == 0 { devices.take() } else { None },
                events: events.clone(),
            });
        }
        let mut threads = Vec::with_capacity(vcpus.len());
        let mut waiting = waiting.into_iter();
        let mut first = None;
        for v in vcpus {
            if first_here && v.index == 0 {
                let done = Arc::new(AtomicBool::new(false));
                threads.push(Runner::Caller {
                    // SAFETY: pthread_self has no preconditions.
                    thread: unsafe { libc::pthread_self() },
                    done: done.clone(),
                });
                first = Some(FirstVcpu { vcpu: v, done });
                continue;
            }
            let w = match waiting.next() {
                Some(w) => w,
                None => Waiting::spawn(v.index)?,
            };
            // The thread waits in `recv` until its end is dropped.
            w.give.send(v).map_err(|_| {
                VmError::SpawnThread(std::io::Error::other("a vCPU thread ended early"))
            })?;
            threads.push(Runner::Thread(w.handle));
        }
        let machine = Machine {
            ctl,
            threads,
            mem,
            disk_sectors,
            _vm: vm,
        };
        Ok((machine, first))
    }

    /// Guest memory.
    pub fn memory(&self) -> &Arc<GuestRam> {
        &self.mem
    }

    /// Sectors of the attached disk, if any.
    pub fn disk_sectors(&self) -> Option<u64> {
        self.disk_sectors
    }

    /// Queue a command for the agent.
    pub fn queue(&self, job: Job) {
        self.ctl.update(|s| s.queue.push_back(job));
    }

    /// Stop every vCPU at a consistent point; returns once all are parked.
    pub fn pause(&self) -> std::result::Result<(), RequestError> {
        self.ctl.update(|s| s.pause = true);
        let deadline = Instant::now() + PAUSE_TIMEOUT;
        let mut s = self.ctl.lock();
        loop {
            if s.paused.iter().all(Option::is_some) {
                return Ok(());
            }
            if self.threads.iter().any(Runner::is_finished) {
                return Err(RequestError::VcpuGone);
            }
            if Instant::now() > deadline {
                return Err(RequestError::PauseTimeout {
                    ms: u64::try_from(PAUSE_TIMEOUT.as_millis()).unwrap_or(u64::MAX),
                });
            }
            for (t, p) in self.threads.iter().zip(&s.paused) {
                if p.is_none() {
                    // A kick that lands outside KVM_RUN is lost; the next
                    // one, KICK_INTERVAL later, catches it.
                    t.kick();
                }
            }
            s = self.ctl.wait_timeout(s, KICK_INTERVAL);
        }
    }

    /// Whether every vCPU is parked by a pause.
    pub fn is_paused(&self) -> bool {
        let s = self.ctl.lock();
        s.pause && s.paused.iter().all(Option::is_some)
    }

    /// Let paused vCPUs run again.
    pub fn resume(&self) {
        self.ctl.update(|s| s.pause = false);
    }

    /// The paused VM's state.
    pub fn capture(&self) -> std::result::Result<VmState, RequestError> {
        let s = self.ctl.lock();
        if !s.pause || s.paused.iter().any(Option::is_none) {
            return Err(RequestError::NotPaused);
        }
        let vcpus = s.paused.iter().flatten().cloned().collect();
        let devices = devices::save(&self.mem).map_err(|e| RequestError::Memory(e.to_string()))?;
        Ok(VmState { vcpus, devices })
    }

    /// Load `state` into the paused VM: devices now, each vCPU when it
    /// resumes (a rollback in place).
    pub fn restore(&self, state: &VmState) -> std::result::Result<(), RequestError> {
        let mut s = self.ctl.lock();
        if !s.pause || s.paused.iter().any(Option::is_none) {
            return Err(RequestError::NotPaused);
        }
        if state.vcpus.len() != s.load.len() {
            return Err(RequestError::InvalidOp(format!(
                "the state has {} vCPUs, this VM {}",
                state.vcpus.len(),
                s.load.len()
            )));
        }
        devices::restore(&self.mem, &state.devices)
            .map_err(|e| RequestError::Memory(e.to_string()))?;
        for (slot, v) in s.load.iter_mut().zip(&state.vcpus) {
            *slot = Some(v.clone());
        }
        Ok(())
    }

    /// Stop the vCPU threads and wait for them.
    pub fn shutdown(self) {
        self.ctl.update(|s| s.stop = true);
        for t in &self.threads {
            while !t.is_finished() {
                t.kick();
                std::thread::sleep(KICK_INTERVAL);
            }
        }
        for t in self.threads {
            if let Runner::Thread(t) = t {
                let _ = t.join();
            }
        }
    }
}

/// Set KVM memory slot `slot` to `size` bytes of guest memory at
/// `guest_phys`, backed by the host mapping at `host`.
///
/// # Safety
/// `host..host + size` must stay mapped as long as the VM lives.
unsafe fn set_slot(vm: &VmFd, slot: u32, guest_phys: u64, size: u64, host: u64) -> Result<()> {
    let region = kvm_userspace_memory_region {
        slot,
        flags: 0,
        guest_phys_addr: guest_phys,
        memory_size: size,
        userspace_addr: host,
    };
    // SAFETY: the caller keeps the mapping alive as long as the VM.
    unsafe { vm.set_user_memory_region(region) }.map_err(|source| VmError::SetMemoryRegion {
        slot,
        guest_phys,
        source,
    })
}

fn entry_of(index: usize) -> u64 {
    if index == 0 {
        agent::ENTRY
    } else {
        agent::PARK
    }
}
