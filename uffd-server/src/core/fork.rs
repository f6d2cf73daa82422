//! Live fork (DESIGN §4): turn one running VM into n+1 without copying its
//! memory.
//!
//! 1. Pause the parent and capture its vCPU/device state.
//! 2. Write-protect the parent's materialized pages (its `Vm(parent)`
//!    extents). Pages it has not materialized need no protection: a write
//!    to them raises MISSING first, and resolving it never changes what a
//!    child reads (the child reads that page from the same source).
//! 3. Each child's table := the parent's table (shared chunks), so for the
//!    child `Vm(parent)` means "read it from the parent".
//! 4. Reflink the parent's disk volume for each child (still paused).
//! 5. Resume the parent; start each child's VMM from the captured state.
//!
//! A later WP fault on the parent copies the pre-write page into every VM
//! whose table still reads it from the parent (see `fault.rs`).

use std::rc::Rc;
use std::time::Instant;

use proto::vmm::{Reply, Request};
use serde_json::{json, Value};
use shared::{VmId, PAGE_SIZE};
use tokio::sync::oneshot;
use tracing::info;

use super::vm::{RunState, Vm, VmParts};
use super::{not_found, ApiError, ApiResult, Core};
use crate::memory::GuestMemory;

/// Most children one request may create.
pub const MAX_FORK_COUNT: u32 = 64;

type Ready = oneshot::Receiver<Result<(), String>>;

