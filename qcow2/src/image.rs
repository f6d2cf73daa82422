//! An opened qcow2 image: header, active L1 table, refcount table and
//! snapshot table, with reads of the active image or of any snapshot.
//!
//! Opening validates every table's placement against the file (a table
//! past the end of the file is an error), so what this allocates is
//! bounded by the file's size and qemu's table limits.

use crate::compress;
use crate::error::{invalid, Error, Result};
use crate::header::Header;
use crate::l2::{self, Mapping};
use crate::snapshot::{self, Snapshot};
use crate::storage::Storage;

/// Which guest view to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// The active image.
    Active,
    /// Internal snapshot number `i` (index into [`Image::snapshots`]).
    Snapshot(usize),
}

/// An opened image over some storage.
#[derive(Debug)]
pub struct Image<S> {
    pub(crate) st: S,
    pub(crate) header: Header,
    pub(crate) l1: Vec<u64>,
    pub(crate) reftable: Vec<u64>,
    pub(crate) snapshots: Vec<Snapshot>,
    pub(crate) snapshots_size: u64,
    pub(crate) file_len: u64,
}

pub(crate) fn read_u64s<S: Storage + ?Sized>(
    st: &S,
    what: &'static str,
    offset: u64,
    n: u64,
    file_len: u64,
) -> Result<Vec<u64>> {
    let bytes = n
        .checked_mul(8)
        .ok_or_else(|| Error::Invalid(format!("the {what} is too large")))?;
    if offset.checked_add(bytes).is_none_or(|end| end > file_len) {
        return invalid(format!("the {what} lies past the end of the file"));
    }
    let len =
        usize::try_from(bytes).map_err(|_| Error::Invalid(format!("the {what} is too large")))?;
    let mut buf = vec![0u8; len];
    st.read_at(&mut buf, offset).map_err(|source| Error::Read {
        what,
        offset,
        source,
    })?;
    Ok(buf
        .chunks_exact(8)
        .map(|c| u64::from_be_bytes(c.try_into().unwrap_or([0; 8])))
        .collect())
}

