//! End-to-end tests of the Firecracker-compatible UFFD backend (issue 6): a
//! real `uffd-server` with Firecracker listeners and real
//! `fc_client` processes that do what Firecracker's "Uffd" memory backend
//! does (anonymous MAP_PRIVATE memory, their own uffd with EVENT_REMOVE, one
//! handshake message with the JSON regions and the uffd).
//!
//! The client compares every byte it reads with the image file itself
//! (`check:IMAGE`), so a page served from the wrong offset, a stale page or
//! a missing zero page shows up as a mismatched page.
//!
//! These tests need /dev/userfaultfd (no KVM): without it they skip with a
//! printed reason, and fail under `CI=true`.

use std::collections::BTreeMap;
use std::io::{IoSlice, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use pagefork_tests::{
    file_source, new_listener, open_fds, pages_by, process_exists, signal, wait_until, FcClient,
    RandomImage, TestServer,
};
use proto::api::{CreateListener, MemorySource, RunState, SourceExtent};
use proto::firecracker::GuestRegionUffdMapping;
use serde_json::Value;

const PAGE: u64 = 4096;
const HUGE_PAGE: u64 = 2 << 20;
/// How long a client command or a state change may take before the test
/// fails instead of hanging.
const TIMEOUT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------
// Gating

/// Whether this machine can run the tests: /dev/userfaultfd must be usable.
/// Skips with a printed reason, or panics under `CI=true`.
fn require_uffd() -> bool {
    let why = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/userfaultfd")
    {
        Ok(_) => return true,
        Err(e) => format!("/dev/userfaultfd is not usable: {e}"),
    };
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but a prerequisite of the Firecracker end-to-end tests is missing: {why}");
    }
    eprintln!("skipping: {why} (these tests need userfaultfd)");
    false
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

fn meminfo(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(field)?
                .strip_prefix(':')?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// 2 MiB hugepages reserved for a test; the previous `nr_hugepages` is
/// restored on drop.
struct HugePages {
    restore: Option<u64>,
}

impl HugePages {
    /// Make sure at least `free` 2 MiB hugepages are free, reserving more
    /// through /proc/sys/vm/nr_hugepages (root) if needed.
    fn reserve(free: u64) -> Result<Self, String> {
        if meminfo("Hugepagesize") != 2048 {
            return Err(format!(
                "the default hugepage size is {} KiB, not 2048",
                meminfo("Hugepagesize")
            ));
        }
        if meminfo("HugePages_Free") >= free {
            return Ok(HugePages { restore: None });
        }
        const KNOB: &str = "/proc/sys/vm/nr_hugepages";
        let before: u64 = std::fs::read_to_string(KNOB)
            .map_err(|e| format!("cannot read {KNOB}: {e}"))?
            .trim()
            .parse()
            .map_err(|e| format!("{KNOB}: {e}"))?;
        let guard = HugePages {
            restore: Some(before),
        };
        std::fs::write(KNOB, (before + 2 * free).to_string())
            .map_err(|e| format!("cannot reserve hugepages through {KNOB}: {e}"))?;
        let have = meminfo("HugePages_Free");
        if have < free {
            return Err(format!(
                "wrote {} to {KNOB} but only {have} hugepages are free (want {free})",
                before + 2 * free
            ));
        }
        Ok(guard)
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        if let Some(n) = self.restore {
            let _ = std::fs::write("/proc/sys/vm/nr_hugepages", n.to_string());
        }
    }
}

// ---------------------------------------------------------------------------
// Listeners and VMs through the API

/// A listener on `<state dir>/<name>.sock` serving `image` with
/// `fault_around_kib` and no readahead (these tests count faults of the
/// fault-around block alone; readahead has its own test); returns its id
/// and socket.
fn listen(
    s: &TestServer,
    name: &str,
    image: &str,
    fault_around_kib: u64,
    working_set: bool,
) -> (String, PathBuf) {
    let l = s.add_listener(&CreateListener {
        fault_around_kib: Some(fault_around_kib),
        readahead_kib: Some(0),
        working_set,
        ..s.listener_request(name, file_source(image))
    });
    (l.id, PathBuf::from(l.socket))
}

/// Wait until the server holds exactly `uffds` userfaultfds and at most
/// `baseline` fds (connections and uffds of gone clients released).
fn wait_fds_released(s: &TestServer, baseline: usize, uffds: usize) {
    let uffds_of = |fds: &[PathBuf]| {
        fds.iter()
            .filter(|p| p.to_string_lossy().contains("userfaultfd"))
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let fds = open_fds(s.pid());
        if fds.len() <= baseline && uffds_of(&fds) == uffds {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "uffd-server holds {} fds ({} userfaultfds) where {baseline} ({uffds}) were expected: \
             fds of gone clients leak: {fds:?}",
            fds.len(),
            uffds_of(&fds)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------
// The client process

/// Run a client to completion; returns its JSON lines.
fn run_client(socket: &Path, opts: &[&str], commands: &[&str]) -> Vec<Value> {
    FcClient::spawn(socket, opts, commands).finish()
}

fn line_of<'a>(lines: &'a [Value], cmd: &str) -> &'a Value {
    lines
        .iter()
        .find(|l| l["cmd"] == cmd)
        .unwrap_or_else(|| panic!("no output of {cmd} in {lines:?}"))
}

fn assert_clean(check: &Value) {
    assert_eq!(
        check["mismatched_pages"], 0,
        "pages differ from the image: {check}"
    );
}

fn check_cmd(image: &str) -> String {
    format!("check:{image}")
}

// ---------------------------------------------------------------------------
// Images

/// A sparse image of `mib` MiB: random data in `data` page ranges, holes
/// everywhere else.
struct SparseImage {
    file: tempfile::NamedTempFile,
}

impl SparseImage {
    fn new(mib: u64, data: &[(u64, u64)], seed: u64) -> Self {
        use rand::{RngCore, SeedableRng};
        use std::io::{Seek, SeekFrom};
        let mut file = tempfile::Builder::new()
            .prefix("pagefork-sparse-")
            .tempfile()
            .expect("cannot create image");
        file.as_file()
            .set_len(mib << 20)
            .expect("cannot size the sparse image");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for &(start, pages) in data {
            let mut buf = vec![0u8; usize::try_from(pages * PAGE).expect("fits")];
            rng.fill_bytes(&mut buf);
            file.seek(SeekFrom::Start(start * PAGE)).expect("seek");
            file.write_all(&buf).expect("cannot write the sparse image");
        }
        file.flush().expect("flush");
        SparseImage { file }
    }

    fn path(&self) -> String {
        self.file
            .path()
            .to_str()
            .expect("temp path is UTF-8")
            .to_owned()
    }
}

// ---------------------------------------------------------------------------
// Raw handshakes

/// Connect to `socket` and send one message of `body` with `fds`.
fn send_handshake(socket: &Path, body: &[u8], fds: &[RawFd]) -> UnixStream {
    let stream = UnixStream::connect(socket)
        .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", socket.display()));
    let cmsgs: Vec<ControlMessage> = if fds.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(fds)]
    };
    sendmsg::<()>(
        stream.as_raw_fd(),
        &[IoSlice::new(body)],
        &cmsgs,
        MsgFlags::empty(),
        None,
    )
    .unwrap_or_else(|e| panic!("sendmsg of the handshake failed: {e}"));
    stream
}

/// The server must close the connection: a read returns 0.
fn assert_closed_by_server(mut stream: UnixStream, what: &str) {
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("set_read_timeout");
    let mut b = [0u8; 64];
    match stream.read(&mut b) {
        Ok(0) => {}
        Ok(n) => panic!("{what}: the server sent {n} bytes instead of closing the connection"),
        Err(e) => panic!("{what}: the server did not close the connection: {e}"),
    }
}

/// A handshake region as current Firecrackers send it (both page size
/// fields).
fn region(base: u64, size: u64, offset: u64, page_size: u64) -> GuestRegionUffdMapping {
    GuestRegionUffdMapping {
        base_host_virt_addr: base,
        size,
        offset,
        page_size: Some(page_size),
        page_size_kib: Some(page_size),
    }
}

/// A handshake's bytes: the regions as JSON.
fn handshake(regions: &[GuestRegionUffdMapping]) -> Vec<u8> {
    serde_json::to_vec(regions).expect("regions encode")
}

// ---------------------------------------------------------------------------
// Tests

/// Every page read equals the image, one page per fault: a random-order
/// touch of all 128 MiB faults exactly once per page, and the debugging
/// views follow the pages from `file:IMAGE` to the VM.
#[test]
fn every_page_read_equals_the_source_file_without_fault_around() {
    if !require_uffd() {
        return;
    }
    let mib = 128;
    let pages = (mib << 20) / PAGE;
    let image = RandomImage::new(mib, 0xf1c0_0001);
    let s = TestServer::start();
    let (lid, sock) = listen(&s, "fc", &image.path(), 0, false);
    assert_eq!(s.listener(&lid).fault_around_kib, 0);
    let mib_arg = mib.to_string();

    // Before any touch, every page comes from the file.
    let idle = FcClient::spawn(&sock, &["--mib", &mib_arg], &["hold"]);
    let v = s.wait_firecracker_vm(idle.pid(), TIMEOUT);
    let id = v.id.clone();
    assert_eq!(v.state, RunState::Running, "{v:?}");
    assert_eq!(v.memory_mib, mib, "{v:?}");
    assert_eq!(v.faults.missing, 0, "{v:?}");
    assert_eq!(v.faults.fault_around_kib, 0, "{v:?}");
    let src = s.sources(&id);
    let file = format!("file:{}", image.path());
    assert_eq!(src.pages, pages, "{src:?}");
    assert_eq!(
        src.by_source,
        BTreeMap::from([(file.clone(), pages)]),
        "{src:?}"
    );
    let p = s.page(&id, 77);
    assert_eq!(
        (p.source.as_deref(), p.present),
        (Some(file.as_str()), false),
        "{p:?}"
    );
    let idle_pid = idle.pid();
    idle.finish();
    s.wait_firecracker_vm_gone(idle_pid, Duration::from_secs(10));

    // A random-order touch then a full compare.
    let check = check_cmd(&image.path());
    let mut c = FcClient::spawn(
        &sock,
        &["--mib", &mib_arg],
        &["touch-random:42", &check, "hold"],
    );
    assert_clean(&c.until(&check));
    let v = s.wait_firecracker_vm(c.pid(), TIMEOUT);
    let id = v.id.clone();
    assert_eq!(
        v.faults.missing, pages,
        "one fault per page without fault-around: {v:?}"
    );
    assert_eq!(v.faults.pages_installed, pages, "{v:?}");
    assert_eq!(pages_by(&v, "vm"), pages, "{v:?}");
    let src = s.sources(&id);
    assert_eq!(
        src.by_source,
        BTreeMap::from([(id.clone(), pages)]),
        "{src:?}"
    );
    let p = s.page(&id, 77);
    assert_eq!(
        (p.source.as_deref(), p.present),
        (Some(id.as_str()), true),
        "{p:?}"
    );
    let pid = c.pid();
    c.finish();
    s.wait_firecracker_vm_gone(pid, Duration::from_secs(10));
    let l = s.listener(&lid);
    assert_eq!((l.accepted, l.refused), (2, 0), "{l:?}");
    s.assert_healthy();
}

/// Every page read equals the image with 64 KiB fault-around: a sequential
/// touch faults once per 16-page block, a random one installs every page
/// exactly once.
#[test]
fn every_page_read_equals_the_source_file_with_fault_around() {
    if !require_uffd() {
        return;
    }
    let mib = 256;
    let pages = (mib << 20) / PAGE;
    let image = RandomImage::new(mib, 0xf1c0_0002);
    let s = TestServer::start();
    let (lid, sock) = listen(&s, "fc", &image.path(), 64, false);
    assert_eq!(s.listener(&lid).fault_around_kib, 64);
    let mib_arg = mib.to_string();
    let check = check_cmd(&image.path());

    for (order, exact_faults) in [("touch-seq", Some(pages / 16)), ("touch-random:9", None)] {
        let mut c = FcClient::spawn(&sock, &["--mib", &mib_arg], &[order, &check, "hold"]);
        assert_clean(&c.until(&check));
        let v = s.wait_firecracker_vm(c.pid(), TIMEOUT);
        assert_eq!(v.faults.fault_around_kib, 64, "{v:?}");
        assert_eq!(
            v.faults.pages_installed, pages,
            "{order}: every page installed once: {v:?}"
        );
        let missing = v.faults.missing;
        match exact_faults {
            Some(n) => assert_eq!(missing, n, "{order}: one fault per 64 KiB block: {v:?}"),
            None => assert!(
                missing >= pages / 16 && missing < pages,
                "{order}: fault-around saves no faults: {v:?}"
            ),
        }
        let pid = c.pid();
        c.finish();
        s.wait_firecracker_vm_gone(pid, Duration::from_secs(10));
    }
    s.assert_healthy();
}

/// Sequential faults grow the install window (16, 32, ... 512 pages) up to
/// the listener's readahead limit; random faults stay at one block.
#[test]
fn sequential_faults_grow_the_readahead_window() {
    if !require_uffd() {
        return;
    }
    let mib = 64;
    let pages = (mib << 20) / PAGE;
    let image = RandomImage::new(mib, 0xf1c0_0012);
    let s = TestServer::start();
    let v = s.add_listener(&CreateListener {
        fault_around_kib: Some(64),
        readahead_kib: Some(2048),
        ..s.listener_request("ra", image.source())
    });
    assert_eq!(v.readahead_kib, 2048, "{v:?}");
    let socket = PathBuf::from(&v.socket);
    let check = check_cmd(&image.path());
    let mut c = FcClient::spawn(
        &socket,
        &["--mib", &mib.to_string()],
        &["touch-seq", &check, "hold"],
    );
    assert_clean(&c.until(&check));
    let v = s.wait_firecracker_vm(c.pid(), TIMEOUT);
    // 16 + 32 + 64 + 128 + 256 + 512 = 1008 pages in 6 faults, then 31
    // windows of 512 for the remaining 15376 pages (the last one clipped).
    assert_eq!(v.faults.missing, 37, "{v:?}");
    assert_eq!(v.faults.pages_installed, pages, "{v:?}");
    let pid = c.pid();
    c.finish();
    s.wait_firecracker_vm_gone(pid, Duration::from_secs(10));
    s.assert_healthy();
}

/// Holes of a sparse image read as zeroes; its data ranges (not aligned to
/// the fault-around blocks) read as written.
#[test]
fn zero_pages_from_sparse_regions_read_zero() {
    if !require_uffd() {
        return;
    }
    let mib = 64;
    let pages = (mib << 20) / PAGE;
    let data = [(0, 100), (1003, 77), (8190, 5), (pages - 3, 3)];
    let image = SparseImage::new(mib, &data, 0xf1c0_0003);
    let meta = std::fs::metadata(image.path()).expect("stat the sparse image");
    assert!(
        meta.blocks() * 512 < (mib << 20) / 2,
        "the image is not sparse: {} blocks",
        meta.blocks()
    );
    let s = TestServer::start();
    let (_, sock) = listen(&s, "fc", &image.path(), 64, false);
    let check = check_cmd(&image.path());
    let holes = [(100, 903), (1080, 7110), (8195, pages - 3 - 8195)];
    let mut cmds: Vec<String> = vec![check.clone()];
    cmds.extend(holes.iter().map(|(a, n)| format!("zero:{a}:{n}")));
    cmds.extend(data.iter().map(|(a, n)| format!("zero:{a}:{n}")));
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    let out = run_client(&sock, &["--mib", &mib.to_string()], &cmds);
    assert_clean(line_of(&out, &check));
    for (a, n) in holes {
        let l = line_of(&out, &format!("zero:{a}:{n}"));
        assert_eq!(
            l["nonzero_pages"],
            0,
            "hole pages {a}..{} are not zero: {l}",
            a + n
        );
    }
    for (a, n) in data {
        let l = line_of(&out, &format!("zero:{a}:{n}"));
        assert_eq!(
            l["nonzero_pages"],
            n,
            "data pages {a}..{} read zero: {l}",
            a + n
        );
    }
}

/// A region with a non-zero offset is served from that offset of the file,
/// including a region that ends exactly at the end of the file.
#[test]
fn a_region_offset_serves_that_part_of_the_file() {
    if !require_uffd() {
        return;
    }
    let mib = 64;
    let image = RandomImage::new(mib, 0xf1c0_0004);
    let s = TestServer::start();
    let (_, sock) = listen(&s, "fc", &image.path(), 64, false);
    let check = check_cmd(&image.path());
    for offset in [(40 << 20) + 3 * PAGE, 48 << 20] {
        let off = offset.to_string();
        let c = FcClient::spawn(&sock, &["--mib", "16", "--offset", &off], &["hold", &check]);
        let v = s.wait_firecracker_vm(c.pid(), TIMEOUT);
        let id = v.id.clone();
        assert_eq!(v.memory_mib, 16, "{v:?}");
        // The table spans the file up to the region's end; only the
        // region's pages come from the file.
        let src = s.sources(&id);
        let first = offset / PAGE;
        assert_eq!(
            src.extents,
            vec![
                SourceExtent {
                    start_page: 0,
                    pages: first,
                    source: "uninitialized".into()
                },
                SourceExtent {
                    start_page: first,
                    pages: 4096,
                    source: format!("file:{}", image.path())
                },
            ],
            "{src:?}"
        );
        let out = c.finish();
        assert_clean(line_of(&out, &check));
    }
}

/// Two Firecracker processes on one listener at once: both listed with
/// their pids while held, both served concurrently and correctly.
#[test]
fn two_clients_on_one_listener_are_served_at_once() {
    if !require_uffd() {
        return;
    }
    let mib = 128;
    let image = RandomImage::new(mib, 0xf1c0_0005);
    let s = TestServer::start();
    let (lid, sock) = listen(&s, "fc", &image.path(), 0, false);
    let check = check_cmd(&image.path());
    let mib_arg = mib.to_string();
    let baseline = open_fds(s.pid()).len();
    let mut a = FcClient::spawn(
        &sock,
        &["--mib", &mib_arg],
        &["hold", "touch-random:1", &check],
    );
    let mut b = FcClient::spawn(&sock, &["--mib", &mib_arg], &["hold", "touch-seq", &check]);
    let (va, vb) = (
        s.wait_firecracker_vm(a.pid(), TIMEOUT),
        s.wait_firecracker_vm(b.pid(), TIMEOUT),
    );
    let (ia, ib) = (va.id, vb.id);
    assert_ne!(ia, ib);
    let listed: Vec<String> = s.firecracker_vms().into_iter().map(|v| v.id).collect();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(listed.contains(&ia) && listed.contains(&ib), "{listed:?}");
    let l = s.listener(&lid);
    assert_eq!(l.accepted, 2, "{l:?}");
    let mut lvms = l.vms.clone();
    lvms.sort();
    let mut want = vec![ia.clone(), ib.clone()];
    want.sort();
    assert_eq!(lvms, want, "{l:?}");

    a.release();
    b.release();
    let (pa, pb) = (a.pid(), b.pid());
    let oa = std::thread::spawn(move || a.finish());
    let ob = b.finish();
    let oa = oa.join().expect("client a");
    assert_clean(line_of(&oa, &check));
    assert_clean(line_of(&ob, &check));
    s.wait_firecracker_vm_gone(pa, Duration::from_secs(10));
    s.wait_firecracker_vm_gone(pb, Duration::from_secs(10));
    assert_eq!(s.listener(&lid).vms, Vec::<String>::new());
    wait_fds_released(&s, baseline, 0);
    s.assert_healthy();
}

/// `madvise(MADV_DONTNEED)` (a balloon REMOVE) makes a range read as zero
/// on its next fault, for touched and never-touched pages, and the rest
/// still matches the image.
/// A thread discarding a range over and over while another reads it: the
/// server sees faults for pages whose REMOVE it has not read yet and
/// installs that fail with EAGAIN. Every read must be the image's bytes or
/// zeroes, nothing may hang, and a final discard leaves zeroes.
#[test]
fn faults_racing_removes_read_image_or_zero_and_never_hang() {
    if !require_uffd() {
        return;
    }
    let mib = 16;
    let image = RandomImage::new(mib, 0xf1c0_0016);
    let s = TestServer::start();
    let (_, sock) = listen(&s, "fc", &image.path(), 64, false);
    let race = format!("race-remove:{}:100:64:400", image.path());
    let check = check_cmd(&image.path());
    let mut c = FcClient::spawn(
        &sock,
        &["--mib", &mib.to_string()],
        &[&race, "remove:100:64", "zero:100:64", &check, "hold"],
    );
    let r = c.until(&race);
    let zero = c.until("zero:100:64");
    let checked = c.until(&check);
    let v = s.wait_firecracker_vm(c.pid(), TIMEOUT);
    let pid = c.pid();
    c.finish();
    s.wait_firecracker_vm_gone(pid, Duration::from_secs(10));
    assert_eq!(
        r["bad_reads"], 0,
        "a read saw neither the image nor zeroes: {r}"
    );
    assert!(r["removes"].as_u64().unwrap_or(0) > 0, "{r}");
    assert_eq!(zero["nonzero_pages"], 0, "{zero}");
    // Only the 64 discarded pages differ from the image at the end.
    assert_eq!(checked["mismatched_pages"], 64, "{checked}");
    eprintln!("race: {r}; server: {:?}", v.faults);
    s.assert_healthy();
}

#[test]
fn madvise_dontneed_makes_a_range_read_zero() {
    if !require_uffd() {
        return;
    }
    let mib = 64;
    let image = RandomImage::new(mib, 0xf1c0_0006);
    let s = TestServer::start();
    let (_, sock) = listen(&s, "fc", &image.path(), 64, false);
    let check = check_cmd(&image.path());
    // 5000..5007 is removed before it is ever touched (inside a 16-page
    // fault-around block); 1003..1303 after the whole memory was read.
    let mut c = FcClient::spawn(
        &sock,
        &["--mib", &mib.to_string()],
        &[
            "remove:5000:7",
            "touch-seq",
            "remove:1003:300",
            "hold",
            "zero:1003:300",
            "zero:5000:7",
            &check,
        ],
    );
    c.until("remove:1003:300");
    let v = s.wait_firecracker_vm(c.pid(), TIMEOUT);
    let id = v.id.clone();
    assert_eq!(v.faults.removes, 2, "{v:?}");
    assert_eq!(pages_by(&v, "uninitialized"), 300, "{v:?}");
    for p in [1003, 1150, 1302] {
        let i = s.page(&id, p);
        assert_eq!(
            (i.source.as_deref(), i.present),
            (Some("uninitialized"), false),
            "page {p}: {i:?}"
        );
    }
    for p in [1002, 1303] {
        let i = s.page(&id, p);
        assert_eq!(
            i.source.as_deref(),
            Some(id.as_str()),
            "page {p} was not removed: {i:?}"
        );
    }
    // Removed before the touch: installed as zero pages by the touch.
    for p in [5000, 5006] {
        let i = s.page(&id, p);
        assert_eq!(
            (i.source.as_deref(), i.present),
            (Some(id.as_str()), true),
            "page {p}: {i:?}"
        );
    }
    let out = c.finish();
    assert_eq!(
        line_of(&out, "zero:1003:300")["nonzero_pages"],
        0,
        "{out:?}"
    );
    assert_eq!(line_of(&out, "zero:5000:7")["nonzero_pages"], 0, "{out:?}");
    let chk = line_of(&out, &check);
    assert_eq!(
        chk["mismatched_pages"], 307,
        "exactly the removed pages differ from the image: {chk}"
    );
    assert_eq!(chk["first_mismatch"], 1003, "{chk}");
}

/// A client SIGKILLed in the middle of its faults leaves the server
/// healthy: its VM goes away, nothing leaks, and the listener serves a new
/// client.
#[test]
fn a_client_killed_mid_run_leaves_the_server_healthy() {
    if !require_uffd() {
        return;
    }
    let mib = 256;
    let pages = (mib << 20) / PAGE;
    let image = RandomImage::new(mib, 0xf1c0_0007);
    let s = TestServer::start();
    let (lid, sock) = listen(&s, "fc", &image.path(), 0, false);
    let baseline = open_fds(s.pid()).len();
    let c = FcClient::spawn(
        &sock,
        &["--mib", &mib.to_string()],
        &["touch-random:5", "sleep:60000"],
    );
    let pid = c.pid();
    let missing = wait_until("the client's first faults", TIMEOUT, || {
        s.firecracker_vm(pid)
            .map(|v| v.faults.missing)
            .filter(|m| *m > 0)
    });
    signal(pid, Signal::SIGKILL);
    let after = s.firecracker_vm(pid).map(|v| v.faults.missing);
    eprintln!(
        "killed the client after {missing} of {pages} faults (server saw {after:?} at the kill)"
    );
    drop(c);
    assert!(
        !process_exists(pid)
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|t| t.contains(") Z"))
    );
    s.wait_firecracker_vm_gone(pid, Duration::from_secs(10));
    s.assert_healthy();
    assert_eq!(s.listener(&lid).vms, Vec::<String>::new());
    wait_fds_released(&s, baseline, 0);

    let check = check_cmd(&image.path());
    let out = run_client(&sock, &["--mib", &mib.to_string()], &[&check]);
    assert_clean(line_of(&out, &check));
    s.assert_healthy();
}

