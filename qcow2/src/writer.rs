//! Writing a new qcow2 v3 image from states that share data: the active
//! image plus internal snapshots, where equal clusters become one host
//! cluster with the right refcount and COPIED flags.
//!
//! The caller describes each state as a list of data ids per guest cluster
//! (`None` reads as zeroes and stays unallocated); equal ids are the same
//! bytes. The layout is fixed and simple:
//!
//! ```text
//! [header][data clusters, by id][L2 tables][L1 tables][snapshot table]
//! [refcount blocks][refcount table]
//! ```
//!
//! L2 tables whose entries are equal are shared between states as well.
//! Everything but the header is written first and synced; the header goes
//! last, so a crash leaves a file without a valid header (the caller writes
//! to a temporary name and renames).

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::header::MAGIC;
use crate::l2::COPIED;
use crate::ops::SnapshotTime;
use crate::refcount;
use crate::snapshot::{self, Snapshot, KNOWN_EXTRA};
use crate::storage::StorageMut;

/// One state of the image: a snapshot (with a name) or the active image.
#[derive(Debug, Clone)]
pub struct State {
    /// Snapshot name; `None` for the active image (give it last).
    pub name: Option<String>,
    /// Guest size in bytes.
    pub size: u64,
    pub date: SnapshotTime,
    /// One entry per guest cluster: the data id holding its bytes.
    pub clusters: Vec<Option<u32>>,
}

/// What was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub data_clusters: u64,
    pub l2_tables: u64,
    pub file_clusters: u64,
}

const ORDER: u32 = 4; // 16-bit refcounts

fn w<S: StorageMut>(st: &S, what: &'static str, off: u64, b: &[u8]) -> Result<()> {
    st.write_at(b, off).map_err(|source| Error::Write {
        what,
        offset: off,
        source,
    })
}

