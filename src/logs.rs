//! Log lines that repeat while a condition lasts (a store down, a collector away, every request
//! answered by the failure mode) pass at most once per interval, each saying how many were
//! held back since the last: an outage is in the log at once and stays readable, not one line
//! per request.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// How often a repeated line passes, by default.
pub(crate) const EVERY: Duration = Duration::from_secs(10);

/// One repeated line's gate (a `static` beside the line).
#[derive(Debug)]
pub(crate) struct Throttle {
    every_ms: u64,
    /// When the next line may pass, in ms since the process's first throttled line.
    next_ms: AtomicU64,
    /// Lines held back since the last that passed.
    held: AtomicU64,
}

impl Throttle {
    /// A line that passes at most once per `every`.
    pub(crate) const fn new(every: Duration) -> Throttle {
        Throttle {
            every_ms: every.as_millis() as u64,
            next_ms: AtomicU64::new(0),
            held: AtomicU64::new(0),
        }
    }

    /// Whether the line may be written now: with how many were held back since the last, or
    /// `None` (it is counted as held back).
    pub(crate) fn pass(&self) -> Option<u64> {
        static START: OnceLock<Instant> = OnceLock::new();
        let now = START.get_or_init(Instant::now).elapsed().as_millis() as u64;
        let next = self.next_ms.load(Ordering::Relaxed);
        if now < next
            || self
                .next_ms
                .compare_exchange(
                    next,
                    now + self.every_ms,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            self.held.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.held.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_line_passes_once_per_interval_with_what_was_held_back() {
        let t = Throttle::new(Duration::from_secs(10));
        assert_eq!(t.pass(), Some(0));
        for _ in 0..5 {
            assert_eq!(t.pass(), None);
        }
        tokio::time::advance(Duration::from_millis(9_999)).await;
        assert_eq!(t.pass(), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(t.pass(), Some(6));
        assert_eq!(t.pass(), None);
    }
}
