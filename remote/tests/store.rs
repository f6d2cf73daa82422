//! Push, pull, list, delete, gc and the chunk cache against a real Ceph
//! RGW (see `common` for how the store is found or booted).

// Test data: page and chunk indices become seed bytes, wrapping on purpose.
#![allow(clippy::cast_possible_truncation)]

mod common;

use std::collections::HashSet;
use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{make_file, make_snapshot, quiet, runtime, store};
use object_store::{ObjectStore, ObjectStoreExt};
use pagefork_remote::{
    ChunkCache, ChunkRef, Error, PageRun, PullTarget, PushSource, Remote, RemoteConfig, Secret,
    Tuning, CHUNK_BYTES,
};
use proto::snapshot::MEMORY_FILE;

const MIB: u64 = CHUNK_BYTES;

/// Pages of an 8 MiB image: chunks 0, 1, 3, 5, 6 and part of 7 hold
/// data (chunk 6 holds chunk 5's bytes again); 2 and 4 are holes.
fn base_pages(p: u64) -> Option<u8> {
    match p / 256 {
        2 | 4 => None,
        6 => Some(5),
        7 if p % 256 >= 100 => None,
        c => Some(c as u8),
    }
}

fn snapshot_files(dir: &Path) -> (Vec<u8>, Vec<u8>) {
    (
        fs::read(dir.join(MEMORY_FILE)).unwrap(),
        fs::read(dir.join("state.json")).unwrap(),
    )
}

fn chunk_digests(dir: &Path) -> Vec<String> {
    common::sum_of(&dir.join(MEMORY_FILE)).chunks
}

#[test]
fn pushed_snapshot_pulls_back_byte_exact() {
    let Some(s) = store() else { return };
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let src = make_snapshot(
        tmp.path(),
        "web-1",
        8 * MIB,
        &base_pages,
        Some("web-1.disk"),
    );
    let vol = tmp.path().join("web-1.disk");
    make_file(&vol, 3 * MIB + 5000, &|p| (p % 3 == 0).then_some(9));
    let remote = s.remote("roundtrip");
    let ws = vec![
        PageRun {
            first: 1,
            pages: 16,
        },
        PageRun {
            first: 900,
            pages: 2,
        },
    ];
    let seen = Arc::new(AtomicU64::new(0));
    let seen2 = Arc::clone(&seen);
    let report = rt
        .block_on(remote.push(
            &PushSource {
                dir: src.clone(),
                volume: Some(vol.clone()),
                working_set: Some(ws.clone()),
            },
            &move |p| seen2.store(p.chunks_done, Ordering::Relaxed),
        ))
        .unwrap();
    // 8 memory chunks (2 holes) and 4 volume chunks, all with data.
    assert_eq!(report.chunks, 12);
    assert_eq!(report.holes, 2);
    assert_eq!(report.uploaded, report.distinct);
    assert_eq!(report.present, 0);
    assert_eq!(seen.load(Ordering::Relaxed), report.distinct);
    assert!(
        report.uploaded_bytes < report.uploaded_raw_bytes / 2,
        "{report:?}"
    );

    let listed = rt.block_on(remote.list_snapshots()).unwrap();
    assert_eq!(
        listed.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(),
        ["web-1"]
    );
    let m = rt.block_on(remote.manifest("web-1")).unwrap();
    assert_eq!(m.working_set.as_deref(), Some(&ws[..]));
    assert_eq!(
        m.memory_chunks()
            .iter()
            .filter(|c| c.stored.is_none())
            .count(),
        2
    );

    let out = tempfile::tempdir().unwrap();
    let target = PullTarget {
        dir: out.path().join("web-1"),
        volume: Some(out.path().join("web-1.disk")),
    };
    let pulled = rt.block_on(remote.pull("web-1", &target, &quiet)).unwrap();
    assert_eq!(pulled.holes, 2);
    assert_eq!(pulled.fetched, report.distinct);
    assert_eq!(snapshot_files(&target.dir), snapshot_files(&src));
    assert_eq!(
        fs::read(&vol).unwrap(),
        fs::read(out.path().join("web-1.disk")).unwrap()
    );
    // Holes stay holes.
    let f = fs::File::open(target.dir.join(MEMORY_FILE)).unwrap();
    let data = pagefork_remote::data_ranges(&f, 8 * MIB).unwrap();
    let in_holes = data
        .iter()
        .any(|&(a, b)| (a < 3 * MIB && b > 2 * MIB) || (a < 5 * MIB && b > 4 * MIB));
    assert!(!in_holes, "{data:?}");
    assert!(out.path().read_dir().unwrap().all(|e| {
        !e.unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with(".tmp-")
    }));

    // A pull under another name renames the snapshot; an existing
    // directory is refused.
    let other = PullTarget {
        dir: out.path().join("web-1-copy"),
        volume: None,
    };
    rt.block_on(remote.pull("web-1", &other, &quiet)).unwrap();
    let st: proto::snapshot::StateFile =
        serde_json::from_slice(&fs::read(other.dir.join("state.json")).unwrap()).unwrap();
    assert_eq!(st.name, "web-1-copy");
    let again = rt.block_on(remote.pull("web-1", &target, &quiet));
    assert!(
        matches!(again, Err(Error::LocalSnapshot { .. })),
        "{again:?}"
    );

    // Pushing the name again is refused; deleting unlists it.
    let twice = rt.block_on(remote.push(
        &PushSource {
            dir: src,
            volume: Some(vol),
            working_set: None,
        },
        &quiet,
    ));
    assert!(
        matches!(twice, Err(Error::AlreadyExists { .. })),
        "{twice:?}"
    );
    assert!(rt.block_on(remote.delete("web-1")).unwrap());
    assert!(!rt.block_on(remote.delete("web-1")).unwrap());
    assert!(rt.block_on(remote.list_snapshots()).unwrap().is_empty());
    let gone = rt.block_on(remote.manifest("web-1"));
    assert!(
        matches!(gone, Err(Error::NoSuchSnapshot { .. })),
        "{gone:?}"
    );
}

