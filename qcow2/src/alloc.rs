//! qemu's refcount bookkeeping and cluster allocator, mirrored decision for
//! decision, with write-back caches flushed in explicit groups.
//!
//! Byte-identical results with `qemu-img snapshot` need the same placement
//! of every new cluster, so this follows qemu's algorithm exactly: a
//! `free_cluster_index` hint starting at 0 for each opened image, first-fit
//! search for a run of free clusters from the hint, a new refcount block
//! placed where it can describe itself (then the search restarts), the hint
//! lowered whenever a refcount drops to zero, freed clusters punched out
//! of the file (qemu discards them for snapshot operations), and a full
//! refcount table replaced by a larger one placed past everything in use.
//!
//! Nothing reaches the file until [`Meta::flush`]; a group's writes are
//! ordered (refcounts before tables when references are added, tables
//! before refcounts when they are dropped) and end with an fsync.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Error, Result};
use crate::image::Image;
use crate::l2::{self, Kind};
use crate::refcount;
use crate::storage::StorageMut;

/// Offset bits of refcount table entries.
pub const REFT_OFFSET_MASK: u64 = 0xffff_ffff_ffff_fe00;
/// qemu's largest cluster offset.
const MAX_CLUSTER_OFFSET: u64 = (1 << 56) - 1;

/// Control flow of the allocator: qemu's -EAGAIN ("a refcount block was
/// placed; search again") or an error.
#[derive(Debug)]
pub(crate) enum Flow {
    Again,
    Err(Error),
}

impl From<Error> for Flow {
    fn from(e: Error) -> Self {
        Flow::Err(e)
    }
}

type R<T> = std::result::Result<T, Flow>;

/// Turn a stray "search again" (impossible outside allocation) into an
/// error.
pub(crate) fn done<T>(r: R<T>) -> Result<T> {
    match r {
        Ok(v) => Ok(v),
        Err(Flow::Err(e)) => Err(e),
        Err(Flow::Again) => Err(Error::Invalid(
            "a referenced cluster has no refcount block".into(),
        )),
    }
}

fn bad<T>(msg: impl Into<String>) -> R<T> {
    Err(Flow::Err(Error::Invalid(msg.into())))
}

/// Which side of a group reaches the disk first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// References are being added: raise refcounts, then write tables.
    RefcountsFirst,
    /// References are being dropped: write tables, then lower refcounts.
    TablesFirst,
}

/// Mutable metadata of an image being changed.
#[derive(Debug)]
pub struct Meta<'a, S> {
    st: &'a S,
    cb: u32,
    cs: u64,
    order: u32,
    rb_bits: u32,
    extended: bool,
    l2_entries: u64,
    l2_esize: u64,
    reftable: Vec<u64>,
    reftable_offset: u64,
    refblocks: BTreeMap<u64, Vec<u8>>,
    dirty_rb: BTreeSet<u64>,
    dirty_rt: BTreeSet<usize>,
    l2: BTreeMap<u64, Vec<u8>>,
    dirty_l2: BTreeSet<u64>,
    writes: Vec<(&'static str, u64, Vec<u8>)>,
    freed: BTreeSet<u64>,
    punch_first: BTreeSet<u64>,
    free_cluster_index: u64,
    /// A grown refcount table not yet on disk: (offset, bytes, clusters).
    new_reftable: Option<(u64, Vec<u8>, u32)>,
}

impl<'a, S: StorageMut> Meta<'a, S> {
    /// Start editing an opened image.
    pub fn new(img: &Image<&'a S>) -> Self {
        let h = img.header();
        Meta {
            st: img.st,
            cb: h.cluster_bits,
            cs: h.cluster_size(),
            order: h.refcount_order,
            rb_bits: h.cluster_bits + 3 - h.refcount_order,
            extended: h.extended_l2(),
            l2_entries: 1 << h.l2_bits(),
            l2_esize: h.l2_entry_size(),
            reftable: img.reftable.clone(),
            reftable_offset: h.refcount_table_offset,
            refblocks: BTreeMap::new(),
            dirty_rb: BTreeSet::new(),
            dirty_rt: BTreeSet::new(),
            l2: BTreeMap::new(),
            dirty_l2: BTreeSet::new(),
            writes: Vec::new(),
            freed: BTreeSet::new(),
            punch_first: BTreeSet::new(),
            free_cluster_index: 0,
            new_reftable: None,
        }
    }