/// A userfaultfd of this process, to pass in handshakes.
fn test_uffd() -> userfaultfd::Uffd {
    userfaultfd::UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(false)
        .create()
        .unwrap_or_else(|e| panic!("cannot create a userfaultfd in the test: {e}"))
}

/// Each malformed handshake is refused with a precise reason and its
/// connection closed, while a held good client keeps being served and the
/// server keeps no fd of the refused connections.
#[test]
fn each_malformed_handshake_is_refused_without_affecting_other_clients() {
    if !require_uffd() {
        return;
    }
    let mib = 64;
    let image = RandomImage::new(mib, 0xf1c0_0008);
    let s = TestServer::start();
    let (lid, sock) = listen(&s, "fc", &image.path(), 64, false);
    let check = check_cmd(&image.path());
    let good = FcClient::spawn(&sock, &["--mib", "64"], &["hold", &check]);
    let good_vm = s.wait_firecracker_vm(good.pid(), TIMEOUT).id;
    let baseline = open_fds(s.pid()).len();

    let uffd = test_uffd();
    let devnull = std::fs::File::open("/dev/null").expect("open /dev/null");
    let (u, n) = (uffd.as_raw_fd(), devnull.as_raw_fd());
    let base: u64 = 0x7f00_0000_0000;
    let ok = handshake(&[region(base, 16 << 20, 0, PAGE)]);
    let overlap = handshake(&[
        region(base, 8 << 20, 0, PAGE),
        region(base + (4 << 20), 8 << 20, 16 << 20, PAGE),
    ]);
    let past = handshake(&[region(base, 16 << 20, 56 << 20, PAGE)]);
    let big_page = handshake(&[region(base, 16 << 20, 0, 65536)]);
    let cases: Vec<(&str, Vec<u8>, Vec<RawFd>, &str)> = vec![
        (
            "bytes that are not JSON, with a uffd",
            b"GET / HTTP/1.1\r\n\r\n".to_vec(),
            vec![u],
            "not a JSON array of regions",
        ),
        (
            "valid regions without an fd",
            ok.clone(),
            vec![],
            "carries 0 fds",
        ),
        (
            "valid regions with two fds",
            ok.clone(),
            vec![u, n],
            "carries 2 fds",
        ),
        (
            "overlapping regions",
            overlap,
            vec![u],
            "regions 0 and 1 overlap",
        ),
        (
            "a region past the end of the source",
            past,
            vec![u],
            "region 0 ends at byte 75497472 of the memory source, which has only 67108864 bytes",
        ),
        (
            "an unsupported page size",
            big_page,
            vec![u],
            "region 0 has page size 65536",
        ),
        (
            "an empty region list",
            b"[]".to_vec(),
            vec![u],
            "lists no regions",
        ),
    ];
    for (i, (what, body, fds, needle)) in cases.iter().enumerate() {
        let stream = send_handshake(&sock, body, fds);
        assert_closed_by_server(stream, what);
        let l = s.listener(&lid);
        assert_eq!(
            l.refused,
            i as u64 + 1,
            "{what}: not counted as refused: {l:?}"
        );
        let why = l
            .last_refusal
            .as_deref()
            .unwrap_or_else(|| panic!("{what}: no last_refusal in {l:?}"));
        assert!(
            why.contains(needle),
            "{what}: last_refusal {why:?} does not say {needle:?}"
        );
    }
    // A peer that hangs up without sending anything.
    let silent = UnixStream::connect(&sock).expect("connect");
    silent
        .shutdown(std::net::Shutdown::Write)
        .expect("shutdown");
    assert_closed_by_server(silent, "a peer that sends nothing");
    let l = s.listener(&lid);
    assert_eq!(l.refused, cases.len() as u64 + 1, "{l:?}");
    assert!(
        l.last_refusal
            .as_deref()
            .is_some_and(|w| w.contains("without a handshake")),
        "{l:?}"
    );

    // Nothing of the refused connections stays; the good client is intact.
    assert_eq!(l.accepted, 1, "{l:?}");
    assert_eq!(l.vms, vec![good_vm.clone()], "{l:?}");
    let listed: Vec<String> = s.firecracker_vms().into_iter().map(|v| v.id).collect();
    assert_eq!(
        listed,
        vec![good_vm],
        "refused handshakes must not create VMs"
    );
    wait_fds_released(&s, baseline, 1);
    s.assert_healthy();
    let out = good.finish();
    assert_clean(line_of(&out, &check));
}

