//! Running `uffdctl` against a [`TestServer`], as a user would.

use std::process::{Command, Output};

use serde::de::DeserializeOwned;

use crate::host::bin;
use crate::server::TestServer;

/// Run `uffdctl --socket <the server's> ARGS` and return what it did.
pub fn uffdctl(s: &TestServer, args: &[&str]) -> Output {
    Command::new(bin("uffdctl"))
        .arg("--socket")
        .arg(s.api_sock())
        .args(args)
        .output()
        .expect("cannot run uffdctl")
}

/// Run `uffdctl ARGS`; panics unless it succeeds. Returns its stdout.
pub fn uffdctl_ok(s: &TestServer, args: &[&str]) -> String {
    ok_stdout(&uffdctl(s, args), &format!("uffdctl {args:?}"))
}

/// The stdout of a finished command `what`; panics (with both outputs)
/// unless it succeeded.
pub fn ok_stdout(out: &Output, what: &str) -> String {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// Run `uffdctl --json ARGS`; panics unless it succeeds and prints a `T`
/// (the `proto::api` type of the answer it shows).
pub fn uffdctl_json<T: DeserializeOwned>(s: &TestServer, args: &[&str]) -> T {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let text = uffdctl_ok(s, &all);
    serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!(
            "uffdctl {all:?} printed no {}: {e}: {text}",
            std::any::type_name::<T>()
        )
    })
}

/// `uffdctl image compress RAW OUT [--frame-kib N]`: a `memory.zst` of a
/// raw image, offline; panics unless it succeeds.
pub fn compress_image(raw: &std::path::Path, out: &std::path::Path, frame_kib: Option<u64>) {
    let mut cmd = Command::new(bin("uffdctl"));
    cmd.args(["image", "compress"]).arg(raw).arg(out);
    if let Some(kib) = frame_kib {
        cmd.args(["--frame-kib", &kib.to_string()]);
    }
    let o = cmd.output().expect("run uffdctl image compress");
    ok_stdout(&o, "uffdctl image compress");
}