#[test]
fn incremental_push_uploads_only_new_chunks() {
    let Some(s) = store() else { return };
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let a = make_snapshot(tmp.path(), "a", 16 * MIB, &|p| Some((p / 256) as u8), None);
    // b: chunks 3 and 9 rewritten, chunk 12 becomes a hole.
    let b = make_snapshot(
        tmp.path(),
        "b",
        16 * MIB,
        &|p| match p / 256 {
            3 | 9 => Some(200 + (p / 256) as u8),
            12 => None,
            _ => Some((p / 256) as u8),
        },
        None,
    );
    let remote = s.remote("incremental");
    let ra = rt
        .block_on(remote.push(
            &PushSource {
                dir: a.clone(),
                ..Default::default()
            },
            &quiet,
        ))
        .unwrap();
    assert_eq!((ra.uploaded, ra.present), (16, 0));
    let rb = rt
        .block_on(remote.push(
            &PushSource {
                dir: b.clone(),
                ..Default::default()
            },
            &quiet,
        ))
        .unwrap();
    let old: HashSet<String> = chunk_digests(&a).into_iter().collect();
    let new: HashSet<String> = chunk_digests(&b)
        .into_iter()
        .filter(|d| *d != pagefork_remote::zero_digest(MIB))
        .collect();
    let expected_new = new.difference(&old).count() as u64;
    assert_eq!(expected_new, 2);
    assert_eq!(rb.uploaded, expected_new, "{rb:?}");
    assert_eq!(rb.present, new.len() as u64 - expected_new);
    assert_eq!(rb.holes, 1);

    let out = tempfile::tempdir().unwrap();
    let t = PullTarget {
        dir: out.path().join("b"),
        volume: None,
    };
    rt.block_on(remote.pull("b", &t, &quiet)).unwrap();
    assert_eq!(snapshot_files(&t.dir), snapshot_files(&b));
}