/// With `working_set`, the pages the first client faulted on are recorded
/// when it hangs up, and installed into later clients right after their
/// handshake, before they touch anything.
#[test]
fn a_recorded_working_set_is_prefetched_into_later_clients() {
    if !require_uffd() {
        return;
    }
    let mib = 64;
    let pages = (mib << 20) / PAGE;
    let image = RandomImage::new(mib, 0xf1c0_0009);
    let s = TestServer::start();
    let (lid, sock) = listen(&s, "fc", &image.path(), 0, true);
    assert!(s.listener(&lid).working_set);
    let check = check_cmd(&image.path());

    // Record: a random-order touch of all pages, then hang up.
    run_client(&sock, &["--mib", "64"], &["touch-random:11"]);
    let recorded = wait_until(
        "the working set to be recorded",
        Duration::from_secs(10),
        || Some(s.listener(&lid).recorded_pages).filter(|n| *n > 0),
    );
    assert_eq!(recorded, pages, "one fault per page was recorded");

    // Replay: pages arrive while the client sleeps, then its check hardly
    // faults.
    let mut c = FcClient::spawn(&sock, &["--mib", "64"], &["sleep:1000", &check, "hold"]);
    let pid = c.pid();
    let early = wait_until("prefetched pages", Duration::from_secs(10), || {
        s.firecracker_vm(pid)
            .filter(|v| v.faults.pages_installed > 0)
    });
    assert_eq!(
        early.faults.missing, 0,
        "pages installed before any touch come from the prefetch: {early:?}"
    );
    assert_clean(&c.until(&check));
    let v = s.wait_firecracker_vm(pid, TIMEOUT);
    let missing = v.faults.missing;
    eprintln!("after prefetch, the full check took {missing} faults for {pages} pages");
    assert!(
        missing < pages / 10,
        "most pages should have been prefetched: {v:?}"
    );
    assert_eq!(v.faults.pages_installed, pages, "{v:?}");
    c.finish();
    s.wait_firecracker_vm_gone(pid, Duration::from_secs(10));

    // A smaller client gets exactly the recorded pages inside its region,
    // with no fault at all; the recording stays the first client's.
    let mut c = FcClient::spawn(&sock, &["--mib", "32"], &["hold", &check]);
    let pid = c.pid();
    let v = wait_until(
        "the 32 MiB client to be prefetched",
        Duration::from_secs(10),
        || {
            s.firecracker_vm(pid)
                .filter(|v| v.faults.pages_installed >= pages / 2)
        },
    );
    assert_eq!(v.faults.pages_installed, pages / 2, "{v:?}");
    assert_eq!(v.faults.missing, 0, "{v:?}");
    c.release();
    assert_clean(line_of(&c.finish(), &check));
    assert_eq!(s.listener(&lid).recorded_pages, pages);
}

