//! The catalog of complete snapshots in `STATE/snapshots/`, rebuilt from
//! the directory at start-up (the filesystem is the only record).
//!
//! Start-up rules: `.tmp-*` directories are leftovers of a snapshot (or a
//! delete) a crash interrupted and are removed; every other directory must
//! hold a `state.json` that parses and validates and a `memory.img` of the
//! recorded size and SHA-256, or it is moved to `.quarantine/` and never
//! served.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use super::checksum::sum_file;
use proto::snapshot::StateFile;

use super::error::{Result, SnapshotError};
use super::layout::{MEMORY_FILE, STATE_FILE};

/// Prefix of directories that are not (yet, or any more) snapshots.
const TMP_PREFIX: &str = ".tmp-";
/// Where snapshots that do not verify go.
const QUARANTINE: &str = ".quarantine";

/// The snapshots of a state directory.
#[derive(Debug)]
pub struct Catalog {
    root: PathBuf,
    entries: BTreeMap<String, StateFile>,
    /// Names being written: taken, but not listed.
    reserved: BTreeSet<String>,
    quarantined: Vec<String>,
    /// Snapshots found unfinished at start-up (their `.tmp-` directories
    /// were removed): a volume snapshot taken for one is an orphan.
    unfinished: Vec<String>,
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// fsync a directory, so a rename or create in it is durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(SnapshotError::io("sync", dir))
}

fn mkdir_private(dir: &Path) -> Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(SnapshotError::io("create", dir)(e)),
    }
}

/// Read and check one snapshot directory: its state file, and, with
/// `sums`, every file's checksum.
fn verify(dir: &Path, name: &str, sums: bool) -> Result<StateFile> {
    let corrupt = |reason: String| SnapshotError::Corrupt {
        name: name.to_owned(),
        reason,
    };
    let path = dir.join(STATE_FILE);
    let bytes = fs::read(&path).map_err(SnapshotError::io("read", &path))?;
    let state = proto::snapshot::parse_state(&bytes).map_err(|e| SnapshotError::BadState {
        path: path.clone(),
        reason: shared::error_chain(&e),
    })?;
    if state.name != name {
        return Err(corrupt(format!("{STATE_FILE} names it {}", state.name)));
    }
    for (file, want) in &state.files {
        if file.contains('/') || file.starts_with('.') {
            return Err(corrupt(format!("{STATE_FILE} names a bad file {file:?}")));
        }
        let path = dir.join(file);
        let f = super::image::open_read(&path)?;
        if !sums {
            continue;
        }
        let got = sum_file(&f, want.algorithm).map_err(SnapshotError::io("checksum", &path))?;
        if &got != want {
            let bad = got
                .chunks
                .iter()
                .zip(&want.chunks)
                .position(|(a, b)| a != b)
                .map_or_else(String::new, |c| format!(" (first at chunk {c})"));
            return Err(corrupt(format!(
                "{file}: {} bytes with {alg:?} digest {}, {STATE_FILE} says {} bytes with {}{bad}",
                got.bytes,
                got.digest,
                want.bytes,
                want.digest,
                alg = want.algorithm
            )));
        }
    }
    let mem = &state.files[MEMORY_FILE];
    if mem.bytes != state.memory_bytes {
        return Err(corrupt(format!(
            "{MEMORY_FILE} has {} bytes for {} bytes of memory",
            mem.bytes, state.memory_bytes
        )));
    }
    Ok(state)
}

/// Remove what a crash during a background rewrite left in snapshot
/// directory `dir` (`.memory.img.rewrite`; the image itself is whole).
fn remove_rewrite_leftovers(dir: &Path) {
    let Ok(listing) = fs::read_dir(dir) else {
        return;
    };
    for e in listing.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.ends_with(super::image::REWRITE_SUFFIX) {
            info!(
                "removing an unfinished image rewrite {}",
                e.path().display()
            );
            if let Err(err) = fs::remove_file(e.path()) {
                warn!("cannot remove {}: {err}", e.path().display());
            }
        }
    }
}

