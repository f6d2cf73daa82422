//! Seeing a VM's memory at work, against real guests: the live fault trace
//! (`/faults?follow=true`, `uffdctl trace`) streams exactly the faults a
//! known sequence of guest ops takes, tells a slow reader how many events
//! it lost; `?explain=true` (`uffdctl page --explain`) gives a page's whole
//! chain after a fork of a fork and after a restore from a snapshot; the
//! access record lists what a VM touched.

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use pagefork_tests::{
    bin, from_snapshot, new_vm, require_kvm_uffd, server_on_xfs, uffdctl_ok, Api, TestServer,
};
use proto::api::{
    ExplainStep, FaultEvent, FaultKind, MapLegend, PageMap, SnapshotMode, TraceDropped,
};
use serde_json::Value;

/// A page beyond every page the tests' ops touch: sentinel touches.
const SENTINEL: u64 = 1800;

/// A trace listener on its own thread: every line it reads, in order.
struct Listener {
    lines: mpsc::Receiver<String>,
    /// Set: the listener stops reading after its next line, until `go`.
    pause: Arc<AtomicBool>,
    go: Option<mpsc::Sender<()>>,
}

impl Listener {
    /// Listen to `vm`'s trace.
    fn start(s: &TestServer, vm: &str) -> Self {
        let api = Api::clone(s);
        let path = format!("/v1/vms/{vm}/faults?follow=true");
        let (tx, lines) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let pause = Arc::new(AtomicBool::new(false));
        let paused = pause.clone();
        std::thread::spawn(move || {
            let r = api.trace(&path, |l| {
                let sent = tx.send(l.to_owned()).is_ok();
                if paused.swap(false, Ordering::SeqCst) {
                    let _ = go_rx.recv();
                }
                sent
            });
            if let Some(r) = r {
                panic!("{path}: {r}");
            }
        });
        Listener {
            lines,
            pause,
            go: Some(go_tx),
        }
    }

    /// Stop reading after the next line.
    fn pause(&self) {
        self.pause.store(true, Ordering::SeqCst);
    }

    fn resume(&mut self) {
        if let Some(go) = self.go.take() {
            let _ = go.send(());
        }
    }

    fn next(&self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(30))
            .expect("no trace line within 30 s")
    }

    /// Touch sentinel pages of `vm` until the listener has seen one: from
    /// then on it sees every fault. Returns the sentinel lines read.
    fn sync(&self, s: &TestServer, vm: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for round in 0.. {
            assert!(Instant::now() < deadline, "the listener never started");
            let page = SENTINEL + round;
            s.touch(vm, page, 1, false);
            let wait = Instant::now() + Duration::from_millis(500);
            while let Some(left) = wait.checked_duration_since(Instant::now()) {
                match self.lines.recv_timeout(left) {
                    Ok(l) => {
                        let ev = event(&l);
                        if ev.page == page {
                            return;
                        }
                        // An earlier sentinel, seen late.
                        assert!(ev.page >= SENTINEL && ev.page < page, "{l}");
                    }
                    Err(mpsc::RecvTimeoutError::Timeout) => break,
                    Err(e) => panic!("listener gone: {e}"),
                }
            }
        }
    }
}

fn event(line: &str) -> FaultEvent {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not an event: {line}: {e}"))
}

fn now_ms() -> u64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("a clock after 1970");
    d.as_secs() * 1000 + u64::from(d.subsec_millis())
}