/// 2 MiB pages (hugetlbfs memory): served one huge page per fault from a
/// 2 MiB-aligned offset, and a REMOVE of whole huge pages reads zero.
#[test]
fn two_mib_pages_are_served_and_removed_whole() {
    if !require_uffd() {
        return;
    }
    let _huge = match HugePages::reserve(32) {
        Ok(h) => h,
        Err(why) if in_ci() => panic!("CI=true but 2 MiB hugepages cannot be reserved: {why}"),
        Err(why) => {
            eprintln!("skipping: {why} (this test needs 32 free 2 MiB hugepages)");
            return;
        }
    };
    let mib = 64;
    let image = RandomImage::new(mib, 0xf1c0_000a);
    let s = TestServer::start();
    let (_, sock) = listen(&s, "fc", &image.path(), 0, false);
    let check = check_cmd(&image.path());
    let huge = HUGE_PAGE.to_string();
    let mut c = FcClient::spawn(
        &sock,
        &["--mib", "32", "--page-size", &huge, "--offset", &huge],
        &[
            &check,
            "hold",
            "remove:512:1024",
            "zero:512:1024",
            "zero:0:512",
        ],
    );
    assert_clean(&c.until(&check));
    let v = s.wait_firecracker_vm(c.pid(), TIMEOUT);
    assert_eq!(v.faults.missing, 16, "one fault per 2 MiB page: {v:?}");
    assert_eq!(v.faults.pages_installed, (32 << 20) / PAGE, "{v:?}");
    let out = c.finish();
    assert_eq!(
        line_of(&out, "zero:512:1024")["nonzero_pages"],
        0,
        "{out:?}"
    );
    assert_eq!(line_of(&out, "zero:0:512")["nonzero_pages"], 512, "{out:?}");
}