impl Catalog {
    /// Open (creating) `state_dir/snapshots`, clean up and verify.
    pub fn open(state_dir: &Path) -> Result<Self> {
        Self::open_with(state_dir, true)
    }

    /// [`Self::open`]; without `sums`, each snapshot's state file is
    /// read and its files found, but their checksums are not read again:
    /// a server taking over from one that died or handed over (which
    /// verified them at its start, and wrote every later one with its
    /// sums) does not make the VMs it takes back wait for that.
    pub fn open_with(state_dir: &Path, sums: bool) -> Result<Self> {
        let root = state_dir.join("snapshots");
        mkdir_private(&root)?;
        let mut cat = Catalog {
            root,
            entries: BTreeMap::new(),
            reserved: BTreeSet::new(),
            quarantined: Vec::new(),
            unfinished: Vec::new(),
        };
        let listing = fs::read_dir(&cat.root).map_err(SnapshotError::io("list", &cat.root))?;
        let mut removed = false;
        for entry in listing.flatten() {
            let Ok(name) = entry.file_name().into_string() else {
                continue;
            };
            let path = entry.path();
            if name.starts_with(TMP_PREFIX) {
                info!(
                    "removing an unfinished snapshot directory {}",
                    path.display()
                );
                if let Err(e) = fs::remove_dir_all(&path) {
                    warn!("cannot remove {}: {e}", path.display());
                }
                if let Some(n) = name.strip_prefix(TMP_PREFIX) {
                    cat.unfinished.push(n.to_owned());
                }
                removed = true;
                continue;
            }
            if name.starts_with('.') || !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            remove_rewrite_leftovers(&path);
            match verify(&path, &name, sums) {
                Ok(state) => {
                    cat.entries.insert(name, state);
                }
                Err(e) => {
                    let reason = shared::error_chain(&e);
                    warn!("snapshot {name} does not verify ({reason}); quarantining it");
                    cat.quarantine(&name);
                    removed = true;
                }
            }
        }
        if removed {
            sync_dir(&cat.root)?;
        }
        if let Ok(q) = fs::read_dir(cat.root.join(QUARANTINE)) {
            cat.quarantined = q
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect();
            cat.quarantined.sort();
        }
        if sums {
            info!("{} snapshot(s) verified", cat.entries.len());
        } else {
            info!(
                "{} snapshot(s) listed (their checksums were verified at the first start)",
                cat.entries.len()
            );
        }
        Ok(cat)
    }

    fn quarantine(&self, name: &str) {
        let q = self.root.join(QUARANTINE);
        let to = q.join(format!("{name}.{}", now_secs()));
        let moved = mkdir_private(&q)
            .map_err(|e| shared::error_chain(&e))
            .and_then(|()| fs::rename(self.root.join(name), &to).map_err(|e| e.to_string()));
        if let Err(e) = moved {
            warn!("cannot quarantine snapshot {name}: {e}");
        }
    }

    /// The directory all snapshots live in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// A complete snapshot.
    pub fn get(&self, name: &str) -> Result<&StateFile> {
        self.entries
            .get(name)
            .ok_or_else(|| SnapshotError::NotFound(name.to_owned()))
    }

    /// Every complete snapshot, by name.
    pub fn iter(&self) -> impl Iterator<Item = &StateFile> {
        self.entries.values()
    }

    /// Names of the snapshots found unfinished at start-up (once).
    pub fn take_unfinished(&mut self) -> Vec<String> {
        std::mem::take(&mut self.unfinished)
    }

    /// Directories set aside at start-up.
    pub fn quarantined(&self) -> &[String] {
        &self.quarantined
    }

