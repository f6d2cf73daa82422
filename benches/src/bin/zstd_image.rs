//! Compressed memory images (issue 10): `memory.zst` frame sizes, a guest
//! restoring its working set from a compressed image against the raw image
//! and prefetched memory, a Firecracker-protocol client served from a
//! compressed image against Firecracker's example handler on the raw file,
//! and what a compressed restore costs other VMs.
//!
//! The image is realistic, not a pattern that compresses 1000:1: the bytes
//! of the system's shared libraries and binaries with about a third of the
//! pages zero (`pagefork_tests::realistic_memory`), made for each run.
//!
//! Usage: `zstd_image [--quick]`. Prints JSON rows.

use std::process::ExitCode;
use std::time::Instant;

use pagefork_benches::fc_handler::BaselineVm;
use pagefork_benches::mapping::PAGE;
use pagefork_benches::{Plan, Row, Stats};
use pagefork_tests::{
    bin, new_vm, op, pages_of, realistic_memory, zstd_source, RandomImage, TestServer,
};
use proto::api::{CreateVm, VmInfo};
use serde_json::Value;

const BENCH: &str = "zstd_image";
const TABLE: &str = "Compressed memory images: memory.zst (issue 10)";

/// Frame sizes measured, in KiB; the default is `zst::DEFAULT_FRAME_KIB`.
pub const FRAME_KIB: [u64; 4] = [4, 64, 256, 2048];

fn median(v: &[f64]) -> f64 {
    Stats::of(v).map_or(f64::NAN, |s| s.median)
}

/// Create a VM from `body`, touch all `pages`, delete it; the guest's
/// time (µs) and the VM's fault counters after the touch.
fn touch_vm(server: &TestServer, body: CreateVm, pages: u64) -> (f64, VmInfo) {
    let id = server.create_vm(&body);
    let v = server
        .try_exec(&id, &op::touch(0, pages, false))
        .unwrap_or_else(|v| panic!("touch on {id} failed: {v}"));
    let us = v.elapsed_us as f64;
    let vm = server.vm(&id);
    server.delete_vm(&id);
    (us, vm)
}

/// Decode every frame of `path` on one thread: uncompressed MB/s.
fn decode_mbps(path: &std::path::Path) -> f64 {
    let img = zst::Image::open(path).expect("open image");
    let mut dec = zstd::bulk::Decompressor::new().expect("decompressor");
    let mut scratch = Vec::new();
    let mut out = vec![0u8; img.frame_bytes(0)];
    let t = Instant::now();
    let mut bytes = 0u64;
    for f in 0..img.header().frames {
        if img.is_zero(f) {
            continue;
        }
        img.decode_frame(f, &mut dec, &mut scratch, &mut out)
            .expect("decode");
        bytes += img.frame_bytes(f) as u64;
    }
    bytes as f64 / 1e6 / t.elapsed().as_secs_f64()
}

