//! A snapshot's recorded working set: `working-set.json` in its directory,
//! the pages a VM restored from it touched first, in the order it touched
//! them, as runs `[first page, pages]`. The server writes it once, after
//! the snapshot's first restore (temporary name, fsync, rename, so it is
//! there whole or not at all); later restores prefetch those pages in that
//! order, and a push carries them in the manifest. It is no part of the
//! snapshot's checksummed files: a snapshot without one, or with one that
//! does not parse, is served the same, only without that prefetch.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use proto::manifest::PageRun;
use serde::{Deserialize, Serialize};

/// The working-set file in a snapshot directory.
pub const WORKING_SET_FILE: &str = "working-set.json";

/// The version of the file this server writes and reads.
const VERSION: u32 = 1;

/// The largest file read (a working set of runs of one page each over
/// 16 GiB of memory is ~60 MiB).
const MAX_BYTES: u64 = 64 << 20;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkingSetFile {
    version: u32,
    pages: Vec<PageRun>,
}

/// Why a working set cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum WorkingSetError {
    #[error("cannot {op} {}", path.display())]
    Io {
        op: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a working set of {pages} pages: {reason}", path.display())]
    Invalid {
        path: std::path::PathBuf,
        pages: u64,
        reason: String,
    },
    #[error("{} is not a working set of {pages} pages", path.display())]
    CheckRuns {
        path: std::path::PathBuf,
        pages: u64,
        #[source]
        source: RunsError,
    },
}

/// Why the runs of a working set do not fit a memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunsError {
    #[error("run {index} holds no page")]
    EmptyRun { index: usize },
    #[error("run {index} (page {first}, {pages} pages) ends past page {memory_pages}")]
    PastEnd {
        index: usize,
        first: u64,
        pages: u64,
        memory_pages: u64,
    },
    #[error("the runs hold {total} pages in all, more than the {memory_pages} of memory")]
    TooManyPages { total: u64, memory_pages: u64 },
}

/// The working set recorded in snapshot directory `dir` for `pages` pages
/// of memory: `Ok(None)` if none was recorded.
pub fn read(dir: &Path, pages: u64) -> Result<Option<Vec<PageRun>>, WorkingSetError> {
    let path = dir.join(WORKING_SET_FILE);
    let io = |op| {
        let path = path.clone();
        move |source| WorkingSetError::Io { op, path, source }
    };
    let file = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("open")(e)),
    };
    let invalid = |reason: String| WorkingSetError::Invalid {
        path: path.clone(),
        pages,
        reason,
    };
    let len = file.metadata().map_err(io("stat"))?.len();
    if len > MAX_BYTES {
        return Err(invalid(format!("{len} bytes, more than {MAX_BYTES}")));
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(file, MAX_BYTES), &mut bytes)
        .map_err(io("read"))?;
    let f: WorkingSetFile = serde_json::from_slice(&bytes).map_err(|e| invalid(e.to_string()))?;
    if f.version != VERSION {
        return Err(invalid(format!("version {}", f.version)));
    }
    check(&f.pages, pages).map_err(|source| WorkingSetError::CheckRuns {
        path: path.clone(),
        pages,
        source,
    })?;
    Ok(Some(f.pages))
}

/// Check that `runs` lie within `pages` pages and hold at most that many.
pub fn check(runs: &[PageRun], pages: u64) -> Result<(), RunsError> {
    let mut total = 0u64;
    for (index, r) in runs.iter().enumerate() {
        if r.pages == 0 {
            return Err(RunsError::EmptyRun { index });
        }
        if r.first.checked_add(r.pages).is_none_or(|end| end > pages) {
            return Err(RunsError::PastEnd {
                index,
                first: r.first,
                pages: r.pages,
                memory_pages: pages,
            });
        }
        total = total.saturating_add(r.pages);
    }
    if total > pages {
        return Err(RunsError::TooManyPages {
            total,
            memory_pages: pages,
        });
    }
    Ok(())
}

/// Write `runs` as the working set of snapshot directory `dir`
/// (replacing any), durably.
pub fn write(dir: &Path, runs: &[PageRun]) -> Result<(), WorkingSetError> {
    let path = dir.join(WORKING_SET_FILE);
    let tmp = dir.join(format!(".{WORKING_SET_FILE}.tmp"));
    let io = |op, p: &Path| {
        let path = p.to_owned();
        move |source| WorkingSetError::Io { op, path, source }
    };
    let text = serde_json::to_vec(&WorkingSetFile {
        version: VERSION,
        pages: runs.to_vec(),
    })
    .map_err(|e| WorkingSetError::Invalid {
        path: path.clone(),
        pages: 0,
        reason: e.to_string(),
    })?;
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)
        .map_err(io("create", &tmp))?;
    f.write_all(&text)
        .and_then(|()| f.sync_all())
        .map_err(io("write", &tmp))?;
    fs::rename(&tmp, &path).map_err(io("rename into", &path))?;
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("sync", dir))
}

/// Pages in the order given, as runs: consecutive pages join a run.
pub fn runs_of(pages: impl IntoIterator<Item = u64>) -> Vec<PageRun> {
    let mut runs: Vec<PageRun> = Vec::new();
    for p in pages {
        match runs.last_mut() {
            Some(r) if r.first + r.pages == p => r.pages += 1,
            _ => runs.push(PageRun { first: p, pages: 1 }),
        }
    }
    runs
}

/// Pages in `runs`.
pub fn page_count(runs: &[PageRun]) -> u64 {
    runs.iter().map(|r| r.pages).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn working_sets_round_trip_and_bad_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path(), 100).unwrap().is_none());
        let runs = runs_of([5, 6, 7, 1, 2, 50]);
        assert_eq!(
            runs,
            [
                PageRun { first: 5, pages: 3 },
                PageRun { first: 1, pages: 2 },
                PageRun {
                    first: 50,
                    pages: 1
                }
            ]
        );
        write(dir.path(), &runs).unwrap();
        assert_eq!(read(dir.path(), 100).unwrap().unwrap(), runs);
        assert_eq!(page_count(&runs), 6);
        // Past the end of a smaller memory.
        assert!(matches!(
            read(dir.path(), 50),
            Err(WorkingSetError::CheckRuns {
                source: RunsError::PastEnd { index: 2, .. },
                ..
            })
        ));
        std::fs::write(dir.path().join(WORKING_SET_FILE), b"{\"version\":1}").unwrap();
        assert!(read(dir.path(), 100).is_err());
    }

    #[test]
    fn runs_that_do_not_fit_the_memory_say_which_and_why() {
        let run = |first, pages| PageRun { first, pages };
        assert_eq!(check(&[run(0, 10), run(90, 10)], 100), Ok(()));
        assert_eq!(
            check(&[run(0, 10), run(5, 0)], 100),
            Err(RunsError::EmptyRun { index: 1 })
        );
        assert_eq!(
            check(&[run(95, 10)], 100),
            Err(RunsError::PastEnd {
                index: 0,
                first: 95,
                pages: 10,
                memory_pages: 100
            })
        );
        assert!(matches!(
            check(&[run(u64::MAX, 2)], 100),
            Err(RunsError::PastEnd { index: 0, .. })
        ));
        // Overlapping runs: each fits, not all of them.
        assert_eq!(
            check(&[run(0, 60), run(0, 60)], 100),
            Err(RunsError::TooManyPages {
                total: 120,
                memory_pages: 100
            })
        );
    }
}