#[test]
fn fault_trace_streams_exactly_the_faults_of_known_guest_ops() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let a = s.create_vm(&new_vm(8));
    // Without follow=true there is no trace to give: a 400 that says so.
    let r = s
        .trace(&format!("/v1/vms/{a}/faults"), |_| false)
        .expect("a refusal");
    assert_eq!(r.status, 400, "{r}");
    assert!(r.error().contains("follow=true"), "{r}");

    let listener = Listener::start(&s, &a);
    listener.sync(&s, &a);

    s.fill(&a, 10, 3, 1); // MISSING writes of never-touched pages
    s.touch(&a, 20, 2, false); // MISSING reads
    let b = s.fork_one(&a);
    s.fill(&a, 10, 1, 2); // WP: the pre-write page goes to the child
    s.fill(&a, 30, 1, 3); // MISSING: nobody else reads page 30 from a

    let mut got = Vec::new();
    for _ in 0..7 {
        let ev = event(&listener.next());
        got.push((
            ev.kind,
            ev.page,
            ev.write,
            ev.source.clone().unwrap_or_default(),
            ev.pages,
        ));
        assert_eq!(ev.vm, a);
        assert!(ev.time_us > 0 && ev.service_us < 1_000_000, "{ev:?}");
    }
    let none = "uninitialized".to_owned();
    use FaultKind::{Missing, Wp};
    assert_eq!(
        got,
        vec![
            (Missing, 10, true, none.clone(), 1),
            (Missing, 11, true, none.clone(), 1),
            (Missing, 12, true, none.clone(), 1),
            (Missing, 20, false, none.clone(), 1),
            (Missing, 21, false, none.clone(), 1),
            (Wp, 10, true, a.clone(), 1),
            (Missing, 30, true, none, 1),
        ]
    );
    // Nothing else happened.
    assert!(listener
        .lines
        .recv_timeout(Duration::from_millis(300))
        .is_err());

    // The CLI: only WP faults, and it stops after --limit of them.
    let cli = std::thread::spawn({
        let sock = s.api_sock();
        let a = a.clone();
        move || {
            Command::new(bin("uffdctl"))
                .arg("--socket")
                .arg(sock)
                .args(["trace", &a, "--kind", "wp", "--limit", "2"])
                .output()
                .expect("uffdctl runs")
        }
    });
    // Its subscription is in place once a fault it would see has been
    // traced for our listener too: keep writing fresh pages (MISSING, not
    // shown by --kind wp) until the CLI's own listener exists, then two WP
    // writes on pages present and protected since the fork.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !tap_count_at_least(&s, &a, 2) {
        assert!(Instant::now() < deadline, "uffdctl trace never subscribed");
        std::thread::sleep(Duration::from_millis(50));
    }
    s.fill(&a, 11, 2, 4);
    let out = cli.join().expect("cli thread");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    for (line, page) in lines.iter().zip([11, 12]) {
        assert!(line.contains(&format!(" {a} wp ")), "{line}");
        assert!(
            line.contains(&format!("page {page:>8} write from {a}")),
            "{line}"
        );
    }
    drop(listener);
    s.delete_vm(&b);
}

/// Whether `vm` has at least `n` trace listeners (read from `/metrics`).
fn tap_count_at_least(s: &TestServer, vm: &str, n: u64) -> bool {
    let text = s.metrics_text();
    let name = format!("pagefork_vm_trace_listeners{{vm=\"{vm}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&name))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|v| v >= n)
}

#[test]
fn a_slow_trace_reader_is_told_how_many_events_it_lost() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let a = s.create_vm(&new_vm(128));
    let mut listener = Listener::start(&s, &a);
    listener.sync(&s, &a);
    listener.pause();
    // The listener reads nothing while 24576 faults happen: far more than
    // the trace buffers plus the socket can hold.
    let pages = 24576;
    let t = Instant::now();
    s.touch(&a, 2048, pages, true);
    eprintln!(
        "{pages} faults with a stalled listener in {:?}",
        t.elapsed()
    );
    listener.resume();
    let (mut events, mut dropped) = (0u64, 0u64);
    let mut last = 0;
    while events + dropped < pages {
        let line = listener.next();
        if let Ok(d) = serde_json::from_str::<TraceDropped>(&line) {
            dropped += d.dropped;
            continue;
        }
        let ev = event(&line);
        assert!(ev.page >= 2048 && ev.page < 2048 + pages, "{line}");
        assert!(
            ev.page > last,
            "events out of order: {line} after page {last}"
        );
        last = ev.page;
        events += 1;
    }
    assert_eq!(events + dropped, pages);
    assert!(
        dropped > 0,
        "nothing was dropped: the test did not stall the reader"
    );
    assert!(events > 0);
}

fn explain(s: &TestServer, vm: &str, page: u64) -> Vec<ExplainStep> {
    let info = s.explain(vm, page);
    match info.explain {
        Some(e) => e.chain,
        None => panic!("no chain: {info:?}"),
    }
}

