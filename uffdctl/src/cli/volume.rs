//! `uffdctl volume ...`: volumes and snapshots over the control API.
//!
//! Prints readable tables, or the server's JSON with `--json`.

use clap::Subcommand;
use proto::api;
use serde_json::Value;

use super::body;

use crate::client::Client;
use crate::{CliError, Result};

/// Volume and snapshot commands.
#[derive(Debug, Clone, Subcommand)]
pub enum VolumeCmd {
    /// Create an empty sparse volume, or clone one from a snapshot.
    Create {
        /// Name of the new volume.
        name: String,
        /// Size in MiB (new empty volume).
        #[arg(
            long,
            required_unless_present = "from_snapshot",
            conflicts_with = "from_snapshot"
        )]
        size_mib: Option<u64>,
        /// Clone this snapshot (one reflink; no data is copied).
        #[arg(long)]
        from_snapshot: Option<String>,
    },
    /// List volumes with their size and space use.
    List,
    /// Show one volume.
    Show { name: String },
    /// Delete a volume (its snapshots stay).
    Delete { name: String },
    /// Grow a volume.
    Grow {
        name: String,
        /// New size in MiB (volumes never shrink).
        #[arg(long)]
        size_mib: u64,
    },
    /// Snapshot a volume (or a snapshot: recorded against its volume).
    Snapshot {
        /// Volume (or snapshot) to snapshot.
        source: String,
        /// Name of the new snapshot.
        name: String,
    },
    /// List the snapshots of a volume, oldest first (all if no volume).
    Snapshots { volume: Option<String> },
    /// Delete a snapshot.
    DeleteSnapshot { name: String },
    /// Roll a volume back to one of its snapshots.
    Rollback {
        volume: String,
        snapshot: String,
        /// Delete the snapshots taken after it (otherwise they are kept).
        #[arg(long)]
        delete_newer: bool,
    },
    /// Import a qcow2 file as a new volume; its internal snapshots become
    /// volume snapshots (the server reads the file).
    Import {
        /// The qcow2 file (a path on the server's host).
        file: std::path::PathBuf,
        /// Name of the new volume.
        name: String,
        /// Prefix for the volume snapshots' names (names are global).
        #[arg(long, default_value = "")]
        snapshot_prefix: String,
    },
    /// Export a volume and its snapshots to a new qcow2 file (written by
    /// the server).
    Export {
        /// The volume.
        name: String,
        /// The new qcow2 file (a path on the server's host; must not exist).
        file: std::path::PathBuf,
    },
    /// Create a volume from a snapshot.
    Clone {
        /// Snapshot to clone.
        snapshot: String,
        /// Name of the new volume.
        name: String,
    },
}

