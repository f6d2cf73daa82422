//! `uffdctl sources`, `uffdctl page`, `uffdctl tree`: memory-source
//! debugging views.

use serde_json::Value;

use super::table::{human_bytes, render};
use super::vm::call;
use crate::client::Client;
use crate::Result;

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// `uffdctl sources ID [--extents N]`.
pub fn sources(client: &Client, id: &str, max_extents: usize, as_json: bool) -> Result<()> {
    let v = call(client, "GET", &format!("/v1/vms/{id}/sources"), None)?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(());
    }
    let total = v["pages"].as_u64().unwrap_or(0).max(1);
    println!("{id}: {} pages", v["pages"]);
    let rows: Vec<Vec<String>> = v["by_source"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, n)| {
                    let n = n.as_u64().unwrap_or(0);
                    vec![
                        k.clone(),
                        n.to_string(),
                        human_bytes(n * shared::PAGE_SIZE),
                        format!("{:.1}%", n as f64 * 100.0 / total as f64),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    print!("{}", render(&["SOURCE", "PAGES", "BYTES", "SHARE"], &rows));
    let extents = v["extents"].as_array().cloned().unwrap_or_default();
    println!(
        "\n{} extents{}",
        extents.len(),
        if extents.len() > max_extents {
            format!(" (first {max_extents})")
        } else {
            String::new()
        }
    );
    let rows: Vec<Vec<String>> = extents
        .iter()
        .take(max_extents)
        .map(|e| {
            let start = e["start_page"].as_u64().unwrap_or(0);
            let n = e["pages"].as_u64().unwrap_or(0);
            vec![
                format!("{start}..{}", start + n),
                n.to_string(),
                s(&e["source"]),
            ]
        })
        .collect();
    print!("{}", render(&["PAGES", "COUNT", "SOURCE"], &rows));
    Ok(())
}

/// `uffdctl page ID PAGE`.
pub fn page(client: &Client, id: &str, page: u64, as_json: bool) -> Result<()> {
    let v = call(client, "GET", &format!("/v1/vms/{id}/pages/{page}"), None)?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        println!(
            "{id} page {page}: source {} ({}), {} in {id}'s memory",
            s(&v["source"]),
            s(&v["kind"]),
            if v["present"].as_bool() == Some(true) {
                "present"
            } else {
                "not present"
            }
        );
    }
    Ok(())
}

/// `uffdctl tree`.
pub fn tree(client: &Client, as_json: bool) -> Result<()> {
    let v = call(client, "GET", "/v1/tree", None)?;
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return Ok(());
    }
    let nodes = v["vms"].as_array().cloned().unwrap_or_default();
    fn walk(nodes: &[Value], id: &str, depth: usize) {
        let Some(n) = nodes.iter().find(|n| n["id"] == id) else {
            return;
        };
        let reads = n["reads_from"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, c)| format!("{c} pages from {k}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        println!(
            "{}{} [{}] own {} pages{}",
            "  ".repeat(depth),
            id,
            s(&n["state"]),
            n["own_pages"],
            if reads.is_empty() {
                String::new()
            } else {
                format!(", reads {reads}")
            }
        );
        for c in n["children"].as_array().cloned().unwrap_or_default() {
            walk(nodes, c.as_str().unwrap_or_default(), depth + 1);
        }
    }
    for root in nodes.iter().filter(|n| n["parent"].is_null()) {
        walk(&nodes, root["id"].as_str().unwrap_or_default(), 0);
    }
    Ok(())
}
