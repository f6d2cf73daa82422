//! `uffdctl map`: where a VM's pages come from, as a picture.
//!
//! - `uffdctl map VM -o map.png`: the server's PNG, saved.
//! - `uffdctl map VM`: the same grid in the terminal, two cells per
//!   character (Unicode upper half blocks, foreground = upper cell,
//!   background = lower cell) in the sources' 24-bit colours; when stdout
//!   is not a terminal, one letter per cell instead (upper case present,
//!   lower case not present) and no escape codes.
//! - `uffdctl map --tree`: the fork tree, each VM's map as one strip, side
//!   by side; a source has the same colour (or letter) in every strip.
//!
//! Cells, legend and colours come from `GET /v1/vms/{id}/map`; this module
//! only draws them.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::Path;

use proto::api::{PageMap, Tree};

use super::vm::call;
use crate::client::Client;
use crate::{CliError, Result};

/// Cells per terminal line.
const COLS: usize = 64;
/// Cells of a terminal map at most: 64 columns × 64 half-block rows.
const TERM_CELLS: u64 = 64 * 64;

fn get_map(client: &Client, id: &str, cells: u64) -> Result<PageMap> {
    let v = call(
        client,
        "GET",
        &format!("/v1/vms/{id}/map?cells={cells}"),
        None,
    )?;
    serde_json::from_value(v).map_err(|e| CliError::Answer(e.to_string()))
}

/// `uffdctl map VM -o FILE`.
pub fn save_png(client: &Client, id: &str, out: &Path) -> Result<()> {
    let (status, bytes) = client.get_bytes(&format!("/v1/vms/{id}/map.png"))?;
    if !(200..300).contains(&status) {
        let message = serde_json::from_slice::<proto::api::ErrorBody>(&bytes)
            .map(|e| e.error)
            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
        return Err(CliError::Api { status, message });
    }
    std::fs::write(out, &bytes).map_err(|source| CliError::Local {
        what: format!("write {}", out.display()),
        source,
    })?;
    println!(
        "{id}: map written to {} ({} bytes)",
        out.display(),
        bytes.len()
    );
    Ok(())
}

/// Whether to draw with colours: stdout is a terminal.
fn colour_out() -> bool {
    std::io::stdout().is_terminal()
}

fn fg(c: [u8; 3]) -> String {
    format!("\x1b[38;2;{};{};{}m", c[0], c[1], c[2])
}

fn bg(c: [u8; 3]) -> String {
    format!("\x1b[48;2;{};{};{}m", c[0], c[1], c[2])
}

const RESET: &str = "\x1b[0m";

/// The letter of legend entry `i`: `a`..`z`, then `0`..`9`, then `?`.
fn letter(i: usize, present: bool) -> char {
    const KEYS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let c = KEYS.get(i).map_or('?', |b| char::from(*b));
    if present {
        c.to_ascii_uppercase()
    } else {
        c
    }
}

/// A cell's colour.
fn rgb(map: &PageMap, cell: usize) -> [u8; 3] {
    let l = &map.legend[usize::from(map.cells[cell]).min(map.legend.len() - 1)];
    if map.present[cell] {
        l.rgb
    } else {
        l.faded_rgb
    }
}

/// The grid of `map` as terminal lines.
pub fn grid_lines(map: &PageMap, colour: bool) -> Vec<String> {
    let n = map.cells.len();
    if map.legend.is_empty() || n == 0 {
        return Vec::new();
    }
    let mut lines = Vec::new();
    let rows = n.div_ceil(COLS);
    if colour {
        for pair in 0..rows.div_ceil(2) {
            let mut line = String::new();
            for col in 0..COLS.min(n) {
                let (top, bottom) = ((2 * pair) * COLS + col, (2 * pair + 1) * COLS + col);
                if top >= n {
                    break;
                }
                line.push_str(&fg(rgb(map, top)));
                if bottom < n {
                    line.push_str(&bg(rgb(map, bottom)));
                } else {
                    line.push_str("\x1b[49m");
                }
                line.push('▀');
            }
            line.push_str(RESET);
            lines.push(line);
        }
    } else {
        for row in 0..rows {
            let line: String = (row * COLS..((row + 1) * COLS).min(n))
                .map(|c| letter(usize::from(map.cells[c]), map.present[c]))
                .collect();
            lines.push(line);
        }
    }
    lines
}