impl<S: Storage> Image<S> {
    /// Open and validate an image.
    pub fn open(st: S) -> Result<Self> {
        let file_len = st.len().map_err(|source| Error::Read {
            what: "file size",
            offset: 0,
            source,
        })?;
        let mut prefix = [0u8; Header::PREFIX];
        st.read_at(&mut prefix, 0).map_err(|source| Error::Read {
            what: "header",
            offset: 0,
            source,
        })?;
        if file_len < 72 {
            return invalid("the file is shorter than a qcow2 header");
        }
        // Peek at cluster_bits to read the whole first cluster (extensions).
        let cb = u32::from_be_bytes(prefix[20..24].try_into().unwrap_or([0; 4]));
        let first_len = if (9..=21).contains(&cb) {
            (1u64 << cb).min(file_len)
        } else {
            Header::PREFIX as u64
        };
        #[allow(clippy::cast_possible_truncation)] // at most 2 MiB
        let mut first = vec![0u8; (first_len as usize).max(Header::PREFIX)];
        st.read_at(&mut first, 0).map_err(|source| Error::Read {
            what: "header",
            offset: 0,
            source,
        })?;
        let header = Header::decode(&first)?;
        let l1 = read_u64s(
            &st,
            "L1 table",
            header.l1_table_offset,
            u64::from(header.l1_size),
            file_len,
        )?;
        let rt_entries = u64::from(header.refcount_table_clusters) * header.cluster_size() / 8;
        let reftable = read_u64s(
            &st,
            "refcount table",
            header.refcount_table_offset,
            rt_entries,
            file_len,
        )?;
        let (snapshots, snapshots_size) = snapshot::read_table(
            &st,
            header.snapshots_offset,
            header.nb_snapshots,
            header.sector_size(),
            file_len,
        )?;
        Ok(Image {
            st,
            header,
            l1,
            reftable,
            snapshots,
            snapshots_size,
            file_len,
        })
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The internal snapshots, in table order.
    pub fn snapshots(&self) -> &[Snapshot] {
        &self.snapshots
    }

    /// The underlying storage.
    pub fn storage(&self) -> &S {
        &self.st
    }

    /// Give the storage back.
    pub fn into_storage(self) -> S {
        self.st
    }

    /// Guest size of a view in bytes.
    pub fn size(&self, view: View) -> Result<u64> {
        match view {
            View::Active => Ok(self.header.size),
            View::Snapshot(i) => Ok(self.snap(i)?.disk_size),
        }
    }

    fn snap(&self, i: usize) -> Result<&Snapshot> {
        self.snapshots
            .get(i)
            .ok_or_else(|| Error::NoSnapshot(format!("#{i}")))
    }

    /// The L1 table of a view.
    pub fn l1_table(&self, view: View) -> Result<Vec<u64>> {
        match view {
            View::Active => Ok(self.l1.clone()),
            View::Snapshot(i) => {
                let s = self.snap(i)?;
                if u64::from(s.l1_size) * 8 > crate::header::MAX_L1_BYTES {
                    return invalid("a snapshot's L1 table is too large");
                }
                if s.l1_table_offset % self.header.cluster_size() != 0 {
                    return invalid("a snapshot's L1 table is not cluster aligned");
                }
                read_u64s(
                    &self.st,
                    "snapshot L1 table",
                    s.l1_table_offset,
                    u64::from(s.l1_size),
                    self.file_len,
                )
            }
        }
    }

    /// Where guest cluster `vc` of the view with L1 table `l1` lives.
    pub fn mapping(&self, l1: &[u64], vc: u64) -> Result<Mapping> {
        let h = &self.header;
        let l1i = vc >> h.l2_bits();
        let Some(&l1e) = usize::try_from(l1i).ok().and_then(|i| l1.get(i)) else {
            return Ok(Mapping::Zero);
        };
        let l2_off = l1e & l2::L1_OFFSET_MASK;
        if l2_off == 0 {
            return Ok(Mapping::Zero);
        }
        if !l2_off.is_multiple_of(h.cluster_size()) {
            return invalid(format!("an L2 table at {l2_off:#x} is not cluster aligned"));
        }
        let idx = vc & ((1u64 << h.l2_bits()) - 1);
        let at = l2_off + idx * h.l2_entry_size();
        let mut e = [0u8; 16];
        let n = usize::try_from(h.l2_entry_size()).unwrap_or(8);
        self.st
            .read_at(&mut e[..n], at)
            .map_err(|source| Error::Read {
                what: "L2 table",
                offset: at,
                source,
            })?;
        let entry = u64::from_be_bytes(e[..8].try_into().unwrap_or([0; 8]));
        let bitmap = u64::from_be_bytes(e[8..].try_into().unwrap_or([0; 8]));
        l2::decode(entry, bitmap, h.cluster_bits, h.extended_l2())
    }

    /// Read one whole guest cluster given its mapping into `out` (one
    /// cluster long).
    pub fn read_mapped(&self, m: Mapping, out: &mut [u8]) -> Result<()> {
        let h = &self.header;
        let cs = h.cluster_size();
        match m {
            Mapping::Zero => out.fill(0),
            Mapping::Data { host } => self.st.read_at(out, host).map_err(|source| Error::Read {
                what: "data cluster",
                offset: host,
                source,
            })?,
            Mapping::Compressed { host, len } => {
                let len = usize::try_from(len).unwrap_or(0);
                let mut c = vec![0u8; len];
                self.st
                    .read_at(&mut c, host)
                    .map_err(|source| Error::Read {
                        what: "compressed cluster",
                        offset: host,
                        source,
                    })?;
                compress::decompress(h.compression, &c, out)?;
            }
            Mapping::Sub { host, alloc } => {
                let sub = usize::try_from(cs / 32).unwrap_or(0);
                for (i, chunk) in out.chunks_mut(sub).enumerate() {
                    if alloc & (1 << i) != 0 {
                        let at = host + (i * sub) as u64;
                        self.st.read_at(chunk, at).map_err(|source| Error::Read {
                            what: "data cluster",
                            offset: at,
                            source,
                        })?;
                    } else {
                        chunk.fill(0);
                    }
                }
            }
        }
        Ok(())
    }

    /// Read guest bytes of a view at `offset`; past the view's size they
    /// read as zeroes.
    pub fn read(&self, view: View, offset: u64, buf: &mut [u8]) -> Result<()> {
        let l1 = self.l1_table(view)?;
        let cs = self.header.cluster_size();
        let mut cluster = vec![0u8; usize::try_from(cs).unwrap_or(0)];
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let vc = pos / cs;
            #[allow(clippy::cast_possible_truncation)] // < cluster size
            let within = (pos % cs) as usize;
            let n = (cluster.len() - within).min(buf.len() - done);
            let m = self.mapping(&l1, vc)?;
            self.read_mapped(m, &mut cluster)?;
            buf[done..done + n].copy_from_slice(&cluster[within..within + n]);
            done += n;
        }
        Ok(())
    }
}
