//! The server's file descriptors against its limit. Every VM holds a few
//! (its uffd, its memfd, its VMM socket, an image), every API client one:
//! running out makes VM creation and API accepts fail. A watcher thread
//! counts `/proc/self/fd` now and then and says so in the log while the
//! count is high, before anything fails.

use std::time::Duration;

use tracing::{info, warn};

/// Open file descriptors of this process. Admission asks before every
/// create, so this is the kernel's count where it gives one (the size of
/// `/proc/self/fd`, Linux 6.2 on), one `stat` however many are open; older
/// kernels report 0 there and the directory is read (one more fd for a
/// moment, counted).
pub fn open_fds() -> std::io::Result<u64> {
    match std::fs::metadata("/proc/self/fd")?.len() {
        0 => Ok(std::fs::read_dir("/proc/self/fd")?.count() as u64),
        n => Ok(n),
    }
}

/// The soft `RLIMIT_NOFILE`.
pub fn fd_limit() -> Option<u64> {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .ok()
        .map(|(soft, _)| soft)
}

/// How full the fd table is, in the levels the log speaks of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Under 70 % of the limit.
    Fine,
    /// 80 % or more.
    Low,
    /// 95 % or more.
    Critical,
}

/// The level of `open` fds out of `limit`, given the level before (a
/// level is left only well below it, so a count moving around one
/// threshold does not fill the log).
pub fn level(open: u64, limit: u64, before: Level) -> Level {
    let pct = open.saturating_mul(100) / limit.max(1);
    match pct {
        95.. => Level::Critical,
        80.. if before < Level::Critical => Level::Low,
        80.. => Level::Critical,
        70.. => before.min(Level::Low),
        _ => Level::Fine,
    }
}

/// Start the watcher: every `every`, count the fds and log when the level
/// rises (a warning naming the count, the limit and what to do) and when
/// it is back to fine.
pub fn watch(every: Duration) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("fd-watch".into())
        .spawn(move || {
            let mut was = Level::Fine;
            loop {
                std::thread::sleep(every);
                let (Ok(open), Some(limit)) = (open_fds(), fd_limit()) else {
                    continue;
                };
                let now = level(open, limit, was);
                if now > was {
                    warn!(
                        "file descriptors running low: {open} open of a limit of {limit}; \
                         new VMs and API clients will fail at the limit: raise it \
                         (ulimit -n, LimitNOFILE=) or delete VMs"
                    );
                } else if now == Level::Fine && was != Level::Fine {
                    info!("file descriptors back to {open} open of a limit of {limit}");
                }
                was = now;
            }
        })
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_rise_at_80_and_95_percent_and_fall_only_below_70() {
        assert_eq!(level(10, 100, Level::Fine), Level::Fine);
        assert_eq!(level(79, 100, Level::Fine), Level::Fine);
        assert_eq!(level(80, 100, Level::Fine), Level::Low);
        assert_eq!(level(95, 100, Level::Low), Level::Critical);
        // Between 70 and 80 % a level holds (or drops from critical to low).
        assert_eq!(level(75, 100, Level::Low), Level::Low);
        assert_eq!(level(75, 100, Level::Critical), Level::Low);
        assert_eq!(level(75, 100, Level::Fine), Level::Fine);
        assert_eq!(level(85, 100, Level::Critical), Level::Critical);
        assert_eq!(level(69, 100, Level::Critical), Level::Fine);
    }

    #[test]
    fn this_process_has_fds_and_a_limit() {
        assert!(open_fds().unwrap() >= 3);
        assert!(fd_limit().unwrap() >= open_fds().unwrap());
    }
}
