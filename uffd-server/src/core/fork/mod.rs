//! Live fork (DESIGN §4): turn one running VM into n+1 without copying its
//! memory.
//!
//! 1. Write-protect the parent's materialized pages (its `Vm(parent)`
//!    extents) while it still runs. Pages it has not materialized need no
//!    protection: a write to them raises MISSING first, and resolving it
//!    never changes what a child reads (the child reads that page from the
//!    same source).
//! 2. Pause the parent and capture its vCPU/device state; re-protect the
//!    pages it wrote or materialized since step 1 (`arm.rs`), so at the
//!    pause every materialized page is protected.
//! 3. Each child's table := the parent's table (shared chunks), so for the
//!    child `Vm(parent)` means "read it from the parent".
//! 4. Reflink the parent's disk volume for each child (still paused).
//! 5. Resume the parent; start each child's VMM from the captured state.
//!
//! A later WP fault on the parent copies the pre-write page into every VM
//! whose table still reads it from the parent (see `fault.rs`).
//!
//! A paused parent forks as a template: steps 1 and 5 skip the pause and
//! the resume, and step 2 runs only on the first fork after the template
//! last ran or changed (`Vm::protected_paused`), so forking a template again
//! and again costs the table fork and the children's start only.

pub mod state;

use std::rc::Rc;
use std::time::Instant;

use proto::api::{ForkPhases, ForkResponse, MAX_FORK_COUNT};
use proto::vmm::{Reply, Request};
use shared::VmId;
use tokio::sync::oneshot;
use tracing::warn;

use super::vm::{RunState, Vm, VmParts};
use super::{Core, Error, Result};

type Ready = oneshot::Receiver<Result<()>>;

/// Children of a live fork at most that start before the parent resumes.
const EARLY_CHILDREN: usize = 4;

