//! Pictures of a VM's pages: the page-source map (`/map`, `/map.png`) and
//! the access heat map (`/access.png`).
//!
//! [`group`] turns one value per page into cells (one per `group` pages,
//! a power of two chosen so the cells fit); [`source_png`] and
//! [`heat_png`] draw them with the `png` crate. Colours belong to sources,
//! not to a VM's legend order ([`colour`]), so a source has the same
//! colour in every VM's map and inheritance shows at a glance.
//!
//! Text (title, legend) is drawn with the public-domain 8×8 bitmap font of
//! the `font8x8` crate: the pictures need a few lines of ASCII at one
//! size, which a bitmap font does with no font files, no rasterizer and
//! the same pixels on every host (a test compares them).
//!
//! Each PNG carries its layout and legend as JSON in an `iTXt` chunk
//! (keyword [`LAYOUT_KEY`]), so a program can find a page's cell without
//! guessing at pixels.

use proto::api::{MapLegend, PageMap};
use serde::Serialize;

/// Keyword of the `iTXt` chunk holding the layout as JSON.
pub const LAYOUT_KEY: &str = "pagefork-layout";
/// Cells per row.
pub const COLS: u64 = 128;
/// Default and largest number of cells.
pub const MAX_CELLS: u64 = COLS * 128;
/// Cell size and pitch in pixels (a one-pixel gap between cells).
const CELL: u32 = 5;
const PITCH: u32 = 6;
/// Legend swatches: two squares, present then not present, a gap between.
const SWATCH: u32 = 12;
/// Margin and text scale (the 8×8 font drawn at 2×: 16 px glyphs).
const MARGIN: u32 = 12;
const SCALE: u32 = 2;
const GLYPH: u32 = 8 * SCALE;
const LINE: u32 = GLYPH + 6;
const BACKGROUND: [u8; 3] = [255, 255, 255];
const INK: [u8; 3] = [20, 20, 20];

/// The colour of a source: the same source, the same colour, in every map.
pub fn colour(kind: &str, name: &str) -> [u8; 3] {
    const VMS: [[u8; 3]; 8] = [
        [31, 119, 180],
        [44, 160, 44],
        [148, 103, 189],
        [23, 190, 207],
        [227, 119, 194],
        [140, 86, 75],
        [188, 189, 34],
        [57, 59, 121],
    ];
    const IMAGES: [[u8; 3]; 3] = [[255, 127, 14], [230, 161, 0], [204, 85, 0]];
    const FILES: [[u8; 3]; 3] = [[214, 39, 40], [165, 15, 21], [240, 80, 110]];
    const ZSTD: [[u8; 3]; 3] = [[0, 128, 128], [0, 100, 100], [60, 150, 130]];
    let hash = name.bytes().fold(0usize, |h, b| {
        h.wrapping_mul(31).wrapping_add(usize::from(b))
    });
    match kind {
        "uninitialized" => [150, 150, 150],
        "vm" => {
            let n: usize = name.trim_start_matches("vm-").parse().unwrap_or(hash);
            VMS[n.wrapping_sub(1) % VMS.len()]
        }
        "image" => IMAGES[hash % IMAGES.len()],
        "zstd" => ZSTD[hash % ZSTD.len()],
        _ => FILES[hash % FILES.len()],
    }
}

/// A cell's colour when its pages are not present: the source's colour
/// faded toward white.
pub fn faded(c: [u8; 3]) -> [u8; 3] {
    c.map(|v| {
        let v = u32::from(v);
        u8::try_from(v + (255 - v) * 3 / 5).unwrap_or(255)
    })
}

/// The smallest power-of-two group of pages that puts `pages` in at most
/// `cells` cells.
pub fn group_size(pages: u64, cells: u64) -> u64 {
    let cells = cells.clamp(1, MAX_CELLS);
    pages.div_ceil(cells).max(1).next_power_of_two()
}