    /// The directory of complete snapshot `name`.
    pub fn dir_of(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// The image of complete snapshot `name`.
    pub fn image_of(&self, name: &str) -> PathBuf {
        self.dir_of(name).join(MEMORY_FILE)
    }

    /// Take `name` for a snapshot about to be written and create its
    /// temporary directory. Returns that directory.
    pub fn reserve(&mut self, name: &str) -> Result<PathBuf> {
        volume::name::validate(name).map_err(|source| SnapshotError::BadName {
            name: name.to_owned(),
            source,
        })?;
        if self.entries.contains_key(name) || self.reserved.contains(name) {
            return Err(SnapshotError::Exists(name.to_owned()));
        }
        let tmp = self.tmp_dir(name);
        if tmp.exists() {
            let _ = fs::remove_dir_all(&tmp);
        }
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&tmp)
            .map_err(SnapshotError::io("create", &tmp))?;
        self.reserved.insert(name.to_owned());
        Ok(tmp)
    }

    /// The temporary directory of a snapshot being written.
    pub fn tmp_dir(&self, name: &str) -> PathBuf {
        self.root.join(format!("{TMP_PREFIX}{name}"))
    }

    /// Give up a reserved name: its temporary directory goes.
    pub fn abandon(&mut self, name: &str) {
        if self.reserved.remove(name) {
            let tmp = self.tmp_dir(name);
            if let Err(e) = fs::remove_dir_all(&tmp) {
                warn!("cannot remove {}: {e}", tmp.display());
            }
        }
    }

    /// Record a snapshot [`publish`] made durable.
    pub fn insert(&mut self, state: StateFile) {
        self.reserved.remove(&state.name);
        self.entries.insert(state.name.clone(), state);
    }

    /// Delete complete snapshot `name`: rename it out of the listing (the
    /// commit point of a delete), then remove its files.
    pub fn remove(&mut self, name: &str) -> Result<StateFile> {
        if !self.entries.contains_key(name) {
            return Err(SnapshotError::NotFound(name.to_owned()));
        }
        let dir = self.dir_of(name);
        let gone = self.root.join(format!("{TMP_PREFIX}deleted-{name}"));
        let _ = fs::remove_dir_all(&gone);
        fs::rename(&dir, &gone).map_err(SnapshotError::io("rename", &dir))?;
        sync_dir(&self.root)?;
        if let Err(e) = fs::remove_dir_all(&gone) {
            warn!("cannot remove {}: {e}", gone.display());
        }
        self.entries
            .remove(name)
            .ok_or_else(|| SnapshotError::NotFound(name.to_owned()))
    }
}

/// Create `tmp`'s `state.json`, empty, for [`write_state`] to fill: a
/// snapshot creates it before its guest pauses, so that allocating an inode
/// and a directory entry (which waits on the filesystem's log while the
/// image is being synced) is no part of the commit. A crash leaves the
/// empty file in a temporary directory, which start-up removes.
pub fn create_state(tmp: &Path) -> Result<File> {
    let path = tmp.join(STATE_FILE);
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(SnapshotError::io("create", &path))
}

