//! Bad input and failing files (issue 18, items 5, 6, 10, 11 and 12): a
//! client's mistake answers 4xx, the paths a client names
//! are opened only as regular files, a page that cannot be served fails
//! its VM visibly (never silent zeroes, never a hang, never a log flood),
//! a fork that fails half-way leaves nothing behind, and VM ids never
//! repeat on one state directory.
//!
//! Tests that need XFS use `PAGEFORK_XFS_DIR` (a loop-mounted XFS with
//! reflink=1); the test that shuts a filesystem down makes its own small
//! one (needs root).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use pagefork_tests::{
    bin, body, expected_digest, file_source, new_vm, op, open_fds, pages_of, request_within,
    require_hugepages, require_kvm_uffd, require_root, vm_num, xfs_dir, Answer, FcClient,
    RandomImage, ScratchXfs, ServerOptions, TestServer,
};
use proto::api::{CreateListener, CreateVm, ExecRequest, ExecResponse, ListenerInfo, RunState};

/// A server whose state directory is on the XFS mount.
fn server_on_xfs(args: &[&str]) -> Option<(TestServer, PathBuf)> {
    let dir = xfs_dir()?;
    if !require_kvm_uffd() {
        return None;
    }
    let s = TestServer::start_with_options(
        args,
        &ServerOptions {
            parent: Some(dir.clone()),
            ..ServerOptions::default()
        },
    );
    Some((s, dir))
}

/// An image-backed VM that reads exactly the pages it touches (no
/// fault-around, no readahead).
fn image_vm(s: &TestServer, mib: u64, path: &str) -> String {
    s.create_vm(&CreateVm {
        memory_source: Some(file_source(path)),
        fault_around_kib: Some(0),
        readahead_kib: Some(0),
        ..new_vm(mib)
    })
}

/// Start `op` on `id` in a thread the test does not wait for (it may never
/// be answered if the server hangs the guest); the client gives up after
/// `timeout`. Returns where the answer arrives.
fn exec_detached(
    s: &TestServer,
    id: &str,
    op: &ExecRequest,
    timeout: Duration,
) -> mpsc::Receiver<Option<(u16, String)>> {
    let (tx, rx) = mpsc::channel();
    let sock = s.api_sock();
    let path = format!("/v1/vms/{id}/exec");
    let op = body(op);
    thread::spawn(move || {
        let _ = tx.send(request_within(&sock, "POST", &path, Some(&op), timeout));
    });
    rx
}

/// Lines of the server log (warnings or not) that mention any of `needles`.
fn log_lines_about(s: &TestServer, needles: &[&str]) -> usize {
    s.server_log_text()
        .lines()
        .filter(|l| needles.iter().any(|n| l.contains(n)))
        .count()
}

// ---------------------------------------------------------------------------
// Item 5: client mistakes are 4xx

#[test]
fn a_disk_op_on_a_vm_without_a_disk_answers_400() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let id = s.create_vm(&new_vm(4));
    for op in [op::disk_fill(0, 8, 1), op::disk_checksum(0, 8)] {
        s.try_exec(&id, &op).unwrap_err().assert_error(
            400,
            "disk",
            &format!("{op:?} without a disk"),
        );
    }
    s.fill(&id, 0, 8, 2);
    assert_eq!(s.verify(&id, 0, 8, 2), 0);
}

// ---------------------------------------------------------------------------
// Item 12: paths a client names