/// Cells of `group` pages from one legend index and presence per page:
/// each cell takes the index most of its pages have (the lowest on a tie)
/// and is present if at least half its pages are.
pub fn group(
    per_page: impl Iterator<Item = (u16, bool)>,
    legend_len: usize,
    group: u64,
) -> (Vec<u16>, Vec<bool>) {
    let mut cells = Vec::new();
    let mut present = Vec::new();
    let mut counts = vec![0u64; legend_len];
    let (mut n, mut here) = (0u64, 0u64);
    let mut flush = |counts: &mut Vec<u64>, n: &mut u64, here: &mut u64| {
        let best = counts
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(&a.0)))
            .map_or(0, |(i, _)| i);
        cells.push(u16::try_from(best).unwrap_or(u16::MAX));
        present.push(*here * 2 >= *n);
        counts.iter_mut().for_each(|c| *c = 0);
        (*n, *here) = (0, 0);
    };
    for (idx, p) in per_page {
        if let Some(c) = counts.get_mut(usize::from(idx)) {
            *c += 1;
        }
        n += 1;
        here += u64::from(p);
        if n == group {
            flush(&mut counts, &mut n, &mut here);
        }
    }
    if n > 0 {
        flush(&mut counts, &mut n, &mut here);
    }
    (cells, present)
}

/// Where things are in a picture (the `iTXt` chunk).
#[derive(Debug, Serialize)]
pub struct Layout {
    /// Top-left pixel of cell 0.
    pub x0: u32,
    pub y0: u32,
    /// Distance between cells, and the filled square of each.
    pub pitch: u32,
    pub cell: u32,
    pub cols: u64,
    pub cells: u64,
    pub group: u64,
    /// Legend swatches are `swatch`×`swatch` squares: at (x, y) the
    /// colour; in a page-source map, at (x + swatch + 2, y) its faded
    /// (not present) form.
    pub swatch: u32,
    pub legend: Vec<LayoutLegend>,
}

/// One legend entry of a layout.
#[derive(Debug, Serialize)]
pub struct LayoutLegend {
    pub source: String,
    pub rgb: [u8; 3],
    pub x: u32,
    pub y: u32,
}

/// An RGB canvas.
struct Canvas {
    w: u32,
    h: u32,
    px: Vec<u8>,
}

impl Canvas {
    fn new(w: u32, h: u32) -> Self {
        let mut px = Vec::with_capacity((w * h * 3) as usize);
        for _ in 0..w * h {
            px.extend_from_slice(&BACKGROUND);
        }
        Canvas { w, h, px }
    }

    fn rect(&mut self, x: u32, y: u32, w: u32, h: u32, c: [u8; 3]) {
        for yy in y..(y + h).min(self.h) {
            for xx in x..(x + w).min(self.w) {
                let i = ((yy * self.w + xx) * 3) as usize;
                self.px[i..i + 3].copy_from_slice(&c);
            }
        }
    }

    /// ASCII `text` at (x, y); other characters draw as `?`.
    fn text(&mut self, x: u32, y: u32, text: &str) {
        for (i, ch) in text.chars().enumerate() {
            let code = if ch.is_ascii() {
                ch as usize
            } else {
                '?' as usize
            };
            let glyph = font8x8::legacy::BASIC_LEGACY[code];
            let gx = x + u32::try_from(i).unwrap_or(u32::MAX / 2) * GLYPH;
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..8u32 {
                    if bits & (1 << col) != 0 {
                        let row = u32::try_from(row).unwrap_or(0);
                        self.rect(gx + col * SCALE, y + row * SCALE, SCALE, SCALE, INK);
                    }
                }
            }
        }
    }

    fn png(&self, layout: &Layout) -> Vec<u8> {
        let mut out = Vec::new();
        let mut enc = png::Encoder::new(&mut out, self.w, self.h);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        // Flat cells and a repeating grid: the best level shrinks a large
        // map several times over for a few ms more.
        enc.set_compression(png::Compression::Best);
        let text = serde_json::to_string(layout).unwrap_or_default();
        // Writing into a Vec fails only on a bad header (impossible here).
        if enc.add_itxt_chunk(LAYOUT_KEY.into(), text).is_ok() {
            if let Ok(mut w) = enc.write_header() {
                let _ = w.write_image_data(&self.px);
            }
        }
        out
    }
}

