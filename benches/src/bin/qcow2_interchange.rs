//! qcow2 interchange (issue 14), side by side with qemu-img in one run, on
//! an XFS (reflink=1) directory given as the first argument or
//! `$PAGEFORK_XFS_DIR`.
//!
//! The image: 4 GiB virtual (quick: 256 MiB) with 512 MiB of data (quick:
//! 64 MiB), then 10 internal snapshots (quick: 2), each followed by 32 MiB
//! (quick: 4 MiB) of new writes: 11 states in all. Baseline outputs are
//! deleted once timed, so the run needs about twice the image's space. (The baselines write
//! every state in full: about 11 GiB of raw and qcow2 files at the peak.)
//!
//! 1. Import (`VolumeEngine::import_qcow2`: every state as a volume or
//!    volume snapshot) against `qemu-img convert -O raw` of every state
//!    (`-l snapshot.name=S` for each snapshot, plus the active image): the
//!    same data out of the same file.
//! 2. Export of the imported volume with its snapshots to one qcow2 file
//!    against `qemu-img convert -O qcow2` of each of the 11 raw states.
//! 3. Internal snapshot create on the 4 GiB image (`qcow2::ops::create`)
//!    against `qemu-img snapshot -c`, each on its own reflinked copy.
//!
//! Usage: `qcow2_interchange [XFS_DIR] [--quick]`. Prints JSON rows.

use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use pagefork_benches::{Plan, Row};
use qcow2::ops::{self, SnapshotTime};
use volume::{Reflink, VolumeEngine};

const BENCH: &str = "qcow2_interchange";
const TABLE: &str = "qcow2 interchange: import, export, internal snapshot (issue 14)";
const MIB: u64 = 1 << 20;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn run(cmd: &str, args: &[&str]) -> Res<()> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    Ok(())
}