/// Run `cmd` against the server behind `client`.
pub fn run(cmd: VolumeCmd, client: &Client, json: bool) -> Result<()> {
    let (method, path, body, show): (&str, String, Option<Value>, fn(&Value)) = match cmd {
        VolumeCmd::Create {
            name,
            size_mib: Some(mib),
            ..
        } => (
            "POST",
            "/v1/volumes".into(),
            Some(body(&api::CreateVolume {
                name,
                size_mib: Some(mib),
                from_snapshot: None,
            })),
            print_volume,
        ),
        VolumeCmd::Create {
            name,
            from_snapshot: Some(snap),
            ..
        }
        | VolumeCmd::Clone {
            snapshot: snap,
            name,
        } => (
            "POST",
            "/v1/volumes".into(),
            Some(body(&api::CreateVolume {
                name,
                size_mib: None,
                from_snapshot: Some(snap),
            })),
            print_volume,
        ),
        VolumeCmd::Create { .. } => {
            return Err(CliError::Usage("give --size-mib or --from-snapshot".into()))
        }
        VolumeCmd::List => ("GET", "/v1/volumes".into(), None, print_volumes),
        VolumeCmd::Show { name } => (
            "GET",
            format!("/v1/volumes/{}", seg(&name)),
            None,
            print_volume,
        ),
        VolumeCmd::Delete { name } => (
            "DELETE",
            format!("/v1/volumes/{}", seg(&name)),
            None,
            print_deleted,
        ),
        VolumeCmd::Grow { name, size_mib } => (
            "POST",
            format!("/v1/volumes/{}/grow", seg(&name)),
            Some(body(&api::GrowVolume { size_mib })),
            print_volume,
        ),
        VolumeCmd::Snapshot { source, name } => (
            "POST",
            format!("/v1/volumes/{}/snapshots", seg(&source)),
            Some(body(&api::CreateVolumeSnapshot { name })),
            print_snapshot,
        ),
        VolumeCmd::Snapshots { volume: Some(v) } => (
            "GET",
            format!("/v1/volumes/{}/snapshots", seg(&v)),
            None,
            print_snapshots,
        ),
        VolumeCmd::Snapshots { volume: None } => {
            ("GET", "/v1/volume-snapshots".into(), None, print_snapshots)
        }
        VolumeCmd::DeleteSnapshot { name } => (
            "DELETE",
            format!("/v1/volume-snapshots/{}", seg(&name)),
            None,
            print_deleted,
        ),
        VolumeCmd::Rollback {
            volume,
            snapshot,
            delete_newer,
        } => (
            "POST",
            format!("/v1/volumes/{}/rollback", seg(&volume)),
            Some(body(&api::RollbackVolume {
                snapshot,
                delete_newer,
            })),
            print_rollback,
        ),
        VolumeCmd::Import {
            file,
            name,
            snapshot_prefix,
        } => (
            "POST",
            "/v1/volumes/import".into(),
            Some(body(&api::ImportVolume {
                name,
                path: absolute(&file)?,
                snapshot_prefix,
            })),
            print_imported,
        ),
        VolumeCmd::Export { name, file } => (
            "POST",
            format!("/v1/volumes/{}/export", seg(&name)),
            Some(body(&api::ExportVolume {
                path: absolute(&file)?,
            })),
            print_exported,
        ),
    };
    let resp = client.request(method, &path, body.as_ref())?;
    if !resp.ok() {
        return Err(CliError::Api {
            status: resp.status,
            message: resp.error_text(),
        });
    }
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&resp.body).unwrap_or_else(|_| resp.body.to_string())
        );
    } else {
        show(&resp.body);
    }
    Ok(())
}

/// `path` made absolute against the current directory (the server has
/// its own).
fn absolute(path: &std::path::Path) -> Result<String> {
    let p = std::path::absolute(path).map_err(|source| CliError::Local {
        what: format!("resolve {}", path.display()),
        source,
    })?;
    p.to_str()
        .map(str::to_owned)
        .ok_or_else(|| CliError::Usage(format!("{} is not UTF-8", p.display())))
}

fn print_imported(v: &Value) {
    if let Some(vol) = v.get("volume") {
        print_volume(vol);
    }
    let snaps: Vec<String> = v
        .get("snapshots")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    println!(
        "snapshots: {}",
        if snaps.is_empty() {
            "-".into()
        } else {
            snaps.join(", ")
        }
    );
}

fn print_exported(v: &Value) {
    println!(
        "{} -> {} ({}; snapshots: {})",
        text(v, "volume"),
        text(v, "path"),
        bytes(v, "size_bytes"),
        v.get("snapshots")
            .and_then(Value::as_array)
            .map(|a| a
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join(", "))
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "-".into())
    );
}

