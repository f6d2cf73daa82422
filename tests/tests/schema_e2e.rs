//! The OpenAPI document against the live server: schemathesis (PyPI)
//! generates requests from `/v1/openapi.json` for every operation, valid and
//! invalid, and checks every answer: no 5xx (but the documented 507 of
//! admission control), every response and status as the document says,
//! invalid bodies refused. The operations to cover are the document's
//! own (the server's router makes it): every one must have had requests,
//! by schemathesis's JUnit report. The server runs on the XFS mount so the volume
//! routes are live, with a VM, a volume and a snapshot to aim at, behind a
//! TCP bridge of its Unix API socket (schemathesis speaks TCP), and with
//! the suite's object store (`PAGEFORK_REMOTE`, AWS_*) when there is one,
//! so the remote routes answer from a real store. Afterwards the server is
//! healthy and its page-source invariant holds.
//!
//! `scripts/setup.sh` installs schemathesis into a venv and `scripts/test.sh`
//! names it in `PAGEFORK_SCHEMATHESIS`; without it the test skips, or fails
//! with `CI=true`.

use std::collections::BTreeSet;
use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;

use pagefork_tests::{new_vm, require_kvm_uffd, xfs_dir, TestServer};
use serde_json::Value;

/// Examples per operation and phase: enough to reach every branch of the
/// request checks, bounded so the test takes well under a minute here.
const MAX_EXAMPLES: &str = "25";

fn in_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

fn skip_or_fail(why: &str) -> Option<PathBuf> {
    if in_ci() {
        panic!("CI=true but {why}: run the tests through scripts/test.sh");
    }
    eprintln!("skipping: {why}");
    None
}

/// The schemathesis command, if installed.
fn schemathesis() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("PAGEFORK_SCHEMATHESIS").map(PathBuf::from),
        Some(PathBuf::from("/var/tmp/pagefork-venv/bin/schemathesis")),
    ];
    for c in candidates.into_iter().flatten() {
        if c.is_file() {
            return Some(c);
        }
    }
    skip_or_fail("schemathesis is not installed")
}

/// Forward TCP connections on a loopback port to the API's Unix socket;
/// returns the port. The threads end with the test process.
fn tcp_bridge(api: &Path) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("cannot bind the bridge");
    let port = listener.local_addr().expect("bridge address").port();
    let api = api.to_owned();
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let Ok(unix) = UnixStream::connect(&api) else {
                continue;
            };
            let (Ok(tcp2), Ok(unix2)) = (tcp.try_clone(), unix.try_clone()) else {
                continue;
            };
            std::thread::spawn(move || pump_up(tcp, unix));
            std::thread::spawn(move || pump_down(unix2, tcp2));
        }
    });
    port
}

fn pump_up(mut from: TcpStream, mut to: UnixStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Write);
}

fn pump_down(mut from: UnixStream, mut to: TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Write);
}

