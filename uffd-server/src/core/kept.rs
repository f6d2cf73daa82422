//! Where the bytes a VM reads from elsewhere live, and what of a VM the
//! server keeps for others: the answers of `GET /v1/vms/{id}`
//! (`reads_from`) and `DELETE /v1/vms/{id}` (`kept`).
//!
//! No VM's pages live in another VM's VMM: a VM on its own memfd is read
//! there (the server's memfd, kept frozen after its VMM goes), and a VM on
//! a shared base hands the pages it wrote to a layer when it forks
//! (`fork::layer`). These views say so, source by source.

use proto::api::{KeptMemory, PageReader, ReadSource};
use shared::VmId;

use crate::core::base::state::OnBase;
use crate::core::registry::Registry;
use crate::pages::{FrozenKind, PageSource, PageTable, SourceId, VmPages, UNINITIALIZED};

/// Where the bytes of source `src` live now, in words.
pub(crate) fn lives_in(reg: &Registry, src: SourceId) -> String {
    let Some(source) = reg.arena.get(src) else {
        return "released".into();
    };
    match &**source {
        PageSource::Uninitialized => "nowhere: zero".into(),
        PageSource::Vm(owner) => {
            let state = match reg.vms.get(owner) {
                Some(v) if v.is_deleted() => format!("; {owner} is deleted"),
                Some(v) if v.link.pid.is_none() || v.faults.uffd.is_none() => {
                    format!("; {owner}'s VMM is not running")
                }
                Some(_) => String::new(),
                None => format!("; {owner} is gone"),
            };
            match reg.arena.memory_of(*owner) {
                Some(VmPages::Memfd(m)) => format!("memfd {} (server{state})", m.name()),
                Some(VmPages::Process(p)) => {
                    format!("private memory of {owner}'s VMM (pid {}{state})", p.pid())
                }
                None => format!("nowhere the server can read ({owner}{state})"),
            }
        }
        PageSource::Frozen(f) => {
            let what = match f.kind {
                FrozenKind::Template => "a template's memfd",
                FrozenKind::Layer => "a layer",
            };
            let state = if reg.vms.get(&f.vm).is_some_and(|v| !v.is_deleted()) {
                String::new()
            } else {
                format!("; {} is gone", f.vm)
            };
            format!(
                "memfd {} (server, {what} of {}{state})",
                f.memory.name(),
                f.vm
            )
        }
        PageSource::File(f) | PageSource::Image(crate::pages::ImageSource { file: f, .. }) => {
            format!("file {}", f.path.display())
        }
        PageSource::Zstd(z) => format!("compressed image {}", z.image.path.display()),
        PageSource::Remote(r) => format!("object store (snapshot {})", r.image.snapshot),
        PageSource::Swap(w) => format!("swap store {}", w.store.borrow().path().display()),
    }
}

/// The sources a table reads its pages from, but its own (`self_src`)
/// and zero, with where their bytes live: the pages of its shared base
/// (`on`), if any, live in the base.
pub(crate) fn reads_from(
    reg: &Registry,
    table: &PageTable,
    self_src: SourceId,
    on: Option<&OnBase>,
) -> Vec<ReadSource> {
    table
        .counts()
        .iter()
        .filter(|(src, n)| **src != self_src && **src != UNINITIALIZED && **n > 0)
        .map(|(src, n)| ReadSource {
            source: reg
                .arena
                .get(*src)
                .map_or_else(|| format!("source-{src}"), |s| s.describe()),
            kind: reg.arena.get(*src).map_or("released", |s| s.kind()).into(),
            pages: *n,
            lives_in: match on.filter(|on| on.src == *src) {
                Some(on) => format!(
                    "shared base {} (memfd {}, server), filled from it as read",
                    on.base.name(),
                    on.base.memory.name()
                ),
                None => lives_in(reg, *src),
            },
        })
        .collect()
}

/// What the server keeps of `vm`'s memory for the VMs that read from it:
/// its own memfd (while it is kept, frozen) and the layers and template
/// memfd frozen from it.
pub(crate) fn kept_of(reg: &Registry, vm: VmId) -> Vec<KeptMemory> {
    let mut kept = Vec::new();
    for (src, source) in reg.arena.iter() {
        let (kind, memory, bytes) = match &**source {
            PageSource::Vm(owner) if *owner == vm => match reg.arena.memory_of(vm) {
                Some(VmPages::Memfd(m)) => {
                    let bytes = m.allocated_bytes();
                    ("memfd", m, bytes)
                }
                _ => continue,
            },
            PageSource::Frozen(f) if f.vm == vm => (
                match f.kind {
                    FrozenKind::Template => "template",
                    FrozenKind::Layer => "layer",
                },
                std::rc::Rc::clone(&f.memory),
                // A layer still being filled: what it holds once whole.
                f.held_bytes(),
            ),
            _ => continue,
        };
        let readers: Vec<PageReader> = reg
            .vms
            .values()
            .filter(|o| o.id != vm)
            .map(|o| (o.id, o.table.count_of(src)))
            .chain(reg.fc_vms.values().map(|o| (o.id, o.table.count_of(src))))
            .filter(|(_, n)| *n > 0)
            .map(|(id, pages)| PageReader {
                vm: id.to_string(),
                pages,
            })
            .collect();
        if readers.is_empty() {
            continue;
        }
        kept.push(KeptMemory {
            source: source.describe(),
            kind: kind.into(),
            memfd: memory.name().to_owned(),
            bytes,
            readers,
        });
    }
    kept
}
