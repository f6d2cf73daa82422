//! Snapshots in an object store (issue 40), with a Ceph RGW on this host
//! (`scripts/ceph.sh`, or the one of `AWS_*`/`PAGEFORK_REMOTE`): a snapshot
//! with a recorded working set, pushed from host A, restored on host B (a
//! second server, in a network namespace of its own when run as root) with
//! a cold cache, until the guest answers and until it has touched its
//! working set, with and without the working-set prefetch, against a
//! local restore of the same snapshot on A and against the floor of
//! reading the working set's chunks with plain parallel GETs; the bytes
//! fetched; and a push against a plain multipart upload of the same bytes.
//!
//! The memory is realistic (`pagefork_tests::realistic_memory`, ~3:1), not
//! a pattern that compresses 1000:1.
//!
//! Usage: `remote_restore [--quick]`. Prints JSON rows.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{StreamExt, TryStreamExt};
use object_store::path::Path as Key;
use object_store::{ObjectStoreExt, WriteMultipart};
use pagefork_benches::{Plan, Row};
use pagefork_tests::{
    new_vm, op, realistic_memory, require_store, Netns, RandomImage, ServerOptions, Store,
    TestServer,
};
use proto::api::{CreateVm, SnapshotMode};

const BENCH: &str = "remote_restore";
const TABLE: &str = "Snapshots in an object store: restore on another host (issue 40)";
const PAGES_PER_MIB: u64 = 256;
/// Requests in flight in the baselines, as in the server's fetches.
const PARALLEL: usize = 16;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The raw client of the store's bucket and the prefix of `url`.
fn raw(store: &Store, url: &str) -> (Arc<object_store::aws::AmazonS3>, String) {
    let bucket = url
        .trim_start_matches("s3://")
        .split('/')
        .next()
        .unwrap_or_default();
    let prefix = url
        .trim_start_matches("s3://")
        .split_once('/')
        .map_or("", |(_, p)| p)
        .to_owned();
    let client = object_store::aws::AmazonS3Builder::new()
        .with_bucket_name(bucket)
        .with_endpoint(&store.env["AWS_ENDPOINT_URL"])
        .with_region(
            store
                .env
                .get("AWS_REGION")
                .map_or("us-east-1", String::as_str),
        )
        .with_access_key_id(&store.env["AWS_ACCESS_KEY_ID"])
        .with_secret_access_key(&store.env["AWS_SECRET_ACCESS_KEY"])
        .with_allow_http(true)
        .build()
        .expect("raw client");
    (Arc::new(client), prefix)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The floor: GET every object of `keys`, `PARALLEL` at once; ms.
fn parallel_gets(
    rt: &tokio::runtime::Runtime,
    s3: &Arc<object_store::aws::AmazonS3>,
    keys: &[Key],
) -> f64 {
    rt.block_on(async {
        let t = Instant::now();
        futures_util::stream::iter(keys.iter().cloned())
            .map(|k| {
                let s3 = Arc::clone(s3);
                async move { s3.get(&k).await?.bytes().await }
            })
            .buffer_unordered(PARALLEL)
            .try_for_each(|_| async { Ok(()) })
            .await
            .expect("GET a chunk");
        ms(t.elapsed())
    })
}

/// The push baseline: `bytes` as one object in a multipart upload of
/// 8 MiB parts, `PARALLEL` in flight; ms. The object is deleted after.
fn multipart(
    rt: &tokio::runtime::Runtime,
    s3: &Arc<object_store::aws::AmazonS3>,
    key: Key,
    bytes: &[u8],
) -> f64 {
    rt.block_on(async {
        let t = Instant::now();
        let upload = s3
            .put_multipart(&key)
            .await
            .expect("start a multipart upload");
        let mut w = WriteMultipart::new_with_chunk_size(upload, 8 << 20);
        for part in bytes.chunks(8 << 20) {
            w.wait_for_capacity(PARALLEL).await.expect("upload a part");
            w.write(part);
        }
        w.finish().await.expect("finish the upload");
        let took = ms(t.elapsed());
        s3.delete(&key).await.expect("delete the upload");
        took
    })
}

/// Host B with a cold cache: a new server on a fresh state directory.
fn host_b(store: &Store, url: &str, netns: Option<&Netns>, prefetch: bool) -> TestServer {
    let endpoint = netns.map(|n| format!("http://{}:{}", n.host_addr, store.port()));
    TestServer::start_with_options(
        &[
            "--remote",
            url,
            "--prefetch-working-set",
            if prefetch { "true" } else { "false" },
        ],
        &ServerOptions {
            env: store.server_env(endpoint.as_deref()),
            netns: netns.map(|n| n.name.clone()),
            ..ServerOptions::default()
        },
    )
}

/// One restore from `from` on `s`: until the guest answers, until it
/// has touched `ws_pages` pages (ms), and the stored bytes fetched from
/// the store before it answered and in all.
fn restore(s: &TestServer, from: &str, ws_pages: u64, remote: bool) -> Restore {
    let fetched = || {
        if remote {
            s.remote_status().fetched_bytes
        } else {
            0
        }
    };
    let before = fetched();
    let t = Instant::now();
    let id = s.restore(from);
    let answer = ms(t.elapsed());
    let at_answer = fetched();
    s.exec(&id, &op::touch(0, ws_pages, false));
    let ws = ms(t.elapsed());
    let after = fetched();
    s.delete_vm(&id);
    Restore {
        answer,
        ws,
        early: at_answer - before,
        total: after - before,
    }
}

/// What one restore measured.
#[derive(Debug)]
struct Restore {
    /// Until the guest answered, and until it had touched its working
    /// set, ms.
    answer: f64,
    ws: f64,
    /// Stored bytes fetched before it answered, and in all.
    early: u64,
    total: u64,
}

/// The samples of restores of one kind.
#[derive(Debug, Default)]
struct Samples {
    answer: Vec<f64>,
    ws: Vec<f64>,
    early_kib: Vec<f64>,
    total: Vec<f64>,
}

fn main() -> ExitCode {
    let plan = Plan::from_args();
    if !pagefork_tests::require_kvm_uffd() {
        eprintln!("{BENCH}: needs /dev/kvm and /dev/userfaultfd");
        return ExitCode::FAILURE;
    }
    let Some(store) = require_store() else {
        eprintln!("{BENCH}: needs an object store (scripts/ceph.sh)");
        return ExitCode::FAILURE;
    };
    let (mib, ws_mib) = (plan.remote_mib, plan.remote_ws_mib);
    let ws_pages = ws_mib * PAGES_PER_MIB;
    eprintln!(
        "{BENCH}: {mib} MiB snapshot, {ws_mib} MiB working set, {} reps",
        plan.reps
    );
    let image = RandomImage::from_bytes(realistic_memory(mib));
    let url = store.fresh_url("bench");
    let a = TestServer::start_with_options(
        &["--remote", &url],
        &ServerOptions {
            env: store.server_env(None),
            ..ServerOptions::default()
        },
    );
    let vm = a.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        ..new_vm(mib)
    });
    a.snapshot(&vm, "s", SnapshotMode::Full);
    a.delete_vm(&vm);
    // The first restore records the working set the guest touches.
    let first = a.restore("s");
    a.exec(&first, &op::touch(0, ws_pages, false));
    a.delete_vm(&first);
    let recorded = pagefork_tests::wait_until(
        "the working set to be recorded",
        Duration::from_secs(30),
        || {
            let n = a.snapshot_info("s").working_set_pages;
            (n > 0).then_some(n)
        },
    );
    eprintln!("  working set recorded: {recorded} pages");

    // Push against a multipart upload of the same bytes; between pushes
    // the snapshot is deleted and its chunks collected.
    let rt = runtime();
    let (s3, prefix) = raw(store, &url);
    let (mut push_ms, mut upload_ms) = (Vec::new(), Vec::new());
    for rep in 0..plan.reps {
        let st = a.push_and_wait("s");
        push_ms.push(st.elapsed_us as f64 / 1e3);
        if rep + 1 < plan.reps {
            a.try_delete_remote_snapshot("s")
                .expect("delete the pushed snapshot");
            a.try_remote_gc().expect("gc");
        }
        let key = Key::from(format!("{prefix}/baseline-upload-{rep}"));
        upload_ms.push(multipart(&rt, &s3, key, &image.bytes));
    }
    let info = a.remote_snapshot("s");
    eprintln!(
        "  pushed: {} chunks, {} stored bytes, working set {} pages",
        info.chunks, info.stored_bytes, info.working_set_pages
    );

    // The floor: the working set's chunks with plain parallel GETs.
    let m = proto::manifest::parse_manifest(&rt.block_on(async {
        s3.get(&Key::from(format!("{prefix}/manifests/s")))
            .await
            .expect("GET the manifest")
            .bytes()
            .await
            .expect("the manifest")
    }))
    .expect("the manifest parses");
    let chunks = m.memory_chunks();
    let mut ws_keys: Vec<Key> = Vec::new();
    for r in m.working_set.as_deref().unwrap_or_default() {
        for c in r.first / PAGES_PER_MIB..=(r.first + r.pages - 1) / PAGES_PER_MIB {
            let Some(chunk) = chunks.get(usize::try_from(c).unwrap_or(usize::MAX)) else {
                continue;
            };
            let key = Key::from(format!("{prefix}/chunks/{}", chunk.digest));
            if chunk.stored.is_some() && !ws_keys.contains(&key) {
                ws_keys.push(key);
            }
        }
    }
    let floor: Vec<f64> = (0..plan.reps)
        .map(|_| parallel_gets(&rt, &s3, &ws_keys))
        .collect();

    let netns = Netns::up("bench");
    let (mut local_answer, mut local_ws) = (Vec::new(), Vec::new());
    let (mut pre, mut lazy) = (Samples::default(), Samples::default());
    for rep in 0..plan.reps {
        let r = restore(&a, "s", ws_pages, false);
        local_answer.push(r.answer);
        local_ws.push(r.ws);
        for (t, prefetch) in [(&mut pre, true), (&mut lazy, false)] {
            let b = host_b(store, &url, netns.as_ref(), prefetch);
            let r = restore(&b, "remote:s", ws_pages, true);
            eprintln!(
                "  rep {rep} prefetch {prefetch}: answers in {:.1} ms, working set in {:.1} ms, {} bytes fetched before the answer, {} in all",
                r.answer, r.ws, r.early, r.total
            );
            t.answer.push(r.answer);
            t.ws.push(r.ws);
            t.early_kib.push(r.early as f64 / 1024.0);
            t.total.push(r.total as f64);
        }
    }
    drop(rt);

    let ws_note = format!(
        "{ws_mib} MiB working set of a {mib} MiB snapshot, recorded on its first restore; B's cache cold (a new server each time)"
    );
    Row::new(
        BENCH,
        "remote.answer",
        TABLE,
        &format!("restore of a {mib} MiB snapshot from the store on host B until the guest answers, working set prefetched"),
        "ms",
        &pre.answer,
        "local restore of the same snapshot on A",
        &local_answer,
    )
    .goal("≤ 2× (Cube: 730 ms across nodes)")
    .note(ws_note.clone())
    .emit();
    Row::new(
        BENCH,
        "remote.answer_lazy",
        TABLE,
        "the same, without the working-set prefetch",
        "ms",
        &lazy.answer,
        "local restore on A",
        &local_answer,
    )
    .goal("≤ 2×")
    .emit();
    // The floor of a restore until the working set is touched: the longer
    // of fetching its chunks (plain parallel GETs) and the guest touching
    // it with its memory here (the local restore), rep by rep.
    let floor_ws: Vec<f64> = floor
        .iter()
        .zip(&local_ws)
        .map(|(g, l)| g.max(*l))
        .collect();
    let floor_name = format!(
        "the floor: the longer of GETs of its {} chunks ({PARALLEL} at once) and the guest touching it after a local restore",
        ws_keys.len()
    );
    Row::new(
        BENCH,
        "remote.ws",
        TABLE,
        "restore on B until the guest has touched its working set, prefetched",
        "ms",
        &pre.ws,
        &floor_name,
        &floor_ws,
    )
    .goal("≤ 1.5×")
    .note(ws_note)
    .emit();
    Row::new(
        BENCH,
        "remote.ws_lazy",
        TABLE,
        "the same, without the prefetch (chunks fetched fault by fault, readahead)",
        "ms",
        &lazy.ws,
        "the same floor",
        &floor_ws,
    )
    .goal("report")
    .emit();
    Row::new(
        BENCH,
        "remote.ws_gets",
        TABLE,
        "restore on B until the working set is touched, prefetched",
        "ms",
        &pre.ws,
        &format!(
            "GETs of the working set's {} chunks alone, {PARALLEL} at once",
            ws_keys.len()
        ),
        &floor,
    )
    .goal("report")
    .note(format!(
        "the guest touching the working set after a local restore took {:.0} ms (median): the slow nested guest, not the fetches, sets the pace here",
        pagefork_benches::Stats::of(&local_ws).map_or(f64::NAN, |s| s.median)
    ))
    .emit();
    Row::new(
        BENCH,
        "remote.fetched_answer",
        TABLE,
        "stored bytes fetched from the store before the guest answered (prefetch on)",
        "KiB",
        &pre.early_kib,
        "the snapshot's stored bytes",
        &[info.stored_bytes as f64 / 1024.0],
    )
    .goal("≪ 1")
    .emit();
    let ws_stored: f64 = ws_keys.len() as f64;
    let per_ws: Vec<f64> = pre.total.iter().map(|b| b / 1024.0).collect();
    Row::new(
        BENCH,
        "remote.fetched_ws",
        TABLE,
        "stored bytes fetched until the working set was touched (prefetch on)",
        "KiB",
        &per_ws,
        &format!("stored bytes of the working set's {ws_stored} chunks"),
        &[m.memory_chunks()
            .iter()
            .filter(|c| ws_keys.iter().any(|k| k.as_ref().ends_with(c.digest)))
            .filter_map(|c| c.stored)
            .map(f64::from)
            .sum::<f64>()
            / 1024.0],
    )
    .goal("≈ 1")
    .emit();
    Row::new(
        BENCH,
        "remote.push",
        TABLE,
        &format!("push of the {mib} MiB snapshot (every chunk new: compress, HEAD, PUT; manifest)"),
        "ms",
        &push_ms,
        "multipart upload of the same bytes (8 MiB parts, 16 at once)",
        &upload_ms,
    )
    .goal("report")
    .emit();
    ExitCode::SUCCESS
}
