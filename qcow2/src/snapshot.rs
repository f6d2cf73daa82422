//! The internal snapshot table: decoding with qemu's rules for extra data,
//! and encoding as qemu writes it.
//!
//! Each entry is a 40-byte fixed part, `extra_data_size` bytes of extra
//! data, the id and the name, and starts 8-byte aligned. Extra data fields
//! are revealed progressively: `vm_state_size_large` exists when the extra
//! data holds 8 bytes, `disk_size` at 16, `icount` at 24; an absent
//! `disk_size` means the active image's size and an absent `icount` is -1.
//! Unknown extra data past 24 bytes is kept and written back unchanged.
//! qemu refuses to open an image whose entry carries more than 1024 bytes
//! of extra data (until `qemu-img check -r all` drops them); so do we.

use crate::error::{invalid, Error, Result};
use crate::storage::Storage;

/// qemu's bound on one entry's extra data.
pub const MAX_EXTRA_DATA: u32 = 1024;
/// qemu's bound on the whole table.
pub const MAX_TABLE_BYTES: u64 = 1024 * 65536;
/// The extra data qemu writes: vm_state_size_large, disk_size, icount.
pub const KNOWN_EXTRA: u32 = 24;

/// One internal snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub l1_table_offset: u64,
    pub l1_size: u32,
    /// The id, as stored (qemu's are decimal numbers).
    pub id: Vec<u8>,
    pub name: Vec<u8>,
    pub date_sec: u32,
    pub date_nsec: u32,
    pub vm_clock_nsec: u64,
    pub vm_state_size: u64,
    /// Virtual disk size when the snapshot was taken.
    pub disk_size: u64,
    /// -1 (all ones) when not recorded.
    pub icount: u64,
    /// As stored; qemu rewrites it as at least 24.
    pub extra_data_size: u32,
    /// Extra data past the 24 known bytes, kept verbatim.
    pub unknown_extra: Vec<u8>,
}

impl Snapshot {
    /// The id as text.
    pub fn id_str(&self) -> String {
        String::from_utf8_lossy(cstr(&self.id)).into_owned()
    }

    /// The name as text.
    pub fn name_str(&self) -> String {
        String::from_utf8_lossy(cstr(&self.name)).into_owned()
    }
}

/// The bytes up to the first NUL: what qemu's C strings keep.
pub fn cstr(b: &[u8]) -> &[u8] {
    b.iter().position(|&c| c == 0).map_or(b, |n| &b[..n])
}

fn rd<S: Storage + ?Sized>(st: &S, buf: &mut [u8], offset: u64) -> Result<()> {
    st.read_at(buf, offset).map_err(|source| Error::Read {
        what: "snapshot table",
        offset,
        source,
    })
}

/// Read `nb` entries starting at `offset`. `disk_size` stands in for
/// entries that do not record theirs; `file_len` bounds the table. Returns
/// the snapshots and the table's length in bytes (qemu's
/// `snapshots_size`: up to the end of the last name).
pub fn read_table<S: Storage + ?Sized>(
    st: &S,
    offset: u64,
    nb: u32,
    disk_size: u64,
    file_len: u64,
) -> Result<(Vec<Snapshot>, u64)> {
    let mut out = Vec::new();
    let mut at = offset;
    for i in 0..nb {
        at = at.div_ceil(8) * 8;
        if at - offset > MAX_TABLE_BYTES {
            return invalid("the snapshot table is larger than 64 MiB");
        }
        if at.saturating_add(40) > file_len {
            return invalid(format!(
                "snapshot table entry {i} lies past the end of the file"
            ));
        }
        let mut h = [0u8; 40];
        rd(st, &mut h, at)?;
        let u64at = |o: usize| u64::from_be_bytes(h[o..o + 8].try_into().unwrap_or([0; 8]));
        let u32at = |o: usize| u32::from_be_bytes(h[o..o + 4].try_into().unwrap_or([0; 4]));
        let u16at = |o: usize| u16::from_be_bytes(h[o..o + 2].try_into().unwrap_or([0; 2]));
        let extra_data_size = u32at(36);
        if extra_data_size > MAX_EXTRA_DATA {
            return invalid(format!(
                "snapshot table entry {i} has {extra_data_size} bytes of extra data (qemu allows {MAX_EXTRA_DATA}; `qemu-img check -r all` drops the excess)"
            ));
        }
        let id_len = u64::from(u16at(12));
        let name_len = u64::from(u16at(14));
        let entry_len = 40 + u64::from(extra_data_size) + id_len + name_len;
        if at + entry_len > file_len {
            return invalid(format!(
                "snapshot table entry {i} lies past the end of the file"
            ));
        }
        if at + entry_len - offset > MAX_TABLE_BYTES {
            return invalid("the snapshot table is larger than 64 MiB");
        }
        let mut rest = vec![
            0u8;
            usize::try_from(entry_len - 40)
                .map_err(|_| Error::Invalid("entry too large".into()))?
        ];
        rd(st, &mut rest, at + 40)?;
        let (extra, names) = rest.split_at(extra_data_size as usize);
        let (id, name) = names.split_at(usize::from(u16at(12)));
        let ex = |o: usize| u64::from_be_bytes(extra[o..o + 8].try_into().unwrap_or([0; 8]));
        let mut vm_state_size = u64::from(u32at(32));
        if extra_data_size >= 8 {
            vm_state_size = ex(0);
        }
        let disk_size = if extra_data_size >= 16 {
            ex(8)
        } else {
            disk_size
        };
        let icount = if extra_data_size >= 24 {
            ex(16)
        } else {
            u64::MAX
        };
        let unknown_extra = if extra_data_size > KNOWN_EXTRA {
            extra[KNOWN_EXTRA as usize..].to_vec()
        } else {
            Vec::new()
        };
        out.push(Snapshot {
            l1_table_offset: u64at(0),
            l1_size: u32at(8),
            id: id.to_vec(),
            name: name.to_vec(),
            date_sec: u32at(16),
            date_nsec: u32at(20),
            vm_clock_nsec: u64at(24),
            vm_state_size,
            disk_size,
            icount,
            extra_data_size,
            unknown_extra,
        });
        at += entry_len;
    }
    Ok((out, if nb == 0 { 0 } else { at - offset }))
}