fn text_width(s: &str) -> u32 {
    u32::try_from(s.chars().count()).unwrap_or(0) * GLYPH
}

/// A legend row: colour, what it stands for, and its label.
type Row = ([u8; 3], String, String);

/// Draw a grid of `cells` (colours) under `title` lines, then `legend`
/// rows (with the faded swatch too when `faded_swatch`); returns the PNG.
fn draw(
    title: &[String],
    colours: &[[u8; 3]],
    legend: &[Row],
    group: u64,
    faded_swatch: bool,
) -> Vec<u8> {
    let cells = colours.len() as u64;
    let rows = u32::try_from(cells.div_ceil(COLS)).unwrap_or(0);
    let cols = u32::try_from(cells.min(COLS)).unwrap_or(0);
    let widest = title
        .iter()
        .chain(legend.iter().map(|(_, _, l)| l))
        .map(|t| text_width(t) + 2 * SWATCH + 10)
        .max()
        .unwrap_or(0);
    let w = 2 * MARGIN + (cols * PITCH).max(widest);
    let y0 = MARGIN + LINE * u32::try_from(title.len()).unwrap_or(0) + 4;
    let legend_y = y0 + rows * PITCH + 10;
    let h = legend_y + LINE * u32::try_from(legend.len()).unwrap_or(0) + MARGIN;
    let mut c = Canvas::new(w, h);
    for (i, t) in title.iter().enumerate() {
        c.text(MARGIN, MARGIN + LINE * u32::try_from(i).unwrap_or(0), t);
    }
    for (i, col) in colours.iter().enumerate() {
        let i = i as u64;
        let (x, y) = (
            MARGIN + u32::try_from(i % COLS).unwrap_or(0) * PITCH,
            y0 + u32::try_from(i / COLS).unwrap_or(0) * PITCH,
        );
        c.rect(x, y, CELL, CELL, *col);
    }
    let mut entries = Vec::new();
    for (i, (rgb, source, label)) in legend.iter().enumerate() {
        let y = legend_y + LINE * u32::try_from(i).unwrap_or(0);
        let sy = y + (GLYPH - SWATCH) / 2;
        c.rect(MARGIN, sy, SWATCH, SWATCH, *rgb);
        if faded_swatch {
            c.rect(MARGIN + SWATCH + 2, sy, SWATCH, SWATCH, faded(*rgb));
        }
        c.text(MARGIN + 2 * SWATCH + 10, y, label);
        entries.push(LayoutLegend {
            source: source.clone(),
            rgb: *rgb,
            x: MARGIN,
            y: sy,
        });
    }
    c.png(&Layout {
        x0: MARGIN,
        y0,
        pitch: PITCH,
        cell: CELL,
        cols: COLS,
        cells,
        group,
        swatch: SWATCH,
        legend: entries,
    })
}

