//! The over-limit cache: counters known to be over are answered without a round trip until
//! the time Redis said a request could fit again. Only enforced limits are cached (never
//! shadow-mode ones), and only requests at least as large as the one that was refused.
//! Other replicas' traffic can only make a counter fuller, so a cached "over" stays true.

use std::collections::HashMap;
use std::time::Instant;

use parking_lot::Mutex;

/// A bounded map from counter key to (over until, smallest refused hits).
pub struct OverLimitCache {
    entries: Mutex<HashMap<Vec<u8>, (Instant, u64)>>,
    capacity: usize,
}

impl OverLimitCache {
    /// A cache of at most `capacity` entries.
    pub fn new(capacity: usize) -> OverLimitCache {
        OverLimitCache {
            entries: Mutex::new(HashMap::with_capacity(capacity.min(4096))),
            capacity,
        }
    }

    /// Remembers that `hits` did not fit in `key` until `until`.
    pub fn insert(&self, key: &[u8], until: Instant, hits: u64) {
        let mut entries = self.entries.lock();
        if entries.len() >= self.capacity && !entries.contains_key(key) {
            let now = Instant::now();
            entries.retain(|_, (u, _)| *u > now);
            if entries.len() >= self.capacity {
                return; // full of live entries: skip rather than evict at random
            }
        }
        // The newest observation replaces older ones: it reflects the counter as it is now.
        entries.insert(key.to_vec(), (until, hits));
    }

    /// If `hits` on `key` are known to be over at `now`, until when.
    pub fn over_until(&self, key: &[u8], hits: u64, now: Instant) -> Option<Instant> {
        let entries = self.entries.lock();
        let &(until, refused) = entries.get(key)?;
        (now < until && hits >= refused).then_some(until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn answers_until_the_reset_and_for_requests_at_least_as_large() {
        let c = OverLimitCache::new(2);
        let now = Instant::now();
        c.insert(b"k", now + Duration::from_secs(1), 2);
        assert!(c.over_until(b"k", 2, now).is_some());
        assert!(c.over_until(b"k", 5, now).is_some());
        assert!(
            c.over_until(b"k", 1, now).is_none(),
            "a smaller request may fit"
        );
        assert!(
            c.over_until(b"k", 2, now + Duration::from_secs(2))
                .is_none()
        );
        assert!(c.over_until(b"other", 2, now).is_none());
    }

    #[test]
    fn stays_bounded() {
        let c = OverLimitCache::new(2);
        let later = Instant::now() + Duration::from_secs(60);
        for k in [b"a", b"b", b"c"] {
            c.insert(k, later, 1);
        }
        assert_eq!(c.entries.lock().len(), 2);
    }
}
