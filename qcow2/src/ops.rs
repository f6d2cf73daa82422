//! Internal snapshot operations with qemu's semantics and crash ordering.
//!
//! Semantics (as `qemu-img snapshot`): a new snapshot's id is the largest
//! numeric id plus one; names need not be unique; apply looks a snapshot up
//! by id first, then by name; delete looks it up by name only; the first
//! match wins.
//!
//! Every operation is a short sequence of write groups, each ended by an
//! fsync; a hook runs after each group so tests can stop the operation
//! there, as a crash would:
//!
//! ```text
//! create:  [L1 copy + refcounts +1, COPIED cleared] → [new table] →
//!          [header 60..72 = (n+1, table)] COMMIT → [old table freed]
//! delete:  [new table] → [header 60..72 = (n-1, table)] COMMIT →
//!          [old table, snapshot L1 and its exclusive clusters freed,
//!           COPIED restored]
//! apply:   [refcounts of the snapshot +1] → [active L1 := snapshot L1]
//!          COMMIT → [old active clusters freed, COPIED restored]
//! ```
//!
//! Before a commit point the old state is what the file says (the new
//! clusters are at worst leaked); after it, the new one (the clusters not
//! yet released are at worst leaked).

use crate::alloc::{Meta, Order};
use crate::error::{invalid, unsupported, Error, Result};
use crate::header::{self, MAX_SNAPSHOTS, SNAPSHOT_FIELDS_OFFSET};
use crate::image::{read_u64s, Image};
use crate::l2;
use crate::snapshot::{self, cstr, Snapshot, KNOWN_EXTRA};
use crate::stage::Stage;
use crate::storage::StorageMut;

/// A snapshot's date (qemu-img uses the wall clock, microsecond precision).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotTime {
    pub sec: u32,
    pub nsec: u32,
}

impl SnapshotTime {
    /// The current wall-clock time, as qemu-img takes it.
    pub fn now() -> Self {
        let d = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        SnapshotTime {
            sec: u32::try_from(d.as_secs()).unwrap_or(u32::MAX),
            nsec: d.subsec_micros() * 1000,
        }
    }
}

/// Called after each write group; an error stops the operation there.
pub type Hook<'h> = &'h mut dyn FnMut(Stage) -> Result<()>;

/// A hook that lets every operation run to the end.
pub fn no_hook(_: Stage) -> Result<()> {
    Ok(())
}

fn open_rw<S: StorageMut>(st: &S) -> Result<Image<&S>> {
    let img = Image::open(st)?;
    let h = img.header();
    if h.autoclear != 0 || h.extensions.contains(&header::ext::BITMAPS) {
        return unsupported("the image has persistent dirty bitmaps (or unknown autoclear features); snapshot operations would invalidate them");
    }
    Ok(img)
}

/// C's `strtoul(s, NULL, 10)` on an id, as qemu numbers snapshots.
fn strtoul(s: &[u8]) -> u64 {
    let s = cstr(s);
    let mut i = 0;
    while i < s.len() && (s[i] == b' ' || (9..=13).contains(&s[i])) {
        i += 1;
    }
    let neg = i < s.len() && s[i] == b'-';
    if i < s.len() && (s[i] == b'-' || s[i] == b'+') {
        i += 1;
    }
    let mut v: u64 = 0;
    let mut overflow = false;
    while i < s.len() && s[i].is_ascii_digit() {
        match v
            .checked_mul(10)
            .and_then(|x| x.checked_add(u64::from(s[i] - b'0')))
        {
            Some(x) => v = x,
            None => overflow = true,
        }
        i += 1;
    }
    if overflow {
        u64::MAX
    } else if neg {
        v.wrapping_neg()
    } else {
        v
    }
}

fn check_l1<S: StorageMut>(img: &Image<&S>, s: &Snapshot) -> Result<()> {
    if u64::from(s.l1_size) * 8 > header::MAX_L1_BYTES {
        return invalid(format!(
            "snapshot {:?} has an oversized L1 table",
            s.name_str()
        ));
    }
    if !s
        .l1_table_offset
        .is_multiple_of(img.header().cluster_size())
    {
        return invalid(format!(
            "snapshot {:?} has a misaligned L1 table",
            s.name_str()
        ));
    }
    Ok(())
}

fn l1_bytes(l1: &[u64]) -> Vec<u8> {
    l1.iter().flat_map(|e| e.to_be_bytes()).collect()
}

