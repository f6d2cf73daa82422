//! Guest block device throughput (issue 13) against the host writing and
//! reading the same bytes, side by side in one run. The server's state
//! directory (and so the volume) and the host's file are on the XFS
//! (reflink=1) given as the first argument or `$PAGEFORK_XFS_DIR`.
//!
//! 1. Writes: the guest's `disk_write_pages` of its own RAM to a volume
//!    attached to the VM (through the server's API, the VMM and KVM) in
//!    requests of 1 MiB, the device reading guest RAM as DMA would (the
//!    goal's row); and the guest's `disk_fill`, which makes each sector's
//!    data with a store of its own, in requests of 2048 sectors (1 MiB, the
//!    default) and of one sector (the first device); each against host
//!    `pwrite`s of 1 MiB into a file of the same size.
//! 2. Reads: the guest's `disk_checksum` of the volume, against host
//!    `pread`s of 1 MiB of the file.
//!
//! Both sides overwrite (and reread) bytes already written once, untimed,
//! so neither pays for block allocation and both hit the page cache. The
//! guest's time is the VMM's own time of the op (`elapsed_us`), without the
//! API round trip. Figures are MiB/s; ratio = guest / host.
//!
//! Usage: `disk_throughput [XFS_DIR] [--quick]`. Prints JSON rows.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use pagefork_benches::{Plan, Row};
use pagefork_tests::{new_vm, TestServer};
use proto::api::{CreateVm, ExecRequest};
use shared::pattern::{disk_word, MAX_SECTORS_PER_IO, SECTOR_SIZE};

const BENCH: &str = "disk_throughput";
const TABLE: &str = "Guest block device throughput (issue 13)";
const MIB: u64 = 1 << 20;
const CHUNK: usize = 1 << 20;

/// Sizes of one run.
struct Sizes {
    /// MiB moved per multi-sector op.
    multi_mib: u64,
    /// MiB moved per one-sector-per-request op (slow: an exit per sector).
    one_mib: u64,
}

impl Sizes {
    fn of(plan: &Plan) -> Sizes {
        if plan.quick {
            Sizes {
                multi_mib: 16,
                one_mib: 2,
            }
        } else {
            Sizes {
                multi_mib: 256,
                one_mib: 32,
            }
        }
    }
}

/// Run one disk op; returns MiB/s by the VMM's time of the op.
fn guest_op(s: &TestServer, vm: &str, body: &ExecRequest, mib: u64) -> f64 {
    let v = s
        .try_exec(vm, body)
        .unwrap_or_else(|v| panic!("exec {body:?}: {v}"));
    let us = v.elapsed_us.max(1);
    mib as f64 / (us as f64 / 1e6)
}

/// Sectors per request as the request's field.
fn per_request(per_io: u64) -> Option<u32> {
    Some(u32::try_from(per_io).expect("sectors per request fit in u32"))
}

fn fill(per_io: u64, mib: u64, seed: u64) -> ExecRequest {
    ExecRequest::DiskFill {
        sector: 0,
        count: mib * MIB / SECTOR_SIZE,
        seed,
        sectors_per_io: per_request(per_io),
    }
}

fn checksum(per_io: u64, mib: u64) -> ExecRequest {
    ExecRequest::DiskChecksum {
        sector: 0,
        count: mib * MIB / SECTOR_SIZE,
        sectors_per_io: per_request(per_io),
    }
}

/// The bytes `disk_fill` of `seed` writes to the 1 MiB chunk `chunk`.
fn fill_chunk(buf: &mut [u8], chunk: u64, seed: u64) {
    buf.fill(0);
    let first = chunk * MIB / SECTOR_SIZE;
    for (i, sector) in buf.chunks_exact_mut(512).enumerate() {
        sector[..8].copy_from_slice(&disk_word(seed, first + i as u64).to_le_bytes());
    }
}

/// Host baseline: `pwrite` `mib` MiB in 1 MiB writes; MiB/s. The data is
/// made before the clock starts (the guest's pattern words cost it time,
/// so this favours the host).
fn host_pwrite(path: &Path, mib: u64, seed: u64) -> f64 {
    let f = OpenOptions::new()
        .write(true)
        .mode(0o600)
        .open(path)
        .expect("open the baseline file");
    let mut bufs = vec![vec![0u8; CHUNK]; 2];
    fill_chunk(&mut bufs[0], 0, seed);
    fill_chunk(&mut bufs[1], 1, seed);
    let t = Instant::now();
    for c in 0..mib {
        f.write_all_at(&bufs[usize::from(c % 2 == 1)], c * MIB)
            .expect("baseline pwrite");
    }
    mib as f64 / t.elapsed().as_secs_f64()
}

/// Host baseline: `pread` `mib` MiB in 1 MiB reads; MiB/s.
fn host_pread(path: &Path, mib: u64) -> f64 {
    let f = std::fs::File::open(path).expect("open the baseline file");
    let mut buf = vec![0u8; CHUNK];
    let mut h = 0u64;
    let t = Instant::now();
    for c in 0..mib {
        f.read_exact_at(&mut buf, c * MIB).expect("baseline pread");
        h = shared::pattern::fold(h, u64::from_le_bytes(buf[..8].try_into().unwrap_or([0; 8])));
    }
    let rate = mib as f64 / t.elapsed().as_secs_f64();
    std::hint::black_box(h);
    rate
}