/// `GET /v1/vms/{id}/map.png`: the map's cells in their sources' colours
/// (faded where not present), its legend, the VM, its memory and the time.
pub fn source_png(map: &PageMap) -> Vec<u8> {
    let colours: Vec<[u8; 3]> = map
        .cells
        .iter()
        .zip(&map.present)
        .map(|(i, p)| {
            let rgb = map
                .legend
                .get(usize::from(*i))
                .map_or(BACKGROUND, |l| l.rgb);
            if *p {
                rgb
            } else {
                faded(rgb)
            }
        })
        .collect();
    let legend: Vec<Row> = map
        .legend
        .iter()
        .map(|l: &MapLegend| {
            let own = if l.own { " (own memory)" } else { "" };
            let label = format!("{}  {} pages{own}", l.source, l.pages);
            (l.rgb, l.source.clone(), label)
        })
        .collect();
    let title = vec![
        format!(
            "{}  {} MiB  {} pages",
            map.id,
            map.memory_bytes >> 20,
            map.pages
        ),
        format!(
            "1 cell = {} page{}  {}",
            map.group,
            if map.group == 1 { "" } else { "s" },
            utc(map.time_ms)
        ),
        "faded: not present in the VM's memory".to_owned(),
    ];
    draw(&title, &colours, &legend, map.group, true)
}

/// Heat-map colours: no fault, then 1, 2-3, 4-7, 8+ faults per page of
/// the cell (on average).
pub const HEAT: [[u8; 3]; 5] = [
    [235, 235, 235],
    [254, 217, 118],
    [253, 141, 60],
    [227, 26, 28],
    [128, 0, 38],
];

/// The heat level of `faults` on `pages` pages.
pub fn heat_level(faults: u64, pages: u64) -> usize {
    let per = faults.div_ceil(pages.max(1));
    match per {
        0 => 0,
        1 => 1,
        2..=3 => 2,
        4..=7 => 3,
        _ => 4,
    }
}

/// `GET /v1/vms/{id}/access.png`: faults per cell since the access record
/// began, as a heat map.
pub fn heat_png(id: &str, pages: u64, since_ms: u64, counts: &[u64], group: u64) -> Vec<u8> {
    let colours: Vec<[u8; 3]> = counts.iter().map(|n| HEAT[heat_level(*n, group)]).collect();
    let legend: Vec<Row> = [
        "no fault",
        "1 fault per page",
        "2-3 faults per page",
        "4-7 faults per page",
        "8 or more faults per page",
    ]
    .iter()
    .zip(HEAT)
    .enumerate()
    .map(|(i, (label, rgb))| (rgb, format!("level-{i}"), (*label).to_owned()))
    .collect();
    let title = vec![
        format!("{id}  faults since {}", utc(since_ms)),
        format!(
            "{pages} pages  1 cell = {group} page{}",
            if group == 1 { "" } else { "s" }
        ),
    ];
    draw(&title, &colours, &legend, group, false)
}

/// Milliseconds since the epoch as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn utc(ms: u64) -> String {
    let secs = ms / 1000;
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC",
        (secs / 3600) % 24,
        (secs / 60) % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_powers_of_two_that_fit() {
        assert_eq!(group_size(2048, MAX_CELLS), 1);
        assert_eq!(group_size(65536, MAX_CELLS), 4);
        assert_eq!(group_size(65537, MAX_CELLS), 8);
        assert_eq!(group_size(2048, 64), 32);
        assert_eq!(group_size(0, 0), 1);
    }

    #[test]
    fn a_cell_takes_the_majority_source_and_presence() {
        let pages = [
            (1, true),
            (1, true),
            (0, false),
            (2, false),
            (2, false),
            (2, true),
        ];
        let (cells, present) = group(pages.into_iter(), 3, 3);
        assert_eq!(cells, vec![1, 2]);
        assert_eq!(present, vec![true, false]);
        // A short last cell, and a tie going to the lower index.
        let (cells, present) = group([(2, true), (1, false)].into_iter(), 3, 4);
        assert_eq!((cells, present), (vec![1], vec![true]));
    }

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_795_435_200_000), "2026-11-23 12:00:00 UTC");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
    }

    #[test]
    fn the_same_vm_has_the_same_colour_everywhere() {
        assert_eq!(colour("vm", "vm-3"), colour("vm", "vm-11"));
        assert_ne!(colour("vm", "vm-3"), colour("vm", "vm-4"));
        assert_eq!(colour("uninitialized", "uninitialized"), [150, 150, 150]);
    }
}