/// `uffdctl map VM` (terminal).
pub fn show(client: &Client, id: &str, as_json: bool) -> Result<()> {
    let map = get_map(client, id, TERM_CELLS)?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&map).unwrap_or_default());
        return Ok(());
    }
    let colour = colour_out();
    println!(
        "{}: {} MiB, {} pages, 1 cell = {} page{}",
        map.id,
        map.memory_bytes >> 20,
        map.pages,
        map.group,
        if map.group == 1 { "" } else { "s" }
    );
    for line in grid_lines(&map, colour) {
        println!("{line}");
    }
    for (i, l) in map.legend.iter().enumerate() {
        let key = if colour {
            format!("{}██{}{}██{}", fg(l.rgb), RESET, fg(l.faded_rgb), RESET)
        } else {
            format!("{}/{}", letter(i, true), letter(i, false))
        };
        let own = if l.own { " (own memory)" } else { "" };
        println!("{key} {} {} pages{own}", l.source, l.pages);
    }
    println!(
        "{}",
        if colour {
            "bright: present in the VM's memory, faded: not present"
        } else {
            "upper case: present in the VM's memory, lower case: not present"
        }
    );
    Ok(())
}

/// `uffdctl map --tree`: each VM of the fork tree as one strip.
pub fn tree(client: &Client, as_json: bool) -> Result<()> {
    let v = call(client, "GET", "/v1/tree", None)?;
    let tree: Tree = serde_json::from_value(v).map_err(|e| CliError::Answer(e.to_string()))?;
    let mut order = Vec::new();
    fn walk(tree: &Tree, id: &str, depth: usize, order: &mut Vec<(String, usize)>) {
        order.push((id.to_owned(), depth));
        if let Some(n) = tree.vms.iter().find(|n| n.id == id) {
            for c in &n.children {
                walk(tree, c, depth + 1, order);
            }
        }
    }
    for root in tree.vms.iter().filter(|n| n.parent.is_none()) {
        walk(&tree, &root.id, 0, &mut order);
    }
    let mut maps = Vec::new();
    for (id, depth) in &order {
        maps.push((get_map(client, id, COLS as u64)?, *depth));
    }
    if as_json {
        let all: Vec<&PageMap> = maps.iter().map(|(m, _)| m).collect();
        println!("{}", serde_json::to_string_pretty(&all).unwrap_or_default());
        return Ok(());
    }
    let colour = colour_out();
    // One key per source across every strip.
    let mut keys: BTreeMap<String, (usize, [u8; 3], [u8; 3])> = BTreeMap::new();
    for (m, _) in &maps {
        for l in &m.legend {
            let next = keys.len();
            keys.entry(l.source.clone())
                .or_insert((next, l.rgb, l.faded_rgb));
        }
    }
    let width = order
        .iter()
        .map(|(id, d)| id.len() + 2 * d)
        .max()
        .unwrap_or(0)
        + 2;
    for (m, depth) in &maps {
        let state = tree
            .vms
            .iter()
            .find(|n| n.id == m.id)
            .map(|n| n.state.to_string())
            .unwrap_or_default();
        let name = format!("{}{}", "  ".repeat(*depth), m.id);
        let mut strip = String::new();
        for (c, idx) in m.cells.iter().enumerate() {
            let source = &m.legend[usize::from(*idx).min(m.legend.len() - 1)].source;
            let (k, rgb, faded) = keys[source];
            if colour {
                let col = if m.present[c] { rgb } else { faded };
                strip.push_str(&fg(col));
                strip.push('█');
            } else {
                strip.push(letter(k, m.present[c]));
            }
        }
        if colour {
            strip.push_str(RESET);
        }
        println!("{name:<width$}{strip}  {state}");
    }
    let mut legend: Vec<_> = keys.iter().collect();
    legend.sort_by_key(|(_, (k, _, _))| *k);
    for (source, (k, rgb, faded)) in legend {
        let key = if colour {
            format!("{}██{}{}██{}", fg(*rgb), RESET, fg(*faded), RESET)
        } else {
            format!("{}/{}", letter(*k, true), letter(*k, false))
        };
        println!("{key} {source}");
    }
    Ok(())
}
