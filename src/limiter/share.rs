//! The `share` failure mode: while Redis cannot be reached, each replica decides alone on its
//! share of what the last replies said was left, and when Redis is back writes the hits it
//! admitted into the counters before it asks Redis again, so that the budget holds across the
//! outage.
//!
//! - **What is kept.** Every answer from Redis tells what is left of each counter the request
//!   touched (a verdict's `remaining`). [`Shares`] keeps the latest per counter, with when it
//!   was seen, within [`SEEN_MAX_BYTES`].
//! - **Deciding alone.** Once a call fails, every request is decided in this process (the
//!   memory backend, its own algorithms) with each limit at `1/n` of its size, `n` being the
//!   replicas alive on the same Redis as last counted there. The first time a counter is
//!   decided alone, its local counter starts at `1/n` of what was left at its last reply (a
//!   counter never seen, or seen in a window that has ended, starts empty: `1/n` of the whole
//!   limit). Fixed windows then start afresh at the window's end; the other algorithms free
//!   what was used as they would.
//! - **Writing back.** The hits admitted (and costs reported) alone are owed to Redis. Once
//!   Redis answers again, a task sends them as cost reports, each into its counter if the
//!   window it was admitted in is still current; requests go to Redis again only when nothing
//!   is owed. A counter decided alone stays in the ledger until Redis has answered for it
//!   again: an outage that follows at once goes on from the local counter, not from the
//!   reply seen before the first.
//!
//! The bound: the `n` replicas together admit at most what was left at the oldest of their last
//! replies. The budget is exceeded by at most what the fleet admitted between a counter's
//! oldest last reply and the outage, plus what the new master had not yet received from the
//! old one (replication lag), plus, for a counter a replica never saw in its window, that
//! replica's share of the whole limit. Concurrency limits' places are decided alone at `1/n`
//! of the places free at the last reply and not written back (a place taken alone is released
//! alone, or ends with its lifetime); refunds while alone are given back locally only (Redis
//! keeps the hits: it errs toward refusing).

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use parking_lot::Mutex;

use super::{
    Algorithm, Clock, CounterKey, Enforcement, Hit, HitKind, Hold, Limit, MemoryBackend, Outcome,
};

/// Bytes the last replies may keep (keys and bookkeeping): past a shard's part of it, the
/// shard drops what it holds and starts again. 16 MiB hold about 100,000 counters of 100-byte
/// keys.
pub(crate) const SEEN_MAX_BYTES: usize = 16 << 20;
/// Bytes the ledger of counters decided alone may keep: past it, a request touching a counter
/// new to it is refused (what cannot be written back is not admitted).
pub(crate) const OWED_MAX_BYTES: usize = 16 << 20;
/// What an entry costs beside its key's bytes.
const ENTRY_OVERHEAD: usize = 96;
const SHARDS: usize = 16;
/// Cost reports per call when writing back.
pub(crate) const WRITE_BACK_BATCH: usize = 64;

/// What the last reply said of a counter.
#[derive(Clone, Copy, Debug)]
struct LastReply {
    /// Hits (or places) left.
    remaining: u64,
    /// When (µs, this process's clock).
    at: u64,
}

#[derive(Default)]
struct LastReplies {
    map: HashMap<CounterKey, LastReply>,
    bytes: usize,
}

/// What a counter owes Redis: hits admitted alone and not yet written back.
struct Owed {
    /// The hit as the config gives it (its whole limit), as the report is sent.
    hit: Hit,
    /// Hits admitted (or reported) alone and not yet written back.
    hits: u64,
    /// When the first of them was (µs).
    at: u64,
}

#[derive(Default)]
struct ShareLedger {
    /// Every counter decided alone since Redis last answered for it: its local counter is
    /// seeded (a later outage goes on from it), and what it owes.
    owed: HashMap<CounterKey, Owed>,
    bytes: usize,
    /// Deciding alone: set by a failed call, cleared once every hit owed is written back.
    alone: bool,
    /// A task is writing back (see `failure_mode.rs`).
    rejoining: bool,
}