#[test]
fn killed_push_leaves_nothing_listed_and_gc_removes_its_chunks() {
    let Some(s) = store() else { return };
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let keep = make_snapshot(tmp.path(), "keep", 4 * MIB, &|_| Some(3), None);
    let big = make_snapshot(
        tmp.path(),
        "big",
        40 * MIB,
        &|p| Some((p / 256) as u8 ^ 0x55),
        None,
    );
    let ttl = Duration::from_secs(3);
    let remote = s.remote_with(
        "killed",
        Tuning {
            concurrency: 2,
            lock_ttl: ttl,
            ..Tuning::default()
        },
    );
    rt.block_on(remote.push(
        &PushSource {
            dir: keep.clone(),
            ..Default::default()
        },
        &quiet,
    ))
    .unwrap();

    // The push is dropped once 5 chunks are in the store.
    let stop = Arc::new(tokio::sync::Notify::new());
    let stop2 = Arc::clone(&stop);
    let src = PushSource {
        dir: big,
        ..Default::default()
    };
    let on_progress = move |p: &pagefork_remote::Progress| {
        if p.chunks_moved >= 5 {
            stop2.notify_one();
        }
    };
    let push = remote.push(&src, &on_progress);
    let finished = rt.block_on(async {
        tokio::select! {
            r = push => Some(r),
            () = stop.notified() => None,
        }
    });
    assert!(finished.is_none(), "the push finished before it was killed");
    let listed = rt.block_on(remote.list_snapshots()).unwrap();
    assert_eq!(
        listed.iter().map(|l| l.name.as_str()).collect::<Vec<_>>(),
        ["keep"]
    );
    let busy = rt.block_on(remote.gc());
    assert!(matches!(busy, Err(Error::Busy { .. })), "{busy:?}");

    // Once its lock is stale, gc removes the lock and the chunks.
    std::thread::sleep(ttl + Duration::from_secs(1));
    let report = rt.block_on(remote.gc()).unwrap();
    assert!(report.chunks_deleted >= 5, "{report:?}");
    assert_eq!(report.chunks_kept, 1, "{report:?}");
    assert_eq!(report.stale_locks_deleted, 1, "{report:?}");
    assert_eq!(report.manifests, 1);
    let again = rt.block_on(remote.gc()).unwrap();
    assert_eq!(
        (again.chunks_deleted, again.chunks_kept),
        (0, 1),
        "{again:?}"
    );
    let out = tempfile::tempdir().unwrap();
    let t = PullTarget {
        dir: out.path().join("keep"),
        volume: None,
    };
    rt.block_on(remote.pull("keep", &t, &quiet)).unwrap();
    assert_eq!(snapshot_files(&t.dir), snapshot_files(&keep));

    // Deleted, the kept snapshot's chunks go too.
    assert!(rt.block_on(remote.delete("keep")).unwrap());
    let last = rt.block_on(remote.gc()).unwrap();
    assert_eq!(
        (last.chunks_deleted, last.chunks_kept, last.manifests),
        (1, 0, 0)
    );
}

/// The chunks of a pushed one-chunk snapshot `name` and the client.
fn pushed_one_chunk(s: &common::Store, test: &str, tmp: &Path) -> (Remote, ChunkRef, String) {
    let rt = runtime();
    let dir = make_snapshot(tmp, "one", MIB, &|p| Some(p as u8), None);
    let remote = s.remote(test);
    rt.block_on(remote.push(
        &PushSource {
            dir,
            ..Default::default()
        },
        &quiet,
    ))
    .unwrap();
    let m = rt.block_on(remote.manifest("one")).unwrap();
    let c = ChunkRef::of(&m.memory_chunks()[0]).unwrap();
    let key = format!("{}/chunks/{}", remote.url().prefix, c.digest);
    (remote, c, key)
}

#[test]
fn corrupted_chunk_is_refused_and_not_cached() {
    let Some(s) = store() else { return };
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let (remote, c, key) = pushed_one_chunk(s, "corrupt", tmp.path());
    let raw = s.raw();
    let key = object_store::path::Path::from(key);
    let good = rt.block_on(async { raw.get(&key).await.unwrap().bytes().await.unwrap() });
    let cache_dir = tmp.path().join("cache");
    let cache =
        ChunkCache::open(&cache_dir, 64 * MIB, remote.clone(), rt.handle().clone()).unwrap();

    let mut flipped = good.to_vec();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 1;
    let other = zstd::bulk::compress(&vec![7u8; MIB as usize], 3).unwrap();
    let truncated = good.slice(..good.len() - 10);
    for bad in [Bytes::from(flipped), Bytes::from(other), truncated] {
        rt.block_on(raw.put(&key, bad.into())).unwrap();
        let e = rt.block_on(remote.fetch_chunk(&c)).unwrap_err();
        assert!(matches!(e, Error::ChunkCorrupt { .. }), "{e:?}");
        assert!(e.to_string().contains(&c.digest), "{e}");
        let e = cache.get(&c).unwrap_err();
        assert!(matches!(e, Error::ChunkCorrupt { .. }), "{e:?}");
        assert_eq!(cache.stats().entries, 0);
        let out = tempfile::tempdir().unwrap();
        let t = PullTarget {
            dir: out.path().join("one"),
            volume: None,
        };
        let e = rt.block_on(remote.pull("one", &t, &quiet)).unwrap_err();
        assert!(matches!(e, Error::ChunkCorrupt { .. }), "{e:?}");
        assert_eq!(
            fs::read_dir(out.path()).unwrap().count(),
            0,
            "a failed pull left files"
        );
    }
    assert_eq!(
        fs::read_dir(&cache_dir).unwrap().count(),
        0,
        "a corrupt chunk reached the cache"
    );
    // Repaired, it is served and cached.
    rt.block_on(raw.put(&key, good.into())).unwrap();
    assert_eq!(cache.get(&c).unwrap().len() as u64, MIB);
    assert_eq!(cache.stats().entries, 1);
    rt.block_on(raw.delete(&key)).unwrap();
    let e = rt.block_on(remote.fetch_chunk(&c)).unwrap_err();
    assert!(matches!(e, Error::ChunkMissing { .. }), "{e:?}");
}

