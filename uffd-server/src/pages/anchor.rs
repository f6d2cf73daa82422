//! A VMM's anchor, as the server holds it: a process that shares the VMM's
//! address space (made by the VMM at its start, `vmm/src/anchor.rs`), by
//! whose pid the pages of a VM on a shared base stay readable after its
//! VMM is gone. The server holds each anchor by a pidfd and kills it with
//! SIGKILL when the last holder lets go ([`Drop`]): the VMM's link while
//! the VMM lives, a layer being filled from it until the layer is whole.
//!
//! A VMM names its anchor by pid; the server takes it only if the kernel
//! says that process shares the VMM's address space (`kcmp(KCMP_VM)`), so
//! a VMM cannot make the server read another process's memory. After a
//! restart of the server, an anchor whose VMM is gone is known by its pid
//! and its start time, both from the journal.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Why a process cannot be taken as an anchor.
#[derive(Debug, thiserror::Error)]
pub enum AnchorError {
    #[error("the anchor pid {pid} is the VMM itself")]
    IsTheVmm { pid: u32 },
    #[error("cannot open a pidfd of the anchor (pid {pid})")]
    Open {
        pid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("process {pid} does not share the address space of VMM {vmm}")]
    NotShared { pid: u32, vmm: u32 },
    #[error("process {pid} is not the anchor it was (started at tick {was}, now {now:?})")]
    Replaced {
        pid: u32,
        was: u64,
        now: Option<u64>,
    },
}

/// An anchor the server holds; killed when dropped.
#[derive(Debug)]
pub struct Anchor {
    pid: u32,
    pidfd: OwnedFd,
    /// When it started (`/proc/PID/stat`'s starttime, clock ticks since
    /// boot): with the pid, what names it across a restart of the server.
    /// Read when first asked for (a fill journals it), not on the start of
    /// every VM.
    started: std::cell::OnceCell<u64>,
}

impl Anchor {
    /// Process `pid`, which VMM `vmm` (alive) names as its anchor.
    pub fn of_vmm(pid: u32, vmm: u32) -> Result<Self, AnchorError> {
        if pid == vmm {
            return Err(AnchorError::IsTheVmm { pid });
        }
        let pidfd = pidfd_open(pid)?;
        // Held by its pidfd from here: if it died and its pid went to
        // another process between the open and the check, that process
        // fails the check.
        // SAFETY: kcmp reads two pids and compares kernel objects.
        let same = unsafe {
            libc::syscall(
                libc::SYS_kcmp,
                libc::pid_t::try_from(vmm).unwrap_or(-1),
                libc::pid_t::try_from(pid).unwrap_or(-1),
                1, // KCMP_VM (KCMP_FILE is 0)
                0,
                0,
            )
        };
        if same != 0 {
            return Err(AnchorError::NotShared { pid, vmm });
        }
        Ok(Anchor {
            pid,
            pidfd,
            started: std::cell::OnceCell::new(),
        })
    }

    /// The anchor `pid` started at `started`, as the journal of the server
    /// before this one had it (its VMM may be gone).
    pub fn adopt(pid: u32, started: u64) -> Result<Self, AnchorError> {
        let pidfd = pidfd_open(pid)?;
        let now = start_time(pid);
        if now != Some(started) {
            return Err(AnchorError::Replaced {
                pid,
                was: started,
                now,
            });
        }
        Ok(Anchor {
            pid,
            pidfd,
            started: std::cell::OnceCell::from(started),
        })
    }

    /// Its pid: the VMM's pages are read by it.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// When it started (see the field); 0 if it is gone already.
    pub fn started(&self) -> u64 {
        *self
            .started
            .get_or_init(|| start_time(self.pid).unwrap_or(0))
    }

    /// Whether it is still alive.
    pub fn alive(&self) -> bool {
        self.signal(0)
    }

    /// Set its `oom_score_adj` (the VMM's is the VMM's to set: the kernel
    /// kills every process of an address space together, and counts the
    /// score of each).
    pub fn set_oom_score_adj(&self, adj: i32) {
        let _ = std::fs::write(format!("/proc/{}/oom_score_adj", self.pid), adj.to_string());
    }

    fn signal(&self, sig: i32) -> bool {
        // SAFETY: pidfd_send_signal on a pidfd this value owns.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                sig,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        r == 0
    }
}

impl Drop for Anchor {
    fn drop(&mut self) {
        // By its pidfd: never another process that took its pid.
        self.signal(libc::SIGKILL);
    }
}

fn pidfd_open(pid: u32) -> Result<OwnedFd, AnchorError> {
    let raw = libc::pid_t::try_from(pid).unwrap_or(-1);
    // SAFETY: pidfd_open returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, 0) };
    if fd < 0 {
        return Err(AnchorError::Open {
            pid,
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: a new fd this process owns alone.
    Ok(unsafe { OwnedFd::from_raw_fd(i32::try_from(fd).unwrap_or(-1)) })
}

/// `/proc/PID/stat`'s starttime (field 22).
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces:
    // fields are counted after its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_of_another_address_space_is_refused() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let err = Anchor::of_vmm(child.id(), std::process::id()).unwrap_err();
        assert!(matches!(err, AnchorError::NotShared { .. }), "{err}");
        let err = Anchor::of_vmm(std::process::id(), std::process::id()).unwrap_err();
        assert!(matches!(err, AnchorError::IsTheVmm { .. }), "{err}");
        // A start time that is not its own: a process that took the pid.
        let started = start_time(child.id()).unwrap();
        let err = Anchor::adopt(child.id(), started + 1).unwrap_err();
        assert!(matches!(err, AnchorError::Replaced { .. }), "{err}");
        // Adopted for what it is, and killed when let go.
        let a = Anchor::adopt(child.id(), started).unwrap();
        assert!(a.alive());
        drop(a);
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
    }
}
