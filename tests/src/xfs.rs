//! A loop-mounted XFS of a test's own, made with `scripts/xfs-loop.sh`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Whether tests that need root (mount, loop devices) run: skips with a
/// printed reason when not root, but fails under `CI=true`.
pub fn require_root(what: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but {what} needs root");
    }
    eprintln!("skipping: {what} needs root");
    false
}

/// `scripts/xfs-loop.sh` of this checkout.
pub fn xfs_loop_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/xfs-loop.sh")
}

/// A small loop-mounted XFS (reflink=1) made for one test with
/// `scripts/xfs-loop.sh`, its image and mount point in a temporary
/// directory under /var/tmp: a test may shut it down or fill it without
/// touching the shared `PAGEFORK_XFS_DIR`. Unmounted and removed on drop.
#[derive(Debug)]
pub struct ScratchXfs {
    dir: Option<tempfile::TempDir>,
    mount: PathBuf,
}

impl ScratchXfs {
    /// Make and mount one (sparse, 512 MiB); panics if that fails.
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("pagefork-scratch-xfs-")
            .tempdir_in("/var/tmp")
            .expect("cannot create a directory under /var/tmp");
        let mount = dir.path().join("mnt");
        let out = Self::script(dir.path(), "up", &mount);
        assert!(
            out.status.success(),
            "xfs-loop.sh up {} failed: {}{}",
            mount.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ScratchXfs {
            dir: Some(dir),
            mount,
        }
    }

    fn script(image_dir: &Path, verb: &str, mount: &Path) -> std::process::Output {
        Command::new("bash")
            .arg(xfs_loop_script())
            .arg(verb)
            .arg(mount)
            .env("XFS_LOOP_IMAGE_DIR", image_dir)
            .env("XFS_LOOP_SIZE", "512M")
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run xfs-loop.sh {verb}: {e}"))
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.mount
    }

    /// The directory holding the image file (and the mount point).
    pub fn image_dir(&self) -> &Path {
        self.dir.as_ref().map_or(Path::new("/"), |d| d.path())
    }

    /// Shut the filesystem down (`xfs_io -x -c shutdown`): every read of
    /// it fails with EIO from now on.
    pub fn shutdown(&self) {
        let st = Command::new("xfs_io")
            .args(["-x", "-c", "shutdown"])
            .arg(&self.mount)
            .status()
            .expect("cannot run xfs_io");
        assert!(
            st.success(),
            "xfs_io shutdown {} failed",
            self.mount.display()
        );
    }

    /// Whether it is still mounted.
    pub fn is_mounted(&self) -> bool {
        Command::new("findmnt")
            .arg("--mountpoint")
            .arg(&self.mount)
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Run `xfs-loop.sh down` on it and return what it did.
    pub fn down(&self) -> std::process::Output {
        Self::script(self.image_dir(), "down", &self.mount)
    }
}

impl Default for ScratchXfs {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for ScratchXfs {
    fn drop(&mut self) {
        if self.is_mounted() {
            let _ = self.down();
        }
        if self.is_mounted() {
            // Busy (a process still holds a file): detach it lazily so the
            // test's directory can go.
            let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
            eprintln!("{} was busy; unmounted lazily", self.mount.display());
        }
        if let Some(dir) = self.dir.take() {
            let img_dir = dir.path().to_owned();
            // Loop devices bound to images in it.
            if let Ok(entries) = std::fs::read_dir(&img_dir) {
                for e in entries.flatten() {
                    if e.path().extension().is_some_and(|x| x == "img") {
                        let _ = Command::new("sh")
                            .arg("-c")
                            .arg("losetup -j \"$1\" -O NAME -n | xargs -r -n1 losetup -d")
                            .arg("sh")
                            .arg(e.path())
                            .status();
                    }
                }
            }
            drop(dir);
        }
    }
}