/// A step as (at, present, installed event, installed from).
fn step(v: &ExplainStep) -> (String, Option<bool>, Option<String>, Option<String>) {
    (
        v.at.clone(),
        v.present,
        v.installed.as_ref().map(|i| i.event.clone()),
        v.installed.as_ref().map(|i| i.from.clone()),
    )
}

fn st(
    at: &str,
    present: Option<bool>,
    ev: Option<&str>,
    from: Option<&str>,
) -> (String, Option<bool>, Option<String>, Option<String>) {
    (
        at.to_owned(),
        present,
        ev.map(str::to_owned),
        from.map(str::to_owned),
    )
}

#[test]
fn explain_follows_a_page_through_a_fork_of_a_fork() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let t0 = now_ms();
    let a = s.create_vm(&new_vm(8));
    s.fill(&a, 10, 2, 1);
    let b = s.fork_one(&a);
    let c = s.fork_one(&b);
    // Not in c, not in b: a holds it; a got it from a MISSING fault on a
    // never-written page.
    let chain = explain(&s, &c, 10);
    let zero = st("zero", None, None, None);
    assert_eq!(
        chain.iter().map(step).collect::<Vec<_>>(),
        vec![
            st(&c, Some(false), None, None),
            st(&a, Some(true), Some("missing"), Some("uninitialized")),
            zero.clone(),
        ]
    );
    let at = chain[1].installed.as_ref().unwrap().time_ms;
    let now = now_ms();
    assert!(at >= t0 && at <= now, "{at} not in {t0}..{now}");

    // a writes page 10: the pre-write copy goes to b and c.
    s.fill(&a, 10, 1, 2);
    assert_eq!(
        explain(&s, &c, 10).iter().map(step).collect::<Vec<_>>(),
        vec![
            st(&c, Some(true), Some("wp-copy"), Some(&a)),
            st(&a, Some(true), Some("missing"), Some("uninitialized")),
            zero.clone(),
        ]
    );
    // A page nobody touched is zero, straight away.
    assert_eq!(
        explain(&s, &c, 40).iter().map(step).collect::<Vec<_>>(),
        vec![st(&c, Some(false), None, None), zero.clone()]
    );
    // c's own write of page 11 (read from a until now).
    s.fill(&c, 11, 1, 3);
    assert_eq!(
        explain(&s, &c, 11).iter().map(step).collect::<Vec<_>>(),
        vec![
            st(&c, Some(true), Some("missing"), Some(&a)),
            st(&a, Some(true), Some("missing"), Some("uninitialized")),
            zero,
        ]
    );
    // The CLI prints the same chain.
    let text = uffdctl_ok(&s, &["page", &c, "10", "--explain"]);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], format!("{c} page 10:"), "{text}");
    assert!(
        lines[1].starts_with(&format!(
            "  {c}: present, installed by wp-copy from {a} at "
        )),
        "{text}"
    );
    assert!(
        lines[2].starts_with(&format!(
            "  ← {a}: present, installed by missing from uninitialized at "
        )),
        "{text}"
    );
    assert_eq!(lines[3], "  ← zero", "{text}");
    assert_eq!(lines.len(), 4, "{text}");
}

