//! Assemble the benchmark report from the outputs of one run.
//!
//! Usage: `bench_report --dir DIR --out FILE --command CMD [--commit C]
//! [--date D] [--build B] [--quick]`
//!
//! DIR holds, per bench, `<bench>.status` (its exit code, written by
//! `scripts/bench.sh`) and its output: `<bench>.jsonl` (rows), or for the
//! volume bench `volume_snapshot.json`. Exits non-zero when a bench failed
//! or an expected row is missing; never judges a timing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use pagefork_benches::plan::BENCHES;
use pagefork_benches::report::{render, volume_rows, BenchOutput, RunInfo};
use pagefork_benches::sys::{cpu_model, cpus, kernel_release, meminfo_kib};
use pagefork_benches::{Plan, Row};

struct Args {
    dir: PathBuf,
    out: PathBuf,
    info: RunInfo,
    quick: bool,
}

fn parse_args() -> Result<Args, Box<dyn std::error::Error>> {
    let (mut dir, mut out) = (None, None);
    let mut info = RunInfo::default();
    let mut quick = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--dir" => dir = Some(PathBuf::from(val()?)),
            "--out" => out = Some(PathBuf::from(val()?)),
            "--command" => info.command = val()?,
            "--commit" => info.commit = val()?,
            "--date" => info.date = val()?,
            "--build" => info.build = val()?,
            "--quick" => quick = true,
            _ => return Err(format!("unknown argument {a}").into()),
        }
    }
    let dir = dir.ok_or("--dir DIR is required")?;
    let out = out.ok_or("--out FILE is required")?;
    info.cpus = cpus();
    info.cpu_model = cpu_model();
    info.kernel = kernel_release();
    info.mem_total_kib = meminfo_kib("MemTotal").unwrap_or(0);
    Ok(Args {
        dir,
        out,
        info,
        quick,
    })
}

fn load(dir: &Path, bench: &str) -> BenchOutput {
    let mut out = BenchOutput::default();
    match std::fs::read_to_string(dir.join(format!("{bench}.status"))) {
        Ok(s) if s.trim() == "0" => {}
        Ok(s) => out.failure = Some(format!("exited with status {}", s.trim())),
        Err(_) => out.failure = Some("did not run".into()),
    }
    let rows = if bench == "volume_snapshot" {
        std::fs::read_to_string(dir.join("volume_snapshot.json"))
            .map_err(|e| format!("no volume_snapshot.json: {e}"))
            .and_then(|t| {
                serde_json::from_str(&t).map_err(|e| format!("bad volume_snapshot.json: {e}"))
            })
            .and_then(|v| volume_rows(&v).map_err(|e| e.to_string()))
    } else {
        std::fs::read_to_string(dir.join(format!("{bench}.jsonl")))
            .map_err(|e| format!("no {bench}.jsonl: {e}"))
            .and_then(|t| {
                t.lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(|l| {
                        serde_json::from_str::<Row>(l).map_err(|e| format!("bad row {l:?}: {e}"))
                    })
                    .collect()
            })
    };
    match rows {
        Ok(r) => out.rows = r,
        Err(e) if out.failure.is_none() => out.failure = Some(e),
        Err(_) => {}
    }
    out
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench_report: {e}");
            return ExitCode::from(2);
        }
    };
    let plan = Plan::new(args.quick);
    let outputs: BTreeMap<String, BenchOutput> = BENCHES
        .iter()
        .map(|b| ((*b).to_owned(), load(&args.dir, b)))
        .collect();
    let (md, problems) = render(&args.info, &plan, &outputs);
    if let Err(e) = std::fs::write(&args.out, md) {
        eprintln!("bench_report: cannot write {}: {e}", args.out.display());
        return ExitCode::FAILURE;
    }
    eprintln!("bench_report: wrote {}", args.out.display());
    if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        for p in &problems {
            eprintln!("bench_report: {p}");
        }
        ExitCode::FAILURE
    }
}