    fn read_cluster(&self, what: &'static str, off: u64) -> Result<Vec<u8>> {
        let mut b = vec![0u8; usize::try_from(self.cs).unwrap_or(0)];
        self.st.read_at(&mut b, off).map_err(|source| Error::Read {
            what,
            offset: off,
            source,
        })?;
        Ok(b)
    }

    fn load_rb(&mut self, off: u64) -> Result<()> {
        if !off.is_multiple_of(self.cs) {
            return Err(Error::Invalid(format!(
                "a refcount block at {off:#x} is not cluster aligned"
            )));
        }
        if !self.refblocks.contains_key(&off) {
            let b = self.read_cluster("refcount block", off)?;
            self.refblocks.insert(off, b);
        }
        Ok(())
    }

    /// Refcount of cluster `idx` (0 past the refcount table).
    pub fn get_refcount(&mut self, idx: u64) -> Result<u64> {
        let ti = idx >> self.rb_bits;
        let Some(&e) = usize::try_from(ti).ok().and_then(|t| self.reftable.get(t)) else {
            return Ok(0);
        };
        let off = e & REFT_OFFSET_MASK;
        if off == 0 {
            return Ok(0);
        }
        self.load_rb(off)?;
        let bi = idx & ((1 << self.rb_bits) - 1);
        Ok(self
            .refblocks
            .get(&off)
            .map_or(0, |b| refcount::get(b, self.order, bi)))
    }

