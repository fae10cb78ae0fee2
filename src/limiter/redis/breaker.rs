//! A small circuit breaker: after a few consecutive failures, stop calling Redis for a short
//! cool-down so a dead Redis costs one timeout per cool-down, not one per request. After the
//! cool-down one probe goes through; its success closes the circuit, its failure re-opens it.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Consecutive failures that open the circuit.
const THRESHOLD: u32 = 3;
/// How long the circuit stays open before a probe.
pub const COOL_DOWN: Duration = Duration::from_millis(500);

/// Closed (calls go through), open (calls fail at once) or half-open (one probe in flight).
pub struct Breaker {
    failures: AtomicU32,
    open_until: Mutex<Option<Instant>>,
    probing: AtomicBool,
}

impl Breaker {
    /// A closed breaker.
    pub fn new() -> Breaker {
        Breaker {
            failures: AtomicU32::new(0),
            open_until: Mutex::new(None),
            probing: AtomicBool::new(false),
        }
    }

    /// Whether a call may go to Redis now.
    pub fn allow(&self) -> bool {
        let Some(until) = *self.open_until.lock() else {
            return true;
        };
        if Instant::now() < until {
            return false;
        }
        // Half-open: exactly one probe.
        self.probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Records a successful call.
    pub fn on_success(&self) {
        self.failures.store(0, Ordering::Release);
        *self.open_until.lock() = None;
        self.probing.store(false, Ordering::Release);
    }

    /// Records a failed call.
    pub fn on_failure(&self) {
        let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if failures >= THRESHOLD || self.probing.load(Ordering::Acquire) {
            *self.open_until.lock() = Some(Instant::now() + COOL_DOWN);
            self.probing.store(false, Ordering::Release);
        }
    }

    /// True unless the circuit is open or half-open.
    #[cfg(test)]
    fn is_closed(&self) -> bool {
        self.open_until.lock().is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_repeated_failures_and_probes_once() {
        let b = Breaker::new();
        for _ in 0..THRESHOLD {
            assert!(b.allow());
            b.on_failure();
        }
        assert!(!b.allow());
        assert!(!b.is_closed());
        *b.open_until.lock() = Some(Instant::now()); // the cool-down has passed
        assert!(b.allow(), "one probe");
        assert!(!b.allow(), "only one");
        b.on_failure();
        assert!(!b.allow(), "a failed probe re-opens");
        *b.open_until.lock() = Some(Instant::now());
        assert!(b.allow());
        b.on_success();
        assert!(b.is_closed() && b.allow() && b.allow());
    }
}
