//! Fuzz entry point: the whole reader over arbitrary bytes.
//!
//! The `qcow2_image` target in `fuzz/` calls [`image`]; the seed corpus in
//! `fuzz/seeds/qcow2_image/` is replayed by this module's test on the
//! stable toolchain. Any input must give a value or an error, never a
//! panic, a hang or an allocation beyond the input's size and the format's
//! limits.

use crate::image::{Image, View};

/// Clusters read per view: enough to reach L2 tables and compressed data
/// without letting a huge virtual size turn into a long loop.
const MAX_CLUSTERS: u64 = 64;

/// Open `data` as an image, then read a few clusters of every view.
pub fn image(data: &[u8]) {
    let Ok(img) = Image::open(data) else { return };
    let views =
        std::iter::once(View::Active).chain((0..img.snapshots().len().min(8)).map(View::Snapshot));
    for view in views {
        let Ok(l1) = img.l1_table(view) else { continue };
        let cs = img.header().cluster_size();
        let Ok(size) = img.size(view) else { continue };
        let mut buf = vec![0u8; usize::try_from(cs).unwrap_or(0)];
        for vc in 0..size.div_ceil(cs).min(MAX_CLUSTERS) {
            if let Ok(m) = img.mapping(&l1, vc) {
                let _ = img.read_mapped(m, &mut buf);
            }
        }
    }
    let _ = crate::list::format(img.snapshots());
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    #[test]
    fn seed_corpus_replays_without_panic() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/qcow2_image");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).expect("the qcow2_image seed corpus exists") {
            let bytes = std::fs::read(e.expect("a seed entry").path()).expect("a readable seed");
            super::image(&bytes);
            n += 1;
        }
        assert!(n > 0, "no seeds in {}", dir.display());
    }
}
