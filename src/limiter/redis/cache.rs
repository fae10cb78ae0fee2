//! The over-limit cache: counters known to be over are answered without a round trip until
//! the time Redis said a request could fit again. Only enforced limits are cached (never
//! shadow-mode ones), and only requests at least as large as the one that was refused.
//! Other replicas' traffic can only make a counter fuller, so a cached "over" stays true.
//!
//! Bounded in bytes, keys included, and sharded: each shard keeps its entries ordered by
//! expiry, so making room drops the expired ones and then those closest to expiry, in
//! O(log n) per entry under one shard's lock. Dropping an entry only costs a round trip later.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

const SHARDS: usize = 16;
/// Bytes an entry costs beyond its key: two map/set slots, the shared key's header, the values.
pub const ENTRY_OVERHEAD: u64 = 96;

#[derive(Default)]
struct Shard {
    entries: HashMap<Arc<[u8]>, (Instant, u64)>,
    by_expiry: BTreeSet<(Instant, Arc<[u8]>)>,
    bytes: u64,
}

impl Shard {
    fn remove(&mut self, key: &[u8]) {
        if let Some((key, (until, _))) = self.entries.remove_entry(key) {
            self.bytes -= key.len() as u64 + ENTRY_OVERHEAD;
            self.by_expiry.remove(&(until, key));
        }
    }

    /// Drops entries, soonest to expire first, until `need` more bytes fit in `budget`.
    fn make_room(&mut self, need: u64, budget: u64) -> bool {
        while self.bytes + need > budget {
            let Some((_, key)) = self.by_expiry.first().cloned() else {
                return false;
            };
            self.remove(&key);
        }
        true
    }
}

/// A byte-bounded map from counter key to (over until, smallest refused hits).
pub struct OverLimitCache {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    shard_budget: u64,
}

impl OverLimitCache {
    /// A cache of at most `bytes` (keys and per-entry overhead included).
    pub fn new(bytes: u64) -> OverLimitCache {
        OverLimitCache {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: RandomState::new(),
            shard_budget: bytes / SHARDS as u64,
        }
    }

    fn shard(&self, key: &[u8]) -> &Mutex<Shard> {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    /// Remembers that `hits` did not fit in `key` until `until`.
    pub fn insert(&self, key: &[u8], until: Instant, hits: u64) {
        let cost = key.len() as u64 + ENTRY_OVERHEAD;
        let mut shard = self.shard(key).lock();
        shard.remove(key);
        if !shard.make_room(cost, self.shard_budget) {
            return; // a key larger than a whole shard's budget: not cached
        }
        // The newest observation replaces older ones: it reflects the counter as it is now.
        let key: Arc<[u8]> = Arc::from(key);
        shard.by_expiry.insert((until, key.clone()));
        shard.entries.insert(key, (until, hits));
        shard.bytes += cost;
    }

    /// Forgets what is known of `key`.
    pub fn remove(&self, key: &[u8]) {
        self.shard(key).lock().remove(key);
    }

    /// If `hits` on `key` are known to be over at `now`, until when.
    pub fn over_until(&self, key: &[u8], hits: u64, now: Instant) -> Option<Instant> {
        let shard = self.shard(key).lock();
        let &(until, refused) = shard.entries.get(key)?;
        (now < until && hits >= refused).then_some(until)
    }

    /// Bytes held (keys and overhead).
    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.lock().bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn answers_until_the_reset_and_for_requests_at_least_as_large() {
        let c = OverLimitCache::new(1 << 20);
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
    fn stays_within_its_bytes_dropping_the_soonest_to_expire() {
        let budget = SHARDS as u64 * 2 * (ENTRY_OVERHEAD + 8);
        let c = OverLimitCache::new(budget);
        let now = Instant::now();
        for i in 0..10_000u64 {
            // Keys of 8 bytes; later keys expire later.
            c.insert(
                format!("{i:08}").as_bytes(),
                now + Duration::from_millis(1000 + i),
                1,
            );
            assert!(c.bytes() <= budget, "{} > {budget}", c.bytes());
        }
        assert!(
            c.over_until(b"00009999", 1, now).is_some(),
            "the newest, latest-expiring entry is kept"
        );
        assert!(
            c.over_until(b"00000000", 1, now).is_none(),
            "the soonest to expire was given up"
        );
        // A key larger than a shard's budget is simply not cached.
        let huge = vec![b'x'; budget as usize];
        c.insert(&huge, now + Duration::from_secs(5), 1);
        assert!(c.over_until(&huge, 1, now).is_none());
        assert!(c.bytes() <= budget);
    }
}