#[test]
fn explain_names_the_snapshot_image_and_offset_after_a_restore() {
    // Copied into the VM's own memory (`based_e2e` explains a page shared
    // from a base).
    let Some(s) = server_on_xfs(&["--shared-bases=false"]) else {
        return;
    };
    let a = s.create_vm(&new_vm(8));
    s.fill(&a, 10, 4, 7);
    s.snapshot(&a, "ex1", SnapshotMode::Full);
    let r = s.create_vm(&from_snapshot("ex1"));
    let image = s.state_dir().join("snapshots/ex1/memory.img");
    let image = image.to_str().unwrap();
    let chain = explain(&s, &r, 12);
    assert_eq!(
        chain.iter().map(step).collect::<Vec<_>>(),
        vec![
            st(&r, Some(false), None, None),
            st("snapshot:ex1", None, None, None)
        ]
    );
    assert_eq!(chain[1].kind, "image");
    assert_eq!(chain[1].file.as_deref(), Some(image), "{chain:?}");
    assert_eq!(chain[1].offset, Some(12 * 4096));
    // The guest reads page 12: installed from the image, its neighbours
    // of the fault-around block with it.
    assert_eq!(s.verify(&r, 12, 1, 7), 0);
    let chain = explain(&s, &r, 12);
    assert_eq!(
        chain.iter().map(step).collect::<Vec<_>>(),
        vec![
            st(&r, Some(true), Some("missing"), Some("snapshot:ex1")),
            st("snapshot:ex1", None, None, None),
        ]
    );
    assert_eq!(chain[1].file.as_deref(), Some(image));
    assert_eq!(chain[1].offset, Some(12 * 4096));
    let chain = explain(&s, &r, 13);
    assert_eq!(
        step(&chain[0]).2.as_deref(),
        Some("fault-around"),
        "{chain:?}"
    );
    assert_eq!(chain[1].offset, Some(13 * 4096));
    // A page the snapshot holds as a hole is zero.
    let chain = explain(&s, &r, 500);
    assert_eq!(
        chain.iter().map(step).collect::<Vec<_>>(),
        vec![
            st(&r, Some(false), None, None),
            st("zero", None, None, None)
        ]
    );

    // The access record: what r touched since its restore.
    let acc = s.access(&r, None);
    assert_eq!(acc.touched, 1, "{acc:?}");
    assert_eq!(acc.extents[0].start_page, 12);
    assert_eq!(acc.extents[0].kind, FaultKind::Missing);
}

/// A decoded PNG: width, RGB pixels and its layout chunk.
struct Picture {
    width: u32,
    rgb: Vec<u8>,
    layout: Value,
}

impl Picture {
    fn decode(bytes: &[u8]) -> Self {
        let mut dec = png::Decoder::new(bytes).read_info().expect("a PNG");
        let mut rgb = vec![0; dec.output_buffer_size()];
        let frame = dec.next_frame(&mut rgb).expect("a frame");
        assert_eq!(frame.color_type, png::ColorType::Rgb);
        rgb.truncate(frame.buffer_size());
        let text = dec
            .info()
            .utf8_text
            .iter()
            .find(|t| t.keyword == "pagefork-layout")
            .expect("the layout chunk")
            .get_text()
            .expect("layout text");
        Picture {
            width: frame.width,
            rgb,
            layout: serde_json::from_str(&text).expect("layout JSON"),
        }
    }

    fn at(&self, x: u64, y: u64) -> [u8; 3] {
        let i = usize::try_from((y * u64::from(self.width) + x) * 3).unwrap();
        [self.rgb[i], self.rgb[i + 1], self.rgb[i + 2]]
    }

    /// The colour in the middle of cell `cell`.
    fn cell(&self, cell: u64) -> [u8; 3] {
        let l = &self.layout;
        let n = |k: &str| l[k].as_u64().unwrap();
        let (cols, pitch) = (n("cols"), n("pitch"));
        self.at(
            n("x0") + (cell % cols) * pitch + n("cell") / 2,
            n("y0") + (cell / cols) * pitch + n("cell") / 2,
        )
    }
}

/// A colour of the picture's layout (`[r, g, b]`).
fn rgb(v: &Value) -> [u8; 3] {
    let a = v.as_array().expect("rgb");
    [0, 1, 2].map(|i| u8::try_from(a[i].as_u64().unwrap()).unwrap())
}

/// Each page's source, from `/sources`.
fn page_sources(s: &TestServer, vm: &str) -> Vec<String> {
    let v = s.sources(vm);
    let mut out = Vec::new();
    for e in &v.extents {
        for _ in 0..e.pages {
            out.push(e.source.clone());
        }
    }
    assert_eq!(out.len() as u64, v.pages);
    out
}

/// The legend entry of `src` in `map`.
fn legend_of<'a>(map: &'a PageMap, src: &str) -> &'a MapLegend {
    map.legend
        .iter()
        .find(|l| l.source == src)
        .unwrap_or_else(|| panic!("{src} is not in the legend: {map:?}"))
}