#[test]
fn image_paths_must_name_regular_files_and_errors_reveal_no_size() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    // A root-only file of an odd size, too small for the VM asked for.
    let secret = dir.path().join("root-only");
    let odd_size = 12_345 * 4 + 7;
    std::fs::write(&secret, vec![0x5a; odd_size]).expect("write");
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o400)).expect("chmod");
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&secret, &link).expect("symlink");
    let fifo = dir.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    let create = |path: &Path| {
        let t = Instant::now();
        let r = s.try_create_vm(&CreateVm {
            memory_source: Some(file_source(path)),
            ..new_vm(4)
        });
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "create from {} took {:?}",
            path.display(),
            t.elapsed()
        );
        r
    };
    let sizes = [odd_size.to_string(), format!("{}", odd_size / 1024)];
    for (path, needle) in [
        (&link, "link"),
        (&fifo, "FIFO"),
        (&dir.path().to_owned(), "directory"),
        (&PathBuf::from("/dev/zero"), "device"),
        (&secret, "smaller"),
    ] {
        let msg = create(path)
            .unwrap_err()
            .assert_error(400, needle, &path.display().to_string());
        for size in &sizes {
            assert!(
                !msg.contains(size.as_str()),
                "the error for {} reveals the file's size ({size}): {msg}",
                path.display()
            );
        }
    }
    assert!(s.vm_ids().is_empty(), "a refused create made a VM");

    // A root-only regular file the server can read is a fine image.
    let image = RandomImage::new(4, 0x12);
    std::fs::set_permissions(image.file.path(), std::fs::Permissions::from_mode(0o400))
        .expect("chmod");
    let id = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        ..new_vm(4)
    });
    let pages = pages_of(4);
    assert_eq!(
        s.digest(&id, 0, pages),
        expected_digest(&image.bytes, 0, pages)
    );
    // The same file through a link is refused.
    let link2 = dir.path().join("link2");
    std::os::unix::fs::symlink(image.file.path(), &link2).expect("symlink");
    create(&link2)
        .unwrap_err()
        .assert_error(400, "link", "a link to a readable image");
}

// ---------------------------------------------------------------------------
// Item 10: failed forks and VM ids across restarts

#[test]
fn vm_ids_never_repeat_across_restarts_on_one_state_directory() {
    if !require_kvm_uffd() {
        return;
    }
    let mut s = TestServer::start();
    let mut used = Vec::new();
    for _ in 0..3 {
        used.push(s.create_vm(&new_vm(4)));
    }
    let children = s.fork(&used[0], 2).children;
    used.extend(children);
    s.delete_vm(&used[1]);
    let highest = used.iter().map(|id| vm_num(id)).max().expect("ids");
    for round in 0..2 {
        s.restart(&[]);
        assert!(
            s.vm_ids().is_empty(),
            "VMs survived a restart: {:?}",
            s.vm_ids()
        );
        let id = s.create_vm(&new_vm(4));
        assert!(
            vm_num(&id) > highest,
            "restart {round}: new VM {id} reuses an id of {used:?}"
        );
        s.fill(&id, 0, 4, 1);
        used.push(id);
    }
    let highest_now = used.iter().map(|id| vm_num(id)).max().expect("ids");
    assert_eq!(
        used.len(),
        used.iter().collect::<std::collections::BTreeSet<_>>().len(),
        "ids repeated: {used:?}"
    );
    assert!(highest_now > highest);
}