#[test]
fn cache_fetches_a_chunk_once_and_stays_bounded() {
    let Some(s) = store() else { return };
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let dir = make_snapshot(
        tmp.path(),
        "c",
        12 * MIB,
        &|p| Some((p / 256) as u8 + 1),
        None,
    );
    let remote = s.remote("cache");
    rt.block_on(remote.push(
        &PushSource {
            dir,
            ..Default::default()
        },
        &quiet,
    ))
    .unwrap();
    let m = rt.block_on(remote.manifest("c")).unwrap();
    let chunks: Vec<ChunkRef> = m.memory_chunks().iter().filter_map(ChunkRef::of).collect();
    let cache_dir = tmp.path().join("cache");
    let cache = Arc::new(
        ChunkCache::open(&cache_dir, 4 * MIB, remote.clone(), rt.handle().clone()).unwrap(),
    );
    // Eight threads ask for one chunk at once: one fetch.
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (cache, c) = (Arc::clone(&cache), chunks[0].clone());
            std::thread::spawn(move || cache.get(&c).unwrap())
        })
        .collect();
    let got: Vec<Bytes> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(got.iter().all(|b| *b == got[0]));
    let st = cache.stats();
    assert_eq!(st.fetches, 1, "{st:?}");
    assert_eq!(st.hits, 7, "{st:?}");
    // All twelve: never more than 4 MiB on disk, the oldest go first.
    for c in &chunks {
        cache.get(c).unwrap();
        let on_disk: u64 = fs::read_dir(&cache_dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        assert!(on_disk <= 4 * MIB, "{on_disk}");
    }
    let st = cache.stats();
    assert_eq!((st.entries, st.bytes), (4, 4 * MIB), "{st:?}");
    assert_eq!(st.evictions, 8, "{st:?}");
    assert!(!cache.path_of(&chunks[0].digest).exists());
    assert!(cache.path_of(&chunks[11].digest).exists());
    // A damaged cached file is fetched again, not served.
    fs::write(cache.path_of(&chunks[11].digest), vec![0u8; MIB as usize]).unwrap();
    let before = cache.stats().fetches;
    assert_eq!(cache.get(&chunks[11]).unwrap().len() as u64, MIB);
    let st = cache.stats();
    assert_eq!((st.damaged, st.fetches), (1, before + 1), "{st:?}");
    // Reopened, the cache keeps what it had.
    drop(cache);
    let cache = ChunkCache::open(&cache_dir, 4 * MIB, remote, rt.handle().clone()).unwrap();
    assert_eq!(cache.stats().entries, 4);
    cache.get(&chunks[11]).unwrap();
    assert_eq!(cache.stats().fetches, 0);
    // From a runtime thread, a blocking get is refused, not a panic.
    let e = rt.block_on(async { cache.get(&chunks[11]) }).unwrap_err();
    assert!(matches!(e, Error::Worker(_)), "{e:?}");
}