/// qemu's `qcow2_write_snapshots`: place and write the new table, commit
/// it in the header, then free the old one (written by the caller's next
/// flush).
fn write_table<S: StorageMut>(
    img: &mut Image<&S>,
    meta: &mut Meta<'_, S>,
    snaps: Vec<Snapshot>,
    hook: Hook<'_>,
) -> Result<()> {
    let size = snapshot::table_size(&snaps)?;
    let off = meta.alloc(size)?;
    for (at, b) in snapshot::encode_table(&snaps, off) {
        meta.write("snapshot table", at, b);
    }
    meta.flush(Order::RefcountsFirst)?;
    hook(Stage::TableWritten)?;
    let nb =
        u32::try_from(snaps.len()).map_err(|_| Error::BadRequest("too many snapshots".into()))?;
    let mut commit = [0u8; 12];
    commit[..4].copy_from_slice(&nb.to_be_bytes());
    commit[4..].copy_from_slice(&off.to_be_bytes());
    img.st
        .write_at(&commit, SNAPSHOT_FIELDS_OFFSET)
        .map_err(|source| Error::Write {
            what: "header",
            offset: SNAPSHOT_FIELDS_OFFSET,
            source,
        })?;
    img.st.sync().map_err(Error::Sync)?;
    hook(Stage::HeaderCommitted)?;
    let (old_off, old_size) = (img.header.snapshots_offset, img.snapshots_size);
    crate::alloc::done(meta.update_refcount(old_off, old_size, 1, true, true))?;
    img.header.nb_snapshots = nb;
    img.header.snapshots_offset = off;
    img.snapshots_size = size;
    img.snapshots = snaps;
    Ok(())
}

/// The snapshots of the image in `st`.
pub fn list<S: crate::storage::Storage>(st: &S) -> Result<Vec<Snapshot>> {
    Ok(Image::open(st)?.snapshots().to_vec())
}

/// Create an internal snapshot of the active image named `name`.
pub fn create<S: StorageMut>(
    st: &S,
    name: &str,
    time: SnapshotTime,
    hook: Hook<'_>,
) -> Result<Snapshot> {
    if name.len() > 255 {
        return Err(Error::BadRequest(
            "a snapshot name has at most 255 bytes".into(),
        ));
    }
    if name.contains('\0') {
        return Err(Error::BadRequest(
            "a snapshot name cannot contain NUL".into(),
        ));
    }
    let mut img = open_rw(st)?;
    if img.snapshots.len() >= MAX_SNAPSHOTS as usize {
        return Err(Error::BadRequest(format!(
            "the image already has {MAX_SNAPSHOTS} snapshots"
        )));
    }
    let id = img
        .snapshots
        .iter()
        .map(|s| strtoul(&s.id))
        .max()
        .unwrap_or(0)
        .wrapping_add(1);
    let mut meta = Meta::new(&img);
    let l1_len = img.l1.len() as u64 * 8;
    let l1_off = meta.alloc(l1_len)?;
    meta.write("snapshot L1 table", l1_off, l1_bytes(&img.l1));
    let mut active = img.l1.clone();
    if meta.snapshot_refcount_pass(&mut active, 1)? {
        meta.write(
            "active L1 table",
            img.header.l1_table_offset,
            l1_bytes(&active),
        );
    }
    meta.flush(Order::RefcountsFirst)?;
    hook(Stage::CopiedL1)?;
    img.l1 = active;
    let sn = Snapshot {
        l1_table_offset: l1_off,
        l1_size: img.header.l1_size,
        id: id.to_string().into_bytes(),
        name: name.as_bytes().to_vec(),
        date_sec: time.sec,
        date_nsec: time.nsec,
        vm_clock_nsec: 0,
        vm_state_size: 0,
        disk_size: img.header.sector_size(),
        icount: 0,
        extra_data_size: KNOWN_EXTRA,
        unknown_extra: Vec::new(),
    };
    let mut snaps = img.snapshots.clone();
    snaps.push(sn.clone());
    write_table(&mut img, &mut meta, snaps, hook)?;
    meta.flush(Order::TablesFirst)?;
    hook(Stage::OldTableFreed)?;
    Ok(sn)
}