/// `--firecracker SOCKET=IMAGE` (with `--working-set`) starts a listener
/// that serves clients like one made through the API.
#[test]
fn a_listener_given_on_the_command_line_serves_clients() {
    if !require_uffd() {
        return;
    }
    let image = RandomImage::new(16, 0xf1c0_000b);
    let dir = tempfile::Builder::new()
        .prefix("pagefork-fc-")
        .tempdir()
        .expect("tempdir");
    let sock = dir.path().join("fc.sock");
    let spec = format!("{}={}", sock.display(), image.path());
    let s = TestServer::start_with_args(&["--firecracker", &spec, "--working-set"]);
    let l = s.listener("fc-1");
    assert_eq!(Path::new(&l.socket), sock, "{l:?}");
    assert_eq!(
        l.memory_source,
        MemorySource::File { path: image.path() },
        "{l:?}"
    );
    assert!(l.working_set, "{l:?}");
    let mode = std::fs::metadata(&sock)
        .expect("the listener socket exists")
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "listener sockets are private");
    let check = check_cmd(&image.path());
    let out = run_client(&sock, &["--mib", "16"], &[&check]);
    assert_clean(line_of(&out, &check));
}

/// Deleting a listener stops new connections (its socket is gone) while
/// its connected clients keep being served.
#[test]
fn deleting_a_listener_keeps_its_connected_clients_served() {
    if !require_uffd() {
        return;
    }
    let image = RandomImage::new(32, 0xf1c0_000c);
    let s = TestServer::start();
    let (lid, sock) = listen(&s, "fc", &image.path(), 64, false);
    let check = check_cmd(&image.path());
    let c = FcClient::spawn(&sock, &["--mib", "32"], &["hold", &check]);
    s.wait_firecracker_vm(c.pid(), TIMEOUT);
    s.delete_listener(&lid);
    assert!(!sock.exists(), "the listener socket outlives its listener");
    let all = s.listeners();
    assert!(all.is_empty(), "{all:?}");
    let v = s.try_delete_listener(&lid).unwrap_err();
    assert_eq!(v.status, 404, "{v}");
    let out = c.finish();
    assert_clean(line_of(&out, &check));
    s.assert_healthy();
}