fn us(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

impl Core {
    /// `POST /v1/vms/{id}/fork`.
    pub(super) async fn fork(self: &Rc<Self>, parent: VmId, count: u32) -> Result<ForkResponse> {
        if count == 0 || count > MAX_FORK_COUNT {
            return Err(Error::BadRequest(format!(
                "count must be between 1 and {MAX_FORK_COUNT}"
            )));
        }
        // A paused VM forks as a template: it stays paused, and its pages
        // need protecting only once until it runs again.
        let template = self
            .reg
            .borrow()
            .vms
            .get(&parent)
            .is_some_and(|v| v.state == RunState::Paused && !v.deleted);
        if !template {
            self.expect_state(parent, RunState::Running, "fork")?;
        }
        {
            let reg = self.reg.borrow();
            let size = reg.vms.get(&parent).map_or(0, |v| v.memory.size());
            reg.admit(&self.settings, u64::from(count), size)?;
        }
        let _busy = self.begin_busy(parent, "fork", "a fork")?;
        let timeout = self.settings.vmm_deadline;
        // A running parent's materialized pages are write-protected now,
        // while it runs; the pause re-protects only what it writes
        // meanwhile (see `arm.rs`).
        let armed = if template {
            None
        } else {
            Some(self.arm_ahead(parent, &self.materialized(parent)?)?)
        };
        // Pause and capture are sent back to back (the VMM answers in
        // order), so the parent's pause pays one round trip, not two.
        let t_pause = Instant::now();
        // A template forked before, and unchanged since, has its state
        // kept: its children need no round trip to its VMM.
        let kept = if template {
            self.reg
                .borrow()
                .vms
                .get(&parent)
                .and_then(|v| v.fork.paused_state.clone())
        } else {
            None
        };
        let paused = if template {
            None
        } else {
            Some(self.send_request(parent, Request::Pause)?)
        };
        let captured = match &kept {
            Some(_) => None,
            None => Some(self.send_request(parent, Request::CaptureState)),
        };
        let paused = match paused {
            Some(rx) => self.await_reply(parent, rx, timeout).await,
            None => Ok(Reply::Done),
        };
        // The vCPUs are stopped: re-protect what the parent wrote since
        // its protection was armed, while the capture's answer is on its
        // way.
        let t_wp = Instant::now();
        let reprotected = match (&armed, &paused) {
            (Some(a), Ok(_)) => Some(a.reprotect().map(|(n, _)| a.pages + n)),
            _ => None,
        };
        let mut wp_us = us(t_wp);
        let captured = match (captured, kept) {
            (Some(Ok(rx)), _) => self
                .await_reply(parent, rx, timeout)
                .await
                .map(|r| match r {
                    Reply::State(s) => Ok(Rc::new(s)),
                    other => Err(other),
                }),
            (Some(Err(e)), _) => Err(e),
            (None, Some(s)) => Ok(Ok(s)),
            (None, None) => unreachable!("a capture is sent unless a state is kept"),
        };
        let t_paused = us(t_pause);
        let state = match (paused, captured) {
            (Ok(_), Ok(Ok(s))) => s,
            (p, c) => {
                // The pause may still land later (a VMM that stopped
                // answering): a resume queued behind it leaves the parent
                // running, as it was before the fork.
                if !template {
                    drop(armed);
                    self.resume_in_background(parent);
                }
                return Err(match (p, c) {
                    (Err(e), _) | (_, Err(e)) => e,
                    (_, Ok(Err(r))) => Error::UnexpectedReply {
                        vm: parent,
                        request: "capture",
                        reply: format!("{r:?}"),
                    },
                    (Ok(_), Ok(Ok(_))) => unreachable!("handled above"),
                });
            }
        };
        let t_wp = Instant::now();
        let protected = if let (Some(a), Some(p)) = (&armed, reprotected) {
            // The children are made right below, with no await between.
            p.and_then(|n| a.finish().map(|(late, _)| n + late))
        } else if self.protected_paused(parent) {
            Ok(0)
        } else {
            let p = self.write_protect_materialized(parent);
            wp_us = us(t_wp);
            p
        };
        if template && protected.is_ok() {
            if let Some(v) = self.reg.borrow_mut().vms.get_mut(&parent) {
                v.fork.protected_paused = true;
                v.fork.paused_state = Some(state.clone());
            }
        }
        let t_fork = Instant::now();
        let created = self.create_children(parent, count, state);
        let fork_us = us(t_fork);
        // Disks are reflinked while the parent is still paused.
        let t_vol = Instant::now();
        let created = match created {
            Ok(c) => self.fork_volumes(parent, c),
            Err(e) => Err(e),
        };
        let volume_us = us(t_vol);
        // The children of a small live fork that find a ready VMM in the
        // pool start now, while the parent's resume is on its way: a bind
        // and a Welcome add microseconds to the pause and take the resume
        // round trip off the children's start. The others (and the
        // children of a template, which has no resume) start below.
        let mut early = Vec::new();
        if let (false, Ok(_), Ok(c)) = (template, &protected, &created) {
            if c.len() <= EARLY_CHILDREN {
                for (id, _) in c {
                    if self.launch_from_pool(*id) {
                        early.push(*id);
                    }
                }
            }
        }
        let t_resume = Instant::now();
        let resumed = if template {
            Ok(Reply::Done)
        } else {
            self.request(parent, Request::Resume, timeout).await
        };
        let resume_us = us(t_resume);
        let pause_us = us(t_pause);
        let phases = ForkPhases {
            armed_ahead_us: armed.as_ref().map_or(0, |a| a.us),
            pause_and_capture_us: t_paused,
            write_protect_us: wp_us,
            table_fork_us: fork_us,
            volumes_us: volume_us,
            resume_us,
            write_protected_pages: protected.as_ref().ok().copied(),
        };
        let children = match (protected, created, resumed) {
            (Ok(_), Ok(c), Ok(_)) => c,
            (p, c, r) => {
                let err = match (p, c, r) {
                    (Err(e), c, _) => {
                        if let Ok(c) = c {
                            self.discard_vms(&c.iter().map(|(id, _)| *id).collect::<Vec<_>>());
                        }
                        e
                    }
                    (_, Err(e), _) => e,
                    (_, Ok(c), Err(e)) => {
                        let ids: Vec<VmId> = c.iter().map(|(id, _)| *id).collect();
                        if early.is_empty() {
                            self.discard_vms(&ids);
                        } else {
                            self.clone().abort_children(&ids).await;
                        }
                        e
                    }
                    (Ok(_), Ok(_), Ok(_)) => unreachable!("handled above"),
                };
                return Err(err);
            }
        };
        // Start every child's VMM, then wait for all of them.
        let ids: Vec<VmId> = children.iter().map(|(id, _)| *id).collect();
        let mut waits = Vec::new();
        for (id, ready) in children {
            if early.contains(&id) {
                waits.push((id, ready));
                continue;
            }
            if let Err(e) = self.spawn_vmm(id).await {
                self.clone().abort_children(&ids).await;
                return Err(e);
            }
            waits.push((id, ready));
        }
        for (id, ready) in waits {
            if let Err(e) = self.wait_ready(id, ready).await {
                self.clone().abort_children(&ids).await;
                return Err(e);
            }
        }
        self.log_after_answer(format!(
            "{parent}: forked into {ids:?} (pause {pause_us} us, table fork {fork_us} us)"
        ));
        Ok(ForkResponse {
            parent: parent.to_string(),
            children: ids.iter().map(ToString::to_string).collect(),
            pause_us,
            fork_us,
            phases,
        })
    }

    /// Whether `vm` is a paused template whose pages are all protected.
    fn protected_paused(&self, vm: VmId) -> bool {
        self.reg
            .borrow()
            .vms
            .get(&vm)
            .is_some_and(|v| v.fork.protected_paused)
    }

    /// Queue a resume for `vm` and log its outcome, without waiting.
    fn resume_in_background(self: &Rc<Self>, vm: VmId) {
        let Ok(rx) = self.send_request(vm, Request::Resume) else {
            return;
        };
        let core = self.clone();
        tokio::task::spawn_local(async move {
            let late = core.settings.exec_timeout;
            match core.await_reply(vm, rx, late).await {
                // The guest runs again, whatever a late pause said before.
                Ok(_) => {
                    if let Some(v) = core.reg.borrow_mut().vms.get_mut(&vm) {
                        if v.state == RunState::Paused {
                            v.state = RunState::Running;
                        }
                    }
                }
                Err(e) => warn!("{vm}: resume after a failed fork: {}", e.message()),
            }
        });
    }

    /// The runs of pages `vm` holds itself (its `Vm(vm)` extents).
    fn materialized(&self, vm: VmId) -> Result<Vec<(u64, u64)>> {
        let reg = self.reg.borrow();
        let v = reg.vms.get(&vm).ok_or(Error::NoSuchVm(vm))?;
        Ok(v.table.ranges_of(v.self_src))
    }

    /// Write-protect `vm`'s materialized pages. Returns how many pages.
    fn write_protect_materialized(&self, vm: VmId) -> Result<u64> {
        let ranges = self.materialized(vm)?;
        let reg = self.reg.borrow();
        reg.vms
            .get(&vm)
            .ok_or(Error::NoSuchVm(vm))?
            .protect(&ranges)?;
        Ok(ranges.iter().map(|&(_, n)| n).sum())
    }

    /// Register `count` children of `parent` sharing its table.
    fn create_children(
        &self,
        parent: VmId,
        count: u32,
        state: Rc<shared::VmState>,
    ) -> Result<Vec<(VmId, Ready)>> {
        let mut reg = self.reg.borrow_mut();
        let (table, (size, page_size), vcpus, fault_around) = {
            let p = reg.vms.get(&parent).ok_or(Error::NoSuchVm(parent))?;
            (
                p.table.fork(),
                (p.memory.size(), p.memory.page_size()),
                p.vcpus,
                p.faults.fault_around_pages,
            )
        };
        let readahead_pages = reg
            .vms
            .get(&parent)
            .map_or(0, |p| p.faults.readahead.max_pages);
        let mut out = Vec::new();
        for _ in 0..count {
            let id = reg.alloc_id(&self.settings.state_dir);
            let (memory, pooled) = match self.new_guest_memory(id, size, page_size) {
                Ok(m) => m,
                Err(e) => {
                    for (id, _) in out {
                        reg.forget(id);
                    }
                    return Err(Error::CreateMemory(e));
                }
            };
            let memory = Rc::new(memory);
            let self_src = reg.arena.vm_with_memory(id, Rc::clone(&memory));
            let (tx, rx) = oneshot::channel();
            let mut vm = Vm::new(VmParts {
                id,
                memory,
                table: table.fork(),
                self_src,
                vcpus,
                fault_around_pages: fault_around,
                readahead_pages,
                ready: tx,
            });
            vm.fork.parent = Some(parent);
            vm.start_state = Some(state.clone());
            vm.pooled = pooled;
            reg.vms.insert(id, vm);
            out.push((id, rx));
        }
        Ok(out)
    }

    /// Give each child a reflink of the parent's volume.
    fn fork_volumes(
        &self,
        parent: VmId,
        children: Vec<(VmId, Ready)>,
    ) -> Result<Vec<(VmId, Ready)>> {
        let parent_vol = self
            .reg
            .borrow()
            .vms
            .get(&parent)
            .and_then(|v| v.volume.clone());
        let (Some(vol), Some(engine)) = (parent_vol, self.volumes.as_ref()) else {
            return Ok(children);
        };
        for (id, _) in &children {
            let name = format!("{vol}-{id}");
            if let Err(source) = engine.reflink_volume(&vol, &name) {
                self.discard_vms(&children.iter().map(|(id, _)| *id).collect::<Vec<_>>());
                return Err(Error::ForkVolume {
                    vm: *id,
                    volume: vol,
                    source,
                });
            }
            if let Some(v) = self.reg.borrow_mut().vms.get_mut(id) {
                v.volume = Some(name);
            }
        }
        Ok(children)
    }

    /// Forget VMs whose VMM never ran (a create or fork that failed
    /// half-way): their memory, sources and the volumes made for them.
    pub(super) fn discard_vms(&self, ids: &[VmId]) {
        let mut reg = self.reg.borrow_mut();
        for id in ids {
            let vol = reg.vms.get_mut(id).and_then(|v| {
                // Only a fork child's (or a restored VM's) own reflinked
                // disk goes with it.
                if v.fork.parent.is_some() || v.owns_volume {
                    v.volume.take()
                } else {
                    None
                }
            });
            if let (Some(vol), Some(engine)) = (vol, self.volumes.as_ref()) {
                if let Err(e) = engine.delete(&vol) {
                    warn!("{id}: cannot delete its volume {vol}: {}", e.chain());
                }
            }
            reg.forget(*id);
        }
        reg.release_unused_sources();
    }

    /// Stop and forget children of a fork that failed half-way.
    async fn abort_children(self: Rc<Self>, ids: &[VmId]) {
        for id in ids {
            self.stop_vmm(*id).await;
        }
        self.discard_vms(ids);
    }
}