/// The replicas alive on one Redis as last counted there (1 until they are): set by the
/// backend's presence marks (`redis/presence.rs`), read by the shares cut from it.
#[derive(Clone, Debug)]
pub(crate) struct ReplicaCount(Arc<AtomicU32>);

impl Default for ReplicaCount {
    fn default() -> Self {
        ReplicaCount(Arc::new(AtomicU32::new(1)))
    }
}

impl ReplicaCount {
    /// The count (at least 1: this replica).
    pub(crate) fn get(&self) -> u32 {
        self.0.load(Ordering::Relaxed).max(1)
    }

    /// Records a new count.
    pub(crate) fn set(&self, n: u32) {
        self.0.store(n, Ordering::Relaxed);
    }
}

/// The share mode's state: the last replies, the replicas counted, and the ledger.
pub(crate) struct Shares {
    seen: Vec<Mutex<LastReplies>>,
    hasher: RandomState,
    ledger: Mutex<ShareLedger>,
    /// The ledger holds a counter (read without its lock on every answer).
    ledger_used: AtomicBool,
    /// `ledger.alone`, read without the lock on every request.
    alone: AtomicBool,
    /// Replicas alive on the store, as last counted there.
    replicas: ReplicaCount,
    /// How long a request waits for Redis before it is decided alone.
    after: std::time::Duration,
    local: Arc<MemoryBackend>,
    clock: Arc<dyn Clock>,
}

/// Whether what was seen at `at` still describes the counter at `now`: the same fixed window,
/// or (other algorithms) less than a window ago.
fn current(limit: &Limit, at: u64, now: u64) -> bool {
    match limit.algorithm {
        Algorithm::FixedWindow => limit.window_at(at) == limit.window_at(now),
        _ => now.saturating_sub(at) < limit.window_us,
    }
}

/// `limit` at `1/n` of its size.
fn scaled(limit: &Limit, n: u64) -> Limit {
    Limit {
        requests_per_unit: limit.requests_per_unit / n,
        burst: limit.burst / n,
        ..*limit
    }
}

/// What a local counter of `limit` (already scaled) holds when full.
fn capacity(limit: &Limit) -> u64 {
    match limit.algorithm {
        Algorithm::TokenBucket => limit.burst,
        _ => limit.requests_per_unit,
    }
}

/// Every hit over, none consumed.
fn refused(hits: &[Hit]) -> Outcome {
    Outcome {
        admitted: false,
        verdicts: hits
            .iter()
            .map(|_| super::Verdict {
                over: true,
                remaining: 0,
                fits: 0,
                reset: std::time::Duration::ZERO,
            })
            .collect(),
        places: Vec::new(),
    }
}

impl Shares {
    /// Empty; decides alone on `local` (the counters it keeps for this mode), cutting each
    /// limit by `replicas` (kept up to date by the caller), a request that Redis has not
    /// answered `after` its start included.
    pub(crate) fn new(
        local: Arc<MemoryBackend>,
        clock: Arc<dyn Clock>,
        replicas: ReplicaCount,
        after: std::time::Duration,
    ) -> Shares {
        Shares {
            seen: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            ledger: Mutex::default(),
            ledger_used: AtomicBool::new(false),
            alone: AtomicBool::new(false),
            replicas,
            after,
            local,
            clock,
        }
    }

    /// How long a request waits for Redis before it is decided alone.
    pub(crate) fn after(&self) -> std::time::Duration {
        self.after
    }

    /// Whether requests are decided alone (until what is owed is written back).
    pub(crate) fn is_alone(&self) -> bool {
        self.alone.load(Ordering::Acquire)
    }

    fn shard(&self, key: &CounterKey) -> &Mutex<LastReplies> {
        let h = self.hasher.hash_one(key.as_bytes()) as usize;
        &self.seen[h % SHARDS]
    }