    fn alloc_noref(&mut self, size: u64) -> R<u64> {
        let n = size.div_ceil(self.cs);
        'retry: loop {
            for _ in 0..n {
                let c = self.free_cluster_index;
                self.free_cluster_index += 1;
                if self.get_refcount(c)? != 0 {
                    continue 'retry;
                }
            }
            break;
        }
        if self.free_cluster_index > 0
            && self.free_cluster_index - 1 > (MAX_CLUSTER_OFFSET >> self.cb)
        {
            return Err(Flow::Err(Error::Unsupported(
                "the image is full (cluster offsets exhausted)".into(),
            )));
        }
        Ok((self.free_cluster_index - n) << self.cb)
    }

    /// Allocate clusters for `size` bytes with refcount 1 (qemu's
    /// `qcow2_alloc_clusters`).
    pub fn alloc(&mut self, size: u64) -> Result<u64> {
        loop {
            let off = done(self.alloc_noref(size))?;
            match self.update_refcount(off, size, 1, false, false) {
                Ok(()) => return Ok(off),
                Err(Flow::Again) => continue,
                Err(Flow::Err(e)) => return Err(e),
            }
        }
    }

    fn alloc_refcount_block(&mut self, idx: u64) -> R<u64> {
        let ti = idx >> self.rb_bits;
        let slot = usize::try_from(ti)
            .ok()
            .filter(|&t| t < self.reftable.len());
        if let Some(t) = slot {
            let off = self.reftable[t] & REFT_OFFSET_MASK;
            if off != 0 {
                self.load_rb(off)?;
                return Ok(off);
            }
        }
        let new_block = self.alloc_noref(self.cs)?;
        if new_block == 0 {
            return bad("a refcount block would be placed over the header");
        }
        let nb_idx = new_block >> self.cb;
        if nb_idx >> self.rb_bits == ti {
            let mut b = vec![0u8; usize::try_from(self.cs).unwrap_or(0)];
            refcount::set(&mut b, self.order, nb_idx & ((1 << self.rb_bits) - 1), 1);
            self.refblocks.insert(new_block, b);
        } else {
            self.update_refcount(new_block, self.cs, 1, false, false)?;
            self.refblocks
                .insert(new_block, vec![0u8; usize::try_from(self.cs).unwrap_or(0)]);
        }
        self.dirty_rb.insert(new_block);
        self.note_allocated(new_block);
        if let Some(t) = slot {
            self.reftable[t] = new_block;
            self.dirty_rt.insert(t);
            return Err(Flow::Again);
        }
        // The refcount table is full: build a larger one (and the blocks
        // it needs) past everything in use, as qemu does.
        let rb_size = 1u64 << self.rb_bits;
        let blocks_used = (idx + 1).max(nb_idx + 1).div_ceil(rb_size);
        self.refcount_area(blocks_used * rb_size * self.cs, ti, new_block)?;
        Err(Flow::Again)
    }

    /// qemu's `qcow2_refcount_metadata_size` (generous): refcount blocks
    /// needed to describe `clusters` clusters plus themselves and a table
    /// grown by half.
    fn refblocks_needed(&self, mut clusters: u64) -> u64 {
        let per_table_cluster = self.cs / 8;
        let per_block = 1u64 << self.rb_bits;
        let (mut table, mut blocks, mut n) = (0u64, 0u64, 0u64);
        let mut generous = true;
        loop {
            let last = n;
            blocks = (clusters + table + blocks).div_ceil(per_block);
            table = blocks.div_ceil(per_table_cluster);
            n = clusters + blocks + table;
            if n == last && generous {
                clusters += table.div_ceil(2);
                n = 0;
                generous = false;
                continue;
            }
            if n == last {
                return blocks;
            }
        }
    }

    /// qemu's `qcow2_refcount_area`: a new refcount table at the end of
    /// `start` + new blocks, covering everything, with `new_block` hooked
    /// at `new_index`; the header is switched to it and the old table freed.
    fn refcount_area(&mut self, start: u64, new_index: u64, new_block: u64) -> R<()> {
        let cs = self.cs;
        let rb_size = 1u64 << self.rb_bits;
        let total = self.refblocks_needed(start / cs);
        if total > crate::header::MAX_REFTABLE_BYTES {
            return bad("the refcount table would exceed qemu's limit");
        }
        let area_index = (start / cs) / rb_size;
        let per_cluster = cs / 8;
        let table_size = (total + total.div_ceil(2)).div_ceil(per_cluster) * per_cluster;
        if table_size * 8 > crate::header::MAX_REFTABLE_BYTES {
            return bad("the refcount table would exceed qemu's limit");
        }
        let table_clusters = table_size * 8 / cs;
        let mut table = vec![0u64; usize::try_from(table_size).unwrap_or(0)];
        let n = self.reftable.len().min(table.len());
        table[..n].copy_from_slice(&self.reftable[..n]);
        let slot = |i: u64| usize::try_from(i).unwrap_or(usize::MAX);
        if new_block != 0 {
            if new_index >= total {
                return bad("a new refcount block falls outside the grown table");
            }
            table[slot(new_index)] = new_block;
        }
        let additional = (area_index..total)
            .filter(|&i| table[slot(i)] & REFT_OFFSET_MASK == 0)
            .count() as u64;
        let table_offset = start + additional * cs;
        let end = table_offset + table_clusters * cs;
        let mut block_offset = start;
        for i in area_index..total {
            let b = if table[slot(i)] & REFT_OFFSET_MASK != 0 {
                let b = table[slot(i)] & REFT_OFFSET_MASK;
                self.load_rb(b)?;
                b
            } else {
                let b = block_offset;
                self.refblocks
                    .insert(b, vec![0u8; usize::try_from(cs).unwrap_or(0)]);
                self.dirty_rb.insert(b);
                table[slot(i)] = b;
                block_offset += cs;
                b
            };
            let first = i * rb_size * cs;
            if first < end {
                let j0 = if first < start {
                    (start - first) / cs
                } else {
                    0
                };
                let j1 = ((end - first) / cs).min(rb_size);
                let order = self.order;
                if let Some(block) = self.refblocks.get_mut(&b) {
                    for j in j0..j1 {
                        if refcount::get(block, order, j) != 0 {
                            return bad("the refcount area overlaps clusters in use");
                        }
                        refcount::set(block, order, j, 1);
                    }
                }
                self.dirty_rb.insert(b);
            }
        }
        let old = (self.reftable_offset, self.reftable.len() as u64 * 8);
        let bytes: Vec<u8> = table.iter().flat_map(|e| e.to_be_bytes()).collect();
        self.new_reftable = Some((
            table_offset,
            bytes,
            u32::try_from(table_clusters).unwrap_or(0),
        ));
        self.reftable = table;
        self.reftable_offset = table_offset;
        self.dirty_rt.clear();
        self.update_refcount(old.0, old.1, 1, true, false)
    }

    fn note_allocated(&mut self, c: u64) {
        if self.freed.remove(&c) {
            self.punch_first.insert(c);
        }
    }

    /// Change the refcounts of the clusters covering `[offset, offset+len)`
    /// by `addend` (qemu's `update_refcount`). `discard` punches clusters
    /// whose refcount drops to zero.
    pub(crate) fn update_refcount(
        &mut self,
        offset: u64,
        len: u64,
        addend: u64,
        decrease: bool,
        discard: bool,
    ) -> R<()> {
        if len == 0 {
            return Ok(());
        }
        let mask = !(self.cs - 1);
        let start = offset & mask;
        let Some(last) = offset.checked_add(len - 1).map(|e| e & mask) else {
            return bad("a cluster range overflows");
        };
        let mut old_ti = u64::MAX;
        let mut block = 0;
        let mut c = start;
        let res = loop {
            if c > last {
                break Ok(());
            }
            let idx = c >> self.cb;
            let ti = idx >> self.rb_bits;
            if ti != old_ti {
                match self.alloc_refcount_block(idx) {
                    Ok(b) => block = b,
                    Err(Flow::Again) => {
                        self.free_cluster_index = self.free_cluster_index.min(start >> self.cb);
                        break Err(Flow::Again);
                    }
                    Err(e) => break Err(e),
                }
            }
            old_ti = ti;
            let bi = idx & ((1 << self.rb_bits) - 1);
            let order = self.order;
            let Some(b) = self.refblocks.get_mut(&block) else {
                break bad("a refcount block vanished");
            };
            let rc = refcount::get(b, order, bi);
            let new = if decrease {
                rc.checked_sub(addend)
            } else {
                rc.checked_add(addend)
                    .filter(|&v| v <= refcount::max(order))
            };
            let Some(new) = new else {
                break bad(format!(
                    "the refcount of cluster {idx} ({rc}) cannot be {} by {addend}",
                    if decrease { "lowered" } else { "raised" }
                ));
            };
            refcount::set(b, order, bi, new);
            self.dirty_rb.insert(block);
            if new == 0 {
                self.free_cluster_index = self.free_cluster_index.min(idx);
                self.l2.remove(&c);
                self.dirty_l2.remove(&c);
                if discard {
                    self.freed.insert(c);
                }
            } else if rc == 0 {
                self.note_allocated(c);
            }
            c += self.cs;
        };
        if res.is_err() && c > offset {
            // Undo what was done, as qemu does.
            let _ = self.update_refcount(offset, c - offset, addend, !decrease, false);
        }
        res
    }

    fn load_l2(&mut self, off: u64) -> Result<()> {
        if !self.l2.contains_key(&off) {
            let b = self.read_cluster("L2 table", off)?;
            self.l2.insert(off, b);
        }
        Ok(())
    }

    fn l2_get(&mut self, off: u64, j: u64) -> Result<u64> {
        self.load_l2(off)?;
        let at = usize::try_from(j * self.l2_esize).unwrap_or(0);
        Ok(self.l2.get(&off).map_or(0, |t| {
            u64::from_be_bytes(t[at..at + 8].try_into().unwrap_or([0; 8]))
        }))
    }

    fn l2_set(&mut self, off: u64, j: u64, v: u64) -> Result<()> {
        self.load_l2(off)?;
        let at = usize::try_from(j * self.l2_esize).unwrap_or(0);
        if let Some(t) = self.l2.get_mut(&off) {
            t[at..at + 8].copy_from_slice(&v.to_be_bytes());
            self.dirty_l2.insert(off);
        }
        Ok(())
    }

    /// qemu's `qcow2_update_snapshot_refcount`: change by `addend` (-1, 0
    /// or 1) the refcount of every L2 table and data cluster that `l1`
    /// reaches, and recompute the COPIED flags of `l1` and its L2 tables.
    /// Returns whether `l1` changed (the caller decides whether to write it).
    pub fn snapshot_refcount_pass(&mut self, l1: &mut [u64], addend: i8) -> Result<bool> {
        let mut modified = false;
        let (up, down) = (addend > 0, addend < 0);
        for (i, slot) in l1.iter_mut().enumerate() {
            let l1e = *slot;
            if l1e == 0 {
                continue;
            }
            let l2_off = l1e & l2::L1_OFFSET_MASK;
            if l2_off == 0 || !l2_off.is_multiple_of(self.cs) {
                return Err(Error::Invalid(format!(
                    "L1 entry {i} ({l1e:#x}) has no valid L2 table offset"
                )));
            }
            for j in 0..self.l2_entries {
                let old = self.l2_get(l2_off, j)?;
                let mut e = old & !l2::COPIED;
                let rc = match l2::kind(e, self.extended) {
                    Kind::Compressed => {
                        if up || down {
                            let (o, n) = l2::compressed_range(e, self.cb);
                            done(self.update_refcount(o, n, 1, down, true))?;
                        }
                        2
                    }
                    Kind::Normal | Kind::ZeroAlloc => {
                        let off = e & l2::L2_OFFSET_MASK;
                        if !off.is_multiple_of(self.cs) {
                            return Err(Error::Invalid(format!(
                                "a data cluster at {off:#x} is not cluster aligned"
                            )));
                        }
                        if up || down {
                            done(self.update_refcount(off, 1, 1, down, true))?;
                        }
                        self.get_refcount(off >> self.cb)?
                    }
                    Kind::ZeroPlain | Kind::Unallocated => 0,
                };
                if rc == 1 {
                    e |= l2::COPIED;
                }
                if e != old {
                    self.l2_set(l2_off, j, e)?;
                }
            }
            if up || down {
                done(self.update_refcount(l2_off, 1, 1, down, true))?;
            }
            let rc = self.get_refcount(l2_off >> self.cb)?;
            let new = l2_off | if rc == 1 { l2::COPIED } else { 0 };
            if new != l1e {
                *slot = new;
                modified = true;
            }
        }
        Ok(modified)
    }

    /// Queue a raw write for the current group.
    pub fn write(&mut self, what: &'static str, offset: u64, bytes: Vec<u8>) {
        self.writes.push((what, offset, bytes));
    }

    fn put(&self, what: &'static str, offset: u64, b: &[u8]) -> Result<()> {
        self.st.write_at(b, offset).map_err(|source| Error::Write {
            what,
            offset,
            source,
        })
    }

    fn sync(&self) -> Result<()> {
        self.st.sync().map_err(Error::Sync)
    }

    fn write_refcounts(&mut self) -> Result<()> {
        for off in std::mem::take(&mut self.dirty_rb) {
            if let Some(b) = self.refblocks.get(&off) {
                self.put("refcount block", off, b)?;
            }
        }
        if let Some((off, bytes, clusters)) = self.new_reftable.take() {
            // New blocks, then the new table, then the header's switch.
            self.sync()?;
            self.put("refcount table", off, &bytes)?;
            self.sync()?;
            let mut h = [0u8; 12];
            h[..8].copy_from_slice(&off.to_be_bytes());
            h[8..].copy_from_slice(&clusters.to_be_bytes());
            self.put("header", 48, &h)?;
        }
        let rt = std::mem::take(&mut self.dirty_rt);
        if !rt.is_empty() {
            // A new block is on disk before the table points at it.
            self.sync()?;
            for t in rt {
                let at = self.reftable_offset + t as u64 * 8;
                self.put("refcount table", at, &self.reftable[t].to_be_bytes())?;
            }
        }
        Ok(())
    }

    fn write_tables(&mut self) -> Result<()> {
        for off in std::mem::take(&mut self.dirty_l2) {
            if let Some(t) = self.l2.get(&off) {
                self.put("L2 table", off, t)?;
            }
        }
        for (what, off, b) in std::mem::take(&mut self.writes) {
            self.put(what, off, &b)?;
        }
        Ok(())
    }

    fn punch(&self, set: &BTreeSet<u64>) -> Result<()> {
        for &c in set {
            self.st.punch(c, self.cs).map_err(Error::Sync)?;
        }
        Ok(())
    }

    /// Write the group's changes in `order`, punch what it freed, fsync.
    pub fn flush(&mut self, order: Order) -> Result<()> {
        let first = std::mem::take(&mut self.punch_first);
        self.punch(&first)?;
        match order {
            Order::RefcountsFirst => {
                self.write_refcounts()?;
                self.sync()?;
                self.write_tables()?;
            }
            Order::TablesFirst => {
                self.write_tables()?;
                self.sync()?;
                self.write_refcounts()?;
            }
        }
        self.sync()?;
        let freed = std::mem::take(&mut self.freed);
        if !freed.is_empty() {
            self.punch(&freed)?;
            self.sync()?;
        }
        Ok(())
    }
}
