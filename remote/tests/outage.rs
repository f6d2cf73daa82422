//! The store going away under a pull or a fetch: stopped (RGW killed) or
//! hung (RGW stopped with SIGSTOP). Each case must end in a clear error
//! within the configured deadline, never a hang, and leave nothing half
//! written. These tests stop the shared RGW, so they run one at a time and
//! only on a cluster of scripts/ceph.sh (`PAGEFORK_CEPH_DIR`).

// Test data: page and chunk indices become seed bytes, wrapping on purpose.
#![allow(clippy::cast_possible_truncation)]

mod common;

use std::sync::{mpsc, Mutex};
use std::time::Duration;

use common::{make_snapshot, quiet, runtime, store, HANG};
use pagefork_remote::{ChunkRef, Error, PullTarget, PushSource, Tuning, CHUNK_BYTES};

/// One outage at a time: they share the store.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn tight() -> Tuning {
    Tuning {
        concurrency: 2,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(3),
        retries: 2,
        retry_timeout: Duration::from_secs(4),
        fetch_deadline: Duration::from_secs(6),
        ..Tuning::default()
    }
}

#[test]
fn store_stopped_mid_pull_fails_with_a_clear_error() {
    let Some(s) = store() else { return };
    if s.ceph_dir.is_none() {
        eprintln!("skipping: the store is not a scripts/ceph.sh cluster (no PAGEFORK_CEPH_DIR)");
        return;
    }
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let dir = make_snapshot(
        tmp.path(),
        "s",
        24 * CHUNK_BYTES,
        &|p| Some((p / 256) as u8),
        None,
    );
    let remote = s.remote_with("stopped", tight());
    rt.block_on(remote.push(
        &PushSource {
            dir,
            ..Default::default()
        },
        &quiet,
    ))
    .unwrap();

    // After 3 chunks the pull's progress waits until RGW is down.
    let (ask, asked) = mpsc::channel::<()>();
    let (done, stopped) = mpsc::channel::<()>();
    let stopper = std::thread::spawn(move || {
        if asked.recv().is_ok() {
            assert!(store().is_some_and(|s| s.ceph("rgw-stop")));
            let _ = done.send(());
        }
    });
    let ask = Mutex::new(Some(ask));
    let stopped = Mutex::new(stopped);
    let out = tempfile::tempdir().unwrap();
    let target = PullTarget {
        dir: out.path().join("s"),
        volume: None,
    };
    let result = rt.block_on(async {
        tokio::time::timeout(
            HANG,
            remote.pull("s", &target, &|p| {
                if p.chunks_done == 3 {
                    if let Some(a) = ask.lock().unwrap().take() {
                        let _ = a.send(());
                        let _ = stopped.lock().unwrap().recv();
                    }
                }
            }),
        )
        .await
    });
    stopper.join().unwrap();
    let restarted = s.ceph("rgw-start");
    let e = result.expect("the pull hung").unwrap_err();
    eprintln!("the pull failed: {e}");
    assert!(e.is_unreachable(), "{e:?}");
    let text = e.to_string();
    assert!(text.contains(&s.env["AWS_ENDPOINT_URL"]), "{text}");
    assert!(text.contains("is it running?"), "{text}");
    assert_eq!(
        std::fs::read_dir(out.path()).unwrap().count(),
        0,
        "a failed pull left files"
    );
    assert!(restarted);

    // The store back, the same pull succeeds.
    rt.block_on(remote.pull("s", &target, &quiet)).unwrap();
}

#[test]
fn hung_store_fails_a_fetch_at_its_deadline() {
    let Some(s) = store() else { return };
    // The other test restarts RGW: its pid is read once that is over.
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(pid) = s.rgw_pid() else {
        eprintln!("skipping: the store is not a scripts/ceph.sh cluster (no PAGEFORK_CEPH_DIR)");
        return;
    };
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let dir = make_snapshot(tmp.path(), "h", 2 * CHUNK_BYTES, &|p| Some(p as u8), None);
    let remote = s.remote_with("hung", tight());
    rt.block_on(remote.push(
        &PushSource {
            dir,
            ..Default::default()
        },
        &quiet,
    ))
    .unwrap();
    let m = rt.block_on(remote.manifest("h")).unwrap();
    let c = ChunkRef::of(&m.memory_chunks()[1]).unwrap();

    // SAFETY: kill(2) with a pid read from the cluster's own pid file.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let result = rt.block_on(async { tokio::time::timeout(HANG, remote.fetch_chunk(&c)).await });
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let e = result.expect("the fetch hung").unwrap_err();
    eprintln!("the fetch failed: {e}");
    assert!(
        matches!(e, Error::Deadline { .. } | Error::Unreachable { .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains(&s.env["AWS_ENDPOINT_URL"]), "{e}");
    // Answering again, the store serves the chunk.
    let b = rt.block_on(remote.fetch_chunk(&c)).unwrap();
    assert_eq!(b.len() as u64, CHUNK_BYTES);
}