/// The first half of the commit: write `state.json` into `file` (made by
/// [`create_state`] in `tmp`) and fsync it and `tmp`. Nothing is committed
/// yet, so this may run while the image's own fsync is still under way;
/// [`publish`] must wait for both.
pub fn write_state(tmp: &Path, mut file: File, state: &StateFile) -> Result<()> {
    let path = tmp.join(STATE_FILE);
    let text = serde_json::to_vec_pretty(state).map_err(|e| SnapshotError::BadState {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    file.write_all(&text)
        .and_then(|()| file.sync_all())
        .map_err(SnapshotError::io("write", &path))?;
    sync_dir(tmp)
}

/// The second half of the commit: rename `tmp` to `name` (the commit
/// point) and fsync the parent. Every file in `tmp` must be durable.
pub fn publish(root: &Path, tmp: &Path, name: &str) -> Result<()> {
    let dst = root.join(name);
    fs::rename(tmp, &dst).map_err(SnapshotError::io("rename", tmp))?;
    sync_dir(root)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::checksum::{Algorithm, WRITE_ALGORITHM};
    use crate::snapshot::image::ImageWriter;
    use crate::snapshot::{FileSum, FORMAT_VERSION};

    fn state(name: &str, sum: FileSum) -> StateFile {
        StateFile {
            format_version: FORMAT_VERSION,
            name: name.into(),
            vm: "vm-1".into(),
            mode: proto::api::SnapshotMode::Full,
            parent: None,
            created: 0,
            memory_bytes: sum.bytes,
            page_size: shared::PAGE_SIZE,
            hugepages: false,
            vm_state: shared::VmState {
                vcpus: vec![shared::VcpuState::default()],
                devices: vec![],
            },
            volume_snapshot: None,
            files: BTreeMap::from([(MEMORY_FILE.to_owned(), sum)]),
            origin: None,
        }
    }

    fn write_one(cat: &mut Catalog, name: &str) {
        write_one_as(cat, name, WRITE_ALGORITHM, FORMAT_VERSION);
    }

    fn write_one_as(cat: &mut Catalog, name: &str, alg: Algorithm, version: u32) {
        let tmp = cat.reserve(name).unwrap();
        let img = ImageWriter::create(&tmp.join(MEMORY_FILE), 16 * 4096).unwrap();
        img.write_pages(2, &[9u8; 4096]).unwrap();
        let sum = sum_file(&img.file, alg).unwrap();
        let mut st = state(name, sum);
        st.format_version = version;
        write_state(&tmp, create_state(&tmp).unwrap(), &st).unwrap();
        publish(cat.root(), &tmp, name).unwrap();
        cat.insert(st);
    }

    #[test]
    fn older_formats_still_verify() {
        for (alg, version) in [(Algorithm::Sha256, 1), (Algorithm::Blake3, 2)] {
            let dir = tempfile::tempdir().unwrap();
            let mut cat = Catalog::open(dir.path()).unwrap();
            write_one_as(&mut cat, "old", alg, version);
            write_one_as(&mut cat, "old-bad", alg, version);
            let img = cat.image_of("old-bad");
            let f = std::fs::OpenOptions::new().write(true).open(img).unwrap();
            std::os::unix::fs::FileExt::write_all_at(&f, &[8], 2 * 4096 + 7).unwrap();
            let cat = Catalog::open(dir.path()).unwrap();
            let names: Vec<&str> = cat.iter().map(|s| s.name.as_str()).collect();
            assert_eq!(
                names,
                ["old"],
                "format {version}: the intact one verifies, the changed one does not"
            );
            assert_eq!(cat.get("old").unwrap().files[MEMORY_FILE].algorithm, alg);
            assert_eq!(cat.quarantined().len(), 1);
        }
    }

    #[test]
    fn only_complete_snapshots_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let mut cat = Catalog::open(dir.path()).unwrap();
        write_one(&mut cat, "good");
        write_one(&mut cat, "bad");
        assert!(matches!(cat.reserve("good"), Err(SnapshotError::Exists(_))));
        // An interrupted one, and a corrupted image.
        let _ = cat.reserve("half").unwrap();
        std::fs::write(cat.image_of("bad"), b"x").unwrap();
        let cat = Catalog::open(dir.path()).unwrap();
        let names: Vec<&str> = cat.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["good"]);
        assert_eq!(cat.quarantined().len(), 1);
        assert!(cat.quarantined()[0].starts_with("bad."));
        assert!(!cat.tmp_dir("half").exists());
    }

    #[test]
    fn remove_takes_the_snapshot_away() {
        let dir = tempfile::tempdir().unwrap();
        let mut cat = Catalog::open(dir.path()).unwrap();
        write_one(&mut cat, "s");
        cat.remove("s").unwrap();
        assert!(cat.get("s").is_err());
        assert!(Catalog::open(dir.path()).unwrap().get("s").is_err());
        assert!(matches!(cat.remove("s"), Err(SnapshotError::NotFound(_))));
    }
}
