//! `uffdctl qcow2 snapshot -l | -c NAME | -a NAME | -d NAME FILE`: internal
//! snapshots of a qcow2 file, offline and without a server.
//!
//! The work is done by the `qcow2` crate (pure format code, no daemon), so
//! the results match `qemu-img snapshot` byte for byte apart from dates.

use std::fs::{File, OpenOptions};
use std::path::PathBuf;

use clap::{ArgGroup, Args, Subcommand};
use qcow2::ops::{self, SnapshotTime};

use crate::{CliError, Result};

/// qcow2 file commands.
#[derive(Debug, Clone, Subcommand)]
pub enum Qcow2Cmd {
    /// List, create, apply or delete internal snapshots (as `qemu-img snapshot`).
    Snapshot(SnapshotArgs),
}

/// One of -l, -c, -a, -d and the file.
#[derive(Debug, Clone, Args)]
#[command(group(ArgGroup::new("op").required(true).args(["list", "create", "apply", "delete"])))]
pub struct SnapshotArgs {
    /// List the snapshots.
    #[arg(short = 'l')]
    list: bool,
    /// Create a snapshot of the active image named NAME.
    #[arg(short = 'c', value_name = "NAME")]
    create: Option<String>,
    /// Revert the active image to snapshot NAME (an id first, then a name).
    #[arg(short = 'a', value_name = "NAME")]
    apply: Option<String>,
    /// Delete the first snapshot named NAME.
    #[arg(short = 'd', value_name = "NAME")]
    delete: Option<String>,
    /// The qcow2 file.
    file: PathBuf,
}

/// Open the image and take qemu's locks for reading or changing it: a
/// running qemu that uses the image makes this fail instead.
fn open(path: &PathBuf, write: bool) -> Result<File> {
    let f = OpenOptions::new()
        .read(true)
        .write(write)
        .open(path)
        .map_err(|source| CliError::Local {
            what: format!("open {}", path.display()),
            source,
        })?;
    qcow2::lock::acquire(&f, write)?;
    Ok(f)
}

/// Run a qcow2 command.
pub fn run(cmd: Qcow2Cmd, json: bool) -> Result<()> {
    let Qcow2Cmd::Snapshot(a) = cmd;
    let mut hook = ops::no_hook;
    if a.list {
        let snaps = ops::list(&open(&a.file, false)?)?;
        if json {
            let v: Vec<_> = snaps
                .iter()
                .map(|s| {
                    serde_json::json!({
                        "id": s.id_str(), "name": s.name_str(), "date_sec": s.date_sec,
                        "date_nsec": s.date_nsec, "vm_state_size": s.vm_state_size,
                        "vm_clock_nsec": s.vm_clock_nsec, "disk_size": s.disk_size,
                    })
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        } else {
            print!("{}", qcow2::list::format(&snaps));
        }
    } else if let Some(name) = a.create {
        ops::create(&open(&a.file, true)?, &name, SnapshotTime::now(), &mut hook)?;
    } else if let Some(name) = a.apply {
        ops::apply(&open(&a.file, true)?, &name, &mut hook)?;
    } else if let Some(name) = a.delete {
        ops::delete(&open(&a.file, true)?, &name, &mut hook)?;
    }
    Ok(())
}
