//! Memory-source debugging: where a VM's pages come from, one page's
//! story, the fork tree, and a check of the table invariant against the
//! kernel's view of each memfd.

use std::collections::BTreeMap;

use proto::api::{
    AccessMap, AccessQuery, ExplainStep, Installed, Invariant, MapLegend, MapQuery, PageExplain,
    PageInfo, PageMap, SourceExtent, Sources, Tree, TreeNode, Violation,
};
use shared::VmId;

use crate::core::error::{Error, Result};
use crate::core::registry::Registry;
use crate::core::state::Core;
use crate::core::vm::{RunState, Vm};
use crate::pages::{PageSource, PageTable, SourceId, VmPages};

/// What `/metrics` reports, read from the core's counters now.
pub(crate) fn metrics_sample(core: &Core) -> crate::observe::metrics::Sample {
    use crate::observe::metrics::{Sample, VmSample};
    let reg = core.reg.borrow();
    let by_kind = |t: &PageTable| reg.pages_by_kind(t).into_iter().collect();
    let mut vms: Vec<VmSample> = reg
        .vms
        .values()
        .map(|v| {
            let memory = crate::core::base::memory(&reg, v.id);
            VmSample {
                id: v.id.to_string(),
                kind: "pagefork",
                state: if v.is_deleted() {
                    RunState::Deleted
                } else {
                    v.state()
                }
                .name()
                .to_owned(),
                stats: v.log.stats,
                resident_pages: (memory.own_bytes + memory.shared_bytes) / shared::PAGE_SIZE,
                shared_bytes: memory.shared_bytes,
                pages_by_source: by_kind(&v.table),
                frozen: v.is_deleted(),
                trace_listeners: v.log.tap.listeners(),
                reclaimed_pages: {
                    let r = v.reclaim.to_api(0);
                    r.dropped_pages + r.swapped_out_total
                },
                refaults: v.reclaim.to_api(0).refaults,
            }
        })
        .collect();
    vms.extend(reg.fc_vms.values().map(|v| VmSample {
        id: v.id.to_string(),
        kind: "firecracker",
        state: v.state.name().to_owned(),
        stats: v.stats,
        resident_pages: v.table.count_of(v.self_src),
        shared_bytes: 0,
        pages_by_source: by_kind(&v.table),
        frozen: false,
        trace_listeners: 0,
        reclaimed_pages: 0,
        refaults: 0,
    }));
    Sample {
        fault_seconds: core.fault_seconds.clone(),
        vms,
        retired: reg.retired,
        sources_by_kind: reg
            .arena
            .count_by_kind()
            .into_iter()
            .map(|(k, n)| (k.to_owned(), n))
            .collect(),
        pool: core.pool.borrow().sample(),
        bases: crate::core::base::list(&reg)
            .bases
            .into_iter()
            .map(|b| crate::observe::metrics::BaseSample {
                id: b.id,
                of: b.of,
                bytes: b.bytes,
                users: b.users.len() as u64,
            })
            .collect(),
        fds: fd_sample(core),
        start: core.restart.sample(),
        memory: {
            drop(reg);
            crate::core::reclaim::status(core)
        },
    }
}

/// The server's fds for `/metrics`: open now (not what admitted
/// operations still starting were promised), the limit, the reserve.
fn fd_sample(core: &Core) -> crate::observe::metrics::FdSample {
    use crate::observe::fds::{fd_limit, open_fds};
    let limit = fd_limit().unwrap_or(0);
    crate::observe::metrics::FdSample {
        open: open_fds().unwrap_or(0),
        limit,
        reserve: crate::core::fd_budget::reserve(limit),
        refused: core.fds.refused(),
    }
}