    /// Keeps what Redis answered for `hits`; a counter it answered for, whose hits owed are
    /// written back, leaves the ledger (the next outage seeds it from this answer).
    pub(crate) fn saw(&self, hits: &[Hit], outcome: &Outcome) {
        let now = self.clock.now_us();
        let shard_budget = SEEN_MAX_BYTES / SHARDS;
        for (hit, verdict) in hits.iter().zip(&outcome.verdicts) {
            if hit.kind == HitKind::Refund {
                continue;
            }
            let seen = LastReply {
                remaining: verdict.remaining,
                at: now,
            };
            let mut shard = self.shard(&hit.key).lock();
            if let Some(s) = shard.map.get_mut(&hit.key) {
                *s = seen;
                continue;
            }
            let cost = hit.key.as_bytes().len() + ENTRY_OVERHEAD;
            if shard.bytes + cost > shard_budget {
                shard.map.clear();
                shard.bytes = 0;
            }
            shard.bytes += cost;
            shard.map.insert(hit.key.clone(), seen);
        }
        if self.ledger_used.load(Ordering::Acquire) {
            let mut ledger = self.ledger.lock();
            for hit in hits {
                if ledger.owed.get(&hit.key).is_some_and(|o| o.hits == 0) {
                    ledger.owed.remove(&hit.key);
                    ledger.bytes -= hit.key.as_bytes().len() + ENTRY_OVERHEAD;
                }
            }
            self.ledger_used
                .store(!ledger.owed.is_empty(), Ordering::Release);
        }
    }

    fn last_seen(&self, hit: &Hit, now: u64) -> Option<u64> {
        let seen = *self.shard(&hit.key).lock().map.get(&hit.key)?;
        current(&hit.limit, seen.at, now).then_some(seen.remaining)
    }

    /// A call to Redis failed: decides `hits` alone (from now on every request is, until what
    /// is owed is written back). Whether a task must be started to write back.
    pub(crate) fn degrade(&self, hits: &[Hit]) -> (Outcome, bool) {
        let mut ledger = self.ledger.lock();
        ledger.alone = true;
        self.alone.store(true, Ordering::Release);
        let start = !std::mem::replace(&mut ledger.rejoining, true);
        (self.decide(&mut ledger, hits), start)
    }

    /// Decides `hits` alone if requests still are; `None`: Redis has everything owed, ask it.
    pub(crate) fn decide_alone(&self, hits: &[Hit]) -> Option<Outcome> {
        let mut ledger = self.ledger.lock();
        ledger.alone.then(|| self.decide(&mut ledger, hits))
    }

    fn decide(&self, ledger: &mut ShareLedger, hits: &[Hit]) -> Outcome {
        let n = u64::from(self.replicas.get());
        let now = self.clock.now_us();
        let mut full = false;
        let local: Vec<Hit> = hits
            .iter()
            .map(|hit| {
                let mut local = Hit {
                    limit: scaled(&hit.limit, n),
                    ..hit.clone()
                };
                if hit.kind == HitKind::Refund || ledger.owed.contains_key(&hit.key) {
                    return local;
                }
                let left = self.last_seen(hit, now);
                if hit.is_place() {
                    // Places: 1/n of those free at the last reply, counted here alone.
                    if let Some(left) = left {
                        local.limit.requests_per_unit = local.limit.requests_per_unit.min(left / n);
                    }
                    return local;
                }
                let cost = hit.key.as_bytes().len() + ENTRY_OVERHEAD;
                if ledger.bytes + cost > OWED_MAX_BYTES {
                    full = true;
                    return local;
                }
                // New to the ledger: start from 1/n of what was left.
                self.local.reset_now(std::slice::from_ref(&local));
                let used = left.map_or(0, |left| capacity(&local.limit).saturating_sub(left / n));
                if used > 0 {
                    self.local.decide_now(&[Hit {
                        hits: used,
                        kind: HitKind::Report,
                        enforcement: Enforcement::Shadow,
                        hold: Hold::Unheld,
                        ..local.clone()
                    }]);
                }
                ledger.bytes += cost;
                ledger.owed.insert(
                    hit.key.clone(),
                    Owed {
                        hit: hit.clone(),
                        hits: 0,
                        at: now,
                    },
                );
                local
            })
            .collect();
        self.ledger_used
            .store(!ledger.owed.is_empty(), Ordering::Release);
        if full {
            // Nothing can be owed for it: refuse rather than admit what Redis would never hear.
            return refused(hits);
        }
        let outcome = self.local.decide_now(&local);
        for (hit, verdict) in hits.iter().zip(&outcome.verdicts) {
            let counted = match hit.kind {
                HitKind::Admission => outcome.admitted && !verdict.over,
                HitKind::Report => true,
                HitKind::Refund => false,
            };
            if !counted || hit.is_place() || hit.hits == 0 {
                continue;
            }
            if let Some(o) = ledger.owed.get_mut(&hit.key) {
                if o.hits == 0 {
                    o.at = now;
                }
                o.hits = o.hits.saturating_add(hit.hits);
            }
        }
        outcome
    }

