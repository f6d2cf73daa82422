//! Firecracker backend (issue 6): a Firecracker-like client touching all
//! of its anonymous guest memory (sequential and random page order), served
//! by the baseline handler that does what Firecracker's example on-demand
//! handler does (one UFFDIO_COPY of one 4 KiB page per fault from a
//! MAP_PRIVATE mapping of the image).
//!
//! pagefork's Firecracker listener is not built yet; its column says so
//! rather than showing a number. When it lands, measure it here with the
//! same client and image and fill `pagefork` in.
//!
//! Usage: `fc_baseline [--quick]`. Prints JSON rows.

use std::process::ExitCode;

use pagefork_benches::fc_handler::BaselineVm;
use pagefork_benches::mapping::{Mapping, PAGE};
use pagefork_benches::{Plan, Row, Stats};
use pagefork_tests::{pages_of, RandomImage};
use rand::seq::SliceRandom;
use rand::SeedableRng;

const BENCH: &str = "fc_baseline";
const TABLE: &str = "Firecracker backend: restore touch (issue 6)";

/// Touch `order` on memory that already holds the image (no faults).
fn floor_us(image: &[u8], order: &[usize]) -> f64 {
    let m = Mapping::anonymous(image.len()).unwrap_or_else(|e| panic!("map floor memory: {e}"));
    // SAFETY: m is a fresh read-write mapping of image.len() bytes.
    unsafe { std::ptr::copy_nonoverlapping(image.as_ptr(), m.ptr(), image.len()) };
    let t = std::time::Instant::now();
    let mut sum = 0u64;
    for &p in order {
        // SAFETY: p * PAGE < image.len() == m.len().
        sum += u64::from(unsafe { m.ptr().add(p * PAGE).read_volatile() });
    }
    std::hint::black_box(sum);
    t.elapsed().as_secs_f64() * 1e6
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    let mib = plan.fc_mib;
    let pages = usize::try_from(pages_of(mib)).expect("pages fit in usize");
    let len = pages * PAGE;
    eprintln!("{BENCH}: {mib} MiB, {} reps", plan.reps);
    let image = RandomImage::new(mib, 0xf1c);
    let expected: u64 = (0..pages).map(|p| u64::from(image.bytes[p * PAGE])).sum();

    let sequential: Vec<usize> = (0..pages).collect();
    let mut random = sequential.clone();
    random.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));

    for (key, label, order) in [
        ("fc.seq", "sequential", &sequential),
        ("fc.rand", "random", &random),
    ] {
        let mut times = Vec::new();
        let mut copies = 0;
        for _ in 0..plan.reps {
            let vm = match BaselineVm::start(image.file.path(), len) {
                Ok(vm) => vm,
                Err(e) => {
                    eprintln!("{BENCH}: cannot start the baseline handler: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let (took, sum) = vm.touch(order);
            let stats = match vm.finish() {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("{BENCH}: baseline handler failed: {e}");
                    return ExitCode::FAILURE;
                }
            };
            if sum != expected {
                eprintln!("{BENCH}: client read wrong bytes (sum {sum}, expected {expected})");
                return ExitCode::FAILURE;
            }
            copies = stats.copies;
            times.push(took.as_secs_f64() * 1e6);
        }
        let floor = Stats::of(
            &(0..plan.reps)
                .map(|_| floor_us(&image.bytes, order))
                .collect::<Vec<_>>(),
        )
        .map_or(f64::NAN, |s| s.median);
        Row::new(
            BENCH,
            key,
            TABLE,
            &format!("client touches {mib} MiB of anonymous memory ({pages} pages, {label} order)"),
            "µs",
            &[],
            "one UFFDIO_COPY of one 4 KiB page per fault (Firecracker's example handler)",
            &times,
        )
        .goal("pagefork (single page, fault-around, working set) faster than the baseline")
        .note(format!(
            "pagefork: not yet available (Firecracker listener not built); baseline did {copies} UFFDIO_COPYs; \
             same touch on pre-populated memory: {floor:.0} µs"
        ))
        .emit();
    }
    ExitCode::SUCCESS
}