/// Where `page` of `id` comes from, step by step: each VM on the way
/// (whether it holds the page, and how it got it), down to a snapshot
/// image or file (with the byte offset) or zero. A VM that holds the
/// page continues the chain with where it got it from; the walk stops
/// at a source that is not a VM, or at a VM already seen.
fn explain_page(reg: &Registry, id: VmId, page: u64) -> PageExplain {
    let mut chain = Vec::new();
    let mut seen = Vec::new();
    let mut at = Some(id);
    while let Some(vm) = at.take() {
        if seen.contains(&vm) {
            break;
        }
        seen.push(vm);
        let Some(v) = reg.table_view(vm) else {
            chain.push(ExplainStep {
                at: vm.to_string(),
                kind: "vm".into(),
                present: None,
                installed: None,
                file: None,
                offset: None,
                frame: None,
                shared_from: None,
                lives_in: None,
            });
            break;
        };
        let src = v.table.get(page);
        let present = src == v.self_src;
        let installed = if present {
            reg.vms.get(&vm).and_then(|v| v.log.pages.installed(page))
        } else {
            None
        };
        let shared_from = reg
            .vms
            .get(&vm)
            .and_then(|v| v.base.on.as_ref())
            .filter(|on| !present && on.src == src)
            .map(|on| on.base.name());
        chain.push(ExplainStep {
            at: vm.to_string(),
            kind: "vm".into(),
            present: Some(present),
            installed: installed.map(|i| Installed {
                time_ms: i.unix_ms,
                event: i.by.name().into(),
                from: describe(reg, i.from),
            }),
            file: None,
            offset: None,
            frame: None,
            shared_from,
            lives_in: present.then(|| crate::core::kept::lives_in(reg, v.self_src)),
        });
        // Where the bytes are (not present) or came from (present).
        let next = match (present, installed) {
            (false, _) => src,
            (true, Some(i)) => i.from,
            (true, None) => break,
        };
        match reg.arena.get(next).map(|s| &**s) {
            Some(PageSource::Vm(other)) => at = Some(*other),
            Some(s) => {
                let mut step = source_step(s, page);
                if !matches!(s, PageSource::Uninitialized) {
                    step.lives_in = Some(crate::core::kept::lives_in(reg, next));
                }
                chain.push(step);
            }
            None => chain.push(retired_step(reg, next, page)),
        }
    }
    PageExplain { chain }
}

/// A source's name, also once released.
fn describe(reg: &Registry, src: SourceId) -> String {
    match (reg.arena.get(src), reg.arena.retired(src)) {
        (Some(s), _) => s.describe(),
        (None, Some(r)) => r.name.clone(),
        (None, None) => format!("source-{src}"),
    }
}

/// The last step of a chain whose source has been released since (an
/// image no table reads any more, a VM that is gone).
fn retired_step(reg: &Registry, src: SourceId, page: u64) -> ExplainStep {
    let r = reg.arena.retired(src);
    let path = r.and_then(|r| r.path.as_ref());
    ExplainStep {
        at: describe(reg, src),
        kind: r.map_or("released", |r| r.kind).into(),
        present: None,
        installed: None,
        file: path.map(|p| p.display().to_string()),
        offset: path.map(|_| page * shared::PAGE_SIZE),
        frame: None,
        shared_from: None,
        lives_in: None,
    }
}

/// The last step of a chain: zero, or an image or file and the offset of
/// `page` in it.
fn source_step(s: &PageSource, page: u64) -> ExplainStep {
    let (at, kind) = match s {
        PageSource::Uninitialized => ("zero".to_owned(), "zero"),
        PageSource::Image(_) => (s.describe(), "image"),
        PageSource::File(_)
        | PageSource::Vm(_)
        | PageSource::Frozen(_)
        | PageSource::Zstd(_)
        | PageSource::Remote(_)
        | PageSource::Swap(_) => (s.describe(), s.kind()),
    };
    if let PageSource::Swap(w) = s {
        // The swap store's file, and where the page's frame is in it.
        let store = w.store.borrow();
        let at_frame = store.location(w.owner(), page);
        return ExplainStep {
            at,
            kind: kind.into(),
            present: None,
            installed: None,
            file: Some(store.path().display().to_string()),
            offset: at_frame.map(|l| l.offset),
            frame: at_frame.map(|l| l.seq),
            shared_from: None,
            lives_in: None,
        };
    }
    if let Some(r) = s.remote() {
        // The chunk object holding the page, and the page's offset in
        // the chunk's bytes.
        let chunk = r.chunk_of(page);
        return ExplainStep {
            at,
            kind: kind.into(),
            present: None,
            installed: None,
            file: r
                .chunk_ref(chunk)
                .map(|c| format!("{}/chunks/{}", r.url, c.digest)),
            offset: Some((page - r.chunk_pages(chunk).start) * shared::PAGE_SIZE),
            frame: Some(chunk),
            shared_from: None,
            lives_in: None,
        };
    }
    if let Some(z) = s.zstd() {
        let frame = z.header().frame_of(page);
        return ExplainStep {
            at,
            kind: kind.into(),
            present: None,
            installed: None,
            file: Some(z.path.display().to_string()),
            offset: z.frame_offset(frame),
            frame: Some(frame),
            shared_from: None,
            lives_in: None,
        };
    }
    let file = s.file();
    ExplainStep {
        at,
        kind: kind.into(),
        present: None,
        installed: None,
        file: file.map(|f| f.path.display().to_string()),
        offset: file.map(|_| page * shared::PAGE_SIZE),
        frame: None,
        shared_from: None,
        lives_in: None,
    }
}