/// Write the image. `data_ids` is the number of distinct data ids;
/// `copy(id, host_offset)` must place that id's bytes (one cluster, or
/// less at the end of a state) at `host_offset`. Snapshots are numbered
/// 1, 2, ... in the order given.
pub fn write<S: StorageMut>(
    st: &S,
    cluster_bits: u32,
    states: &[State],
    data_ids: u32,
    copy: &mut dyn FnMut(u32, u64) -> std::io::Result<()>,
) -> Result<Written> {
    let cs = 1u64 << cluster_bits;
    let l2n = cs / 8;
    let Some((active, snaps)) = states.split_last() else {
        return Err(Error::BadRequest("nothing to write".into()));
    };
    if active.name.is_some() || snaps.iter().any(|s| s.name.is_none()) {
        return Err(Error::BadRequest(
            "the active image must come last and only once".into(),
        ));
    }
    // L2 tables, shared when equal; per state its L1 (table ids).
    let mut tables: Vec<Vec<Option<u32>>> = Vec::new();
    let mut table_ids: HashMap<Vec<Option<u32>>, u32> = HashMap::new();
    let mut l1s: Vec<Vec<Option<u32>>> = Vec::new();
    for s in states {
        let l1_size = s.size.div_ceil(l2n * cs);
        let mut l1 = Vec::new();
        for i in 0..l1_size {
            let from = usize::try_from(i * l2n)
                .unwrap_or(usize::MAX)
                .min(s.clusters.len());
            let to = usize::try_from((i + 1) * l2n)
                .unwrap_or(usize::MAX)
                .min(s.clusters.len());
            let mut entries = s.clusters[from..to].to_vec();
            if entries.iter().all(Option::is_none) {
                l1.push(None);
                continue;
            }
            entries.resize(usize::try_from(l2n).unwrap_or(0), None);
            let next = u32::try_from(tables.len())
                .map_err(|_| Error::BadRequest("too many L2 tables".into()))?;
            let id = *table_ids.entry(entries.clone()).or_insert_with(|| {
                tables.push(entries);
                next
            });
            l1.push(Some(id));
        }
        l1s.push(l1);
    }
    // Refcounts: a table per L1 entry reaching it, data per L2 entry per
    // reaching L1 entry (qemu counts references from every tree).
    let mut table_rc = vec![0u64; tables.len()];
    for t in l1s.iter().flatten().flatten() {
        table_rc[*t as usize] += 1;
    }
    let mut data_rc = vec![0u64; data_ids as usize];
    for (t, entries) in tables.iter().enumerate() {
        for d in entries.iter().flatten() {
            *data_rc
                .get_mut(*d as usize)
                .ok_or_else(|| Error::BadRequest("a data id out of range".into()))? += table_rc[t];
        }
    }
    if data_rc
        .iter()
        .chain(&table_rc)
        .any(|&r| r > refcount::max(ORDER))
    {
        return Err(Error::BadRequest(
            "a cluster would be shared more than 65535 times".into(),
        ));
    }
    // Layout.
    let data0 = 1u64;
    let l2_0 = data0 + u64::from(data_ids);
    let mut next = l2_0 + tables.len() as u64;
    let mut l1_at = Vec::new();
    for l1 in &l1s {
        l1_at.push(next);
        next += (l1.len() as u64 * 8).div_ceil(cs).max(1);
    }
    let host_of_data = |d: u32| (data0 + u64::from(d)) * cs;
    let host_of_table = |t: u32| (l2_0 + u64::from(t)) * cs;
    // Snapshot table.
    let mut table = Vec::new();
    for (k, s) in snaps.iter().enumerate() {
        table.push(Snapshot {
            l1_table_offset: l1_at[k] * cs,
            l1_size: u32::try_from(l1s[k].len())
                .map_err(|_| Error::BadRequest("disk too large".into()))?,
            id: (k + 1).to_string().into_bytes(),
            name: s.name.clone().unwrap_or_default().into_bytes(),
            date_sec: s.date.sec,
            date_nsec: s.date.nsec,
            vm_clock_nsec: 0,
            vm_state_size: 0,
            disk_size: s.size,
            icount: u64::MAX,
            extra_data_size: KNOWN_EXTRA,
            unknown_extra: Vec::new(),
        });
    }
    let table_size = snapshot::table_size(&table)?;
    let table_at = next;
    next += table_size.div_ceil(cs);
    // Refcount blocks and table at the end, sized by fixed point.
    let per_block = (cs * 8) >> ORDER;
    let (mut blocks, mut rt_clusters) = (0u64, 1u64);
    loop {
        let total = next + blocks + rt_clusters;
        let b = total.div_ceil(per_block);
        let r = (b * 8).div_ceil(cs).max(1);
        if b == blocks && r == rt_clusters {
            break;
        }
        (blocks, rt_clusters) = (b, r);
    }
    let rb_at = next;
    let rt_at = rb_at + blocks;
    let total = rt_at + rt_clusters;
    // Data.
    for d in 0..data_ids {
        copy(d, host_of_data(d)).map_err(|source| Error::Write {
            what: "data cluster",
            offset: host_of_data(d),
            source,
        })?;
    }
    // L2 tables.
    for (t, entries) in tables.iter().enumerate() {
        let mut b = Vec::with_capacity(usize::try_from(cs).unwrap_or(0));
        for e in entries {
            let v = e.map_or(0, |d| {
                host_of_data(d) | if data_rc[d as usize] == 1 { COPIED } else { 0 }
            });
            b.extend_from_slice(&v.to_be_bytes());
        }
        #[allow(clippy::cast_possible_truncation)] // t < u32 by construction
        w(st, "L2 table", host_of_table(t as u32), &b)?;
    }
    // L1 tables.
    for (k, l1) in l1s.iter().enumerate() {
        let b: Vec<u8> = l1
            .iter()
            .flat_map(|e| {
                e.map_or(0, |t| {
                    host_of_table(t) | if table_rc[t as usize] == 1 { COPIED } else { 0 }
                })
                .to_be_bytes()
            })
            .collect();
        if !b.is_empty() {
            w(st, "L1 table", l1_at[k] * cs, &b)?;
        }
    }
    for (at, b) in snapshot::encode_table(&table, table_at * cs) {
        w(st, "snapshot table", at, &b)?;
    }
    // Refcounts.
    let mut rc = vec![
        0u64;
        usize::try_from(total)
            .map_err(|_| Error::BadRequest("image too large".into()))?
    ];
    rc[0] = 1;
    for (d, r) in data_rc.iter().enumerate() {
        rc[usize::try_from(data0).unwrap_or(0) + d] = *r;
    }
    for (t, r) in table_rc.iter().enumerate() {
        rc[usize::try_from(l2_0).unwrap_or(0) + t] = *r;
    }
    let meta_from = usize::try_from(l2_0).unwrap_or(0) + tables.len();
    for r in rc.iter_mut().skip(meta_from) {
        *r = 1;
    }
    let mut reftable = Vec::new();
    for b in 0..blocks {
        let mut block = vec![0u8; usize::try_from(cs).unwrap_or(0)];
        for i in 0..per_block {
            let c = b * per_block + i;
            if let Some(&v) = usize::try_from(c).ok().and_then(|c| rc.get(c)) {
                refcount::set(&mut block, ORDER, i, v);
            }
        }
        w(st, "refcount block", (rb_at + b) * cs, &block)?;
        reftable.extend_from_slice(&((rb_at + b) * cs).to_be_bytes());
    }
    reftable.resize(usize::try_from(rt_clusters * cs).unwrap_or(0), 0);
    w(st, "refcount table", rt_at * cs, &reftable)?;
    st.sync().map_err(Error::Sync)?;
    // The header, last.
    let mut h = vec![0u8; 120];
    h[0..4].copy_from_slice(&MAGIC.to_be_bytes());
    h[4..8].copy_from_slice(&3u32.to_be_bytes());
    h[20..24].copy_from_slice(&cluster_bits.to_be_bytes());
    h[24..32].copy_from_slice(&active.size.to_be_bytes());
    h[36..40].copy_from_slice(
        &u32::try_from(l1s[snaps.len()].len())
            .unwrap_or(0)
            .to_be_bytes(),
    );
    h[40..48].copy_from_slice(&(l1_at[snaps.len()] * cs).to_be_bytes());
    h[48..56].copy_from_slice(&(rt_at * cs).to_be_bytes());
    h[56..60].copy_from_slice(&u32::try_from(rt_clusters).unwrap_or(0).to_be_bytes());
    h[60..64].copy_from_slice(&u32::try_from(snaps.len()).unwrap_or(0).to_be_bytes());
    h[64..72].copy_from_slice(&(if snaps.is_empty() { 0 } else { table_at * cs }).to_be_bytes());
    h[96..100].copy_from_slice(&ORDER.to_be_bytes());
    h[100..104].copy_from_slice(&112u32.to_be_bytes());
    // h[112..120]: the end-of-extensions marker, zero.
    w(st, "header", 0, &h)?;
    if st.len().map_err(|source| Error::Read {
        what: "file size",
        offset: 0,
        source,
    })? < total * cs
    {
        // Make the last cluster whole (the refcount table is written whole,
        // so this only matters for an empty tail).
        w(st, "refcount table", total * cs - 1, &[0])?;
    }
    st.sync().map_err(Error::Sync)?;
    Ok(Written {
        data_clusters: u64::from(data_ids),
        l2_tables: tables.len() as u64,
        file_clusters: total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::image::{Image, View};
    use crate::storage::MemStorage;

    #[test]
    fn shared_data_is_written_once_and_reads_back_per_state() {
        let cs = 512u64;
        let st = MemStorage::default();
        let t = SnapshotTime { sec: 1, nsec: 0 };
        let states = vec![
            State {
                name: Some("a".into()),
                size: 4 * cs,
                date: t,
                clusters: vec![Some(0), None, Some(1), None],
            },
            State {
                name: Some("b".into()),
                size: 4 * cs,
                date: t,
                clusters: vec![Some(0), Some(2), Some(1), None],
            },
            State {
                name: None,
                size: 4 * cs,
                date: t,
                clusters: vec![Some(3), Some(2), Some(1), None],
            },
        ];
        let mut copy = |d: u32, at: u64| st.write_at(&[u8::try_from(d + 1).unwrap(); 512], at);
        let written = write(&st, 9, &states, 4, &mut copy).unwrap();
        assert_eq!(written.data_clusters, 4);
        let img = Image::open(&st).unwrap();
        assert_eq!(img.snapshots().len(), 2);
        let mut buf = vec![0u8; 4 * 512];
        for (view, want) in [
            (View::Snapshot(0), [1u8, 0, 2, 0]),
            (View::Snapshot(1), [1, 3, 2, 0]),
            (View::Active, [4, 3, 2, 0]),
        ] {
            img.read(view, 0, &mut buf).unwrap();
            for (c, w) in want.iter().enumerate() {
                assert!(
                    buf[c * 512..(c + 1) * 512].iter().all(|b| b == w),
                    "{view:?} cluster {c}"
                );
            }
        }
    }
}
