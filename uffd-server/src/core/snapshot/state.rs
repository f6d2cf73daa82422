//! What snapshots keep per VM: the snapshot it started from, the pages it
//! wrote since its last snapshot (the dirty log), a snapshot still saving
//! pages while it runs again, and the pages that lost their write
//! protection since a fork or snapshot armed it ahead of a pause.
//!
//! Every write the fault path sees goes through [`SnapshotState::record_write`]
//! first (see `track::before_write`).

use std::cell::RefCell;
use std::rc::Rc;

use crate::pages::SourceId;
use crate::snapshot::pageset::PageSet;
use crate::snapshot::writer::WriterHandle;

/// One VM's snapshot state.
#[derive(Debug, Default)]
pub struct SnapshotState {
    /// The snapshot the VM started from (restore or rollback), and the
    /// arena id of its image.
    pub base: Option<(String, SourceId)>,
    /// Pages written since the VM's last snapshot, while tracked.
    pub dirty: Option<DirtyLog>,
    /// A snapshot still saving pages after the guest resumed: a write to
    /// one of them first hands its pre-image to it.
    pub saving: Option<Rc<RefCell<Saving>>>,
    /// Pages that lost their write protection since a fork or snapshot
    /// armed it ahead of its pause (see `snapshot/arm.rs`); the pause re-protects
    /// them.
    pub arming: Option<PageSet>,
}

impl SnapshotState {
    /// Whether pages installed into the VM keep write protection: its
    /// writes are tracked (a dirty log, a snapshot saving, protection
    /// being armed ahead of a pause).
    pub fn tracks_writes(&self) -> bool {
        self.dirty.is_some() || self.saving.is_some() || self.arming.is_some()
    }

    /// Pages `[lo, hi)` are about to be written: the dirty log and the
    /// arming set record them.
    pub fn record_write(&mut self, lo: u64, hi: u64) {
        if let Some(d) = self.dirty.as_mut() {
            d.pages.insert_range(lo, hi - lo);
        }
        if let Some(a) = self.arming.as_mut() {
            a.insert_range(lo, hi - lo);
        }
    }
}

/// Pages written since a VM's last snapshot.
#[derive(Debug)]
pub struct DirtyLog {
    /// The snapshot the log counts from.
    pub since: String,
    pub pages: PageSet,
}

/// A snapshot saving pages while its VM runs again.
#[derive(Debug)]
pub struct Saving {
    /// The snapshot's name.
    pub name: String,
    /// Pages whose bytes at the pause are not in the image yet.
    pub pending: PageSet,
    /// Every page this snapshot writes (`pending` at the pause): chunks
    /// of a reflinked image without one keep their parent's checksums.
    pub touched: PageSet,
    /// The thread writing the image; taken when the last page is queued.
    pub writer: Option<WriterHandle>,
    /// The first failure to read a page; the snapshot fails with it.
    pub error: Option<String>,
    pub pages_written: u64,
    /// Pages saved by the fault handler ahead of the writer.
    pub saved_before_write: u64,
    /// Pages queued for the writer to copy out of the VM's memory itself
    /// and maybe not copied yet: a write to one first saves its bytes
    /// again, behind the copy (`snapshot::track::before_write`).
    pub in_flight: PageSet,
    /// Those copy runs, `(number, first, end)`, oldest first.
    pub copying: std::collections::VecDeque<(u64, u64, u64)>,
    /// Bulk runs of the VM's own pages go to the writer to copy (see
    /// `COPY_MIN_PAGES` in the save).
    pub copy_runs: bool,
}

impl Saving {
    /// Forget the copy runs the writer has finished.
    pub fn prune_copies(&mut self) {
        let Some(copied) = self.writer.as_ref().map(WriterHandle::copied) else {
            return;
        };
        while let Some(&(seq, lo, hi)) = self.copying.front() {
            if seq > copied {
                break;
            }
            for p in lo..hi {
                self.in_flight.remove(p);
            }
            self.copying.pop_front();
        }
    }
}