/// `GET /v1/vms/{id}/sources`.
pub(crate) fn sources(core: &Core, id: VmId) -> Result<Sources> {
    crate::core::base::sync_private(&mut core.reg.borrow_mut(), id)?;
    let reg = core.reg.borrow();
    let v = reg.table_view(id).ok_or(Error::NoSuchVm(id))?;
    let describe = |src| {
        reg.arena
            .get(src)
            .map(|s| s.describe())
            .unwrap_or_else(|| format!("source-{src}"))
    };
    let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
    let mut by_source: BTreeMap<String, u64> = BTreeMap::new();
    for (src, n) in v.table.counts() {
        let kind = reg.arena.get(*src).map(|s| s.kind()).unwrap_or("unknown");
        *by_kind.entry(kind.into()).or_default() += n;
        *by_source.entry(describe(*src)).or_default() += n;
    }
    let extents = v
        .table
        .extents()
        .into_iter()
        .map(|e| SourceExtent {
            start_page: e.start,
            pages: e.pages,
            source: describe(e.source),
        })
        .collect();
    Ok(Sources {
        id: id.to_string(),
        pages: v.table.pages(),
        by_kind,
        by_source,
        extents,
    })
}

/// `GET /v1/vms/{id}/pages/{page}[?explain=true]`.
pub(crate) fn page(core: &Core, id: VmId, page: u64, explain: bool) -> Result<PageInfo> {
    // The pages a VM on a shared base wrote over it, which raised no
    // fault, are its own in what this shows.
    crate::core::base::sync_private(&mut core.reg.borrow_mut(), id)?;
    let reg = core.reg.borrow();
    let v = reg.table_view(id).ok_or(Error::NoSuchVm(id))?;
    if page >= v.table.pages() {
        return Err(Error::PageOutOfRange {
            vm: id,
            page,
            pages: v.table.pages(),
        });
    }
    let src = v.table.get(page);
    let source = reg.arena.get(src);
    Ok(PageInfo {
        id: id.to_string(),
        page,
        source: source.map(|s| s.describe()),
        kind: source.map(|s| s.kind().to_owned()),
        // Pagefork VMs: the kernel's view of the memfd. Firecracker VMs:
        // installed into its address space (the table's record).
        // Hugetlb memory: the kernel cannot say (see `memory.rs`).
        // A VM on a shared base: held privately by its VMM.
        present: crate::core::base::private_pages(&reg, id)
            .and_then(|held| held.get(shared::geometry::usize_of(page)).copied())
            .or_else(|| v.memory.and_then(|m| m.is_present(page)))
            .unwrap_or(src == v.self_src),
        table_says_present: src == v.self_src,
        explain: explain.then(|| explain_page(&reg, id, page)),
    })
}

