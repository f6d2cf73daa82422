//! A stand-in for Firecracker's "Uffd" memory backend, for tests and
//! benchmarks: it does on the wire and in memory what Firecracker does when
//! it restores a snapshot with `mem_backend.backend_type = "Uffd"`.
//!
//! 1. mmap anonymous MAP_PRIVATE guest memory (MAP_HUGETLB for 2 MiB pages);
//! 2. create a userfaultfd with EVENT_REMOVE and register the memory MISSING;
//! 3. connect to the socket and send ONE message: the JSON region array
//!    (`base_host_virt_addr`, `size`, `offset`, `page_size`,
//!    `page_size_kib`) with the uffd as the only SCM_RIGHTS fd;
//! 4. keep the socket open while it runs the commands given on the command
//!    line, printing one JSON line per command.
//!
//! Commands: `touch-seq`, `touch-seq-latency` (also the p50/p99 time of
//! one page's read), `touch-random:SEED`, `check:IMAGE` (compare every
//! byte with the image), `remove:START:PAGES` (madvise DONTNEED),
//! `zero:START:PAGES` (count non-zero pages), `sleep:MS`, `hold` (wait for
//! stdin to close).

use std::io::{IoSlice, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Instant;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use proto::firecracker::GuestRegionUffdMapping;
use userfaultfd::{FeatureFlags, UffdBuilder};

const PAGE: usize = 4096;

struct Args {
    socket: String,
    mib: usize,
    page_size: usize,
    offset: u64,
    commands: Vec<String>,
}

fn parse_args() -> Result<Args, Box<dyn std::error::Error>> {
    let mut a = Args {
        socket: String::new(),
        mib: 64,
        page_size: PAGE,
        offset: 0,
        commands: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut val = || it.next().ok_or(format!("{x} needs a value"));
        match x.as_str() {
            "--socket" => a.socket = val()?,
            "--mib" => a.mib = val()?.parse().map_err(|e| format!("--mib: {e}"))?,
            "--page-size" => {
                a.page_size = val()?.parse().map_err(|e| format!("--page-size: {e}"))?
            }
            "--offset" => a.offset = val()?.parse().map_err(|e| format!("--offset: {e}"))?,
            _ => a.commands.push(x),
        }
    }
    if a.socket.is_empty() {
        return Err(
            "usage: fc_client --socket PATH [--mib N] [--page-size B] [--offset B] COMMAND..."
                .into(),
        );
    }
    Ok(a)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("fc_client: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let len = args.mib << 20;
    let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    if args.page_size == 2 << 20 {
        flags |= libc::MAP_HUGETLB;
    }
    // SAFETY: a fresh anonymous mapping; we own it for the process's life.
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            -1,
            0,
        )
    };
    if mem == libc::MAP_FAILED {
        return Err(format!("mmap {len} bytes: {}", std::io::Error::last_os_error()).into());
    }
    let uffd = UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(false)
        .require_features(FeatureFlags::EVENT_REMOVE)
        .create()
        .map_err(|e| format!("create uffd: {e}"))?;
    uffd.register(mem, len)
        .map_err(|e| format!("register: {e}"))?;
    let page_size = u64::try_from(args.page_size).map_err(|e| format!("page size: {e}"))?;
    let regions = [GuestRegionUffdMapping {
        base_host_virt_addr: mem as u64,
        size: u64::try_from(len).map_err(|e| format!("size: {e}"))?,
        offset: args.offset,
        page_size: Some(page_size),
        page_size_kib: Some(page_size),
    }];
    let body = serde_json::to_string(&regions).map_err(|e| format!("regions: {e}"))?;
    let stream =
        UnixStream::connect(&args.socket).map_err(|e| format!("connect {}: {e}", args.socket))?;
    let fds = [uffd.as_raw_fd()];
    sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(body.as_bytes())],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .map_err(|e| format!("sendmsg: {e}"))?;
    // SAFETY: `mem` is our mapping of `len` bytes; accesses through this
    // slice fault into the server, which installs the pages.
    let bytes = unsafe { std::slice::from_raw_parts_mut(mem.cast::<u8>(), len) };
    let pages = len / PAGE;
    for cmd in &args.commands {
        let t = Instant::now();
        let parts: Vec<&str> = cmd.split(':').collect();
        let out = match parts.as_slice() {
            ["touch-seq-latency"] => {
                // One clock read per page: the time each read took (a
                // fault's whole round trip when the page was missing).
                let mut lat = Vec::with_capacity(pages);
                let mut sum = 0u64;
                let mut before = Instant::now();
                for p in 0..pages {
                    // SAFETY: in bounds; volatile so the read happens.
                    sum = sum.wrapping_add(u64::from(unsafe {
                        std::ptr::read_volatile(&bytes[p * PAGE])
                    }));
                    let after = Instant::now();
                    lat.push(u64::try_from((after - before).as_nanos()).unwrap_or(u64::MAX));
                    before = after;
                }
                lat.sort_unstable();
                let q = |f: usize| lat.get((lat.len() * f).div_ceil(100).max(1) - 1).copied();
                serde_json::json!({ "sum": sum, "p50_ns": q(50), "p99_ns": q(99) })
            }
            ["touch-seq"] => {
                let mut sum = 0u64;
                for p in 0..pages {
                    // SAFETY: in bounds; volatile so the read happens.
                    sum = sum.wrapping_add(u64::from(unsafe {
                        std::ptr::read_volatile(&bytes[p * PAGE])
                    }));
                }
                serde_json::json!({ "sum": sum })
            }
            ["touch-random", seed] => {
                let mut order: Vec<usize> = (0..pages).collect();
                let mut x: u64 = seed.parse().map_err(|e| format!("{cmd}: {e}"))?;
                for i in (1..order.len()).rev() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    order.swap(i, shared::geometry::usize_of(x % (i as u64 + 1)));
                }
                let mut sum = 0u64;
                for p in order {
                    // SAFETY: in bounds; volatile so the read happens.
                    sum = sum.wrapping_add(u64::from(unsafe {
                        std::ptr::read_volatile(&bytes[p * PAGE])
                    }));
                }
                serde_json::json!({ "sum": sum })
            }
            ["check", image] => {
                let mut f = std::fs::File::open(image).map_err(|e| format!("{image}: {e}"))?;
                let mut img = Vec::new();
                f.read_to_end(&mut img)
                    .map_err(|e| format!("{image}: {e}"))?;
                let off = usize::try_from(args.offset).unwrap_or(usize::MAX);
                let mut bad = 0u64;
                let mut first_bad = None;
                for p in 0..pages {
                    let want = img.get(off + p * PAGE..off + (p + 1) * PAGE);
                    let got = &bytes[p * PAGE..(p + 1) * PAGE];
                    let ok = match want {
                        Some(w) => w == got,
                        None => got.iter().all(|b| *b == 0),
                    };
                    if !ok {
                        bad += 1;
                        first_bad.get_or_insert(p);
                    }
                }
                serde_json::json!({ "mismatched_pages": bad, "first_mismatch": first_bad })
            }
            ["remove", start, n] => {
                let (s, n): (usize, usize) = (
                    start.parse().map_err(|e| format!("{cmd}: {e}"))?,
                    n.parse().map_err(|e| format!("{cmd}: {e}"))?,
                );
                // SAFETY: the range lies inside our mapping.
                let r = unsafe {
                    libc::madvise(
                        bytes.as_mut_ptr().add(s * PAGE).cast(),
                        n * PAGE,
                        libc::MADV_DONTNEED,
                    )
                };
                if r != 0 {
                    return Err(format!("madvise: {}", std::io::Error::last_os_error()).into());
                }
                serde_json::json!({ "removed": n })
            }
            ["race-remove", image, start, n, rounds] => {
                // One thread discards the range again and again while this
                // one reads it: every read must be the image's page or
                // zeroes, never anything else, and nothing may hang.
                let img = std::fs::read(image).map_err(|e| format!("{image}: {e}"))?;
                let (s, n, rounds): (usize, usize, usize) = (
                    start.parse().map_err(|e| format!("{cmd}: {e}"))?,
                    n.parse().map_err(|e| format!("{cmd}: {e}"))?,
                    rounds.parse().map_err(|e| format!("{cmd}: {e}"))?,
                );
                let base = bytes.as_mut_ptr() as usize + s * PAGE;
                let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
                let stop2 = stop.clone();
                let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
                let done2 = done.clone();
                let remover = std::thread::spawn(move || {
                    let mut removes = 0u64;
                    while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                        // SAFETY: the range lies inside our mapping, which
                        // outlives this thread (joined below).
                        unsafe {
                            libc::madvise(base as *mut libc::c_void, n * PAGE, libc::MADV_DONTNEED)
                        };
                        removes += 1;
                        done2.store(removes, std::sync::atomic::Ordering::Relaxed);
                        // A balloon discards now and then, not in a tight
                        // loop: one that never pauses keeps a REMOVE pending
                        // nearly all the time, and installs fail with EAGAIN
                        // until it stops.
                        std::thread::sleep(std::time::Duration::from_micros(300));
                    }
                    removes
                });
                let off = usize::try_from(args.offset).unwrap_or(usize::MAX);
                let mut bad = 0u64;
                // At least `rounds` rounds, and on until the discards have
                // really raced the reads (a fast reader on an idle machine
                // can finish before the other thread first runs), within
                // 20 s.
                let t0 = std::time::Instant::now();
                let mut round = 0;
                while round < rounds
                    || (done.load(std::sync::atomic::Ordering::Relaxed) < 20
                        && t0.elapsed() < std::time::Duration::from_secs(20))
                {
                    round += 1;
                    for p in s..s + n {
                        // SAFETY: in bounds; volatile so every read faults
                        // in again after a discard.
                        let page: Vec<u8> = (0..PAGE)
                            .step_by(512)
                            .map(|i| unsafe { std::ptr::read_volatile(&bytes[p * PAGE + i]) })
                            .collect();
                        let want = img.get(off + p * PAGE..off + (p + 1) * PAGE).unwrap_or(&[]);
                        // The samples of one page are not read at one
                        // instant: a discard between two of them makes the
                        // later ones read the page anew (zero or image).
                        // Each sample must be the image's byte or zero.
                        let good = want.len() == PAGE
                            && page
                                .iter()
                                .enumerate()
                                .all(|(k, b)| *b == want[k * 512] || *b == 0);
                        if !good {
                            bad += 1;
                        }
                    }
                }
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                let removes = remover
                    .join()
                    .map_err(|_| "remover thread panicked".to_owned())?;
                serde_json::json!({ "bad_reads": bad, "removes": removes })
            }
            ["zero", start, n] => {
                let (s, n): (usize, usize) = (
                    start.parse().map_err(|e| format!("{cmd}: {e}"))?,
                    n.parse().map_err(|e| format!("{cmd}: {e}"))?,
                );
                let nonzero = (s..s + n)
                    .filter(|p| bytes[p * PAGE..(p + 1) * PAGE].iter().any(|b| *b != 0))
                    .count();
                serde_json::json!({ "nonzero_pages": nonzero })
            }
            ["write", start, n] => {
                let (s, n): (usize, usize) = (
                    start.parse().map_err(|e| format!("{cmd}: {e}"))?,
                    n.parse().map_err(|e| format!("{cmd}: {e}"))?,
                );
                for p in s..s + n {
                    bytes[p * PAGE] = 0xAB;
                }
                serde_json::json!({ "written": n })
            }
            ["sleep", ms] => {
                std::thread::sleep(std::time::Duration::from_millis(ms.parse().unwrap_or(0)));
                serde_json::json!({})
            }
            ["hold"] => {
                let mut sink = Vec::new();
                let _ = std::io::stdin().read_to_end(&mut sink);
                serde_json::json!({})
            }
            _ => return Err(format!("unknown command {cmd}").into()),
        };
        let mut out = out;
        out["cmd"] = serde_json::json!(cmd);
        out["elapsed_us"] =
            serde_json::json!(u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX));
        println!("{out}");
    }
    drop(stream);
    Ok(())
}
