//! Snapshot cost versus volume size, against a plain copy.
//!
//! On an XFS (reflink=1) directory, fills a 1 GiB and a 16 GiB volume with
//! data, then times (median of 5) one engine snapshot of each, a
//! `cp --reflink=never` of the 1 GiB volume (plus fsync, as the snapshot
//! also syncs), and 100 clones of one snapshot. The goal is
//! snapshot16/snapshot1 ≈ 1, both in milliseconds.
//!
//! The 16 GiB volume is filled by FICLONERANGE-sharing the 1 GiB volume's
//! extents 16 times: a fully allocated file of real extents in seconds.
//! `--write-all` writes 16 GiB of fresh bytes instead (minutes on slow
//! disks).
//!
//! Usage: `volume_snapshot [DIR] [--json PATH] [--write-all]`, DIR defaulting
//! to `$PAGEFORK_XFS_DIR`.

use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use volume::{Reflink, VolumeEngine};

const GIB: u64 = 1 << 30;
const CHUNK: usize = 8 << 20;
const RUNS: usize = 5;
const CLONES: usize = 100;

struct Args {
    dir: PathBuf,
    json: Option<PathBuf>,
    write_all: bool,
}

fn parse_args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut dir = std::env::var_os("PAGEFORK_XFS_DIR").map(PathBuf::from);
    let (mut json, mut write_all) = (None, false);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--json" => json = Some(PathBuf::from(it.next().ok_or("--json needs a PATH")?)),
            "--write-all" => write_all = true,
            "-h" | "--help" => {
                return Err("usage: volume_snapshot [DIR] [--json PATH] [--write-all]".into())
            }
            _ => dir = Some(PathBuf::from(a)),
        }
    }
    let dir =
        dir.ok_or("give DIR or set PAGEFORK_XFS_DIR (scripts/xfs-loop.sh up DIR makes one)")?;
    Ok(Args {
        dir,
        json,
        write_all,
    })
}

/// Fill `len` bytes of `path` from `offset` with fresh pseudo-random data.
fn write_data(
    path: &Path,
    offset: u64,
    len: u64,
    seed: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| format!("open {}: {e}", path.display()))?;
    let mut buf = vec![0u8; CHUNK];
    let mut x = seed | 1;
    let mut done = 0u64;
    while done < len {
        for word in buf.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            word.copy_from_slice(&x.to_le_bytes());
        }
        f.write_all_at(&buf, offset + done)
            .map_err(|e| format!("write {}: {e}", path.display()))?;
        done += CHUNK as u64;
    }
    f.sync_all()
        .map_err(|e| format!("fsync {}: {e}", path.display()).into())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median time of `RUNS` snapshots of `vol` (each deleted afterwards, untimed).
fn time_snapshots(e: &VolumeEngine, vol: &str) -> Result<f64, Box<dyn std::error::Error>> {
    let mut times = Vec::new();
    for i in 0..RUNS {
        let name = format!("{vol}-snap{i}");
        let t = Instant::now();
        e.snapshot(vol, &name).map_err(|e| e.chain())?;
        times.push(ms(t.elapsed()));
        e.delete_snapshot(&name).map_err(|e| e.chain())?;
    }
    Ok(median(times))
}