/// `GET /v1/vms/{id}/map`: the table as cells (see `observe/map.rs`).
pub(crate) fn page_map(core: &Core, id: VmId, q: &MapQuery) -> Result<PageMap> {
    use crate::observe::map;
    let reg = core.reg.borrow();
    let v = reg.table_view(id).ok_or(Error::NoSuchVm(id))?;
    let pages = v.table.pages();
    // The legend: own memory first, then by source id (creation order).
    let mut ids: Vec<SourceId> = v.table.counts().keys().copied().collect();
    ids.sort_by_key(|s| (*s != v.self_src, *s));
    let legend: Vec<MapLegend> = ids
        .iter()
        .map(|src| {
            let (source, kind) = reg.arena.get(*src).map_or_else(
                || (format!("source-{src}"), "unknown"),
                |s| (s.describe(), s.kind()),
            );
            let rgb = map::colour(kind, &source);
            MapLegend {
                rgb,
                faded_rgb: map::faded(rgb),
                source,
                kind: kind.to_owned(),
                own: *src == v.self_src,
                pages: v.table.count_of(*src),
            }
        })
        .collect();
    let mut present = vec![false; shared::geometry::usize_of(pages)];
    let ranges = v
        .memory
        .and_then(|m| m.present_ranges())
        .unwrap_or_else(|| v.table.ranges_of(v.self_src));
    for (start, n) in ranges {
        for p in start..(start + n).min(pages) {
            present[shared::geometry::usize_of(p)] = true;
        }
    }
    let index = |src: SourceId| {
        ids.iter()
            .position(|s| *s == src)
            .and_then(|i| u16::try_from(i).ok())
            .unwrap_or(u16::MAX)
    };
    let group = map::group_size(pages, q.cells.unwrap_or(map::MAX_CELLS));
    let per_page = (0..pages).map(|p| {
        (
            index(v.table.get(p)),
            present[shared::geometry::usize_of(p)],
        )
    });
    let (cells, present) = map::group(per_page, legend.len(), group);
    Ok(PageMap {
        id: id.to_string(),
        pages,
        memory_bytes: pages * shared::PAGE_SIZE,
        group,
        time_ms: crate::observe::trace::unix_us() / 1000,
        legend,
        cells,
        present,
    })
}

/// `GET /v1/vms/{id}/access.png`: the PNG of faults per cell.
pub(crate) fn access_png(core: &Core, id: VmId, q: &MapQuery) -> Result<Vec<u8>> {
    use crate::observe::map;
    let reg = core.reg.borrow();
    let v = reg.vm(id)?;
    let pages = v.log.pages.pages();
    let group = map::group_size(pages, q.cells.unwrap_or(map::MAX_CELLS));
    let per_page: Vec<u64> = v.log.pages.fault_counts().collect();
    let counts: Vec<u64> = per_page
        .chunks(shared::geometry::usize_of(group))
        .map(|c| c.iter().sum())
        .collect();
    Ok(map::heat_png(
        &id.to_string(),
        pages,
        v.log.pages.since_unix_ms(),
        &counts,
        group,
    ))
}

/// `GET /v1/vms/{id}/access`.
pub(crate) fn access(core: &Core, id: VmId, q: &AccessQuery) -> Result<AccessMap> {
    let reg = core.reg.borrow();
    let v = reg.vm(id)?;
    let extents = v.log.pages.extents(q.within_ms);
    Ok(AccessMap {
        id: id.to_string(),
        pages: v.log.pages.pages(),
        since_ms: v.log.pages.since_unix_ms(),
        touched: extents.iter().map(|e| e.pages).sum(),
        extents,
    })
}

/// `GET /v1/tree`: every VM (deleted-but-frozen ones too) with its
/// parent, children and how many pages it reads from each other VM.
pub(crate) fn tree(core: &Core) -> Tree {
    let reg = core.reg.borrow();
    let vms = reg
        .vms
        .values()
        .map(|v| {
            let mut reads: BTreeMap<String, u64> = BTreeMap::new();
            for (src, n) in v.table.counts() {
                if *src == v.self_src {
                    continue;
                }
                match reg.arena.get(*src).map(|s| &**s) {
                    Some(crate::pages::PageSource::Vm(other)) => {
                        reads.insert(other.to_string(), *n);
                    }
                    // Snapshot images, by name, next to the VMs.
                    Some(crate::pages::PageSource::Image(i)) => {
                        *reads.entry(format!("snapshot:{}", i.snapshot)).or_insert(0) += *n;
                    }
                    _ => {}
                }
            }
            let children: Vec<String> = reg
                .vms
                .values()
                .filter(|c| c.fork.parent == Some(v.id))
                .map(|c| c.id.to_string())
                .collect();
            TreeNode {
                id: v.id.to_string(),
                parent: v.fork.parent.map(|p| p.to_string()),
                state: v.api_state(),
                children,
                own_pages: v.table.count_of(v.self_src),
                reads_from: reads,
            }
        })
        .collect();
    Tree { vms }
}