/// The fork's child volume `<vol>-<child id>` already exists: the fork
/// answers a client error, leaves no child (VM, volume or process) and the
/// parent keeps working; the next fork works.
#[test]
fn a_fork_whose_child_volume_name_is_taken_leaves_no_debris() {
    let Some((s, _)) = server_on_xfs(&[]) else {
        return;
    };
    s.create_volume("d", 4);
    let parent = s.create_vm(&CreateVm {
        volume: Some("d".into()),
        ..new_vm(8)
    });
    s.fill(&parent, 0, 64, 3);
    s.exec(&parent, &op::disk_fill(0, 64, 3));
    let disk_sum = s.exec(&parent, &op::disk_checksum(0, 64));
    // The child of the next fork is vm-(parent + 1): take its volume name.
    let taken = format!("d-vm-{}", vm_num(&parent) + 1);
    s.create_volume(&taken, 1);
    let volumes = |s: &TestServer| -> Vec<String> {
        let mut names: Vec<String> = s.volumes().into_iter().map(|v| v.name).collect();
        names.sort();
        names
    };
    let vols_before = volumes(&s);
    let logs_before = std::fs::read_dir(s.state_dir().join("logs"))
        .expect("logs")
        .count();
    let pid = s.pid();
    let children_before = pagefork_tests::child_pids(pid).len();
    let held_before = pagefork_tests::Holdings::of(pid);

    let v = s.try_fork(&parent, &Default::default()).unwrap_err();
    eprintln!("fork onto a taken volume name: {v}");
    assert!(
        (400..500).contains(&v.status),
        "a name collision is not the server's failure: {v}"
    );
    assert!(
        v.error().contains(&taken),
        "the error does not name the volume: {v}"
    );
    assert_eq!(
        s.vm_ids(),
        vec![parent.clone()],
        "the failed fork left a VM"
    );
    assert_eq!(
        volumes(&s),
        vols_before,
        "the failed fork changed the volumes"
    );
    assert_eq!(
        pagefork_tests::child_pids(pid).len(),
        children_before,
        "the failed fork left a process"
    );
    assert_eq!(
        std::fs::read_dir(s.state_dir().join("logs"))
            .expect("logs")
            .count(),
        logs_before,
        "the failed fork left a log"
    );
    // Nor an fd, a uffd, or a child in the fork tree that the parent's
    // writes would copy pages to (which made the server grow before).
    // (An API connection of the answer may still be closing: wait for it.)
    let settled = pagefork_tests::wait_for(Duration::from_secs(5), || {
        let held = pagefork_tests::Holdings::of(pid);
        (held.fds <= held_before.fds && held.userfaultfds == held_before.userfaultfds).then_some(())
    });
    assert!(
        settled.is_some(),
        "the failed fork left fds: before {held_before:?}, after {:?}: {:?}",
        pagefork_tests::Holdings::of(pid),
        pagefork_tests::open_fds(pid)
    );
    let tree = s.tree();
    let failed_child = format!("vm-{}", vm_num(&parent) + 1);
    assert!(
        !tree.vms.iter().any(|n| n.id == failed_child
            || n.parent.as_ref() == Some(&failed_child)
            || n.children.contains(&failed_child)
            || n.reads_from.contains_key(&failed_child)),
        "the failed child is in the tree: {tree:?}"
    );
    s.fill(&parent, 0, 2048, 9);
    let held = pagefork_tests::Holdings::of(pid);
    assert!(
        held.rss_shmem_kib <= held_before.rss_shmem_kib + 8 * 1024 + 1024,
        "rewriting the parent grew the server's shared memory beyond the parent's 8 MiB: \
         before {held_before:?}, after {held:?}"
    );
    s.fill(&parent, 0, 64, 3);
    // The parent keeps working, memory and disk.
    assert_eq!(s.vm(&parent).state, RunState::Running);
    assert_eq!(s.verify(&parent, 0, 64, 3), 0);
    assert_eq!(s.exec(&parent, &op::disk_checksum(0, 64)), disk_sum);
    s.fill(&parent, 64, 64, 4);
    // The next fork takes a fresh id and works.
    let child = s.fork_one(&parent);
    assert_eq!(s.verify(&child, 0, 64, 3), 0);
    assert_eq!(s.exec(&child, &op::disk_checksum(0, 64)), disk_sum);
}

// ---------------------------------------------------------------------------
// Items 6 and 11: pages that cannot be served