/// A handshake as older Firecrackers send it (only the deprecated
/// `page_size_kib`, in KiB) with two regions, listed out of address order,
/// at unrelated file offsets and not a multiple of the fault-around block:
/// each is served from its own offset. The peer is this very process, found
/// by SO_PEERCRED.
#[test]
fn two_regions_with_only_page_size_kib_are_served_from_their_offsets() {
    if !require_uffd() {
        return;
    }
    let image = RandomImage::new(16, 0xf1c0_000d);
    let s = TestServer::start();
    let (_, sock) = listen(&s, "fc", &image.path(), 64, false);
    // Region A: 259 pages from file offset 8 MiB + 4 KiB; region B right
    // after it in memory: 64 pages from file offset 2 MiB.
    let (a_pages, a_off, b_pages, b_off) = (259u64, (8u64 << 20) + PAGE, 64u64, 2u64 << 20);
    let len = usize::try_from((a_pages + b_pages) * PAGE).expect("fits");
    // SAFETY: a fresh anonymous mapping, unmapped at the end of the test.
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(
        mem,
        libc::MAP_FAILED,
        "mmap: {}",
        std::io::Error::last_os_error()
    );
    let uffd = test_uffd();
    uffd.register(mem, len).expect("register the test mapping");
    let base = mem as u64;
    let old = |base_host_virt_addr, size, offset| GuestRegionUffdMapping {
        base_host_virt_addr,
        size,
        offset,
        page_size: None,
        page_size_kib: Some(4),
    };
    let body = handshake(&[
        old(base + a_pages * PAGE, b_pages * PAGE, b_off),
        old(base, a_pages * PAGE, a_off),
    ]);
    let stream = send_handshake(&sock, &body, &[uffd.as_raw_fd()]);
    let id = s.wait_firecracker_vm(std::process::id(), TIMEOUT).id;
    // Fault page by page in address order, on another thread so a server
    // that never answers fails the test instead of hanging it.
    let addr = mem as usize;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // SAFETY: `addr..addr+len` is the mapping above, alive until after
        // this thread reports.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
        for p in (0..len).step_by(4096) {
            // SAFETY: in bounds; volatile so the read (and fault) happens.
            let _ = unsafe { std::ptr::read_volatile(&bytes[p]) };
        }
        let _ = tx.send(bytes.to_vec());
    });
    let got = rx
        .recv_timeout(TIMEOUT)
        .expect("the server did not serve this process's faults");
    let at = |off: u64, pages: u64| {
        let o = usize::try_from(off).expect("fits");
        &image.bytes[o..o + usize::try_from(pages * PAGE).expect("fits")]
    };
    let split = usize::try_from(a_pages * PAGE).expect("fits");
    assert!(
        got[..split] == *at(a_off, a_pages),
        "region A differs from the image at offset {a_off}"
    );
    assert!(
        got[split..] == *at(b_off, b_pages),
        "region B differs from the image at offset {b_off}"
    );
    let v = s.vm(&id);
    // 64 KiB blocks counted from each region's start: 17 for A's 259
    // pages (the last one clipped), 4 for B's 64.
    assert_eq!(v.faults.missing, 17 + 4, "{v:?}");
    assert_eq!(v.faults.pages_installed, a_pages + b_pages, "{v:?}");
    drop(stream);
    s.wait_firecracker_vm_gone(std::process::id(), Duration::from_secs(10));
    drop(uffd);
    // SAFETY: the mapping made above; no reference into it remains.
    unsafe { libc::munmap(mem, len) };
}