/// Delete the first snapshot named `name`.
pub fn delete<S: StorageMut>(st: &S, name: &str, hook: Hook<'_>) -> Result<Snapshot> {
    let mut img = open_rw(st)?;
    let idx = img
        .snapshots
        .iter()
        .position(|s| cstr(&s.name) == name.as_bytes())
        .ok_or_else(|| Error::NoSnapshot(name.to_string()))?;
    let sn = img.snapshots[idx].clone();
    check_l1(&img, &sn)?;
    let mut snaps = img.snapshots.clone();
    snaps.remove(idx);
    let mut meta = Meta::new(&img);
    write_table(&mut img, &mut meta, snaps, hook)?;
    let mut snl1 = read_u64s(
        st,
        "snapshot L1 table",
        sn.l1_table_offset,
        u64::from(sn.l1_size),
        img.file_len,
    )?;
    meta.snapshot_refcount_pass(&mut snl1, -1)?;
    crate::alloc::done(meta.update_refcount(
        sn.l1_table_offset,
        u64::from(sn.l1_size) * 8,
        1,
        true,
        true,
    ))?;
    let mut active = img.l1.clone();
    if meta.snapshot_refcount_pass(&mut active, 0)? {
        meta.write(
            "active L1 table",
            img.header.l1_table_offset,
            l1_bytes(&active),
        );
    }
    meta.flush(Order::TablesFirst)?;
    hook(Stage::Released)?;
    Ok(sn)
}

/// Revert the active image to a snapshot found by id, else by name.
pub fn apply<S: StorageMut>(st: &S, id_or_name: &str, hook: Hook<'_>) -> Result<Snapshot> {
    let mut img = open_rw(st)?;
    let key = id_or_name.as_bytes();
    let idx = img
        .snapshots
        .iter()
        .position(|s| cstr(&s.id) == key)
        .or_else(|| img.snapshots.iter().position(|s| cstr(&s.name) == key))
        .ok_or_else(|| Error::NoSnapshot(id_or_name.to_string()))?;
    let sn = img.snapshots[idx].clone();
    check_l1(&img, &sn)?;
    if sn.disk_size != img.header.sector_size() {
        return unsupported(format!(
            "snapshot {:?} has a different disk size ({} bytes, the image has {}); resizing on apply is not supported",
            sn.name_str(),
            sn.disk_size,
            img.header.sector_size()
        ));
    }
    if sn.l1_size > img.header.l1_size {
        return unsupported("the snapshot's L1 table is larger than the active one");
    }
    let snl1 = read_u64s(
        st,
        "snapshot L1 table",
        sn.l1_table_offset,
        u64::from(sn.l1_size),
        img.file_len,
    )?;
    let mut new_active = snl1.clone();
    new_active.resize(img.l1.len(), 0);
    let mut meta = Meta::new(&img);
    let mut pass = snl1;
    if meta.snapshot_refcount_pass(&mut pass, 1)? {
        meta.write("snapshot L1 table", sn.l1_table_offset, l1_bytes(&pass));
    }
    meta.flush(Order::RefcountsFirst)?;
    hook(Stage::RefcountsRaised)?;
    // The commit. The snapshot's L1 may carry COPIED flags from when it
    // was taken; every table it reaches now has a second reference, so the
    // committed copy goes without them (qemu writes them and fixes them in
    // its last pass, leaving a window that `qemu-img check` calls corrupt).
    let committed: Vec<u64> = new_active.iter().map(|e| e & !l2::COPIED).collect();
    meta.write(
        "active L1 table",
        img.header.l1_table_offset,
        l1_bytes(&committed),
    );
    meta.flush(Order::TablesFirst)?;
    hook(Stage::ActiveL1Replaced)?;
    let mut old = std::mem::replace(&mut img.l1, new_active);
    meta.snapshot_refcount_pass(&mut old, -1)?;
    let mut active = img.l1.clone();
    meta.snapshot_refcount_pass(&mut active, 0)?;
    if active != committed {
        meta.write(
            "active L1 table",
            img.header.l1_table_offset,
            l1_bytes(&active),
        );
    }
    meta.flush(Order::TablesFirst)?;
    hook(Stage::OldActiveReleased)?;
    Ok(sn)
}

#[cfg(test)]
mod tests {
    use super::strtoul;

    #[test]
    fn ids_are_numbered_like_strtoul() {
        assert_eq!(strtoul(b"12"), 12);
        assert_eq!(strtoul(b"  7abc"), 7);
        assert_eq!(strtoul(b"snap"), 0);
        assert_eq!(strtoul(b"99999999999999999999999"), u64::MAX);
    }
}