#[test]
fn bad_credentials_are_refused_without_showing_them() {
    let Some(s) = store() else { return };
    let rt = runtime();
    let mut c: RemoteConfig = s.config(&s.fresh_url("creds"), Tuning::default());
    let secret = "WrongSecretKeyThatMustNotLeak0123456789";
    c.credentials.secret_access_key = Secret::new(secret);
    let shown = format!("{c:?}");
    assert!(
        !shown.contains(secret) && !shown.contains(&s.env["AWS_ACCESS_KEY_ID"]),
        "{shown}"
    );
    let remote = Remote::new(c).unwrap();
    let e = rt.block_on(remote.list_snapshots()).unwrap_err();
    assert!(matches!(e, Error::Denied { .. }), "{e:?}");
    for text in [e.to_string(), format!("{e:?}"), format!("{remote:?}")] {
        assert!(!text.contains(secret), "{text}");
        assert!(!text.contains(&s.env["AWS_ACCESS_KEY_ID"]), "{text}");
    }
    assert!(e.to_string().contains("AWS_SECRET_ACCESS_KEY"), "{e}");

    let no_bucket = s.config("s3://pagefork-no-such-bucket/x", Tuning::default());
    let e = rt
        .block_on(Remote::new(no_bucket).unwrap().list_snapshots())
        .unwrap_err();
    assert!(matches!(e, Error::NoSuchBucket { .. }), "{e:?}");
    assert!(e.to_string().contains("create it"), "{e}");
}

#[test]
fn a_manifest_that_does_not_parse_is_refused() {
    let Some(s) = store() else { return };
    let rt = runtime();
    let remote = s.remote("badmanifest");
    let raw = s.raw();
    let key = object_store::path::Path::from(format!("{}/manifests/evil", remote.url().prefix));
    rt.block_on(raw.put(
        &key,
        Bytes::from_static(b"{\"manifest_version\": 1}").into(),
    ))
    .unwrap();
    let e = rt.block_on(remote.manifest("evil")).unwrap_err();
    assert!(matches!(e, Error::BadManifest { .. }), "{e:?}");
    // gc cannot know what it names: it stops rather than delete.
    let e = rt.block_on(remote.gc()).unwrap_err();
    assert!(matches!(e, Error::BadManifest { .. }), "{e:?}");
}

/// The commit of a manifest relies on the store refusing a create over an
/// existing object (`If-None-Match: *`): two pushes of one name cannot
/// both commit.
#[test]
fn the_store_refuses_a_create_over_an_existing_object() {
    let Some(s) = store() else { return };
    let rt = runtime();
    let remote = s.remote("create");
    let raw = s.raw();
    let key = object_store::path::Path::from(format!("{}/manifests/x", remote.url().prefix));
    let create = || object_store::PutOptions {
        mode: object_store::PutMode::Create,
        ..Default::default()
    };
    rt.block_on(raw.put_opts(&key, Bytes::from_static(b"first").into(), create()))
        .unwrap();
    let second = rt.block_on(raw.put_opts(&key, Bytes::from_static(b"second").into(), create()));
    assert!(
        matches!(
            second,
            Err(object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. })
        ),
        "{second:?}"
    );
    let kept = rt.block_on(async { raw.get(&key).await.unwrap().bytes().await.unwrap() });
    assert_eq!(&kept[..], b"first");
}

/// A snapshot with `memory.zst` beside its image pushes the image alone:
/// the pulled snapshot is the same snapshot without the compressed copy.
#[test]
fn a_compressed_snapshot_travels_as_its_image_alone() {
    let Some(s) = store() else { return };
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let dir = make_snapshot(tmp.path(), "z", 2 * MIB, &|p| Some(p as u8), None);
    let zst = dir.join("memory.zst");
    fs::write(&zst, b"a compressed copy the store does not need").unwrap();
    let mut state: proto::snapshot::StateFile =
        serde_json::from_slice(&fs::read(dir.join("state.json")).unwrap()).unwrap();
    state
        .files
        .insert("memory.zst".into(), common::sum_of(&zst));
    fs::write(
        dir.join("state.json"),
        serde_json::to_vec_pretty(&state).unwrap(),
    )
    .unwrap();

    let remote = s.remote("zst");
    rt.block_on(remote.push(
        &PushSource {
            dir: dir.clone(),
            ..Default::default()
        },
        &quiet,
    ))
    .unwrap();
    let out = tempfile::tempdir().unwrap();
    let t = PullTarget {
        dir: out.path().join("z"),
        volume: None,
    };
    rt.block_on(remote.pull("z", &t, &quiet)).unwrap();
    let mut names: Vec<String> = fs::read_dir(&t.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["memory.img", "state.json"]);
    let pulled: proto::snapshot::StateFile =
        serde_json::from_slice(&fs::read(t.dir.join("state.json")).unwrap()).unwrap();
    state.files.remove("memory.zst");
    assert_eq!(pulled, state);
    assert_eq!(
        fs::read(t.dir.join(MEMORY_FILE)).unwrap(),
        fs::read(dir.join(MEMORY_FILE)).unwrap()
    );
}
