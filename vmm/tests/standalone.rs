//! Runs `vmm standalone` on real KVM and checks the guest agent's results
//! against the reference functions of `shared::pattern`.
//!
//! Skips with a printed reason when /dev/kvm is unusable, except under
//! `CI=true`, where a missing /dev/kvm is a failure.

// Test images are small; their sizes fit usize on every test host.
#![allow(clippy::cast_possible_truncation)]

use std::process::Command;

use serde_json::Value;
use shared::pattern::{self, SECTOR_SIZE};
use shared::PAGE_SIZE;

mod common;
use common::kvm_available;

/// Run the standalone VMM; returns the JSON reply lines keyed by step.
fn run(args: &[&str], steps: &[String]) -> Vec<Value> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vmm"));
    cmd.arg("standalone").args(args);
    for s in steps {
        cmd.arg("--exec").arg(s);
    }
    let out = cmd.output().expect("run vmm");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "vmm failed: {stderr}");
    let mut replies = vec![Value::Null; steps.len()];
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: Value = serde_json::from_str(line).expect("JSON line");
        if let Some(step) = v.get("step").and_then(Value::as_u64) {
            replies[step as usize] = v["result"].clone();
        }
    }
    replies
}

fn value(reply: &Value) -> u64 {
    reply["Ok"]["Op"]["value"]
        .as_u64()
        .unwrap_or_else(|| panic!("not an op result: {reply}"))
}