fn p(path: &Path) -> Res<&str> {
    path.to_str().ok_or_else(|| "non-UTF-8 path".into())
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

struct Sizes {
    virt: u64,
    data: u64,
    snaps: usize,
    delta: u64,
}

fn make_image(dir: &Path, s: &Sizes) -> Res<PathBuf> {
    let img = dir.join("src.qcow2");
    run(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", p(&img)?, &s.virt.to_string()],
    )?;
    run(
        "qemu-io",
        &[
            "-f",
            "qcow2",
            "-c",
            &format!("write -P 0x5a 0 {}", s.data),
            p(&img)?,
        ],
    )?;
    for i in 0..s.snaps {
        run("qemu-img", &["snapshot", "-c", &format!("s{i}"), p(&img)?])?;
        let at = (i as u64 * 3 * s.delta) % (s.virt - s.delta);
        run(
            "qemu-io",
            &[
                "-f",
                "qcow2",
                "-c",
                &format!("write -P {} {at} {}", 0x10 + i, s.delta),
                p(&img)?,
            ],
        )?;
    }
    Ok(img)
}

fn bench(dir: &Path, plan: &Plan) -> Res<()> {
    let s = if plan.quick {
        Sizes {
            virt: 256 * MIB,
            data: 64 * MIB,
            snaps: 2,
            delta: 4 * MIB,
        }
    } else {
        Sizes {
            virt: 4096 * MIB,
            data: 1024 * MIB,
            snaps: 10,
            delta: 64 * MIB,
        }
    };
    let work = dir.join("qcow2-bench");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work)?;
    eprintln!(
        "making the image ({} MiB virtual, {} snapshots) ...",
        s.virt / MIB,
        s.snaps
    );
    let img = make_image(&work, &s)?;
    let engine = VolumeEngine::open(&work.join("state")).map_err(|e| e.chain())?;
    if engine.reflink() != &Reflink::Supported {
        return Err(format!("{} cannot reflink", dir.display()).into());
    }
    let states: Vec<Option<String>> = (0..s.snaps)
        .map(|i| Some(format!("s{i}")))
        .chain(std::iter::once(None))
        .collect();

    // 1. Import vs qemu-img convert -O raw of every state.
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for rep in 0..plan.reps {
        let name = format!("imp{rep}");
        let t = Instant::now();
        engine
            .import_qcow2(&img, &name, &format!("{name}-"))
            .map_err(|e| e.chain())?;
        ours.push(ms(t));
        let mut took = 0.0;
        for st in &states {
            let raw = work.join("state.raw");
            let _ = fs::remove_file(&raw);
            let opt = st.as_ref().map(|n| format!("snapshot.name={n}"));
            let mut args = vec!["convert", "-O", "raw"];
            if let Some(o) = &opt {
                args.extend(["-l", o.as_str()]);
            }
            args.extend([p(&img)?, p(&raw)?]);
            let t = Instant::now();
            run("qemu-img", &args)?;
            took += ms(t);
            fs::remove_file(&raw)?;
        }
        theirs.push(took);
        if rep > 0 {
            for st in states.iter().flatten() {
                engine
                    .delete_snapshot(&format!("{name}-{st}"))
                    .map_err(|e| e.chain())?;
            }
            engine.delete(&name).map_err(|e| e.chain())?;
        }
    }
    Row::new(BENCH, "qcow2.import", TABLE, &format!("import {} MiB image, {} snapshots", s.virt / MIB, s.snaps), "ms", &ours, "qemu-img convert -O raw of every state", &theirs)
        .goal("≤ 1×")
        .note("pagefork writes the oldest state, then FICLONEs it per later state and rewrites only changed clusters (reflinked out of the qcow2 file where aligned)")
        .emit();

    // 2. Export vs qemu-img convert -O qcow2 of each raw state (the
    //    imported volume's files are exactly those states).
    let vol_dir = work.join("state/volumes/imp0");
    let mut raw_states: Vec<PathBuf> = states
        .iter()
        .flatten()
        .map(|n| vol_dir.join(format!("imp0-{n}")))
        .collect();
    raw_states.push(vol_dir.join("imp0"));
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for rep in 0..plan.reps {
        let out = work.join(format!("export{rep}.qcow2"));
        let t = Instant::now();
        engine.export_qcow2("imp0", &out).map_err(|e| e.chain())?;
        ours.push(ms(t));
        fs::remove_file(&out)?;
        let mut took = 0.0;
        for raw in &raw_states {
            let q = work.join("state.qcow2");
            let _ = fs::remove_file(&q);
            let t = Instant::now();
            run(
                "qemu-img",
                &["convert", "-f", "raw", "-O", "qcow2", p(raw)?, p(&q)?],
            )?;
            took += ms(t);
            fs::remove_file(&q)?;
        }
        theirs.push(took);
    }
    Row::new(BENCH, "qcow2.export", TABLE, &format!("export {} MiB volume, {} snapshots", s.virt / MIB, s.snaps), "ms", &ours, "qemu-img convert -O qcow2 of every state", &theirs)
        .goal("≤ 1×")
        .note("one qcow2 with shared clusters (from FIEMAP), data reflinked into it; the baseline writes one file per state")
        .emit();

    // 3. Internal snapshot create vs qemu-img snapshot -c.
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for rep in 0..plan.reps {
        let a = work.join(format!("ours{rep}.qcow2"));
        let b = work.join(format!("qemu{rep}.qcow2"));
        for c in [&a, &b] {
            run("cp", &["--reflink=always", p(&img)?, p(c)?])?;
        }
        let f = OpenOptions::new().read(true).write(true).open(&a)?;
        let t = Instant::now();
        ops::create(&f, "bench", SnapshotTime::now(), &mut ops::no_hook)?;
        ours.push(ms(t));
        let t = Instant::now();
        run("qemu-img", &["snapshot", "-c", "bench", p(&b)?])?;
        theirs.push(ms(t));
        drop(File::open(&a)?);
        fs::remove_file(&a)?;
        fs::remove_file(&b)?;
    }
    Row::new(
        BENCH,
        "qcow2.snapshot_create",
        TABLE,
        &format!("internal snapshot create, {} MiB image", s.virt / MIB),
        "ms",
        &ours,
        "qemu-img snapshot -c",
        &theirs,
    )
    .goal("≤ 1×")
    .note("same bytes as qemu-img's result; qemu-img's time includes its process start")
    .emit();
    let _ = fs::remove_dir_all(&work);
    Ok(())
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    let dir = pagefork_benches::sys::xfs_dir_arg();
    let Some(dir) = dir else {
        eprintln!("{BENCH}: give XFS_DIR or set PAGEFORK_XFS_DIR");
        return ExitCode::FAILURE;
    };
    match bench(&dir, &plan) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{BENCH}: {e}");
            ExitCode::FAILURE
        }
    }
}