/// Median time of `RUNS` `cp --reflink=never` + fsync of `src`.
fn time_cp(src: &Path, dir: &Path) -> Result<f64, Box<dyn std::error::Error>> {
    let mut times = Vec::new();
    for i in 0..RUNS {
        let dst = dir.join(format!("cp-{i}"));
        let t = Instant::now();
        let status = Command::new("cp")
            .arg("--reflink=never")
            .arg(src)
            .arg(&dst)
            .status()
            .map_err(|e| format!("cannot run cp: {e}"))?;
        if !status.success() {
            return Err(format!("cp failed: {status}").into());
        }
        fs::File::open(&dst)
            .and_then(|f| f.sync_all())
            .map_err(|e| format!("fsync copy: {e}"))?;
        times.push(ms(t.elapsed()));
        fs::remove_file(&dst).map_err(|e| format!("remove copy: {e}"))?;
    }
    Ok(median(times))
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let root = args.dir.join("bench-volume-snapshot");
    let _ = fs::remove_dir_all(&root);
    fs::create_dir_all(&root).map_err(|e| format!("create {}: {e}", root.display()))?;
    let e = VolumeEngine::open(&root).map_err(|e| e.chain())?;
    if let Reflink::Unsupported { fs, .. } = e.reflink() {
        return Err(format!(
            "{} is on {fs}; use XFS with reflink=1 (scripts/xfs-loop.sh up DIR)",
            root.display()
        )
        .into());
    }

    eprintln!("filling the 1 GiB volume ...");
    let t = Instant::now();
    e.create("v1g", GIB).map_err(|e| e.chain())?;
    write_data(&e.volume_path("v1g"), 0, GIB, 1)?;
    eprintln!("  {:.1} s", t.elapsed().as_secs_f64());

    eprintln!(
        "filling the 16 GiB volume ({}) ...",
        if args.write_all {
            "writing"
        } else {
            "FICLONERANGE x16"
        }
    );
    let t = Instant::now();
    e.create("v16g", 16 * GIB).map_err(|e| e.chain())?;
    if args.write_all {
        write_data(&e.volume_path("v16g"), 0, 16 * GIB, 2)?;
    } else {
        let open = |p: PathBuf| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(&p)
                .map_err(|e| format!("open {}: {e}", p.display()))
        };
        let (src, dst) = (open(e.volume_path("v1g"))?, open(e.volume_path("v16g"))?);
        for k in 0..16 {
            reflink::ficlonerange(&dst, k * GIB, &src, 0, GIB)
                .map_err(|e| format!("FICLONERANGE: {e}"))?;
        }
        dst.sync_all().map_err(|e| format!("fsync: {e}"))?;
    }
    eprintln!("  {:.1} s", t.elapsed().as_secs_f64());
    let v16 = e.show("v16g").map_err(|e| e.chain())?;
    if v16.usage.allocated_bytes < 16 * GIB {
        return Err(format!("16 GiB volume is not fully allocated: {:?}", v16.usage).into());
    }

    let snap1 = time_snapshots(&e, "v1g")?;
    let snap16 = time_snapshots(&e, "v16g")?;
    let cp = time_cp(&e.volume_path("v1g"), &root)?;

    e.snapshot("v1g", "base").map_err(|e| e.chain())?;
    let t = Instant::now();
    for i in 0..CLONES {
        e.clone_snapshot("base", &format!("clone{i}"))
            .map_err(|e| e.chain())?;
    }
    let clones = ms(t.elapsed());

    println!("| operation | time |");
    println!("|---|---:|");
    println!("| snapshot, 1 GiB volume (median of {RUNS}) | {snap1:.2} ms |");
    println!("| snapshot, 16 GiB volume (median of {RUNS}) | {snap16:.2} ms |");
    println!("| cp --reflink=never + fsync, 1 GiB (median of {RUNS}) | {cp:.1} ms |");
    println!(
        "| {CLONES} clones of one snapshot | {clones:.1} ms ({:.2} ms each) |",
        clones / CLONES as f64
    );
    println!();
    println!("| ratio | value |");
    println!("|---|---:|");
    println!("| snapshot16 / snapshot1 | {:.2} |", snap16 / snap1);
    println!("| cp / snapshot1 | {:.0} |", cp / snap1);

    if let Some(path) = &args.json {
        let line = serde_json::json!({
            "bench": "volume_snapshot",
            "snapshot_1g_ms": snap1,
            "snapshot_16g_ms": snap16,
            "cp_1g_ms": cp,
            "clones": CLONES,
            "clones_total_ms": clones,
            "ratio_snapshot16_snapshot1": snap16 / snap1,
            "ratio_cp_snapshot1": cp / snap1,
            "fill_16g": if args.write_all { "write" } else { "ficlonerange" },
        });
        fs::write(path, format!("{line}\n"))
            .map_err(|e| format!("write {}: {e}", path.display()))?;
    }
    let _ = fs::remove_dir_all(&root);
    Ok(())
}

fn main() -> ExitCode {
    let result = parse_args().and_then(|a| run(&a));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("volume_snapshot: {msg}");
            ExitCode::FAILURE
        }
    }
}