/// A listener never replaces a file that is already there and is not a
/// socket, neither through the API (409, the file untouched) nor on the
/// command line (the server refuses to start and says why); a symlink
/// there is not followed.
#[test]
fn a_listener_refuses_to_replace_an_existing_file_that_is_not_a_socket() {
    if !require_uffd() {
        return;
    }
    let image = RandomImage::new(4, 0xf1c0_0042);
    let s = TestServer::start();
    let file = s.state_dir().join("precious.txt");
    std::fs::write(&file, b"keep me").expect("write");
    let link = s.state_dir().join("link.sock");
    std::os::unix::fs::symlink(&file, &link).expect("symlink");
    for socket in [&file, &link] {
        let v = s
            .try_add_listener(&new_listener(socket, image.source()))
            .unwrap_err();
        assert_eq!(v.status, 409, "{}: {v}", socket.display());
        let msg = v.error();
        assert!(msg.contains("already exists"), "{msg}");
    }
    assert_eq!(std::fs::read(&file).expect("read"), b"keep me");
    assert!(std::fs::symlink_metadata(&link)
        .expect("link")
        .file_type()
        .is_symlink());
    s.assert_healthy();

    // On the command line: the server does not start.
    let state = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new(pagefork_tests::bin("uffd-server"))
        .arg("--state-dir")
        .arg(state.path().join("state"))
        .arg("--vmm-bin")
        .arg(pagefork_tests::bin("vmm"))
        .arg("--firecracker")
        .arg(format!("{}={}", file.display(), image.path()))
        .output()
        .expect("run uffd-server");
    assert!(!out.status.success(), "the server started over a file");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already exists") && err.contains("precious.txt"),
        "{err}"
    );
    assert_eq!(std::fs::read(&file).expect("read"), b"keep me");
}