/// `fc_client` touching `mib` MiB in order from `socket`: its µs and sum.
fn client_touch(socket: &std::path::Path, mib: u64) -> (f64, u64) {
    let out = std::process::Command::new(bin("fc_client"))
        .arg("--socket")
        .arg(socket)
        .arg("--mib")
        .arg(mib.to_string())
        .arg("touch-seq")
        .output()
        .expect("run fc_client");
    assert!(
        out.status.success(),
        "fc_client: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(line.lines().next().unwrap_or_default()).expect("JSON");
    (
        v["elapsed_us"].as_f64().expect("elapsed_us"),
        v["sum"].as_u64().expect("sum"),
    )
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    if !pagefork_tests::require_kvm_uffd() {
        eprintln!("{BENCH}: needs /dev/kvm and /dev/userfaultfd");
        return ExitCode::FAILURE;
    }
    let mib = plan.lazy_mib;
    let pages = pages_of(mib);
    eprintln!("{BENCH}: {mib} MiB realistic image, {} reps", plan.reps);
    let raw = RandomImage::from_bytes(realistic_memory(mib));
    let dir = tempfile::tempdir().expect("tempdir");

    // Compress once per frame size: ratio and one-thread decode speed.
    let mut images = Vec::new();
    for kib in FRAME_KIB {
        let path = dir.path().join(format!("memory-{kib}.zst"));
        let opts = zst::CompressOptions {
            frame_pages: u32::try_from(kib / 4).expect("small"),
            ..zst::CompressOptions::default()
        };
        let input = std::fs::File::open(raw.file.path()).expect("open raw");
        let t = Instant::now();
        let s = zst::compress(&input, &path, &opts, &mut |_, _| {}).expect("compress");
        let secs = t.elapsed().as_secs_f64();
        let ratio = s.memory_bytes as f64 / s.file_bytes as f64;
        let mbps = median(&(0..3).map(|_| decode_mbps(&path)).collect::<Vec<_>>());
        eprintln!(
            "  {kib} KiB frames: {ratio:.2}:1, decode {mbps:.0} MB/s, compress {:.0} MB/s",
            s.memory_bytes as f64 / 1e6 / secs
        );
        images.push((kib, path, ratio, mbps));
    }

    let server = TestServer::start();
    let mut zstd_us: Vec<Vec<f64>> = vec![Vec::new(); FRAME_KIB.len()];
    let mut zstd_faults: Vec<(f64, f64)> = vec![(0.0, 0.0); FRAME_KIB.len()];
    let (mut raw_us, mut pre_us) = (Vec::new(), Vec::new());
    for rep in 0..plan.reps {
        let (us, _) = touch_vm(
            &server,
            CreateVm {
                memory_source: Some(raw.source()),
                ..new_vm(mib)
            },
            pages,
        );
        raw_us.push(us);
        for (i, (_, path, _, _)) in images.iter().enumerate() {
            let (us, vm) = touch_vm(
                &server,
                CreateVm {
                    memory_source: Some(zstd_source(path)),
                    ..new_vm(mib)
                },
                pages,
            );
            zstd_us[i].push(us);
            zstd_faults[i] = (vm.faults.missing as f64, vm.faults.frame_waits as f64);
        }
        let (us, _) = touch_vm(
            &server,
            CreateVm {
                memory_source: Some(raw.source()),
                prefetch: true,
                ..new_vm(mib)
            },
            pages,
        );
        pre_us.push(us);
        eprintln!(
            "  rep {rep}: raw {:.0} us, zstd(256) {:.0} us",
            raw_us[rep], zstd_us[2][rep]
        );
    }
    for (i, (kib, _, ratio, mbps)) in images.iter().enumerate() {
        let default = *kib == zst::DEFAULT_FRAME_KIB;
        Row::new(
            BENCH,
            &format!("zst.restore.{kib}"),
            TABLE,
            &format!(
                "guest touches {mib} MiB: from memory.zst, {kib} KiB frames{}",
                if default { " (default)" } else { "" }
            ),
            "µs",
            &zstd_us[i],
            "same guest from the raw image (server defaults)",
            &raw_us,
        )
        .goal(if default { "≤ 1.3" } else { "report (frame-size choice)" })
        .note(format!(
            "ratio {ratio:.2}:1; one-thread decode {mbps:.0} MB/s; faults.missing {:.0}, frame_waits {:.0}",
            zstd_faults[i].0, zstd_faults[i].1
        ))
        .emit();
    }
    let d = FRAME_KIB
        .iter()
        .position(|k| *k == zst::DEFAULT_FRAME_KIB)
        .unwrap_or(0);
    Row::new(
        BENCH,
        "zst.restore.prefetch",
        TABLE,
        &format!("guest touches {mib} MiB: from memory.zst (default frames)"),
        "µs",
        &zstd_us[d],
        "prefetched memory (no faults)",
        &pre_us,
    )
    .goal("report")
    .emit();

    // A Firecracker-protocol client from memory.zst vs the example handler
    // on the raw file, sequential touch.
    let listener =
        server.add_listener(&server.listener_request("fc-zst", zstd_source(&images[d].1)));
    let socket = std::path::PathBuf::from(listener.socket);
    let len = usize::try_from(mib << 20).expect("fits");
    let expected: u64 = (0..len / PAGE)
        .map(|p| u64::from(raw.bytes[p * PAGE]))
        .sum();
    let order: Vec<usize> = (0..len / PAGE).collect();
    let data_bytes = zst::Image::open(&images[d].1)
        .map(|i| {
            (0..i.header().frames)
                .filter(|f| !i.is_zero(*f))
                .map(|f| i.frame_bytes(f) as f64)
                .sum::<f64>()
        })
        .unwrap_or(0.0);
    let decode_floor_us = data_bytes / images[d].3;
    let (mut fc_us, mut base_us) = (Vec::new(), Vec::new());
    for _ in 0..plan.reps {
        let (us, sum) = client_touch(&socket, mib);
        assert_eq!(sum, expected, "fc_client read wrong bytes from memory.zst");
        fc_us.push(us);
        let vm = BaselineVm::start(raw.file.path(), len).expect("baseline handler");
        let (took, sum) = vm.touch(&order);
        vm.finish().expect("baseline handler");
        assert_eq!(sum, expected, "baseline read wrong bytes");
        base_us.push(took.as_secs_f64() * 1e6);
    }
    Row::new(
        BENCH,
        "zst.fc",
        TABLE,
        &format!("Firecracker-protocol client touches {mib} MiB in order: pagefork from memory.zst (defaults)"),
        "µs",
        &fc_us,
        "Firecracker's example handler on the raw file (one 4 KiB UFFDIO_COPY per fault)",
        &base_us,
    )
    .goal("≤ 0.2")
    .note(format!(
        "floor: decoding the image's data frames on one thread takes {:.0} µs",
        decode_floor_us
    ))
    .emit();

    // Other VMs while one restores from memory.zst: a VM faulting one page
    // at a time from a raw image (every fault goes through the core
    // thread), alone and with a compressed restore running beside it.
    let other_mib = mib / 4;
    let other_pages = pages_of(other_mib);
    let other_body = CreateVm {
        memory_source: Some(raw.source()),
        fault_around_kib: Some(0),
        readahead_kib: Some(0),
        ..new_vm(other_mib)
    };
    let beside = |restore: CreateVm| {
        std::thread::scope(|s| {
            let h = s.spawn(|| touch_vm(&server, restore, pages));
            // Let the restore get going first.
            std::thread::sleep(std::time::Duration::from_millis(20));
            let us = touch_vm(&server, other_body.clone(), other_pages).0;
            let _ = h.join();
            us
        })
    };
    let (mut alone, mut beside_zst, mut beside_raw) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..plan.reps {
        alone.push(touch_vm(&server, other_body.clone(), other_pages).0);
        beside_zst.push(beside(CreateVm {
            memory_source: Some(zstd_source(&images[d].1)),
            ..new_vm(mib)
        }));
        beside_raw.push(beside(CreateVm {
            memory_source: Some(raw.source()),
            ..new_vm(mib)
        }));
    }
    Row::new(
        BENCH,
        "zst.others",
        TABLE,
        &format!(
            "another VM faulting {other_mib} MiB one page per fault, while a {mib} MiB VM restores from memory.zst"
        ),
        "µs",
        &beside_zst,
        "the same, beside a restore of the same guest from the raw image",
        &beside_raw,
    )
    .goal("≈ 1: unchanged within noise (the core thread never decodes)")
    .note(format!(
        "alone: {:.0} µs; 2 cores: the restoring vCPU and the decoder threads share them with the other VM's vCPU",
        median(&alone)
    ))
    .emit();
    ExitCode::SUCCESS
}
