//! The pages a VM on a shared base holds privately: they live in its VMM
//! process (the guest wrote them, or the server copied them in), not in a
//! memfd the server maps. Another VM that reads them from it (a fork
//! child) gets them with `process_vm_readv`.
//!
//! Only pages mapped in that process are read: a page that is not would
//! be faulted in through the VM's userfaultfd, which the core thread
//! reading it is the one to serve, and the read would never return. The
//! pagemap says which are mapped without touching them.

use std::cell::RefCell;
use std::io::IoSliceMut;
use std::rc::Rc;

use nix::sys::uio::{process_vm_readv, RemoteIoVec};
use nix::unistd::Pid;
use shared::PAGE_SIZE;
use uffd_abi::pagemap::Pagemap;
use vm_memory::VolatileSlice;

use super::anchor::Anchor;

/// Why pages of a VMM process cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum ProcessReadError {
    #[error("pages {first}..{end} are not mapped in the VMM (pid {pid})")]
    NotMapped { pid: u32, first: u64, end: u64 },
    #[error("cannot read the pagemap of the VMM (pid {pid})")]
    Pagemap {
        pid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read pages {first}..{end} of the VMM (pid {pid})")]
    Read {
        pid: u32,
        first: u64,
        end: u64,
        #[source]
        source: nix::errno::Errno,
    },
}

/// A VM's guest RAM in its VMM process.
#[derive(Debug)]
pub struct ProcessPages {
    /// The pid the pages are read by: the VMM's anchor if it has one,
    /// else the VMM.
    pid: u32,
    /// The VMM's address of guest page 0.
    base: u64,
    pagemap: Pagemap,
    /// Held while these pages are needed after the VMM went (see
    /// [`Self::let_go_anchor`]).
    anchor: RefCell<Option<Rc<Anchor>>>,
}

impl ProcessPages {
    /// The guest RAM of VMM `pid`, mapped at `base` there, read by its
    /// `anchor`'s pid if it has one.
    pub fn open(pid: u32, base: u64, anchor: Option<Rc<Anchor>>) -> std::io::Result<Self> {
        let pid = anchor.as_ref().map_or(pid, |a| a.pid());
        Ok(ProcessPages {
            pid,
            base,
            pagemap: Pagemap::open(pid)?,
            anchor: RefCell::new(anchor),
        })
    }

    /// The pid the pages are read by.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The VMM's address of guest page 0.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The anchor these pages are read through, while they hold it.
    pub fn anchor(&self) -> Option<Rc<Anchor>> {
        self.anchor.borrow().clone()
    }

    /// The VMM went: these pages hold its anchor no more (whoever still
    /// needs the pages, a layer being filled, holds it by
    /// [`Self::anchor`]). Once the anchor is gone every read fails: the
    /// pagemap, opened on the anchor, says nothing is mapped.
    pub fn let_go_anchor(&self) {
        self.anchor.borrow_mut().take();
    }

    /// Read pages `first..` (as many as `dst` holds) out of the process.
    pub fn read(&self, first: u64, dst: &VolatileSlice<'_>) -> Result<(), ProcessReadError> {
        let len = dst.len() as u64;
        let end = first + len / PAGE_SIZE;
        let at = self.base + first * PAGE_SIZE;
        let pid = self.pid;
        let mapped = self
            .pagemap
            .all_present(at, len)
            .map_err(|source| ProcessReadError::Pagemap { pid, source })?;
        if !mapped {
            return Err(ProcessReadError::NotMapped { pid, first, end });
        }
        let ptr = dst.ptr_guard_mut().as_ptr();
        let mut done = 0usize;
        while done < dst.len() {
            // SAFETY: `ptr + done .. ptr + len` is the live memory `dst`
            // describes, written only by the kernel during the call.
            let local = unsafe { std::slice::from_raw_parts_mut(ptr.add(done), dst.len() - done) };
            let remote = RemoteIoVec {
                base: shared::geometry::usize_of(at + done as u64),
                len: dst.len() - done,
            };
            match process_vm_readv(
                Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX)),
                &mut [IoSliceMut::new(local)],
                &[remote],
            ) {
                Ok(0) => {
                    return Err(ProcessReadError::Read {
                        pid,
                        first,
                        end,
                        source: nix::errno::Errno::EFAULT,
                    })
                }
                Ok(n) => done += n,
                Err(nix::errno::Errno::EINTR) => {}
                Err(source) => {
                    return Err(ProcessReadError::Read {
                        pid,
                        first,
                        end,
                        source,
                    })
                }
            }
        }
        Ok(())
    }

    /// How many of the first `pages` guest pages the process holds as its
    /// own, and how many it maps from a file (its shared base).
    pub fn counts(&self, pages: u64) -> Result<(u64, u64), ProcessReadError> {
        let pid = self.pid;
        let end = self.base + pages * PAGE_SIZE;
        let err = |e: nix::errno::Errno| ProcessReadError::Pagemap {
            pid,
            source: std::io::Error::from(e),
        };
        let sum = |runs: Vec<(u64, u64)>| runs.iter().map(|r| r.1 / PAGE_SIZE).sum::<u64>();
        let own = sum(self.pagemap.private_runs(self.base, end).map_err(err)?);
        let shared = sum(self.pagemap.file_runs(self.base, end).map_err(err)?);
        Ok((own, shared))
    }

    /// The runs of the first `pages` guest pages the process holds as its
    /// own (`(first, n)` in pages): written by the guest or copied in, not
    /// mapped from a base (see [`Pagemap::private_runs`]).
    pub fn private_runs(&self, pages: u64) -> Result<Vec<(u64, u64)>, ProcessReadError> {
        self.runs(pages, Pagemap::private_runs)
    }

    /// The runs of the first `pages` guest pages the process maps shared:
    /// from its base, or the zero page (see [`Pagemap::shared_runs`]).
    pub fn shared_runs(&self, pages: u64) -> Result<Vec<(u64, u64)>, ProcessReadError> {
        self.runs(pages, Pagemap::shared_runs)
    }

    /// The runs `scan` finds in the first `pages` guest pages, in pages.
    fn runs(
        &self,
        pages: u64,
        scan: impl Fn(&Pagemap, u64, u64) -> Result<Vec<(u64, u64)>, nix::errno::Errno>,
    ) -> Result<Vec<(u64, u64)>, ProcessReadError> {
        let pid = self.pid;
        let runs = scan(&self.pagemap, self.base, self.base + pages * PAGE_SIZE).map_err(|e| {
            ProcessReadError::Pagemap {
                pid,
                source: std::io::Error::from(e),
            }
        })?;
        Ok(runs
            .into_iter()
            .map(|(a, n)| ((a - self.base) / PAGE_SIZE, n / PAGE_SIZE))
            .collect())
    }
}