/// The image's filesystem is shut down under a running VM (reads fail
/// with EIO): the next fault on an unread page fails the VM with a reason
/// naming the image, the log gets a bounded number of warnings, other VMs
/// keep working, and once the VM is deleted the server no longer holds
/// the image, so the filesystem unmounts.
#[test]
fn an_image_failing_with_eio_fails_its_vm_and_is_released() {
    if !require_kvm_uffd() || !require_root("a loop XFS to shut down") {
        return;
    }
    let xfs = ScratchXfs::new();
    let image_path = xfs.path().join("image.raw");
    let image = RandomImage::new(8, 0xe10);
    std::fs::write(&image_path, &image.bytes).expect("write the image");
    let s = TestServer::start();
    let pid = s.pid();
    let path = image_path.to_str().expect("utf-8").to_owned();
    let id = image_vm(&s, 8, &path);
    let other = s.create_vm(&new_vm(16));
    assert_eq!(
        s.digest(&id, 0, 16),
        expected_digest(&image.bytes, 0, 16),
        "pages read before the failure"
    );

    // Drop the page cache of the image, then make every read fail.
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "1");
    xfs.shutdown();
    let answer = exec_detached(
        &s,
        &id,
        &op::touch(1000, 100, false),
        Duration::from_secs(30),
    );
    let v = s.wait_state(&id, RunState::Failed, Duration::from_secs(10));
    let failure = v.failure.as_deref().unwrap_or_default();
    assert!(
        failure.contains("image.raw"),
        "the failure does not name the image: {v:?}"
    );
    // The touch gets an answer (an error), not a hang.
    match answer.recv_timeout(Duration::from_secs(30)) {
        Ok(Some((status, body))) => {
            assert!(
                status >= 400,
                "touch of an unreadable page answered {status}: {body}"
            );
        }
        other => panic!("the touch on the failed VM got no answer: {other:?}"),
    }
    // Let a fault loop, if any, show in the log.
    thread::sleep(Duration::from_secs(2));
    let lines = log_lines_about(&s, &[&id, "image.raw"]);
    eprintln!("{lines} log lines about {id} or its image after an EIO; failure: {failure}");
    assert!(
        lines < 50,
        "{lines} log lines about {id} or its image:\n{}",
        s.server_log_tail(20)
    );

    // Other VMs keep working.
    s.fill(&other, 0, pages_of(16), 5);
    assert_eq!(s.verify(&other, 0, pages_of(16), 5), 0);
    s.assert_healthy();

    s.delete_vm(&id);
    let deadline = Instant::now() + Duration::from_secs(10);
    let held = loop {
        let held: Vec<PathBuf> = open_fds(pid)
            .into_iter()
            .filter(|p| p.starts_with(xfs.path()))
            .collect();
        if held.is_empty() || Instant::now() >= deadline {
            break held;
        }
        thread::sleep(Duration::from_millis(50));
    };
    assert!(
        held.is_empty(),
        "the server still holds {held:?} after the delete"
    );
    let out = xfs.down();
    assert!(
        out.status.success() && !xfs.is_mounted(),
        "the filesystem does not unmount after the delete: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An image on ext4 (which cannot reflink, so the server serves the file
/// itself) is truncated while its VM runs: touching a page past the new
/// end fails the VM; it never reads as silent zeroes.
#[test]
fn a_truncated_image_fails_its_vm_instead_of_serving_zeroes() {
    if !require_kvm_uffd() {
        return;
    }
    truncated_image_fails_its_vm(false);
}

/// The same on 2 MiB hugetlb guest RAM, whose blocks the server copies
/// straight out of the image's mapped page cache.
#[test]
fn a_truncated_image_fails_its_hugepage_vm_instead_of_serving_zeroes() {
    if !require_hugepages(4) {
        return;
    }
    truncated_image_fails_its_vm(true);
}

fn truncated_image_fails_its_vm(hugepages: bool) {
    let s = TestServer::start();
    let image = RandomImage::new(8, 0x7c);
    let id = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        fault_around_kib: Some(0),
        readahead_kib: Some(0),
        hugepages: Some(hugepages),
        ..new_vm(8)
    });
    let other = s.create_vm(&new_vm(4));
    assert_eq!(s.digest(&id, 0, 16), expected_digest(&image.bytes, 0, 16));
    image.file.as_file().set_len(16 * 4096).expect("truncate");
    let answer = exec_detached(&s, &id, &op::digest(1000, 10), Duration::from_secs(30));
    let deadline = Instant::now() + Duration::from_secs(10);
    let v = loop {
        let v = s.vm(&id);
        if v.state == RunState::Failed {
            break v;
        }
        if let Ok(Some((200, body))) = answer.try_recv() {
            panic!("pages past the end of a truncated image were served: {body}; {v:?}");
        }
        assert!(
            Instant::now() < deadline,
            "{id} is not failed 10 s after touching pages past the end of its truncated image: {v:?}"
        );
        thread::sleep(Duration::from_millis(50));
    };
    assert!(
        v.failure
            .as_deref()
            .is_some_and(|f| f.contains(&image.path())),
        "the failure does not name the image: {v:?}"
    );
    s.fill(&other, 0, 64, 1);
    assert_eq!(s.verify(&other, 0, 64, 1), 0);
}

