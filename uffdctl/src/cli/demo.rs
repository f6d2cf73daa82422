//! `uffdctl demo`: start a server in a temporary state directory and walk
//! through the main job: create a VM, write its memory, fork it, show that
//! parent and child diverge, show where pages come from, snapshot the
//! parent's memory and start a VM from it, and snapshot a
//! disk volume; then what a page server on shared bases and under a
//! keeper adds (see [`steps`]), each step's figure checked, and a table
//! of the figures.

use std::time::Instant;

use proto::api;

use super::body;

mod common;
mod steps;

pub use self::common::DemoArgs;
use self::common::{exec, server_bin, spawn_server, start_server, step};

use super::vm::call;
use crate::client::Client;
use crate::{CliError, Result};

/// Run the demo.
pub fn run(args: DemoArgs) -> Result<()> {
    let server = start_server(&args)?;
    let c = Client::new(server.dir.join("api.sock"));
    println!(
        "pagefork demo: uffd-server running, state directory {}",
        server.dir.display()
    );

    step(
        1,
        &format!(
            "create a {} MiB VM (its RAM is a memfd owned by the server)",
            args.memory_mib
        ),
    );
    let t = Instant::now();
    let vm = steps::create_info(&c, args.memory_mib, None, None)?;
    let parent = vm.id.clone();
    println!(
        "    {parent} running (vmm pid {}) in {:.0} ms",
        vm.pid.map_or_else(|| "none".to_owned(), |p| p.to_string()),
        t.elapsed().as_secs_f64() * 1e3
    );
    let pages = args.memory_mib * 256;

    step(
        2,
        "the guest fills every page with pattern seed 1, then checksums its RAM",
    );
    exec(
        &c,
        &parent,
        api::ExecRequest::Fill {
            start_page: None,
            pages: None,
            seed: 1,
        },
    )?;
    let sum = exec(
        &c,
        &parent,
        api::ExecRequest::Checksum {
            start_page: None,
            pages: None,
        },
    )?;
    println!("    {parent}: {pages} pages filled, checksum {sum:#018x}");

    step(
        3,
        "fork the running VM into 2 children (no memory is copied)",
    );
    let fork = call(
        &c,
        "POST",
        &format!("/v1/vms/{parent}/fork"),
        Some(&body(&api::ForkRequest { count: 2 })),
    )?;
    let children: Vec<String> = fork["children"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    println!(
        "    children {children:?}; parent paused {} us, table fork {} us",
        fork["pause_us"], fork["fork_us"]
    );
    if let Some(first) = children.first() {
        let s = exec(
            &c,
            first,
            api::ExecRequest::Checksum {
                start_page: None,
                pages: None,
            },
        )?;
        let same = if s == sum {
            "same as parent"
        } else {
            "DIFFERENT"
        };
        println!("    {first}: checksum of all RAM {s:#018x} ({same})");
        if s != sum {
            return Err(CliError::Check(format!(
                "{first}'s checksum {s:#018x} is not its parent's {sum:#018x}"
            )));
        }
    }
    if let Some(second) = children.get(1) {
        let part = exec(
            &c,
            second,
            api::ExecRequest::Checksum {
                start_page: Some(0),
                pages: Some(1024),
            },
        )?;
        let want = exec(
            &c,
            &parent,
            api::ExecRequest::Checksum {
                start_page: Some(0),
                pages: Some(1024),
            },
        )?;
        let same = if part == want {
            "same as parent"
        } else {
            "DIFFERENT"
        };
        println!("    {second}: checksum of its first 1024 pages {part:#018x} ({same}); the rest stays unread");
        if part != want {
            return Err(CliError::Check(format!(
                "{second}'s first 1024 pages: checksum {part:#018x}, its parent's {want:#018x}"
            )));
        }
    }

    step(
        4,
        "parent and first child write different data; each sees only its own",
    );
    let half = pages / 2;
    exec(
        &c,
        &parent,
        api::ExecRequest::Fill {
            start_page: Some(0),
            pages: Some(half),
            seed: 2,
        },
    )?;
    if let Some(ch) = children.first() {
        exec(
            &c,
            ch,
            api::ExecRequest::Fill {
                start_page: Some(half),
                pages: Some(pages - half),
                seed: 3,
            },
        )?;
        let p_ok = exec(
            &c,
            &parent,
            api::ExecRequest::Verify {
                start_page: Some(half),
                pages: Some(pages - half),
                seed: 1,
            },
        )?;
        let c_ok = exec(
            &c,
            ch,
            api::ExecRequest::Verify {
                start_page: Some(0),
                pages: Some(half),
                seed: 1,
            },
        )?;
        println!("    {parent}: upper half still seed 1 ({p_ok} mismatches); {ch}: lower half still seed 1 ({c_ok} mismatches)");
        if p_ok != 0 || c_ok != 0 {
            return Err(CliError::Check(format!(
                "writes leaked between parent and child: {p_ok} and {c_ok} mismatches"
            )));
        }
    }

    step(
        5,
        "where do the pages come from? (a page is copied only when read or overwritten)",
    );
    for id in std::iter::once(&parent).chain(children.iter()) {
        let v = call(&c, "GET", &format!("/v1/vms/{id}/sources"), None)?;
        let by = v["by_source"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, n)| format!("{n} pages from {k}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        println!("    {id}: {by}");
    }

    step(
        6,
        "snapshot the parent's memory and start a VM from it (pages fetched lazily)",
    );
    let pages_all = args.memory_mib * 256;
    let digest = |id: &str| {
        exec(
            &c,
            id,
            api::ExecRequest::Digest {
                start_page: Some(0),
                pages: Some(pages_all),
            },
        )
    };
    let snap = call(
        &c,
        "POST",
        &format!("/v1/vms/{parent}/snapshots"),
        Some(&body(&api::CreateSnapshot {
            name: "demo-mem".into(),
            mode: api::SnapshotMode::Full,
            compress: false,
        })),
    )?;
    println!(
        "    snapshot demo-mem of {parent}: {} pages written, guest paused {} µs",
        snap["pages_written"], snap["pause_us"]
    );
    let t = Instant::now();
    let restored = steps::create(&c, args.memory_mib, Some("demo-mem"), None)?;
    println!(
        "    {restored} started from demo-mem in {:.1} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let same = digest(&parent)? == digest(&restored)?;
    println!("    {restored}'s memory equals {parent}'s, every byte: {same}");
    if !same {
        return Err(CliError::Check(format!(
            "{restored}, started from demo-mem, differs from {parent}"
        )));
    }
    call(&c, "DELETE", &format!("/v1/vms/{restored}"), None)?;
    call(&c, "DELETE", "/v1/snapshots/demo-mem", None)?;

    step(7, "snapshot a disk volume (one FICLONE)");
    let vol = call(
        &c,
        "POST",
        "/v1/volumes",
        Some(&body(&api::CreateVolume {
            name: "demo-disk".into(),
            size_mib: Some(1024),
            from_snapshot: None,
        })),
    );
    match vol {
        Ok(_) => {
            let t = Instant::now();
            call(
                &c,
                "POST",
                "/v1/volumes/demo-disk/snapshots",
                Some(&body(&api::CreateVolumeSnapshot {
                    name: "demo-snap".into(),
                })),
            )?;
            println!(
                "    volume demo-disk (1 GiB) snapshotted in {:.2} ms",
                t.elapsed().as_secs_f64() * 1e3
            );
        }
        Err(e) => println!("    skipped: {e}"),
    }

    let mut figures = Vec::new();
    let restores = steps::restores(&c, &args, &parent, 8, &mut figures)?;
    let (first, rest) = restores
        .split_first()
        .ok_or_else(|| CliError::Answer("no restore started".into()))?;
    let orphan = steps::orphan(&c, &args, first, 9, &mut figures)?;
    for id in rest {
        call(&c, "DELETE", &format!("/v1/vms/{id}"), None)?;
    }
    let running: Vec<String> = std::iter::once(parent.clone())
        .chain(children.iter().cloned())
        .chain(std::iter::once(orphan.clone()))
        .collect();
    steps::crash(&c, &args, &running, 10, &mut figures)?;
    let bin = server_bin(&args)?;
    steps::memcg(
        &args,
        &server.dir,
        |dir| spawn_server(&bin, dir.to_owned(), true),
        11,
        &mut figures,
    )?;

    step(12, "clean up");
    for id in std::iter::once(&orphan)
        .chain(children.iter())
        .chain(std::iter::once(&parent))
    {
        call(&c, "DELETE", &format!("/v1/vms/{id}"), None)?;
    }
    call(&c, "DELETE", "/v1/snapshots/demo-base", None)?;
    println!("    all VMs deleted");
    println!("\nfigures:");
    steps::table(&figures);
    println!("demo done");
    drop(server);
    Ok(())
}