/// A name as a path segment. Valid names need no escaping; anything else
/// is percent-encoded so the server answers with a clear invalid-name error.
fn seg(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn print_volumes(v: &Value) {
    let rows: Vec<Vec<String>> = as_list(v).iter().map(volume_row).collect();
    print_table(
        &[
            "NAME",
            "SIZE",
            "ALLOCATED",
            "SHARED",
            "EXCLUSIVE",
            "SNAPSHOTS",
        ],
        &rows,
    );
}

fn print_volume(v: &Value) {
    print_volumes(&Value::Array(vec![v.clone()]));
}

fn volume_row(v: &Value) -> Vec<String> {
    vec![
        text(v, "name"),
        bytes(v, "size_bytes"),
        bytes(v, "allocated_bytes"),
        bytes(v, "shared_bytes"),
        bytes(v, "exclusive_bytes"),
        v.get("snapshots")
            .and_then(Value::as_u64)
            .map_or_else(|| "-".into(), |n| n.to_string()),
    ]
}

fn print_snapshots(v: &Value) {
    let rows: Vec<Vec<String>> = as_list(v)
        .iter()
        .map(|s| {
            let mut volume = text(s, "volume");
            if s.get("volume_exists").and_then(Value::as_bool) == Some(false) {
                volume.push_str(" (deleted)");
            }
            vec![
                text(s, "name"),
                volume,
                bytes(s, "size_bytes"),
                bytes(s, "allocated_bytes"),
                bytes(s, "shared_bytes"),
                bytes(s, "exclusive_bytes"),
                s.get("created_unix_ms")
                    .and_then(Value::as_i64)
                    .map_or_else(|| "-".into(), utc),
            ]
        })
        .collect();
    print_table(
        &[
            "NAME",
            "VOLUME",
            "SIZE",
            "ALLOCATED",
            "SHARED",
            "EXCLUSIVE",
            "CREATED (UTC)",
        ],
        &rows,
    );
}

fn print_snapshot(v: &Value) {
    print_snapshots(&Value::Array(vec![v.clone()]));
}

fn print_deleted(v: &Value) {
    println!("deleted {}", text(v, "deleted"));
}

fn print_rollback(v: &Value) {
    println!(
        "rolled {} back to {}",
        text(v, "volume"),
        text(v, "snapshot")
    );
    let deleted: Vec<&str> = as_list(&v["deleted_snapshots"])
        .iter()
        .filter_map(Value::as_str)
        .collect();
    if !deleted.is_empty() {
        println!("deleted newer snapshots: {}", deleted.join(", "));
    }
}

fn as_list(v: &Value) -> &[Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

fn text(v: &Value, key: &str) -> String {
    v.get(key).and_then(Value::as_str).unwrap_or("-").to_owned()
}

fn bytes(v: &Value, key: &str) -> String {
    v.get(key)
        .and_then(Value::as_u64)
        .map_or_else(|| "-".into(), human)
}

/// `1536` → `1.5K`, binary units.
fn human(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "K", "M", "G", "T", "P"];
    let mut unit = 0;
    let mut div = 1u64;
    while unit + 1 < UNITS.len() && n / div >= 1024 {
        div *= 1024;
        unit += 1;
    }
    if unit == 0 {
        return format!("{n}B");
    }
    let whole = n / div;
    let tenth = (n % div) * 10 / div;
    if whole >= 100 || tenth == 0 {
        format!("{whole}{}", UNITS[unit])
    } else {
        format!("{whole}.{tenth}{}", UNITS[unit])
    }
}

/// Unix milliseconds as `YYYY-MM-DD HH:MM:SS` (UTC).
fn utc(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
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
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        cmd: VolumeCmd,
    }

    #[test]
    fn sizes_print_in_binary_units() {
        assert_eq!(human(0), "0B");
        assert_eq!(human(1023), "1023B");
        assert_eq!(human(1536), "1.5K");
        assert_eq!(human(1 << 30), "1G");
        assert_eq!(human(16 << 30), "16G");
        assert_eq!(human(200 << 20), "200M");
    }

    #[test]
    fn timestamps_print_as_utc() {
        assert_eq!(utc(0), "1970-01-01 00:00:00");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00");
        assert_eq!(utc(1_700_000_000_123), "2023-11-14 22:13:20");
    }

    #[test]
    fn odd_names_are_percent_encoded_in_paths() {
        assert_eq!(seg("vol-1.img"), "vol-1.img");
        assert_eq!(seg("a/b"), "a%2Fb");
        assert_eq!(seg("a b"), "a%20b");
    }

    #[test]
    fn create_needs_a_size_or_a_snapshot_but_not_both() {
        assert!(Cli::try_parse_from(["x", "create", "v"]).is_err());
        assert!(Cli::try_parse_from([
            "x",
            "create",
            "v",
            "--size-mib",
            "1",
            "--from-snapshot",
            "s"
        ])
        .is_err());
        let cli = Cli::try_parse_from(["x", "create", "v", "--size-mib", "64"]).unwrap();
        assert!(matches!(
            cli.cmd,
            VolumeCmd::Create {
                size_mib: Some(64),
                ..
            }
        ));
        let cli = Cli::try_parse_from(["x", "rollback", "v", "s", "--delete-newer"]).unwrap();
        assert!(matches!(
            cli.cmd,
            VolumeCmd::Rollback {
                delete_newer: true,
                ..
            }
        ));
    }
}