/// Run schemathesis with `config` and `args`, its JUnit report in
/// `junit`; returns (success, output).
fn run(st: &Path, config: &Path, url: &str, junit: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(st)
        .arg("--config-file")
        .arg(config)
        .arg("run")
        .arg(url)
        .args([
            "--max-examples",
            MAX_EXAMPLES,
            "--workers",
            "1",
            "--seed",
            "1",
        ])
        // The server refuses some schema-valid bodies for reasons a schema
        // cannot state (e.g. exactly one of two fields); that check is off.
        .args(["--exclude-checks", "positive_data_acceptance"])
        .arg("--report")
        .arg("junit")
        .arg("--report-junit-path")
        .arg(junit)
        .args(args)
        // Its cache (found crashes) goes in the config's directory, not
        // the source tree.
        .current_dir(config.parent().unwrap_or(Path::new("/")))
        .env("NO_COLOR", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", st.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The "N generated" count of a schemathesis summary.
fn generated(output: &str) -> u64 {
    output
        .lines()
        .find_map(|l| {
            let l = l.trim();
            l.split_once(" generated")
                .and_then(|(n, _)| n.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Every operation of the document, as "METHOD /path".
fn operations(doc: &Value) -> BTreeSet<String> {
    let mut ops = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().expect("the document has no paths") {
        for method in item.as_object().expect("a path item").keys() {
            ops.insert(format!("{} {path}", method.to_uppercase()));
        }
    }
    ops
}

/// The operations a JUnit report of schemathesis has test cases of.
fn tested(junit: &Path) -> BTreeSet<String> {
    let xml = std::fs::read_to_string(junit)
        .unwrap_or_else(|e| panic!("no report {}: {e}", junit.display()));
    xml.split("<testcase name=\"")
        .skip(1)
        .filter_map(|t| t.split_once('"').map(|(name, _)| name.to_owned()))
        .collect()
}

#[test]
fn the_live_api_matches_its_openapi_document() {
    let Some(st) = schemathesis() else {
        return;
    };
    let Some(xfs) = xfs_dir() else {
        return;
    };
    if !require_kvm_uffd() {
        return;
    }
    // The harness makes its temporary directory under TMPDIR.
    std::env::set_var("TMPDIR", &xfs);
    // With the suite's object store (scripts/test.sh boots one), the
    // remote routes answer from it, not only their 400 without one.
    let remote = std::env::var("PAGEFORK_REMOTE")
        .ok()
        .filter(|_| std::env::var_os("AWS_ENDPOINT_URL").is_some())
        .map(|r| format!("{}/schema-{}", r.trim_end_matches('/'), std::process::id()));
    let mut args = vec!["--max-vms", "12"];
    if let Some(r) = &remote {
        args.extend(["--remote", r.as_str()]);
    }
    let s = TestServer::start_with_args(&args);
    let vm = s.create_vm(&new_vm(8));
    s.create_volume("v1", 4);
    s.snapshot_volume("v1", "s1");

    let doc = s.raw("GET", "/v1/openapi.json", None);
    assert_eq!(doc.status, 200, "{}", doc.body);
    let doc = doc.body;
    // Creating a Firecracker listener binds a socket at a client-chosen
    // path, and an upgrade hands the server over to a new process; both
    // have their own tests. Every other operation gets requests.
    let skipped = "POST /v1/firecracker/listeners";
    let upgrade = "POST /v1/server/upgrade";
    let mut expected = operations(&doc);
    assert!(expected.remove(skipped), "{skipped} is not in the document");
    assert!(expected.remove(upgrade), "{upgrade} is not in the document");
    assert!(expected.len() > 40, "{expected:?}");

    let port = tcp_bridge(&s.api_sock());
    let url = format!("http://127.0.0.1:{port}/v1/openapi.json");
    let config = s.state_dir().join("..").join("schemathesis.toml");
    let mut f = std::fs::File::create(&config).expect("cannot write the config");
    // Path parameters aim at the objects made above; 507 is the documented
    // answer of admission control (the server runs with --max-vms 12). The
    // fault trace with follow=true streams until the client hangs up, so
    // here it is asked without (its stream has its own tests).
    write!(
        f,
        "[parameters]\n\"path.id\" = \"{vm}\"\n\"path.name\" = \"v1\"\n\"path.page\" = 3\n\
         \"query.follow\" = false\n\n\
         [checks.not_a_server_error]\nexpected-statuses = [\"2XX\", \"4XX\", \"507\"]\n"
    )
    .expect("cannot write the config");
    drop(f);

    // Everything but deletes first (so the VM and volume stay there to be
    // aimed at), then the deletes.
    let reports = config.with_file_name("junit");
    let (first, deletes) = (reports.join("first.xml"), reports.join("deletes.xml"));
    let (ok, out) = run(
        &st,
        &config,
        &url,
        &first,
        &[
            "--exclude-name",
            skipped,
            "--exclude-name",
            upgrade,
            "--exclude-method",
            "DELETE",
        ],
    );
    assert!(ok, "schemathesis found problems:\n{out}");
    let mut cases = generated(&out);
    let (ok, out) = run(
        &st,
        &config,
        &url,
        &deletes,
        &["--include-method", "DELETE"],
    );
    assert!(ok, "schemathesis found problems with deletes:\n{out}");
    cases += generated(&out);
    let mut covered = tested(&first);
    covered.extend(tested(&deletes));
    let missed: Vec<&String> = expected.difference(&covered).collect();
    assert!(
        missed.is_empty(),
        "operations of the document schemathesis never tested: {missed:?}"
    );
    assert!(!covered.contains(skipped), "{skipped} was tested");
    assert!(!covered.contains(upgrade), "{upgrade} was tested");
    eprintln!(
        "schemathesis: {cases} generated requests over all {} operations but {skipped} and \
         {upgrade}, no problem found",
        expected.len()
    );
    assert!(cases > 500, "too few requests were generated ({cases})");

    s.assert_healthy();
    s.assert_invariant("after the schema run");
}
