//! The over-limit cache: counters known to be over are answered without a round trip until
//! the time Redis said a request could fit again. Only enforced limits are cached (never
//! shadow-mode ones), and only requests at least as large as the one that was refused.
//! Other replicas' traffic can only make a counter fuller, so a cached "over" stays true,
//! except where an operator intervenes, and each such case is covered:
//! - a reload that changes a limit: an entry answers only for the limit it was learned under
//!   (requests_per_unit and burst; algorithm and window are part of the key);
//! - an admin reset through another replica: an entry answers for at most [`MAX_AGE`], so every
//!   replica sees a reset within a second, at the cost of one round trip per over-limit counter
//!   per second.
//!
//! Bounded in bytes, keys included, and sharded: each shard keeps its entries ordered by
//! expiry, so making room drops the expired ones and then those closest to expiry, in
//! O(log n) per entry under one shard's lock. Dropping an entry only costs a round trip later.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use parking_lot::Mutex;

const SHARDS: usize = 16;
/// How long an entry answers before Redis is asked again.
pub(super) const MAX_AGE: Duration = Duration::from_secs(1);
/// Bytes an entry costs beyond its key: two map/set slots, the shared key's header, the values.
pub(super) const ENTRY_OVERHEAD: u64 = 96;

/// What is known of one counter.
struct Known {
    /// When a request of `refused` hits fits again, as Redis said.
    until: Instant,
    /// When this entry stops answering: `until`, or [`MAX_AGE`] after it was learned.
    fresh_until: Instant,
    /// The smallest request refused.
    refused: u64,
    /// The limit it was refused under: (requests_per_unit, burst).
    limit: (u64, u64),
}

#[derive(Default)]
struct CacheShard {
    entries: HashMap<Arc<[u8]>, Known>,
    /// By `fresh_until`.
    by_expiry: BTreeSet<(Instant, Arc<[u8]>)>,
    bytes: u64,
}

impl CacheShard {
    fn remove(&mut self, key: &[u8]) {
        if let Some((key, e)) = self.entries.remove_entry(key) {
            self.bytes -= key.len() as u64 + ENTRY_OVERHEAD;
            self.by_expiry.remove(&(e.fresh_until, key));
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

/// A byte-bounded map from counter key to what is known of it: over until when, for requests of
/// how many hits, under which limit.
pub(super) struct OverLimitCache {
    shards: Box<[Mutex<CacheShard>]>,
    hasher: RandomState,
    shard_budget: u64,
}

impl OverLimitCache {
    /// A cache of at most `bytes` (keys and per-entry overhead included).
    pub(super) fn new(bytes: u64) -> OverLimitCache {
        OverLimitCache {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(CacheShard::default()))
                .collect(),
            hasher: RandomState::new(),
            shard_budget: bytes / SHARDS as u64,
        }
    }

    fn shard(&self, key: &[u8]) -> &Mutex<CacheShard> {
        &self.shards[self.hasher.hash_one(key) as usize % SHARDS]
    }

    /// Remembers that `hits` did not fit in `key` under `limit` (requests_per_unit, burst) until
    /// `until`, as learned at `now`.
    pub(super) fn insert(
        &self,
        key: &[u8],
        limit: (u64, u64),
        now: Instant,
        until: Instant,
        hits: u64,
    ) {
        let cost = key.len() as u64 + ENTRY_OVERHEAD;
        let mut shard = self.shard(key).lock();
        shard.remove(key);
        if !shard.make_room(cost, self.shard_budget) {
            return; // a key larger than a whole shard's budget: not cached
        }
        // The newest observation replaces older ones: it reflects the counter as it is now.
        let key: Arc<[u8]> = Arc::from(key);
        let fresh_until = until.min(now + MAX_AGE);
        shard.by_expiry.insert((fresh_until, key.clone()));
        shard.entries.insert(
            key,
            Known {
                until,
                fresh_until,
                refused: hits,
                limit,
            },
        );
        shard.bytes += cost;
    }

    /// Forgets what is known of `key`.
    pub(super) fn remove(&self, key: &[u8]) {
        self.shard(key).lock().remove(key);
    }

    /// If `hits` on `key` under `limit` are known to be over at `now`, until when.
    pub(super) fn over_until(
        &self,
        key: &[u8],
        limit: (u64, u64),
        hits: u64,
        now: Instant,
    ) -> Option<Instant> {
        let shard = self.shard(key).lock();
        let e = shard.entries.get(key)?;
        (now < e.fresh_until && hits >= e.refused && limit == e.limit).then_some(e.until)
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

    const L: (u64, u64) = (3, 3);

    #[test]
    fn answers_until_the_reset_and_for_requests_at_least_as_large() {
        let c = OverLimitCache::new(1 << 20);
        let now = Instant::now();
        c.insert(b"k", L, now, now + Duration::from_millis(900), 2);
        assert!(c.over_until(b"k", L, 2, now).is_some());
        assert!(c.over_until(b"k", L, 5, now).is_some());
        assert!(
            c.over_until(b"k", L, 1, now).is_none(),
            "a smaller request may fit"
        );
        assert!(
            c.over_until(b"k", L, 2, now + Duration::from_secs(1))
                .is_none()
        );
        assert!(c.over_until(b"other", L, 2, now).is_none());
    }

    #[test]
    fn an_entry_answers_only_for_its_limit_and_for_at_most_a_second() {
        let c = OverLimitCache::new(1 << 20);
        let now = Instant::now();
        let hour = now + Duration::from_secs(3600);
        c.insert(b"k", L, now, hour, 1);
        assert_eq!(
            c.over_until(b"k", L, 1, now),
            Some(hour),
            "the reset Redis gave"
        );
        assert!(
            c.over_until(b"k", (100, 100), 1, now).is_none(),
            "a reload raised the limit"
        );
        assert!(
            c.over_until(b"k", L, 1, now + MAX_AGE).is_none(),
            "a second later, Redis is asked again (a reset elsewhere shows)"
        );
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
                L,
                now,
                now + Duration::from_millis(1 + i / 20),
                1,
            );
            assert!(c.bytes() <= budget, "{} > {budget}", c.bytes());
        }
        assert!(
            c.over_until(b"00009999", L, 1, now).is_some(),
            "the newest, latest-expiring entry is kept"
        );
        assert!(
            c.over_until(b"00000000", L, 1, now).is_none(),
            "the soonest to expire was given up"
        );
        // A key larger than a shard's budget is simply not cached.
        let huge = vec![b'x'; budget as usize];
        c.insert(&huge, L, now, now + Duration::from_secs(5), 1);
        assert!(c.over_until(&huge, L, 1, now).is_none());
        assert!(c.bytes() <= budget);
    }
}
