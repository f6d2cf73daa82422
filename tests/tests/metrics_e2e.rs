//! `/metrics` against what the API reports: after a known workload (fill,
//! fork, copy-on-write writes, a delete), every per-VM counter equals the
//! VM's own `faults` in `GET /v1/vms/{id}`, the server totals keep a
//! deleted VM's counts, the same text is served over TCP with
//! `--metrics-addr`, and `promtool check metrics` (Debian's prometheus
//! package, installed by `scripts/setup.sh`) accepts it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

use pagefork_tests::{new_vm, require_kvm_uffd, TestServer};
use proto::api::FaultCounters;

/// One of a VM's fault counters.
type Counter = fn(&FaultCounters) -> u64;

/// The value of the series `name{labels}` (labels as printed), if present.
fn series(text: &str, name_and_labels: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free port")
}

fn scrape_tcp(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("metrics port");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_owned()
}

#[test]
fn metrics_match_the_vm_counters_and_pass_promtool() {
    if !require_kvm_uffd() {
        return;
    }
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let s = TestServer::start_with_args(&["--metrics-addr", &addr]);
    let a = s.create_vm(&new_vm(8));
    s.fill(&a, 0, 300, 1);
    let kids = s.fork(&a, 2).children;
    s.fill(&a, 0, 50, 2); // WP copies for the children
    s.fill(&kids[0], 100, 20, 3);
    let gone = s.create_vm(&new_vm(4));
    s.fill(&gone, 0, 10, 4);
    let gone_missing = s.vm(&gone).faults.missing;
    assert!(gone_missing > 0);
    s.delete_vm(&gone);

    let text = s.metrics_text();
    let mut missing_sum = 0;
    for id in [&a, &kids[0], &kids[1]] {
        let vm = s.vm(id);
        let fields: [(&str, Counter); 5] = [
            ("faults_missing", |f| f.missing),
            ("faults_write_protect", |f| f.write_protect),
            ("pages_installed", |f| f.pages_installed),
            ("remove_events", |f| f.removes),
            ("wp_copies", |f| f.wp_copies),
        ];
        for (metric, field) in fields {
            let name = format!("pagefork_vm_{metric}_total{{vm=\"{id}\",kind=\"pagefork\"}}");
            assert_eq!(
                series(&text, &name),
                Some(field(&vm.faults)),
                "{name} vs {vm:?}"
            );
        }
        missing_sum += vm.faults.missing;
        let resident = vm.resident_pages;
        let name = format!("pagefork_vm_resident_pages{{vm=\"{id}\"}}");
        assert_eq!(series(&text, &name), Some(resident), "{name}");
    }
    assert!(
        series(
            &text,
            &format!("pagefork_vm_faults_write_protect_total{{vm=\"{a}\",kind=\"pagefork\"}}")
        )
        .unwrap()
            >= 50,
        "the parent's writes were WP faults"
    );
    assert_eq!(
        series(
            &text,
            &format!("pagefork_vm_wp_copies_total{{vm=\"{a}\",kind=\"pagefork\"}}")
        ),
        Some(100),
        "each of the parent's 50 writes gave its page to both children"
    );
    // The deleted VM is gone from the per-VM series but not from the
    // totals. (Its own scrape-time counters were read before its delete;
    // a fault after that read is impossible: it had no VMM any more.)
    assert!(
        !text.contains(&format!("vm=\"{gone}\"")),
        "{gone} still listed"
    );
    let total = series(&text, "pagefork_faults_missing_total").expect("total");
    assert!(
        total >= missing_sum + gone_missing,
        "total {total} < live {missing_sum} + deleted {gone_missing}"
    );
    assert!(series(&text, "pagefork_fault_service_seconds_count").unwrap() >= total);
    assert!(text.ends_with("# EOF\n"));

    let tcp = scrape_tcp(port);
    assert!(
        tcp.contains(&format!("pagefork_vm_faults_missing_total{{vm=\"{a}\"")),
        "{tcp}"
    );

    match Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(mut child) => {
            child
                .stdin
                .take()
                .expect("stdin")
                .write_all(text.as_bytes())
                .expect("feed promtool");
            let out = child.wait_with_output().expect("promtool");
            let report = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            // The text is OpenMetrics (what prometheus-client writes): a
            // counter family `x` has its HELP under `x` and its sample as
            // `x_total`. Debian's promtool lints the older text format and
            // reports such samples as "no help text"; that, for a family
            // whose HELP is there, is the only report allowed.
            let unexpected: Vec<&str> = report
                .lines()
                .filter(|l| !l.trim().is_empty())
                .filter(|l| {
                    let Some(base) = l
                        .strip_suffix(" no help text")
                        .and_then(|n| n.strip_suffix("_total"))
                    else {
                        return true;
                    };
                    !text.contains(&format!("# HELP {base} "))
                })
                .collect();
            assert!(
                unexpected.is_empty(),
                "promtool check metrics: {unexpected:?}\n{report}"
            );
        }
        Err(e) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("CI=true but promtool is missing ({e}): run scripts/setup.sh")
        }
        Err(e) => eprintln!("skipping the promtool check: {e}"),
    }
}
