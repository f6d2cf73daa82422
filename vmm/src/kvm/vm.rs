//! The VM: KVM memory slots over [`GuestRam`], the private region's initial
//! image, vCPU creation (boot or restore), and pause/resume/capture/stop.

use proto::vmm::RequestError;
use std::os::raw::{c_int, c_void};
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
use crate::memory::GuestRam;
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
    threads: Vec<JoinHandle<()>>,
    mem: Arc<GuestRam>,
    disk_sectors: Option<u64>,
    _vm: VmFd,
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
}

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
    pub fn new(vcpus: usize) -> Result<Self> {
        install_kick_handler()?;
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        let vm = kvm.create_vm().map_err(VmError::CreateVm)?;
        let cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(VmError::OpenKvm)?;
        crate::fixed::prepare();
        let mut pre = Prewarmed {
            kvm,
            vm,
            cpuid,
            vcpus: Vec::with_capacity(vcpus),
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
    pub fn start(
        mut pre: Prewarmed,
        mem: Arc<GuestRam>,
        cfg: MachineConfig,
        events: EventSink,
    ) -> Result<Self> {
        if pre.vcpus.len() > cfg.vcpus {
            // KVM cannot remove a vCPU; a VM with fewer starts afresh.
            pre = Prewarmed::new(cfg.vcpus)?;
        }
        pre.add_vcpus(cfg.vcpus)?;
        let Prewarmed {
            kvm: _kvm,
            vm,
            cpuid: _,
            vcpus: vcpu_fds,
        } = pre;
        for (slot, (guest_phys, size, host)) in (0u32..).zip(mem.slots()) {
            let region = kvm_userspace_memory_region {
                slot,
                flags: 0,
                guest_phys_addr: guest_phys,
                memory_size: size,
                userspace_addr: host,
            };
            // SAFETY: `host..host+size` is a live mapping owned by `mem`,
            // which this Machine keeps alive (Arc) at least as long as the VM.
            unsafe { vm.set_user_memory_region(region) }.map_err(|source| {
                VmError::SetMemoryRegion {
                    slot,
                    guest_phys,
                    source,
                }
            })?;
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
        for v in vcpus {
            let name = format!("vcpu{}", v.index);
            threads.push(
                std::thread::Builder::new()
                    .name(name)
                    .spawn(move || v.run())
                    .map_err(VmError::SpawnThread)?,
            );
        }
        Ok(Machine {
            ctl,
            threads,
            mem,
            disk_sectors,
            _vm: vm,
        })
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
            if self.threads.iter().any(JoinHandle::is_finished) {
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
                    let _ = t.kill(kick_signal());
                }
            }
            s = self.ctl.wait_timeout(s, KICK_INTERVAL);
        }
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
                let _ = t.kill(kick_signal());
                std::thread::sleep(KICK_INTERVAL);
            }
        }
        for t in self.threads {
            let _ = t.join();
        }
    }
}

fn entry_of(index: usize) -> u64 {
    if index == 0 {
        agent::ENTRY
    } else {
        agent::PARK
    }
}
