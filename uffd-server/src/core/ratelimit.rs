//! Rate-limited warnings for the fault path.
//!
//! A fault that keeps failing (a bad image, a dying VMM) can repeat
//! thousands of times a second; logging each one floods the log and costs
//! the core thread more than the fault itself. Each VM keeps one
//! [`RateLimit`]: the first warning is logged, then at most one per
//! interval, carrying the count of those suppressed in between.

use std::time::{Duration, Instant};

/// One warning per interval, with the number suppressed since the last.
#[derive(Debug, Clone)]
pub struct RateLimit {
    interval: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl Default for RateLimit {
    fn default() -> Self {
        RateLimit::new(Duration::from_secs(1))
    }
}

impl RateLimit {
    /// At most one warning per `interval`.
    pub fn new(interval: Duration) -> Self {
        RateLimit {
            interval,
            last: None,
            suppressed: 0,
        }
    }

    /// Whether a warning may be logged now: `Some(n)` with the `n` warnings
    /// suppressed since the last one logged, or `None` (and it is counted).
    pub fn allow(&mut self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    fn allow_at(&mut self, now: Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|t| now.saturating_duration_since(t) < self.interval)
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// `" (N similar suppressed)"` when N > 0, for the end of a warning.
pub fn suppressed_note(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(" ({n} similar suppressed)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_warning_per_interval_with_the_count_of_the_rest() {
        let mut r = RateLimit::new(Duration::from_secs(1));
        let t0 = Instant::now();
        assert_eq!(r.allow_at(t0), Some(0));
        for i in 1..=500 {
            assert_eq!(r.allow_at(t0 + Duration::from_micros(i)), None);
        }
        assert_eq!(r.allow_at(t0 + Duration::from_millis(1001)), Some(500));
        assert_eq!(r.allow_at(t0 + Duration::from_millis(1002)), None);
    }
}
