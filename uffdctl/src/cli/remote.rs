//! `uffdctl snapshot push|pull|ls --remote|show --remote|rm --remote|gc|
//! clone`: snapshots in the server's object store (`uffd-server --remote`).
//! A push answers at once and goes on in the server; its progress bar
//! follows `push` in `GET /v1/snapshots/{name}`. A pull answers when it is
//! done; its bar follows `pulls` in `GET /v1/remote` meanwhile.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use proto::api;
use serde_json::Value;

use super::body;
use super::table::render;
use super::vm::call;
use crate::client::Client;
use crate::Result;

/// A bar of bytes on a terminal (hidden elsewhere).
fn bar(msg: &'static str) -> indicatif::ProgressBar {
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(0);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    pb.set_message(msg);
    pb
}

/// `uffdctl snapshot push NAME`: start the push, follow it to its end.
pub fn push(client: &Client, name: &str, as_json: bool) -> Result<Value> {
    call(client, "POST", &format!("/v1/snapshots/{name}/push"), None)?;
    let pb = bar("pushing");
    let status = loop {
        let v = call(client, "GET", &format!("/v1/snapshots/{name}"), None)?;
        let p = v["push"].clone();
        pb.set_length(p["bytes_total"].as_u64().unwrap_or(0));
        pb.set_position(p["bytes_done"].as_u64().unwrap_or(0));
        if p["state"].as_str() != Some("running") {
            break p;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    pb.finish_and_clear();
    if status["state"].as_str() == Some("failed") {
        return Err(crate::CliError::Background(format!(
            "push of {name} failed: {}",
            status["error"].as_str().unwrap_or("?")
        )));
    }
    if !as_json {
        println!(
            "{name} pushed to {}: {} chunks uploaded ({} bytes stored), {} already there, in {} ms",
            status["url"].as_str().unwrap_or("?"),
            status["chunks_uploaded"],
            status["uploaded_bytes"],
            status["chunks_present"],
            status["elapsed_us"].as_u64().unwrap_or(0) / 1000
        );
    }
    Ok(status)
}

/// `uffdctl snapshot pull NAME [--as LOCAL]`, with a bar while it runs.
pub fn pull(client: &Client, name: &str, local: Option<String>, as_json: bool) -> Result<Value> {
    let want = local.clone().unwrap_or_else(|| name.to_owned());
    let req = body(&api::PullSnapshot { name: local });
    let done = AtomicBool::new(false);
    let v = std::thread::scope(|s| {
        s.spawn(|| {
            let pb = bar("pulling");
            while !done.load(Ordering::Relaxed) {
                if let Ok(v) = call(client, "GET", "/v1/remote", None) {
                    let found = v["pulls"]
                        .as_array()
                        .and_then(|a| a.iter().find(|p| p["name"].as_str() == Some(&want)));
                    if let Some(p) = found {
                        pb.set_length(p["bytes_total"].as_u64().unwrap_or(0));
                        pb.set_position(p["bytes_done"].as_u64().unwrap_or(0));
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            pb.finish_and_clear();
        });
        let r = call(
            client,
            "POST",
            &format!("/v1/remote/snapshots/{name}/pull"),
            Some(&req),
        );
        done.store(true, Ordering::Relaxed);
        r
    })?;
    if !as_json {
        println!(
            "{} pulled from remote snapshot {name}: {} chunks ({} bytes stored) in {} ms{}",
            v["name"].as_str().unwrap_or("?"),
            v["chunks_fetched"],
            v["fetched_bytes"],
            v["duration_us"].as_u64().unwrap_or(0) / 1000,
            v["volume_snapshot"]
                .as_str()
                .map(|s| format!(", volume snapshot {s}"))
                .unwrap_or_default()
        );
    }
    Ok(v)
}

/// `uffdctl snapshot ls --remote`.
pub fn list(client: &Client, as_json: bool) -> Result<Value> {
    let v = call(client, "GET", "/v1/remote/snapshots", None)?;
    if !as_json {
        let rows: Vec<Vec<String>> = v["snapshots"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|s| {
                        vec![
                            s["name"].as_str().unwrap_or("?").to_owned(),
                            s["committed"].to_string(),
                            s["manifest_bytes"].to_string(),
                        ]
                    })
                    .collect()
            })
            .unwrap_or_default();
        println!("{}", v["url"].as_str().unwrap_or("?"));
        print!(
            "{}",
            render(&["NAME", "COMMITTED", "MANIFEST_BYTES"], &rows)
        );
    }
    Ok(v)
}

/// `uffdctl snapshot show --remote NAME`.
pub fn show(client: &Client, name: &str, as_json: bool) -> Result<Value> {
    let v = call(client, "GET", &format!("/v1/remote/snapshots/{name}"), None)?;
    if !as_json {
        let s = |k: &str| match &v[k] {
            Value::String(s) => s.clone(),
            Value::Null => "-".into(),
            other => other.to_string(),
        };
        let headers = [
            "NAME", "VM", "MEM_MIB", "CHUNKS", "HOLES", "STORED", "VOLUME", "WS_PAGES",
        ];
        let row = vec![
            s("name"),
            s("vm"),
            s("memory_mib"),
            s("chunks"),
            s("holes"),
            s("stored_bytes"),
            s("volume_snapshot"),
            s("working_set_pages"),
        ];
        print!("{}", render(&headers, &[row]));
    }
    Ok(v)
}

/// `uffdctl snapshot rm --remote NAME`.
pub fn delete(client: &Client, name: &str) -> Result<Value> {
    call(
        client,
        "DELETE",
        &format!("/v1/remote/snapshots/{name}"),
        None,
    )
}

/// `uffdctl snapshot gc`.
pub fn gc(client: &Client, as_json: bool) -> Result<Value> {
    let v = call(client, "POST", "/v1/remote/gc", None)?;
    if !as_json {
        println!(
            "{} chunks deleted ({} bytes), {} kept for {} snapshots, {} stale locks removed",
            v["chunks_deleted"],
            v["bytes_deleted"],
            v["chunks_kept"],
            v["manifests"],
            v["stale_locks_deleted"]
        );
    }
    Ok(v)
}

/// `uffdctl snapshot clone --remote NAME --count N`.
pub fn clone(client: &Client, name: &str, count: u32, concurrency: u32) -> Result<Value> {
    let req = body(&api::CloneVm { count, concurrency });
    call(
        client,
        "POST",
        &format!("/v1/remote/snapshots/{name}/clone"),
        Some(&req),
    )
}
