//! The embedded backend: counters in this process, sharded behind mutexes.
//!
//! Guarantees: exact under any number of concurrent callers (a request holds the locks of every
//! shard its keys live in, taken in shard order, for its check and commit), all-or-nothing per
//! request, and bounded memory: expired counters are swept from a shard whenever it has doubled
//! since its last sweep, and by [`MemoryBackend::sweep`]. Counts are per process: replicas
//! do not share them (use the Redis backend for that).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use super::algorithm::State;
use super::{Backend, BackendError, BoxFuture, Clock, Hit, Outcome, SystemClock, admits};

const SHARDS: usize = 64;
const MIN_SWEEP_LEN: usize = 256;

struct Entry {
    state: State,
    expires_at: u64,
}

#[derive(Default)]
struct Shard {
    entries: HashMap<Vec<u8>, Entry>,
    /// Sweep when `entries.len()` reaches this; doubles with the live set (amortized O(1)).
    sweep_at: usize,
}

impl Shard {
    fn sweep(&mut self, now: u64) {
        self.entries.retain(|_, e| e.expires_at > now);
        self.sweep_at = (self.entries.len() * 2).max(MIN_SWEEP_LEN);
    }
}

/// In-process counters with the same semantics as the Redis backend.
pub struct MemoryBackend {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new(Arc::new(SystemClock))
    }
}

impl MemoryBackend {
    /// A backend that reads time from `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: RandomState::new(),
            clock,
        }
    }

    fn shard_of(&self, key: &[u8]) -> usize {
        (self.hasher.hash_one(key) as usize) % SHARDS
    }

    /// Number of counters held, expired or not (for tests and metrics).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().entries.len()).sum()
    }

    /// True when no counter is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every expired counter now.
    pub fn sweep(&self) {
        let now = self.clock.now_us();
        for shard in self.shards.iter() {
            shard.lock().sweep(now);
        }
    }

    /// Decides synchronously; [`Backend::decide`] wraps this.
    pub fn decide_now(&self, hits: &[Hit]) -> Outcome {
        let now = self.clock.now_us();
        let shard_ids: Vec<usize> = hits
            .iter()
            .map(|h| self.shard_of(h.key.as_bytes()))
            .collect();
        let mut order = shard_ids.clone();
        order.sort_unstable();
        order.dedup();
        // Locks in ascending shard order, so concurrent requests cannot deadlock.
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, self.shards[i].lock())).collect();
        let guard_of = |shard: usize| order.binary_search(&shard).expect("locked shard");

        let mut verdicts = Vec::with_capacity(hits.len());
        for (hit, &shard) in hits.iter().zip(&shard_ids) {
            let entries = &mut guards[guard_of(shard)].1.entries;
            let verdict = match entries.get_mut(hit.key.as_bytes()) {
                Some(e) if e.state.is(hit.limit.algorithm) => {
                    e.state.check(&hit.limit, now, hit.hits)
                }
                _ => State::new(hit.limit.algorithm).check(&hit.limit, now, hit.hits),
            };
            verdicts.push(verdict);
        }

        let admitted = admits(hits, |i| verdicts[i].over);
        if admitted {
            for ((hit, &shard), verdict) in hits.iter().zip(&shard_ids).zip(&verdicts) {
                if verdict.over || hit.hits == 0 {
                    continue; // an over-limit shadow or quota hit has nothing to take
                }
                let (_, shard) = &mut guards[guard_of(shard)];
                commit(shard, hit, now);
            }
        }
        Outcome { admitted, verdicts }
    }
}

fn commit(shard: &mut Shard, hit: &Hit, now: u64) {
    let limit = &hit.limit;
    if shard.entries.len() >= shard.sweep_at {
        shard.sweep(now);
    }
    let entry = shard
        .entries
        .entry(hit.key.as_bytes().to_vec())
        .or_insert_with(|| Entry {
            state: State::new(limit.algorithm),
            expires_at: 0,
        });
    if !entry.state.is(limit.algorithm) {
        entry.state = State::new(limit.algorithm);
    }
    entry.state.commit(limit, now, hit.hits);
    entry.expires_at = entry.state.expires_at(limit);
}

impl Backend for MemoryBackend {
    fn decide<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<Outcome, BackendError>> {
        Box::pin(std::future::ready(Ok(self.decide_now(hits))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{Algorithm, CounterKey, Enforcement, Limit, ManualClock};
    use std::time::Duration;

    const T0: u64 = 1_800_000_000_000_000;

    fn hit(key: &str, algorithm: Algorithm, rpu: u64) -> Hit {
        Hit {
            key: CounterKey::new("test", [("k", key)]),
            limit: Limit {
                algorithm,
                requests_per_unit: rpu,
                window_us: 1_000_000,
                burst: rpu,
            },
            hits: 1,
            enforcement: Enforcement::Enforce,
        }
    }

    #[test]
    fn rejected_requests_consume_nothing() {
        let clock = ManualClock::new(T0);
        let backend = MemoryBackend::new(Arc::new(clock));
        let roomy = hit("roomy", Algorithm::FixedWindow, 10);
        let tight = hit("tight", Algorithm::FixedWindow, 1);
        assert!(backend.decide_now(&[roomy.clone(), tight.clone()]).admitted);
        let out = backend.decide_now(&[roomy.clone(), tight.clone()]);
        assert!(!out.admitted);
        assert_eq!(out.verdicts[0].remaining, 8, "checked, not consumed");
        let out = backend.decide_now(&[roomy]);
        assert_eq!(
            out.verdicts[0].remaining, 8,
            "the rejected request took nothing"
        );
    }

    #[test]
    fn exact_under_concurrency_for_every_algorithm() {
        for algorithm in Algorithm::ALL {
            let backend = Arc::new(MemoryBackend::new(Arc::new(ManualClock::new(T0))));
            let admitted = std::sync::atomic::AtomicU64::new(0);
            std::thread::scope(|s| {
                for t in 0..8 {
                    let backend = &backend;
                    let admitted = &admitted;
                    s.spawn(move || {
                        for i in 0..50 {
                            // Every request touches the shared key plus a private one, so
                            // requests lock different shard sets in different orders.
                            let hits = [
                                hit(&format!("own-{t}-{i}"), algorithm, 5),
                                hit("shared", algorithm, 100),
                            ];
                            if backend.decide_now(&hits).admitted {
                                admitted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            }
                        }
                    });
                }
            });
            assert_eq!(admitted.into_inner(), 100, "{algorithm}");
        }
    }

    #[test]
    fn memory_stays_bounded_under_a_stream_of_distinct_keys() {
        let clock = ManualClock::new(T0);
        let backend = MemoryBackend::new(Arc::new(clock.clone()));
        for i in 0..200_000u64 {
            backend.decide_now(&[hit(&i.to_string(), Algorithm::FixedWindow, 10)]);
            clock.advance(Duration::from_micros(100)); // 10 000 keys per 1 s window
        }
        let held = backend.len();
        // ~10 000 live keys; a shard sweeps when it doubles, or at 256 entries.
        assert!(held < 30_000, "{held} counters held");
        clock.advance(Duration::from_secs(5));
        backend.sweep();
        assert!(backend.is_empty());
    }
}