#[test]
fn page_maps_show_each_page_in_its_sources_colour() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let a = s.create_vm(&new_vm(8));
    s.fill(&a, 0, 300, 1);
    let b = s.fork_one(&a);
    s.fill(&b, 100, 20, 2); // b's own copies of pages it read from a
    s.touch(&b, 400, 10, false); // b's own zero pages
    s.fill(&a, 0, 10, 3); // WP faults in a: pages 0..10 go to b first

    for vm in [&a, &b] {
        let sources = page_sources(&s, vm);
        let map = s.map(vm, None);
        assert_eq!(map.group, 1);
        // The legend lists every source of the table, with its pages.
        let by = s.sources(vm);
        let listed: std::collections::BTreeMap<String, u64> = map
            .legend
            .iter()
            .map(|l| (l.source.clone(), l.pages))
            .collect();
        assert_eq!(listed, by.by_source);
        let colour = |src: &str, present: bool| {
            let l = legend_of(&map, src);
            if present {
                l.rgb
            } else {
                l.faded_rgb
            }
        };

        let (st, bytes) = s.get_bytes(&format!("/v1/vms/{vm}/map.png"));
        assert_eq!(st, 200);
        if let Some(dir) = std::env::var_os("PAGEFORK_MAP_OUT") {
            std::fs::write(std::path::Path::new(&dir).join(format!("{vm}.png")), &bytes).unwrap();
        }
        let pic = Picture::decode(&bytes);
        assert_eq!(pic.layout["cells"], 2048);
        // Every page's cell: its source's colour, bright where present (the
        // VM's own memory), faded where not.
        for (p, src) in sources.iter().enumerate() {
            let present = src == vm;
            assert_eq!(
                pic.cell(p as u64),
                colour(src, present),
                "{vm} page {p} from {src}"
            );
        }
        // The legend's swatches, one per source, in the same colours.
        let swatches = pic.layout["legend"].as_array().unwrap();
        assert_eq!(swatches.len(), listed.len());
        for sw in swatches {
            let src = sw["source"].as_str().unwrap();
            let (x, y) = (sw["x"].as_u64().unwrap(), sw["y"].as_u64().unwrap());
            let far = x + pic.layout["swatch"].as_u64().unwrap() + 4;
            assert_eq!(pic.at(x + 2, y + 2), colour(src, true), "swatch of {src}");
            assert_eq!(pic.at(far, y + 2), colour(src, false), "swatch of {src}");
        }
    }
    // a's colour is the same in b's map as in its own.
    let legend_rgb = |vm: &str, src: &str| legend_of(&s.map(vm, None), src).rgb;
    assert_eq!(legend_rgb(&a, &a), legend_rgb(&b, &a));
    assert_ne!(legend_rgb(&b, &a), legend_rgb(&b, &b));

    // The terminal map (not a terminal here: letters), cell by cell.
    let text = uffdctl_ok(&s, &["map", &b]);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], format!("{b}: 8 MiB, 2048 pages, 1 cell = 1 page"));
    let grid = &lines[1..33];
    let keys: std::collections::BTreeMap<char, String> = lines[33..]
        .iter()
        .filter_map(|l| {
            let (key, rest) = l.split_once(' ')?;
            let up = key.chars().next()?;
            (key.len() == 3 && key.as_bytes()[1] == b'/')
                .then(|| (up, rest.split(' ').next().unwrap().to_owned()))
        })
        .collect();
    let sources = page_sources(&s, &b);
    for (p, src) in sources.iter().enumerate() {
        let c = grid[p / 64].as_bytes()[p % 64] as char;
        assert_eq!(&keys[&c.to_ascii_uppercase()], src, "page {p}: {c}");
        assert_eq!(c.is_ascii_uppercase(), src == &b, "page {p}: {c}");
    }
    assert!(!text.contains('\x1b'), "escape codes in plain output");

    // -o saves the server's PNG.
    let out = s.state_dir().join("..").join("b-map.png");
    uffdctl_ok(&s, &["map", &b, "-o", out.to_str().unwrap()]);
    let saved = Picture::decode(&std::fs::read(&out).unwrap());
    for p in [0u64, 105, 405, 1000] {
        let src = &sources[usize::try_from(p).unwrap()];
        let m = s.map(&b, None);
        let l = legend_of(&m, src);
        let want = if src == &b { l.rgb } else { l.faded_rgb };
        assert_eq!(saved.cell(p), want, "page {p}");
    }

    // The tree: one strip of 64 cells (32 pages each) per VM, the child
    // indented under its parent.
    let text = uffdctl_ok(&s, &["map", "--tree"]);
    let lines: Vec<&str> = text.lines().collect();
    let keys: std::collections::BTreeMap<String, char> = lines[2..]
        .iter()
        .filter_map(|l| {
            let (key, src) = l.split_once(' ')?;
            Some((src.to_owned(), key.chars().next()?))
        })
        .collect();
    for (line, vm, indent) in [(lines[0], &a, ""), (lines[1], &b, "  ")] {
        let name = format!("{indent}{vm}");
        assert!(line.starts_with(&format!("{name} ")), "{line}");
        let strip = line[name.len()..].trim_start().split(' ').next().unwrap();
        assert_eq!(strip.len(), 64, "{line}");
        let sources = page_sources(&s, vm);
        for (cell, c) in strip.chars().enumerate() {
            let mut count: std::collections::BTreeMap<&String, u64> = Default::default();
            for src in &sources[cell * 32..cell * 32 + 32] {
                *count.entry(src).or_default() += 1;
            }
            let most = count.values().max().copied().unwrap();
            let winners: Vec<&&String> = count
                .iter()
                .filter(|(_, n)| **n == most)
                .map(|(s, _)| s)
                .collect();
            assert_eq!(
                winners.len(),
                1,
                "a tie in cell {cell} of {vm}: pick other pages"
            );
            assert_eq!(
                c.to_ascii_uppercase(),
                keys[winners[0].as_str()],
                "{vm} cell {cell}"
            );
            assert_eq!(
                c.is_ascii_uppercase(),
                *winners[0] == vm,
                "{vm} cell {cell}"
            );
        }
    }
}