impl Core {
    /// `POST /v1/vms/{id}/fork`.
    pub(super) async fn fork(self: Rc<Self>, parent: VmId, count: u32) -> ApiResult<Value> {
        if count == 0 || count > MAX_FORK_COUNT {
            return Err(ApiError::bad_request(format!(
                "count must be between 1 and {MAX_FORK_COUNT}"
            )));
        }
        {
            let reg = self.reg.borrow();
            let v = reg.vms.get(&parent).ok_or_else(|| not_found(parent))?;
            if v.state != RunState::Running {
                return Err(ApiError::conflict(format!(
                    "cannot fork {parent}: it is {}; only a running VM can be forked",
                    v.state.name()
                )));
            }
        }
        let timeout = self.settings.exec_timeout;
        // Pause and capture are sent back to back (the VMM answers in
        // order), so the parent's pause pays one round trip, not two.
        let t_pause = Instant::now();
        let paused = self.send_request(parent, Request::Pause)?;
        let captured = self.send_request(parent, Request::CaptureState);
        let paused = self.await_reply(parent, paused, timeout).await;
        let captured = match captured {
            Ok(rx) => self.await_reply(parent, rx, timeout).await,
            Err(e) => Err(e),
        };
        let t_paused = t_pause.elapsed().as_micros();
        let state = match (paused, captured) {
            (Ok(_), Ok(Reply::State(s))) => s,
            (p, c) => {
                let _ = self.request(parent, Request::Resume, timeout).await;
                return Err(match (p, c) {
                    (Err(e), _) | (_, Err(e)) => e,
                    (_, Ok(r)) => {
                        ApiError::vmm(format!("{parent}: unexpected reply to capture: {r:?}"))
                    }
                });
            }
        };
        let t_wp = Instant::now();
        let protected = self.write_protect_materialized(parent);
        let wp_us = t_wp.elapsed().as_micros();
        let t_fork = Instant::now();
        let created = self.create_children(parent, count, Rc::new(state));
        let fork_us = t_fork.elapsed().as_micros();
        // Disks are reflinked while the parent is still paused.
        let t_vol = Instant::now();
        let created = match created {
            Ok(c) => self.fork_volumes(parent, c),
            Err(e) => Err(e),
        };
        let volume_us = t_vol.elapsed().as_micros();
        let t_resume = Instant::now();
        let resumed = self.request(parent, Request::Resume, timeout).await;
        let resume_us = t_resume.elapsed().as_micros();
        let pause_us = t_pause.elapsed().as_micros();
        let phases = json!({
            "pause_and_capture_us": t_paused,
            "write_protect_us": wp_us,
            "table_fork_us": fork_us,
            "volumes_us": volume_us,
            "resume_us": resume_us,
            "write_protected_pages": protected.as_ref().ok(),
        });
        let children = match (protected, created, resumed) {
            (Ok(_), Ok(c), Ok(_)) => c,
            (p, c, r) => {
                if let Ok(c) = &c {
                    let ids: Vec<VmId> = c.iter().map(|(id, _)| *id).collect();
                    self.discard_children(&ids);
                }
                return Err(p
                    .err()
                    .or(c.err())
                    .or(r.err())
                    .unwrap_or_else(|| ApiError::internal("fork failed")));
            }
        };
        // Start every child's VMM, then wait for all of them.
        let ids: Vec<VmId> = children.iter().map(|(id, _)| *id).collect();
        let mut waits = Vec::new();
        for (id, ready) in children {
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
        info!("{parent}: forked into {ids:?} (pause {pause_us} us, table fork {fork_us} us)");
        Ok(json!({
            "parent": parent.to_string(),
            "children": ids.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "pause_us": pause_us,
            "fork_us": fork_us,
            "phases": phases,
        }))
    }

    /// Write-protect `vm`'s materialized pages. Returns how many pages.
    fn write_protect_materialized(&self, vm: VmId) -> ApiResult<u64> {
        let reg = self.reg.borrow();
        let v = reg.vms.get(&vm).ok_or_else(|| not_found(vm))?;
        let uffd = v
            .uffd
            .clone()
            .ok_or_else(|| ApiError::conflict(format!("{vm} has no userfaultfd")))?;
        let mut pages = 0;
        for (start, n) in v.table.ranges_of(v.self_src) {
            uffd.get_ref()
                .write_protect(v.addr_of(start), shared::geometry::usize_of(n * PAGE_SIZE))
                .map_err(|e| {
                    ApiError::internal(format!(
                        "cannot write-protect {vm} pages {start}..{}: {e}",
                        start + n
                    ))
                })?;
            pages += n;
        }
        Ok(pages)
    }

    /// Register `count` children of `parent` sharing its table.
    fn create_children(
        &self,
        parent: VmId,
        count: u32,
        state: Rc<shared::VmState>,
    ) -> ApiResult<Vec<(VmId, Ready)>> {
        let mut reg = self.reg.borrow_mut();
        let (table, size, vcpus, fault_around) = {
            let p = reg.vms.get(&parent).ok_or_else(|| not_found(parent))?;
            (
                p.table.fork(),
                p.memory.size(),
                p.vcpus,
                p.fault_around_pages,
            )
        };
        let readahead_pages = reg.vms.get(&parent).map_or(0, |p| p.readahead.max_pages);
        let mut out = Vec::new();
        for _ in 0..count {
            reg.next_id += 1;
            let id = VmId(reg.next_id);
            let memory = match GuestMemory::create(&format!("pagefork-{id}"), size) {
                Ok(m) => m,
                Err(e) => {
                    let ids: Vec<VmId> = out.iter().map(|(id, _)| *id).collect();
                    for id in ids {
                        reg.vms.remove(&id);
                    }
                    return Err(ApiError::internal(format!(
                        "cannot create memory for a child: {}",
                        super::chain(&e)
                    )));
                }
            };
            let self_src = reg.arena.vm(id);
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
            vm.parent = Some(parent);
            vm.start_state = Some(state.clone());
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
    ) -> ApiResult<Vec<(VmId, Ready)>> {
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
            engine.reflink_volume(&vol, &name).map_err(|e| {
                ApiError::internal(format!(
                    "cannot reflink volume {vol} for {id}: {}",
                    super::chain(&e)
                ))
            })?;
            if let Some(v) = self.reg.borrow_mut().vms.get_mut(id) {
                v.volume = Some(name);
            }
        }
        Ok(children)
    }

    fn discard_children(&self, ids: &[VmId]) {
        let mut reg = self.reg.borrow_mut();
        for id in ids {
            if let Some(v) = reg.vms.remove(id) {
                reg.arena.release(v.self_src);
                if let (Some(vol), Some(engine)) = (v.volume, self.volumes.as_ref()) {
                    let _ = engine.delete(&vol);
                }
            }
        }
    }

    /// Stop and forget children of a fork that failed half-way.
    async fn abort_children(self: Rc<Self>, ids: &[VmId]) {
        for id in ids {
            self.stop_vmm(*id).await;
        }
        self.discard_children(ids);
    }
}