fn exec(op: &str) -> String {
    format!(r#"{{"Exec":{op}}}"#)
}

const PAGES: u64 = 2048; // 8 MiB

#[test]
fn guest_ops_match_reference_patterns() {
    if !kvm_available() {
        return;
    }
    let (start, n, seed) = (3u64, PAGES - 10, 7u64);
    let sectors = 256u64;
    let steps = vec![
        exec(r#""Identity""#),
        exec(&format!(
            r#"{{"Fill":{{"start_page":{start},"pages":{n},"seed":{seed}}}}}"#
        )),
        exec(&format!(
            r#"{{"Verify":{{"start_page":0,"pages":{PAGES},"seed":{seed}}}}}"#
        )),
        exec(&format!(
            r#"{{"Verify":{{"start_page":{start},"pages":{n},"seed":{}}}}}"#,
            seed + 1
        )),
        exec(&format!(
            r#"{{"Checksum":{{"start_page":0,"pages":{PAGES}}}}}"#
        )),
        exec(&format!(
            r#"{{"Digest":{{"start_page":0,"pages":{PAGES}}}}}"#
        )),
        exec(&format!(
            r#"{{"Touch":{{"start_page":0,"pages":{PAGES},"write":true}}}}"#
        )),
        exec(&format!(
            r#"{{"Digest":{{"start_page":1,"pages":{}}}}}"#,
            PAGES - 1
        )),
        exec(&format!(
            r#"{{"DiskFill":{{"sector":0,"count":{sectors},"seed":5}}}}"#
        )),
        exec(&format!(
            r#"{{"DiskChecksum":{{"sector":0,"count":{sectors}}}}}"#
        )),
        exec(r#"{"DiskChecksum":{"sector":3,"count":10}}"#),
        exec(&format!(
            r#"{{"Fill":{{"start_page":{},"pages":2,"seed":1}}}}"#,
            PAGES - 1
        )),
        exec(r#"{"DiskChecksum":{"sector":2047,"count":2}}"#),
    ];
    // A 1 MiB disk: 2048 sectors, of which the first 256 are filled.
    let r = run(
        &["--memory-mib", "8", "--disk-mib", "1", "--vm-id", "42"],
        &steps,
    );

    let mut mem = vec![0u8; (PAGES * PAGE_SIZE) as usize];
    for p in start..start + n {
        let b = (p * PAGE_SIZE) as usize;
        pattern::fill_page(&mut mem[b..b + PAGE_SIZE as usize], p, seed);
    }
    let mut disk = vec![0u8; (sectors * SECTOR_SIZE) as usize];
    for s in 0..sectors {
        let b = (s * SECTOR_SIZE) as usize;
        disk[b..b + 8].copy_from_slice(&pattern::disk_word(5, s).to_le_bytes());
    }

    assert_eq!(value(&r[0]), 42, "identity");
    assert_eq!(value(&r[1]), 0, "fill");
    assert_eq!(value(&r[2]), PAGES - n, "verify counts the unfilled pages");
    assert_eq!(value(&r[3]), n, "verify with another seed");
    assert_eq!(
        value(&r[4]),
        pattern::checksum(&mem, 0, 0, PAGES),
        "checksum"
    );
    assert_eq!(value(&r[5]), pattern::digest(&mem, 0, 0, PAGES), "digest");
    assert_eq!(value(&r[6]), 0, "touch");
    assert_eq!(
        value(&r[7]),
        pattern::digest(&mem, 0, 1, PAGES - 1),
        "touch kept memory unchanged"
    );
    assert_eq!(value(&r[8]), 0, "disk fill");
    assert_eq!(
        value(&r[9]),
        pattern::disk_checksum(&disk, 0, sectors),
        "disk checksum"
    );
    assert_eq!(
        value(&r[10]),
        pattern::disk_checksum(&disk, 3, 10),
        "disk checksum of a sub-range"
    );
    assert!(
        r[11]["Err"]
            .as_str()
            .is_some_and(|e| e.contains("outside guest RAM")),
        "{}",
        r[11]
    );
    assert!(
        r[12]["Err"]
            .as_str()
            .is_some_and(|e| e.contains("past the end of the disk")),
        "{}",
        r[12]
    );
}

#[test]
fn disk_ops_without_a_disk_are_errors() {
    if !kvm_available() {
        return;
    }
    let r = run(
        &["--memory-mib", "2"],
        &[exec(r#"{"DiskChecksum":{"sector":0,"count":1}}"#)],
    );
    assert!(
        r[0]["Err"].as_str().is_some_and(|e| e.contains("no disk")),
        "{}",
        r[0]
    );
}

#[test]
fn pause_capture_restore_resumes_the_agent() {
    if !kvm_available() {
        return;
    }
    let steps = vec![
        r#"{"Async":{"Exec":{"Fill":{"start_page":0,"pages":2048,"seed":9}}}}"#.to_string(),
        r#""Pause""#.into(),
        r#""CaptureState""#.into(),
        r#""Resume""#.into(),
        r#""Wait""#.into(),
        r#""CaptureState""#.into(),
        r#""Pause""#.into(),
        r#""CaptureState""#.into(),
        r#""Restore""#.into(),
        exec(r#"{"Verify":{"start_page":0,"pages":2048,"seed":9}}"#),
        exec(r#""Identity""#),
        r#""Pause""#.into(),
        r#""Resume""#.into(),
        exec(r#"{"Checksum":{"start_page":0,"pages":2048}}"#),
        r#""Stop""#.into(),
    ];
    let r = run(
        &["--memory-mib", "8", "--vcpus", "2", "--vm-id", "7"],
        &steps,
    );
    let mut mem = vec![0u8; (PAGES * PAGE_SIZE) as usize];
    for p in 0..PAGES {
        let b = (p * PAGE_SIZE) as usize;
        pattern::fill_page(&mut mem[b..b + PAGE_SIZE as usize], p, 9);
    }
    assert_eq!(value(&r[0]), 0, "a fill paused in flight still completes");
    assert_eq!(r[1]["Ok"], "Done");
    assert_eq!(r[2]["Ok"]["State"]["vcpus"], 2);
    assert!(
        r[5]["Err"]
            .as_str()
            .is_some_and(|e| e.contains("not paused")),
        "{}",
        r[5]
    );
    assert_eq!(r[7]["Ok"]["State"]["vcpus"], 2);
    assert_eq!(value(&r[9]), 0, "the restored VM sees the filled memory");
    assert_eq!(value(&r[10]), 7, "the restored agent answers commands");
    assert_eq!(value(&r[13]), pattern::checksum(&mem, 0, 0, PAGES));
    assert_eq!(r[14]["Ok"], "Done");
}

#[test]
fn ram_over_the_local_apic_page_behaves_like_ram() {
    if !kvm_available() {
        return;
    }
    // KVM traps the page at 0xfee0_0000 as MMIO; the VMM emulates it on RAM.
    let apic_page = 0xfee0_0000 / PAGE_SIZE;
    let (start, n) = (apic_page - 8, 16u64);
    let steps = vec![
        exec(&format!(
            r#"{{"Fill":{{"start_page":{start},"pages":{n},"seed":11}}}}"#
        )),
        exec(&format!(
            r#"{{"Verify":{{"start_page":{start},"pages":{n},"seed":11}}}}"#
        )),
        exec(&format!(
            r#"{{"Checksum":{{"start_page":{start},"pages":{n}}}}}"#
        )),
        exec(&format!(
            r#"{{"Digest":{{"start_page":{start},"pages":{n}}}}}"#
        )),
    ];
    let r = run(&["--memory-mib", "4100"], &steps);
    let mut mem = vec![0u8; (n * PAGE_SIZE) as usize];
    for p in start..start + n {
        let b = ((p - start) * PAGE_SIZE) as usize;
        pattern::fill_page(&mut mem[b..b + PAGE_SIZE as usize], p, 11);
    }
    assert_eq!(value(&r[1]), 0, "verify");
    assert_eq!(
        value(&r[2]),
        pattern::checksum(&mem, start, start, n),
        "checksum"
    );
    assert_eq!(
        value(&r[3]),
        pattern::digest(&mem, start, start, n),
        "digest"
    );
}

/// A state captured in the middle of a multi-sector `disk_checksum` and
/// loaded into a new machine over the same private memory (whose read
/// buffer now holds the parent's last request, like a rollback in place)
/// finishes with the parent's result: the words of the request in progress
/// travel in the device state.
#[test]
fn disk_checksum_resumed_from_a_mid_op_state_folds_the_same_words() {
    if !kvm_available() {
        return;
    }
    let sectors = 64 * 2048u64; // 64 MiB
    let mut steps = vec![
        exec(&format!(
            r#"{{"DiskFill":{{"sector":0,"count":{sectors},"seed":3}}}}"#
        )),
        format!(r#"{{"Async":{{"Exec":{{"DiskChecksum":{{"sector":0,"count":{sectors}}}}}}}}}"#),
        r#"{"Sleep":15}"#.into(),
        r#""Pause""#.into(),
        r#""CaptureState""#.into(),
        r#""Resume""#.into(),
        r#""Wait""#.into(),
        r#""Restore""#.into(),
    ];
    // Poll the restored machine until its agent is back at its command wait.
    for _ in 0..20 {
        steps.push(r#"{"Sleep":100}"#.into());
        steps.push(r#""Pause""#.into());
        steps.push(r#""CaptureState""#.into());
        steps.push(r#""Resume""#.into());
    }
    for attempt in 0..5 {
        let r = run(&["--memory-mib", "8", "--disk-mib", "64"], &steps);
        let mut disk = vec![0u8; (sectors * SECTOR_SIZE) as usize];
        for s in 0..sectors {
            let b = (s * SECTOR_SIZE) as usize;
            disk[b..b + 8].copy_from_slice(&pattern::disk_word(3, s).to_le_bytes());
        }
        let want = pattern::disk_checksum(&disk, 0, sectors);
        assert_eq!(value(&r[1]), want, "the parent's checksum");
        if r[4]["Ok"]["State"]["disk_op_in_flight"] != true {
            eprintln!("attempt {attempt}: the pause missed the checksum: {}", r[4]);
            continue;
        }
        let after = r[8..]
            .iter()
            .filter_map(|v| v["Ok"].get("State"))
            .find(|s| s["disk_op_in_flight"] == false)
            .unwrap_or_else(|| panic!("the resumed checksum never ended: {r:?}"));
        assert_eq!(after["agent_result"], want, "the resumed checksum");
        return;
    }
    panic!("no pause landed inside the checksum in 5 attempts");
}