#[test]
fn access_maps_count_the_faults_since_creation() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let a = s.create_vm(&new_vm(8));
    s.touch(&a, 40, 30, false); // one MISSING fault each
    let b = s.fork_one(&a);
    s.fill(&a, 40, 10, 1); // a WP fault each on 40..50: two faults there
    s.fill(&a, 200, 4, 2); // MISSING writes

    let acc = s.access(&a, None);
    assert_eq!(acc.touched, 34);
    let ext: Vec<(u64, u64, FaultKind, u64)> = acc
        .extents
        .iter()
        .map(|e| (e.start_page, e.pages, e.kind, e.faults))
        .collect();
    assert_eq!(
        ext,
        vec![
            (40, 30, FaultKind::Missing, 40),
            (200, 4, FaultKind::Missing, 4)
        ]
    );
    // b's record began at the fork: it touched nothing yet.
    let acc_b = s.access(&b, None);
    assert_eq!(acc_b.touched, 0, "{acc_b:?}");

    let (st, bytes) = s.get_bytes(&format!("/v1/vms/{a}/access.png"));
    assert_eq!(st, 200);
    if let Some(dir) = std::env::var_os("PAGEFORK_MAP_OUT") {
        std::fs::write(
            std::path::Path::new(&dir).join(format!("{a}-access.png")),
            &bytes,
        )
        .unwrap();
    }
    let pic = Picture::decode(&bytes);
    let legend = pic.layout["legend"].as_array().unwrap();
    let level = |i: usize| rgb(&legend[i]["rgb"]);
    for p in 0..2048u64 {
        let want = match p {
            40..=49 => level(2),
            50..=69 | 200..=203 => level(1),
            _ => level(0),
        };
        assert_eq!(pic.cell(p), want, "page {p}");
    }
    let swatch = pic.layout["swatch"].as_u64().unwrap();
    for (i, sw) in legend.iter().enumerate() {
        let (x, y) = (sw["x"].as_u64().unwrap(), sw["y"].as_u64().unwrap());
        assert_eq!(pic.at(x + 2, y + 2), level(i));
        // One swatch per level: no faded twin in a heat map.
        assert_eq!(pic.at(x + swatch + 4, y + 2), [255, 255, 255]);
    }

    // The CLI: the same extents; --reset begins the record again.
    let text = uffdctl_ok(&s, &["access", &a, "--reset"]);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with(&format!("{a}: 34 of 2048 pages faulted since ")),
        "{text}"
    );
    let rows: Vec<Vec<&str>> = lines[2..4]
        .iter()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows[0][..3], ["40..70", "30", "missing"], "{text}");
    assert_eq!(rows[0][4], "40", "{text}");
    assert_eq!(rows[1][..3], ["200..204", "4", "missing"], "{text}");
    assert_eq!(lines[4], format!("{a}: access record begins again now"));
    s.touch(&a, 300, 2, false);
    let acc = s.access(&a, None);
    assert_eq!(acc.touched, 2, "{acc:?}");
    assert_eq!(acc.extents[0].start_page, 300);

    // A reset is a POST: the record is still there after it, only empty.
    // A DELETE of the record is no route, and leaves it as it was.
    let (status, _) = s.raw_bytes("DELETE", &format!("/v1/vms/{a}/access"), b"");
    assert_eq!(status, 405, "DELETE of the access record");
    assert_eq!(s.access(&a, None).touched, 2);
    let acc = s.reset_access(&a);
    assert_eq!((acc.touched, acc.extents.len()), (0, 0), "{acc:?}");
    assert_eq!(s.access(&a, None).touched, 0);
}