/// `GET /v1/debug/invariant`: for every VM and page, the table says
/// `Vm(core)` exactly where the memfd holds the page, or the page is
/// stale (a rollback's, in the memfd until it is punched: see
/// `Vm::stale`).
pub(crate) fn check_invariant(core: &Core) -> Invariant {
    let reg = core.reg.borrow();
    let mut violations = Vec::new();
    let mut checked = 0u64;
    for v in reg.vms.values() {
        if v.base.is_based() {
            based_violations(&reg, v, &mut violations);
            checked += v.table.pages();
            continue;
        }
        let Some(ranges) = v.memory.present_ranges() else {
            // Hugetlb: the kernel cannot say which blocks are present;
            // what must hold is that each block is wholly present or
            // wholly absent in the table (see `memory.rs`).
            block_violations(v, &mut violations);
            checked += v.table.pages();
            continue;
        };
        let mut present = vec![false; usize::try_from(v.table.pages()).unwrap_or(0)];
        for (start, n) in ranges {
            for p in start..start + n {
                if let Some(slot) = present.get_mut(shared::geometry::usize_of(p)) {
                    *slot = true;
                }
            }
        }
        for (p, is_present) in present.iter().enumerate() {
            let says = v.table.get(p as u64) == v.self_src;
            let stale = *is_present && !says && v.rollback.stale.contains(p as u64);
            if says != *is_present && !stale {
                violations.push(Violation {
                    id: v.id.to_string(),
                    page: p as u64,
                    table_says_present: says,
                    present: *is_present,
                });
                if violations.len() >= 32 {
                    break;
                }
            }
        }
        checked += v.table.pages();
    }
    let reads_from_other_vmms = reads_from_other_vmms(&reg);
    Invariant {
        ok: violations.is_empty() && reads_from_other_vmms.is_empty(),
        pages_checked: checked,
        violations,
        reads_from_other_vmms,
    }
}

/// Every VM whose table names another VM's source while that VM's pages
/// are private pages of its VMM: bytes that die with a process the reader
/// does not own (a fork of a VM on a base copies them into a layer
/// instead, `fork::layer`).
fn reads_from_other_vmms(reg: &Registry) -> Vec<String> {
    let tables = reg
        .vms
        .values()
        .map(|v| (v.id, &v.table))
        .chain(reg.fc_vms.values().map(|v| (v.id, &v.table)));
    let mut found = Vec::new();
    for (reader, table) in tables {
        for (src, n) in table.counts() {
            let Some(PageSource::Vm(owner)) = reg.arena.get(*src).map(|s| &**s) else {
                continue;
            };
            if *owner == reader || *n == 0 {
                continue;
            }
            if let Some(VmPages::Process(_)) = reg.arena.memory_of(*owner) {
                found.push(format!("{reader} reads {n} pages from {owner}'s VMM"));
            }
        }
    }
    found
}

/// Pages of a VM on a shared base that its table says are its own but its
/// VMM does not hold privately. The other way round is no violation: a
/// guest's write over a page mapped from the base raises no fault, and
/// the table learns of it when it must (`core::base::sync_private`).
fn based_violations(reg: &Registry, v: &Vm, out: &mut Vec<Violation>) {
    let Some(held) = crate::core::base::private_pages(reg, v.id) else {
        return;
    };
    for (p, held) in held.iter().enumerate() {
        if out.len() >= 32 {
            break;
        }
        let src = v.table.get(p as u64);
        let says = src == v.self_src;
        // A page it holds as one of its layers does is named by the layer
        // (see `fork::layer`); any other page it holds must be named its
        // own: every first write to a page it maps shared faults.
        if says != *held && !(*held && crate::core::base::is_own_layer(reg, v.id, src)) {
            out.push(Violation {
                id: v.id.to_string(),
                page: p as u64,
                table_says_present: says,
                present: *held,
            });
        }
    }
}

/// Blocks of a hugetlb VM that the table marks partly present: the page
/// marked present reported as `present: false` where its block's first page
/// is absent, and the other way round.
fn block_violations(v: &Vm, out: &mut Vec<Violation>) {
    let unit = v.memory.unit_pages();
    let pages = v.table.pages();
    let mut b = 0;
    while b < pages && out.len() < 32 {
        let first = v.table.get(b) == v.self_src;
        for p in b..(b + unit).min(pages) {
            let says = v.table.get(p) == v.self_src;
            if says != first {
                out.push(Violation {
                    id: v.id.to_string(),
                    page: p,
                    table_says_present: says,
                    present: first,
                });
                break;
            }
        }
        b += unit;
    }
}