    /// What is owed now, as cost reports of each counter's whole limit (hits owed in a window
    /// that has since ended are forgiven: that window is gone in Redis too).
    pub(crate) fn owed(&self) -> Vec<Hit> {
        self.owed_in(&mut self.ledger.lock())
    }

    fn owed_in(&self, ledger: &mut ShareLedger) -> Vec<Hit> {
        let now = self.clock.now_us();
        ledger
            .owed
            .values_mut()
            .filter_map(|o| {
                if o.hits > 0 && !current(&o.hit.limit, o.at, now) {
                    o.hits = 0;
                }
                (o.hits > 0).then(|| Hit {
                    hits: o.hits,
                    kind: HitKind::Report,
                    enforcement: Enforcement::Shadow,
                    hold: Hold::Unheld,
                    ..o.hit.clone()
                })
            })
            .collect()
    }

    /// `reports` (from [`Shares::owed`]) are written back (or given up).
    pub(crate) fn written(&self, reports: &[Hit]) {
        let mut ledger = self.ledger.lock();
        for r in reports {
            if let Some(o) = ledger.owed.get_mut(&r.key) {
                o.hits = o.hits.saturating_sub(r.hits);
            }
        }
    }

    /// Requests go to Redis again from now on; what is still owed (admitted alone since the
    /// last [`Shares::owed`]: a write-back's round trip of traffic) is handed over, as
    /// [`Shares::owed`] would give it, for the caller to write back. Waiting instead for a moment
    /// with nothing owed kept a busy replica alone for seconds after Redis was back.
    pub(crate) fn rejoin(&self) -> Vec<Hit> {
        let mut ledger = self.ledger.lock();
        let rest = self.owed_in(&mut ledger);
        for r in &rest {
            if let Some(o) = ledger.owed.get_mut(&r.key) {
                o.hits = 0;
            }
        }
        ledger.alone = false;
        ledger.rejoining = false;
        self.alone.store(false, Ordering::Release);
        rest
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{ManualClock, Verdict};

    fn hit(limit: u64) -> Hit {
        Hit {
            key: CounterKey::new("d", [("k", "v")]),
            limit: Limit {
                algorithm: Algorithm::FixedWindow,
                requests_per_unit: limit,
                window_us: 3_600_000_000,
                burst: limit,
                calendar: None,
            },
            hits: 1,
            enforcement: Enforcement::Enforce,
            kind: HitKind::Admission,
            hold: Hold::Unheld,
        }
    }

    fn shares() -> (Shares, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let local = Arc::new(MemoryBackend::new(clock.clone()));
        (
            Shares::new(
                local,
                clock.clone(),
                ReplicaCount::default(),
                std::time::Duration::from_millis(15),
            ),
            clock,
        )
    }

    fn answered(remaining: u64) -> Outcome {
        Outcome {
            admitted: true,
            verdicts: vec![Verdict {
                over: false,
                remaining,
                fits: 0,
                reset: std::time::Duration::ZERO,
            }],
            places: Vec::new(),
        }
    }

    fn admitted_alone(s: &Shares, h: &Hit) -> u64 {
        (0..1000)
            .take_while(|_| s.degrade(std::slice::from_ref(h)).0.admitted)
            .count() as u64
    }

    /// Writes back what is owed (as if Redis took it) and rejoins; what was written.
    fn written_back(s: &Shares) -> Vec<Hit> {
        let owed = s.owed();
        s.written(&owed);
        assert!(s.rejoin().is_empty(), "everything written");
        owed
    }

    #[test]
    fn alone_a_replica_admits_its_share_of_what_was_left() {
        let (s, _) = shares();
        s.replicas.set(3);
        let h = hit(100);
        s.saw(std::slice::from_ref(&h), &answered(31));
        assert_eq!(admitted_alone(&s, &h), 10, "31 left, 3 replicas");
        assert!(s.is_alone());
        let owed = written_back(&s);
        assert_eq!(owed.len(), 1);
        assert_eq!((owed[0].hits, owed[0].kind), (10, HitKind::Report));
        assert_eq!(owed[0].limit.requests_per_unit, 100, "the whole limit");
        assert!(!s.is_alone());
        assert!(s.owed().is_empty(), "written back once");
        assert!(s.decide_alone(std::slice::from_ref(&h)).is_none());
    }

    #[test]
    fn a_counter_never_seen_gets_a_share_of_the_whole_limit() {
        let (s, _) = shares();
        s.replicas.set(4);
        assert_eq!(admitted_alone(&s, &hit(100)), 25);
    }

    #[test]
    fn what_was_seen_in_an_ended_window_is_not_used() {
        let (s, clock) = shares();
        s.replicas.set(2);
        let h = hit(100);
        s.saw(std::slice::from_ref(&h), &answered(0));
        clock.advance(std::time::Duration::from_secs(3600));
        assert_eq!(admitted_alone(&s, &h), 50);
    }

    #[test]
    fn hits_owed_in_an_ended_window_are_forgiven() {
        let (s, clock) = shares();
        let h = hit(100);
        assert!(s.degrade(std::slice::from_ref(&h)).0.admitted);
        clock.advance(std::time::Duration::from_secs(3600));
        assert!(s.owed().is_empty());
        assert!(s.rejoin().is_empty());
    }

    #[test]
    fn an_outage_goes_on_from_the_last_until_redis_answers_for_the_counter() {
        let (s, _) = shares();
        let h = hit(100);
        s.saw(std::slice::from_ref(&h), &answered(5));
        assert_eq!(admitted_alone(&s, &h), 5);
        written_back(&s);
        // Failed again before Redis answered for it: nothing more than the 5.
        assert_eq!(admitted_alone(&s, &h), 0);
        written_back(&s);
        s.saw(std::slice::from_ref(&h), &answered(3));
        assert_eq!(admitted_alone(&s, &h), 3);
    }

    #[test]
    fn rejoining_hands_over_hits_admitted_while_writing_back() {
        let (s, _) = shares();
        let h = hit(100);
        assert!(s.degrade(std::slice::from_ref(&h)).1, "a task to start");
        assert!(!s.degrade(std::slice::from_ref(&h)).1, "one task");
        let owed = s.owed();
        assert_eq!(owed[0].hits, 2);
        assert!(s.decide_alone(std::slice::from_ref(&h)).unwrap().admitted);
        s.written(&owed);
        let rest = s.rejoin();
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].hits, 1, "the hit admitted while writing back");
        assert!(!s.is_alone());
        assert!(
            s.decide_alone(std::slice::from_ref(&h)).is_none(),
            "to Redis again"
        );
        assert!(s.owed().is_empty(), "nothing owed twice");
        assert!(
            s.degrade(std::slice::from_ref(&h)).1,
            "a new outage, a new task"
        );
    }

    #[test]
    fn refused_requests_owe_nothing() {
        let (s, _) = shares();
        let h = hit(100);
        s.saw(std::slice::from_ref(&h), &answered(2));
        let mut big = h.clone();
        big.hits = 3;
        assert!(!s.degrade(std::slice::from_ref(&big)).0.admitted);
        assert!(s.degrade(std::slice::from_ref(&h)).0.admitted);
        assert_eq!(s.owed()[0].hits, 1);
    }
}