fn run(plan: &Plan, s: &TestServer, xfs: &Path) {
    let sz = Sizes::of(plan);
    let vol_mib = sz.multi_mib.max(sz.one_mib);
    s.create_volume("bench-disk", vol_mib);
    // Guest RAM holds the pages `disk_write_pages` sends.
    let vm = s.create_vm(&CreateVm {
        volume: Some("bench-disk".into()),
        ..new_vm(sz.multi_mib.max(64))
    });
    let host = xfs.join(format!("pagefork-bench-disk-{}", std::process::id()));
    {
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&host)
            .expect("create the baseline file");
        f.set_len(vol_mib * MIB).expect("size the baseline file");
    }
    // Write everything once, untimed: both sides then overwrite.
    guest_op(s, &vm, &fill(MAX_SECTORS_PER_IO, vol_mib, 1), vol_mib);
    host_pwrite(&host, vol_mib, 1);

    let cases = [
        ("multi", MAX_SECTORS_PER_IO, sz.multi_mib),
        ("one", 1, sz.one_mib),
    ];
    // Pages with data in every one (two pattern words each), faulted in
    // and written out once untimed.
    let pages = sz.multi_mib * MIB / 4096;
    s.exec(
        &vm,
        &ExecRequest::Fill {
            start_page: None,
            pages: Some(pages),
            seed: 3,
        },
    );
    let write_pages = ExecRequest::DiskWritePages {
        start_page: None,
        pages: Some(pages),
        sector: 0,
        sectors_per_io: None,
    };
    guest_op(s, &vm, &write_pages, sz.multi_mib);
    let (mut guest, mut base) = (Vec::new(), Vec::new());
    for rep in 0..plan.reps {
        guest.push(guest_op(s, &vm, &write_pages, sz.multi_mib));
        base.push(host_pwrite(&host, sz.multi_mib, 10 + rep as u64));
    }
    Row::new(
        BENCH,
        "disk.write.pages",
        TABLE,
        &format!(
            "guest disk_write_pages of {} MiB of its RAM, 1 MiB per request",
            sz.multi_mib
        ),
        "MiB/s",
        &guest,
        "host pwrite of as many bytes, 1 MiB per call, same XFS",
        &base,
    )
    .goal("≥ 0.5 of host pwrite")
    .note(
        "one OUT exit per MiB; the VMM pwrites each request straight from its mapping of guest RAM",
    )
    .emit();

    for (name, per_io, mib) in cases {
        let (mut guest, mut base) = (Vec::new(), Vec::new());
        for rep in 0..plan.reps {
            let seed = 10 + rep as u64;
            guest.push(guest_op(s, &vm, &fill(per_io, mib, seed), mib));
            base.push(host_pwrite(&host, mib, seed));
        }
        Row::new(
            BENCH,
            &format!("disk.write.{name}"),
            TABLE,
            &format!(
                "guest disk_fill of {mib} MiB, {} per request",
                request_size(per_io)
            ),
            "MiB/s",
            &guest,
            "host pwrite of the same bytes, 1 MiB per call, same XFS",
            &base,
        )
        .goal(if per_io == MAX_SECTORS_PER_IO {
            "report (the guest computes a word per sector: guest-CPU bound)"
        } else {
            "report (the one-sector device, before issue 13)"
        })
        .note("the guest writes one word per sector; the VMM pwrites each request from its bounce buffer")
        .emit();
    }
    for (name, per_io, mib) in cases {
        let (mut guest, mut base) = (Vec::new(), Vec::new());
        for _ in 0..plan.reps {
            guest.push(guest_op(s, &vm, &checksum(per_io, mib), mib));
            base.push(host_pread(&host, mib));
        }
        Row::new(
            BENCH,
            &format!("disk.read.{name}"),
            TABLE,
            &format!(
                "guest disk_checksum of {mib} MiB, {} per request",
                request_size(per_io)
            ),
            "MiB/s",
            &guest,
            "host pread of the same bytes, 1 MiB per call",
            &base,
        )
        .goal("report")
        .note("the guest folds the first word of each sector (3 instructions each)")
        .emit();
    }
    let _ = std::fs::remove_file(&host);
    s.delete_vm(&vm);
}

fn request_size(per_io: u64) -> String {
    let bytes = per_io * SECTOR_SIZE;
    if bytes >= MIB {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{bytes} B")
    }
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    let xfs = pagefork_benches::sys::xfs_dir_arg();
    let Some(xfs) = xfs else {
        eprintln!("disk_throughput: give an XFS (reflink=1) directory or set PAGEFORK_XFS_DIR");
        return ExitCode::from(2);
    };
    // The harness makes its state directory under TMPDIR.
    std::env::set_var("TMPDIR", &xfs);
    let s = TestServer::start();
    run(&plan, &s, &xfs);
    ExitCode::SUCCESS
}