/// The same on a VM whose writes are tracked (after a snapshot, every
/// page it lacks carries a write-protect marker, which UFFDIO_POISON
/// refuses): the VM fails once, its exec is answered and its VMM ends,
/// instead of the fault being retried for ever.
#[test]
fn a_truncated_image_fails_a_tracked_vm_once_instead_of_looping() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let image = RandomImage::new(8, 0x7d);
    let id = s.create_vm(&CreateVm {
        memory_source: Some(image.source()),
        fault_around_kib: Some(0),
        readahead_kib: Some(0),
        ..new_vm(8)
    });
    assert_eq!(s.digest(&id, 0, 16), expected_digest(&image.bytes, 0, 16));
    s.snapshot(&id, "tracked", proto::api::SnapshotMode::Full);
    image.file.as_file().set_len(16 * 4096).expect("truncate");
    let answer = exec_detached(&s, &id, &op::digest(1000, 10), Duration::from_secs(60));
    let got = answer
        .recv_timeout(Duration::from_secs(20))
        .expect("the exec on a page that cannot be served is answered");
    match got {
        Some((200, body)) => panic!("pages past the end of a truncated image were served: {body}"),
        Some(_) => {}
        None => panic!("the exec got no answer"),
    }
    let v = s.vm(&id);
    assert_eq!(v.state, RunState::Failed, "{v:?}");
    assert!(
        v.faults.missing < 1000,
        "the unservable page was retried {} times: {v:?}",
        v.faults.missing
    );
}

/// An image on the same XFS as the server's state directory is served
/// from a private reflink clone: truncating (or rewriting) the client's
/// file has no effect on the VM.
#[test]
fn an_image_on_the_state_filesystem_is_served_from_a_private_clone() {
    let Some((s, xfs)) = server_on_xfs(&[]) else {
        return;
    };
    let image = RandomImage::new(8, 0xc1);
    let file = tempfile::Builder::new()
        .prefix("pagefork-image-")
        .tempfile_in(&xfs)
        .expect("image on the XFS");
    std::fs::write(file.path(), &image.bytes).expect("write the image");
    let path = file.path().to_str().expect("utf-8").to_owned();
    let id = image_vm(&s, 8, &path);
    let pages = pages_of(8);
    assert_eq!(s.digest(&id, 0, 16), expected_digest(&image.bytes, 0, 16));
    file.as_file().set_len(0).expect("truncate");
    let answer = request_within(
        &s.api_sock(),
        "POST",
        &format!("/v1/vms/{id}/exec"),
        Some(&body(&op::digest(0, pages))),
        Duration::from_secs(30),
    );
    let Some((200, body)) = answer else {
        panic!(
            "digest after truncating the image: {answer:?}; {:?}",
            s.vm(&id)
        );
    };
    let v: ExecResponse = serde_json::from_str(&body).expect("an ExecResponse");
    assert_eq!(
        v.result,
        expected_digest(&image.bytes, 0, pages),
        "the VM does not read the image as it was when the VM was created"
    );
    assert_eq!(s.vm(&id).state, RunState::Running);
}

// ---------------------------------------------------------------------------
// Item 11: Firecracker listeners

/// Try a listener on `<state dir>/<name>.sock` serving `image` page by
/// page; returns the answer and the socket.
fn listen(s: &TestServer, name: &str, image: &Path) -> (Answer<ListenerInfo>, PathBuf) {
    let req = CreateListener {
        fault_around_kib: Some(0),
        readahead_kib: Some(0),
        ..s.listener_request(name, file_source(image))
    };
    (s.try_add_listener(&req), PathBuf::from(req.socket))
}

#[test]
fn a_fifo_as_a_listeners_memory_file_is_refused_at_once() {
    let s = TestServer::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let fifo = dir.path().join("memory");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    let t = Instant::now();
    let (v, socket) = listen(&s, "fifo", &fifo);
    let took = t.elapsed();
    v.unwrap_err()
        .assert_error(400, "FIFO", "a FIFO as memory file");
    assert!(
        took < Duration::from_secs(10),
        "refusing a FIFO took {took:?}"
    );
    assert!(!socket.exists(), "a refused listener left its socket");
    // Symlinks are refused too; a regular file works.
    let image = RandomImage::new(4, 3);
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(image.file.path(), &link).expect("symlink");
    let (v, _) = listen(&s, "link", &link);
    v.unwrap_err()
        .assert_error(400, "link", "a symlink as memory file");
    let (v, _) = listen(&s, "ok", image.file.path());
    if let Err(v) = v {
        panic!("{v}");
    }
    s.assert_healthy();
}

