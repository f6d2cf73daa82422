//! Trust boundaries a client cannot cross: with `--image-dir`, the server
//! serves images only from under that directory, however the path is
//! spelled (symlinked directories, `..`), for VMs and Firecracker
//! listeners alike.

use pagefork_tests::{
    file_source, new_listener, new_vm, require_kvm_uffd, RandomImage, TestServer,
};
use proto::api::CreateVm;

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

    let id = s.create_vm(&CreateVm {
        memory_source: Some(file_source(inside.to_str().unwrap())),
        ..new_vm(4)
    });
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
        let r = s
            .try_create_vm(&CreateVm {
                memory_source: Some(file_source(&path)),
                ..new_vm(4)
            })
            .unwrap_err();
        assert_eq!(r.status, 400, "{path}: {r}");
        let msg = r.error();
        assert!(msg.contains("--image-dir"), "{path}: {msg}");

        let socket = root.path().join("fc.sock");
        let r = s
            .try_add_listener(&new_listener(&socket, file_source(&path)))
            .unwrap_err();
        assert_eq!(r.status, 400, "listener on {path}: {r}");
        assert!(!socket.exists(), "a refused listener left its socket");
    }
    assert_eq!(s.vm_ids(), vec![id]);
    s.assert_healthy();
}