/// A private tmux server (its own socket), killed when dropped.
struct Tmux {
    socket: String,
}

impl Tmux {
    /// None (skip) when tmux is missing, unless `CI=true`.
    fn new() -> Option<Self> {
        match Command::new("tmux").arg("-V").output() {
            Ok(o) if o.status.success() => {
                // One private server per test: tests run in parallel.
                static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let n = NEXT.fetch_add(1, Ordering::SeqCst);
                Some(Tmux {
                    socket: format!("pagefork-test-{}-{n}", std::process::id()),
                })
            }
            _ if std::env::var("CI").as_deref() == Ok("true") => {
                panic!("CI=true but tmux is missing: run scripts/setup.sh")
            }
            _ => {
                eprintln!("skipping: tmux is not installed (scripts/setup.sh installs it)");
                None
            }
        }
    }

    fn run(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux")
            .args(["-L", &self.socket])
            .args(args)
            .output()
            .expect("tmux runs")
    }

    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.run(&["capture-pane", "-p", "-t", "top"]).stdout).into_owned()
    }

    fn alive(&self) -> bool {
        self.run(&["has-session", "-t", "top"]).status.success()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

/// The cells of `vm`'s row on a `top` screen.
fn top_row(screen: &str, vm: &str) -> Option<Vec<String>> {
    screen.lines().find_map(|l| {
        let cells: Vec<String> = l
            .replace('│', " ")
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        (cells.first().map(String::as_str) == Some(vm)).then_some(cells)
    })
}

/// Wait until `ok` holds for the screen; returns that screen.
fn screen_until(t: &Tmux, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let screen = t.screen();
        if ok(&screen) {
            return screen;
        }
        assert!(Instant::now() < deadline, "{what}; the screen:\n{screen}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn top_shows_each_vms_faults_live_in_a_real_terminal() {
    if !require_kvm_uffd() {
        return;
    }
    let Some(t) = Tmux::new() else { return };
    let s = TestServer::start();
    let idle = s.create_vm(&new_vm(8));
    let busy = s.create_vm(&new_vm(64));
    s.touch(&idle, 0, 5, false);
    let cmd = format!(
        "{} --socket {} top --interval 0.5",
        bin("uffdctl").display(),
        s.api_sock().display()
    );
    let out = t.run(&[
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        "150",
        "-y",
        "30",
        &cmd,
    ]);
    assert!(out.status.success(), "{out:?}");
    // Column indexes of a row: VM STATE MISS/s WP/s REM/s INST/s COPY/s
    // RESIDENT P50us P99us FAULTS.
    let (miss_s, inst_s, resident, faults) = (2, 5, 7, 10);
    let num = |row: &[String], i: usize| row[i].parse::<u64>().unwrap_or(u64::MAX);

    // A known workload: the busy VM writes fresh pages, 256 per op, for
    // as long as it takes top to show it; the idle one does nothing.
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let mut start = 0;
            while !stop.load(Ordering::SeqCst) && start + 256 <= 16384 {
                s.fill(&busy, start, 256, 1);
                start += 256;
            }
        });
        let screen = screen_until(&t, "the busy VM never showed faults/s", |sc| {
            top_row(sc, &busy).is_some_and(|r| {
                let (m, i) = (num(&r, miss_s), num(&r, inst_s));
                m > 0 && m != u64::MAX && i >= m
            })
        });
        stop.store(true, Ordering::SeqCst);
        let idle_row = top_row(&screen, &idle).expect("the idle VM is listed");
        assert_eq!(&idle_row[2..7], ["0", "0", "0", "0", "0"], "{screen}");
        assert!(screen.contains("pagefork top"), "{screen}");
        assert!(screen.contains("2 VMs"), "{screen}");
    });
    // Once the workload is over: no more faults/s, and every total equals
    // the VM's own counters.
    let counters = |id: &str| {
        let v = s.vm(id);
        let f = &v.faults;
        (f.missing + f.write_protect + f.removes, v.resident_pages)
    };
    let (busy_faults, busy_resident) = counters(&busy);
    let (idle_faults, idle_resident) = counters(&idle);
    assert_eq!(idle_faults, 5);
    let screen = screen_until(&t, "top never settled on the final counters", |sc| {
        let (Some(b), Some(i)) = (top_row(sc, &busy), top_row(sc, &idle)) else {
            return false;
        };
        num(&b, miss_s) == 0
            && num(&b, faults) == busy_faults
            && num(&b, resident) == busy_resident
            && num(&i, faults) == idle_faults
            && num(&i, resident) == idle_resident
    });
    // Sorted by faults/s with both idle: by id, the idle VM (created
    // first) on top. `r` sorts by resident pages: the busy VM on top.
    let busy_first = |sc: &str| {
        let at = |id: &str| sc.lines().position(|l| top_row(l, id).is_some());
        at(&busy) < at(&idle)
    };
    assert!(!busy_first(&screen), "{screen}");
    assert!(busy_resident > idle_resident);
    t.run(&["send-keys", "-t", "top", "r"]);
    screen_until(&t, "r did not sort by resident", |sc| {
        sc.contains("sorted by resident") && busy_first(sc)
    });
    t.run(&["send-keys", "-t", "top", "q"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while t.alive() {
        assert!(Instant::now() < deadline, "q did not quit top");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_terminal_map_draws_half_blocks_in_the_sources_colours() {
    if !require_kvm_uffd() {
        return;
    }
    let Some(t) = Tmux::new() else { return };
    let s = TestServer::start();
    let a = s.create_vm(&new_vm(8));
    s.fill(&a, 0, 64, 1); // the first row of cells: present, own memory
    let b = s.fork_one(&a);
    s.fill(&b, 200, 10, 2); // b's own memory, further down
    let map = s.map(&b, None);
    let of = |src: &str, key: &str| {
        let l = legend_of(&map, src);
        if key == "rgb" {
            l.rgb
        } else {
            l.faded_rgb
        }
    };
    let cmd = format!(
        "{} --socket {} map {b}; sleep 30",
        bin("uffdctl").display(),
        s.api_sock().display()
    );
    let out = t.run(&[
        "new-session",
        "-d",
        "-s",
        "top",
        "-x",
        "100",
        "-y",
        "40",
        &cmd,
    ]);
    assert!(out.status.success(), "{out:?}");
    let screen = screen_until(&t, "the map never appeared", |sc| {
        sc.contains("(own memory)")
    });
    let colours =
        String::from_utf8_lossy(&t.run(&["capture-pane", "-e", "-p", "-t", "top"]).stdout)
            .into_owned();
    // Row 1 of the grid: pages 0..64 (upper halves, read from a: faded)
    // over pages 64..128 (lower halves, zero: faded grey).
    let grid = colours.lines().nth(1).expect("a grid line");
    assert_eq!(grid.matches('▀').count(), 64, "{screen}");
    let [r, g, bl] = of(&a, "faded_rgb");
    assert!(grid.contains(&format!("38;2;{r};{g};{bl}")), "{grid:?}");
    let [r, g, bl] = of("uninitialized", "faded_rgb");
    assert!(grid.contains(&format!("48;2;{r};{g};{bl}")), "{grid:?}");
    // The legend's keys: both colours of each source.
    let own = colours
        .lines()
        .find(|l| l.contains("(own memory)"))
        .unwrap();
    let [r, g, bl] = of(&b, "rgb");
    assert!(own.contains(&format!("38;2;{r};{g};{bl}")), "{own:?}");
    assert!(screen
        .lines()
        .next()
        .unwrap()
        .starts_with(&format!("{b}: 8 MiB, 2048 pages")));
}