/// The memory file of a listener is truncated while a client is connected:
/// the client's faults on pages past the new end do not hang for ever and
/// never read zeroes in place of the image. Either the listener serves a
/// private copy it took at creation (its image is on a reflink
/// filesystem), and the client reads the image exactly as it was, or the
/// client's VM fails visibly (state, reason, the server's log) and the
/// client dies on the poisoned page. The server and its other clients go
/// on.
#[test]
fn faults_on_a_truncated_firecracker_memory_file_do_not_hang() {
    if !require_kvm_uffd() {
        return;
    }
    let s = TestServer::start();
    let image = RandomImage::new(16, 0xfc);
    let (v, socket) = listen(&s, "fc", image.file.path());
    if let Err(v) = v {
        panic!("{v}");
    }
    let good = RandomImage::new(4, 0xfd);
    let (v, good_socket) = listen(&s, "good", good.file.path());
    if let Err(v) = v {
        panic!("{v}");
    }

    // What the image held before it was cut: the client checks every page
    // against it.
    let before = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::copy(image.file.path(), before.path()).expect("copy the image");
    let check = format!("check:{}", before.path().display());
    let mut client = FcClient::spawn(&socket, &["--mib", "16"], &["hold", &check]);
    let pid = client.pid();
    let fc_vm = |s: &TestServer| s.firecracker_vm(pid);
    let deadline = Instant::now() + Duration::from_secs(20);
    while fc_vm(&s).is_none() {
        assert!(Instant::now() < deadline, "the client never connected");
        thread::sleep(Duration::from_millis(20));
    }
    image.file.as_file().set_len(1 << 20).expect("truncate");
    client.release();

    let t = Instant::now();
    let mut seen_failed = None;
    let outcome = loop {
        if let Some(vm) = fc_vm(&s) {
            if vm.state == RunState::Failed {
                seen_failed.get_or_insert(vm);
            }
        }
        if let Some(line) = client.try_line() {
            if line.contains("mismatched_pages") {
                let v: serde_json::Value = serde_json::from_str(&line).expect("JSON");
                assert_eq!(
                    v["mismatched_pages"], 0,
                    "the client finished but read other bytes than the image had: {line}"
                );
                break format!("the client read the image as it was: {line}");
            }
        }
        if let Some(st) = client.try_wait() {
            // It died on the poisoned page: the failure must be visible.
            let log = s.server_log_text();
            assert!(
                seen_failed.is_some() || log.contains("failed: "),
                "the client ended ({st}) but no VM failure is visible"
            );
            assert!(
                log.contains("the page is poisoned"),
                "the client ended ({st}) and the server's log says nothing of it"
            );
            break format!("the client ended on a poisoned page: {st}");
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the client's faults past the end of the truncated memory file still hang after 20 s; \
             its VM: {:?}",
            fc_vm(&s)
        );
        thread::sleep(Duration::from_millis(20));
    };
    eprintln!(
        "after truncation: {outcome} after {:?}; failed VM seen: {seen_failed:?}",
        t.elapsed()
    );
    if let Some(vm) = &seen_failed {
        assert!(
            vm.failure.as_deref().is_some_and(|f| !f.is_empty()),
            "failed without a reason: {vm:?}"
        );
    }
    s.assert_healthy();
    // Another client, on another listener, is served.
    let out = Command::new(bin("fc_client"))
        .arg("--socket")
        .arg(&good_socket)
        .args(["--mib", "4", &format!("check:{}", good.path())])
        .output()
        .expect("fc_client");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value =
        serde_json::from_slice(out.stdout.split(|b| *b == b'\n').next().expect("a line"))
            .expect("JSON");
    assert_eq!(line["mismatched_pages"], 0, "{line}");
}