/// A kill-and-stop storm against Firecracker clients of one image on two
/// listeners (one page per fault, and fault-around): eight clients fault
/// at once; three are SIGKILLed mid-touch, two SIGSTOPped mid-touch and
/// then SIGKILLed while stopped, one SIGSTOPped and later continued, two
/// left alone. Those left alone and the continued one read every page
/// exactly; the server drops the VMs, uffds and connections of the
/// killed ones and serves a new client exactly afterwards.
#[test]
fn a_kill_and_stop_storm_of_firecracker_clients_leaves_the_rest_exact() {
    if !require_uffd() {
        return;
    }
    let mib = 128;
    let image = RandomImage::new(mib, 0xf1c0_0051);
    let s = TestServer::start();
    let (la, sock_a) = listen(&s, "storm-a", &image.path(), 0, false);
    let (lb, sock_b) = listen(&s, "storm-b", &image.path(), 64, false);
    let baseline = open_fds(s.pid()).len();
    let check = check_cmd(&image.path());
    let opts = ["--mib", "128"];
    let sock = |i: usize| {
        if i.is_multiple_of(2) {
            &sock_a
        } else {
            &sock_b
        }
    };
    let touch = |i: usize| format!("touch-random:{i}");
    let spawn_victim = |i: usize| FcClient::spawn(sock(i), &opts, &[&touch(i), "sleep:60000"]);
    let faulting = |c: &FcClient| {
        wait_until("a client's first faults", TIMEOUT, || {
            s.firecracker_vm(c.pid())
                .map(|v| v.faults.missing)
                .filter(|m| *m > 0)
        })
    };

    let mut left_alone: Vec<FcClient> = (0..2)
        .map(|i| FcClient::spawn(sock(i), &opts, &[&check]))
        .collect();
    let killed: Vec<FcClient> = (2..5).map(spawn_victim).collect();
    let stopped: Vec<FcClient> = (5..7).map(spawn_victim).collect();
    // On the one-page-per-fault listener, so it is still touching when
    // it is stopped.
    let mut continued = FcClient::spawn(&sock_a, &opts, &[&check]);

    for c in &killed {
        faulting(c);
        signal(c.pid(), Signal::SIGKILL);
    }
    for c in stopped.iter().chain(std::iter::once(&continued)) {
        faulting(c);
        signal(c.pid(), Signal::SIGSTOP);
        let at = s.firecracker_vm(c.pid()).map(|v| v.faults.missing);
        eprintln!("stopped client {} after {at:?} faults", c.pid());
    }
    // Stopped clients hold their faults; everyone else is served.
    for c in &mut left_alone {
        assert_clean(&c.until(&check));
    }
    for c in &stopped {
        signal(c.pid(), Signal::SIGKILL);
    }
    signal(continued.pid(), Signal::SIGCONT);
    assert_clean(&continued.until(&check));

    let gone: Vec<u32> = killed.iter().chain(&stopped).map(FcClient::pid).collect();
    drop(killed);
    drop(stopped);
    for pid in &gone {
        s.wait_firecracker_vm_gone(*pid, Duration::from_secs(10));
    }
    drop(left_alone);
    drop(continued);
    wait_until("every client's VM to go", Duration::from_secs(10), || {
        s.firecracker_vms().is_empty().then_some(())
    });
    assert_eq!(s.listener(&la).vms, Vec::<String>::new());
    assert_eq!(s.listener(&lb).vms, Vec::<String>::new());
    wait_fds_released(&s, baseline, 0);
    s.assert_healthy();

    let out = run_client(&sock_a, &opts, &[&check]);
    assert_clean(line_of(&out, &check));
}
