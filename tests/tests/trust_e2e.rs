//! Trust boundaries a client cannot cross: with `--image-dir`, the server
//! serves images only from under that directory, however the path is
//! spelled (symlinked directories, `..`), for VMs and Firecracker
//! listeners alike.

use pagefork_tests::{require_kvm_uffd, RandomImage, TestServer};
use serde_json::json;

#[test]
fn image_dir_confines_the_images_a_client_can_name() {
    if !require_kvm_uffd() {
        return;
    }
    let root = tempfile::tempdir().expect("temp dir");
    let images = root.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let inside = images.join("mem.raw");
    let img = RandomImage::new(4, 5);
    std::fs::write(&inside, &img.bytes).unwrap();
    std::os::unix::fs::symlink(std::env::temp_dir(), images.join("tmp")).unwrap();
    let s = TestServer::start_with_args(&["--image-dir", images.to_str().unwrap()]);

    let id = s.create_vm(json!({
        "memory_mib": 4,
        "memory_source": {"kind": "file", "path": inside.to_str().unwrap()},
    }));
    assert_eq!(
        s.digest(&id, 0, 1024),
        pagefork_tests::expected_digest(&img.bytes, 0, 1024)
    );

    let name = img.file.path().file_name().unwrap().to_str().unwrap();
    for path in [
        img.path(),
        format!("{}/tmp/{name}", images.display()),
        format!("{}/../images/../{name}", images.display()),
    ] {
        let (status, body) = s.api(
            "POST",
            "/v1/vms",
            Some(json!({"memory_mib": 4, "memory_source": {"kind": "file", "path": path}})),
        );
        assert_eq!(status, 400, "{path}: {body}");
        let msg = body["error"].as_str().unwrap_or_default();
        assert!(msg.contains("--image-dir"), "{path}: {msg}");

        let socket = root.path().join("fc.sock");
        let (status, body) = s.api(
            "POST",
            "/v1/firecracker/listeners",
            Some(json!({"socket": socket, "memory_source": {"kind": "file", "path": path}})),
        );
        assert_eq!(status, 400, "listener on {path}: {body}");
        assert!(!socket.exists(), "a refused listener left its socket");
    }
    assert_eq!(s.vm_ids(), vec![id]);
    s.assert_healthy();
}
