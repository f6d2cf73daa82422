//! Measure a store with a real snapshot: push and pull throughput against
//! a plain multipart upload and plain parallel GETs of the same bytes, the
//! latency of fetching one chunk whole against a quarter of it (what a
//! frame of 256 KiB would cost), and zstd's cost per chunk.
//!
//! ```sh
//! eval "$(scripts/ceph.sh start)"
//! cargo run -p pagefork-remote --example measure -- STATE/snapshots/NAME [VOLUME_FILE]
//! ```
//!
//! Everything goes under a fresh prefix of `$PAGEFORK_REMOTE`, deleted at
//! the end. `ZSTD_LEVEL=N` pushes at another zstd level.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use futures_util::{StreamExt, TryStreamExt};
use object_store::{ObjectStoreExt, WriteMultipart};
use pagefork_remote::{ChunkRef, PullTarget, PushSource, Remote, RemoteConfig, CHUNK_BYTES};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const CHUNK: usize = 1 << 20;

fn mb_s(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / 1e6 / d.as_secs_f64()
}

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Res<()> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .ok_or("usage: measure SNAPSHOT_DIR [VOLUME_FILE]")?,
    );
    let volume = args.next().map(PathBuf::from);
    let base = std::env::var("PAGEFORK_REMOTE").map_err(|_| "set PAGEFORK_REMOTE")?;
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)?
        .as_nanos();
    let url = format!("{}/measure-{nanos:x}", base.trim_end_matches('/'));
    let mut config = RemoteConfig::from_env(&url)?;
    if let Some(level) = std::env::var("ZSTD_LEVEL")
        .ok()
        .and_then(|l| l.parse().ok())
    {
        config.tuning.zstd_level = level;
    }
    let remote = Remote::new(config.clone())?;

    // Push.
    let t = Instant::now();
    let push = remote
        .push(
            &PushSource {
                dir: dir.clone(),
                volume,
                working_set: None,
            },
            &|_| {},
        )
        .await?;
    let push_time = t.elapsed();
    println!(
        "push: {} chunks ({} holes, {} distinct) in {:.2?}: {:.1} MB/s of chunk data, \
         {:.1} MB/s stored ({} -> {} bytes, {:.2}:1)",
        push.chunks,
        push.holes,
        push.distinct,
        push_time,
        mb_s(push.uploaded_raw_bytes, push_time),
        mb_s(push.uploaded_bytes, push_time),
        push.uploaded_raw_bytes,
        push.uploaded_bytes,
        push.uploaded_raw_bytes as f64 / push.uploaded_bytes.max(1) as f64
    );
    let name = push.name.clone();
    let t = Instant::now();
    let again = remote.manifest(&name).await?;
    println!(
        "manifest: {} bytes, read back in {:.2?}",
        push.manifest_bytes,
        t.elapsed()
    );

    // Pull.
    let out = tempfile::tempdir_in(dir.parent().ok_or("no parent")?)?;
    let t = Instant::now();
    let last = std::sync::Mutex::new(Duration::ZERO);
    let pull = remote
        .pull(
            &name,
            &PullTarget {
                dir: out.path().join(&name),
                volume: None,
            },
            &|_| {
                *last
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = t.elapsed()
            },
        )
        .await?;
    let pull_time = t.elapsed();
    println!(
        "pull: {} chunks fetched in {:.2?}: {:.1} MB/s of chunk data (the last chunk written \
         at {:.2?}, then fsync and rename)",
        pull.fetched,
        pull_time,
        mb_s(pull.fetched_raw_bytes, pull_time),
        *last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    );

    // The same bytes, plain: the non-hole chunks of memory.img as one
    // object, multipart, 8 MiB parts, 16 in flight; then read back with
    // 16 parallel range GETs of 8 MiB.
    let chunks: Vec<ChunkRef> = again
        .memory_chunks()
        .iter()
        .filter_map(ChunkRef::of)
        .collect();
    let img = File::open(dir.join("memory.img"))?;
    let data_chunks: Vec<u64> = again
        .memory_chunks()
        .iter()
        .filter(|c| c.stored.is_some())
        .map(|c| c.offset)
        .collect();
    let raw = object_store::aws::AmazonS3Builder::from_env()
        .with_url(format!("{url}/plain"))
        .with_allow_http(true)
        .build()?;
    let key = object_store::path::Path::from(format!("{}/plain", remote.url().prefix));
    let t = Instant::now();
    let upload = raw.put_multipart(&key).await?;
    let mut w = WriteMultipart::new_with_chunk_size(upload, 8 << 20);
    let mut buf = vec![0u8; CHUNK];
    for off in &data_chunks {
        w.wait_for_capacity(16).await?;
        let n = usize::try_from((img.metadata()?.len() - off).min(CHUNK_BYTES))?;
        img.read_exact_at(&mut buf[..n], *off)?;
        w.write(&buf[..n]);
    }
    w.finish().await?;
    let plain_bytes: u64 = data_chunks.len() as u64 * CHUNK_BYTES;
    let up_time = t.elapsed();
    println!(
        "plain multipart upload of the same {} bytes: {:.2?}, {:.1} MB/s (push: {:.2}x its time)",
        plain_bytes,
        up_time,
        mb_s(plain_bytes, up_time),
        push_time.as_secs_f64() / up_time.as_secs_f64()
    );
    let t = Instant::now();
    let parts: Vec<u64> = (0..plain_bytes.div_ceil(8 << 20)).collect();
    let got: u64 = futures_util::stream::iter(parts)
        .map(|i| {
            let (raw, key) = (&raw, &key);
            async move {
                let lo = i * (8 << 20);
                let hi = (lo + (8 << 20)).min(plain_bytes);
                raw.get_range(key, lo..hi).await.map(|b| b.len() as u64)
            }
        })
        .buffer_unordered(16)
        .try_fold(0, |a, n| async move { Ok(a + n) })
        .await?;
    let down_time = t.elapsed();
    println!(
        "plain parallel GETs of the same {} bytes: {:.2?}, {:.1} MB/s (pull: {:.2}x its time)",
        got,
        down_time,
        mb_s(got, down_time),
        pull_time.as_secs_f64() / down_time.as_secs_f64()
    );
    raw.delete(&key).await?;
    // And the disk's part: writing those bytes to a file and fsyncing it.
    let t = Instant::now();
    let f = File::create(out.path().join("plain-write"))?;
    for (i, off) in data_chunks.iter().enumerate() {
        let n = usize::try_from((img.metadata()?.len() - off).min(CHUNK_BYTES))?;
        img.read_exact_at(&mut buf[..n], *off)?;
        f.write_all_at(&buf[..n], i as u64 * CHUNK_BYTES)?;
    }
    f.sync_all()?;
    let write_time = t.elapsed();
    println!(
        "plain write + fsync of the same bytes: {:.2?}, {:.1} MB/s (pull: {:.2}x its time)",
        write_time,
        mb_s(plain_bytes, write_time),
        pull_time.as_secs_f64() / write_time.as_secs_f64()
    );

    // One chunk at a time: whole (what a fault costs) against a quarter.
    let sample: Vec<&ChunkRef> = chunks.iter().step_by((chunks.len() / 48).max(1)).collect();
    let (mut whole, mut quarter, mut dec_whole, mut dec_quarter) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let s3 = object_store::aws::AmazonS3Builder::from_env()
        .with_url(url.clone())
        .with_allow_http(true)
        .build()?;
    for c in &sample {
        let k =
            object_store::path::Path::from(format!("{}/chunks/{}", remote.url().prefix, c.digest));
        let t = Instant::now();
        let b = s3.get_range(&k, 0..u64::from(c.stored)).await?;
        whole.push(t.elapsed());
        let t = Instant::now();
        let _ = s3.get_range(&k, 0..u64::from(c.stored / 4).max(1)).await?;
        quarter.push(t.elapsed());
        let t = Instant::now();
        let bytes = zstd::bulk::decompress(&b, CHUNK)?;
        let _ = pagefork_remote::digest(&bytes);
        dec_whole.push(t.elapsed());
        let q = zstd::bulk::compress(&bytes[..bytes.len() / 4], 3)?;
        let t = Instant::now();
        let _ = zstd::bulk::decompress(&q, CHUNK / 4)?;
        dec_quarter.push(t.elapsed());
    }
    let t = Instant::now();
    for c in &sample {
        remote.fetch_chunk(c).await?;
    }
    println!(
        "one chunk, {} sampled: GET whole {:.2?} p50, GET a quarter {:.2?} p50; decode+check 1 MiB \
         {:.2?}, decode 256 KiB {:.2?}; fetch_chunk (GET+decode+check) {:.2?} mean",
        sample.len(),
        p50(whole),
        p50(quarter),
        p50(dec_whole),
        p50(dec_quarter),
        t.elapsed() / u32::try_from(sample.len().max(1))?
    );

    // zstd levels on the sampled chunks.
    for level in [1, 3, 6] {
        let (mut raw_b, mut out_b, mut took) = (0u64, 0u64, Duration::ZERO);
        for c in &sample {
            let bytes = remote.fetch_chunk(c).await?;
            let t = Instant::now();
            let z = zstd::bulk::compress(&bytes, level)?;
            took += t.elapsed();
            raw_b += bytes.len() as u64;
            out_b += z.len() as u64;
        }
        println!(
            "zstd level {level}: {:.2}:1, {:.0} MB/s on one core",
            raw_b as f64 / out_b.max(1) as f64,
            mb_s(raw_b, took)
        );
    }

    remote.delete(&name).await?;
    let gc = remote.gc().await?;
    println!("cleaned up: {} chunks deleted", gc.chunks_deleted);
    Ok(())
}
