//! Shared by the vmm integration tests.

/// Whether /dev/kvm can be opened; outside CI a missing device skips the
/// test with a printed reason, with CI=true it fails.
pub fn kvm_available() -> bool {
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("CI=true but /dev/kvm is unusable: {e}");
            }
            eprintln!("skipping: /dev/kvm is unusable ({e})");
            false
        }
    }
}