/// The table's size as qemu computes it before writing.
pub fn table_size(snaps: &[Snapshot]) -> Result<u64> {
    let mut off = 0u64;
    for s in snaps {
        off = off.div_ceil(8) * 8;
        off += 40
            + u64::from(s.extra_data_size.max(KNOWN_EXTRA))
            + cstr(&s.id).len() as u64
            + cstr(&s.name).len() as u64;
        if off > MAX_TABLE_BYTES {
            return Err(Error::BadRequest(
                "the snapshot table would exceed qemu's 64 MiB limit".into(),
            ));
        }
    }
    Ok(off)
}

/// The byte ranges qemu writes for a table placed at `base`: (offset,
/// bytes). The 8-byte alignment gaps between entries are not written.
pub fn encode_table(snaps: &[Snapshot], base: u64) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut off = base;
    for s in snaps {
        off = off.div_ceil(8) * 8;
        let id = cstr(&s.id);
        let name = cstr(&s.name);
        let extra = s.extra_data_size.max(KNOWN_EXTRA);
        let mut b = Vec::with_capacity(64 + id.len() + name.len() + s.unknown_extra.len());
        b.extend_from_slice(&s.l1_table_offset.to_be_bytes());
        b.extend_from_slice(&s.l1_size.to_be_bytes());
        #[allow(clippy::cast_possible_truncation)] // lengths came from u16 fields or were checked
        {
            b.extend_from_slice(&(id.len() as u16).to_be_bytes());
            b.extend_from_slice(&(name.len() as u16).to_be_bytes());
        }
        b.extend_from_slice(&s.date_sec.to_be_bytes());
        b.extend_from_slice(&s.date_nsec.to_be_bytes());
        b.extend_from_slice(&s.vm_clock_nsec.to_be_bytes());
        let small = u32::try_from(s.vm_state_size).unwrap_or(0);
        b.extend_from_slice(&small.to_be_bytes());
        b.extend_from_slice(&extra.to_be_bytes());
        b.extend_from_slice(&s.vm_state_size.to_be_bytes());
        b.extend_from_slice(&s.disk_size.to_be_bytes());
        b.extend_from_slice(&s.icount.to_be_bytes());
        b.extend_from_slice(&s.unknown_extra);
        b.extend_from_slice(id);
        b.extend_from_slice(name);
        let len = b.len() as u64;
        out.push((off, b));
        off += len;
    }
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn snap(name: &str, extra: u32) -> Snapshot {
        Snapshot {
            l1_table_offset: 0x30000,
            l1_size: 2,
            id: b"1".to_vec(),
            name: name.as_bytes().to_vec(),
            date_sec: 5,
            date_nsec: 6000,
            vm_clock_nsec: 0,
            vm_state_size: 0,
            disk_size: 1 << 20,
            icount: 0,
            extra_data_size: extra,
            unknown_extra: vec![9; extra.saturating_sub(24) as usize],
        }
    }

    fn flat(parts: &[(u64, Vec<u8>)], base: u64) -> Vec<u8> {
        let mut v = Vec::new();
        for (o, b) in parts {
            let start = usize::try_from(o - base).unwrap();
            v.resize(start, 0);
            v.extend_from_slice(b);
        }
        v
    }

    #[test]
    fn encode_then_read_round_trips_with_unknown_extra_data() {
        let snaps = vec![snap("a", 24), snap("second", 40), snap("c", 24)];
        let bytes = flat(&encode_table(&snaps, 0), 0);
        assert_eq!(bytes.len() as u64, table_size(&snaps).unwrap());
        let (back, len) = read_table(bytes.as_slice(), 0, 3, 7, bytes.len() as u64).unwrap();
        assert_eq!(back, snaps);
        assert_eq!(len, bytes.len() as u64);
    }

    #[test]
    fn absent_extra_fields_take_qemus_defaults() {
        let mut s = snap("old", 24);
        s.extra_data_size = 0;
        let mut bytes = flat(&encode_table(&[s], 0), 0);
        // Rewrite as a v2-era entry: no extra data at all.
        bytes[36..40].copy_from_slice(&0u32.to_be_bytes());
        bytes.drain(40..64);
        let (back, _) = read_table(bytes.as_slice(), 0, 1, 777, bytes.len() as u64).unwrap();
        assert_eq!(back[0].disk_size, 777);
        assert_eq!(back[0].icount, u64::MAX);
        assert_eq!(back[0].name, b"old");
    }

    #[test]
    fn too_much_extra_data_is_refused() {
        let s = snap("x", 24);
        let mut bytes = flat(&encode_table(&[s], 0), 0);
        bytes[36..40].copy_from_slice(&1100u32.to_be_bytes());
        bytes.resize(2000, 0);
        let e = read_table(bytes.as_slice(), 0, 1, 0, 2000)
            .unwrap_err()
            .to_string();
        assert!(e.contains("extra data"), "{e}");
    }

    proptest! {
        #[test]
        fn arbitrary_tables_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..1500), nb in 0u32..70000) {
            let _ = read_table(bytes.as_slice(), 0, nb, 0, bytes.len() as u64);
        }
    }
}
