//! The embedded backend: counters in this process, sharded behind mutexes.
//!
//! Guarantees: exact under any number of concurrent callers (a request holds the locks of every
//! shard its keys live in, taken in shard order, for its refunds, check and commit),
//! all-or-nothing admissions per request (reports recorded, refunds given back, in the same
//! step), and bounded memory. Counts are per process: replicas do not share them (use the
//! Redis backend for that).
//!
//! The bound is in bytes, keys included (`--memory-max-bytes`), for the process. Expired
//! counters leave first (each shard keeps its counters ordered by expiry, so that costs
//! O(log n) per counter, never a scan). One counter, its holds included, may keep at most a
//! share of the bound (1/64 of it): when it alone would outgrow that, a rate limit drops its
//! holds that end first (`ratelimit_memory_holds_dropped_total`: their hits stay counted, their
//! refunds give nothing back), and a concurrency limit refuses a place that would not fit
//! (`ratelimit_memory_places_refused_total`; a place in use is never dropped). So a tenant's
//! holds cost its own counter its holds, never another tenant's counter. Only when the
//! process's counters together exceed the bound are counters given up: those closest to
//! expiry of the shards past their share of the bound (1/64 of it), the shard being written
//! first (`ratelimit_memory_evictions_total`; a given-up counter starts again from zero, so
//! its key can be admitted up to its whole limit again within the window it was in), then
//! that counter's own holds. The counter being written is never given up for its own room.
//! Nothing else is ever lost, and the process never grows past the bound with counters
//! however many distinct values or holds clients send.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashTable;
use parking_lot::{Mutex, MutexGuard};
use smallvec::SmallVec;

use super::algorithm::State;
use super::hold::{Held, HoldId, HoldView, Holds};
use super::{
    Algorithm, Backend, BackendError, BoxFuture, Clock, DEFAULT_MAX_DEBT, Hit, HitKind, Hold,
    Outcome, PlaceChange, SystemClock, admits,
};
pub(crate) use crate::metrics::MemoryMetrics;

/// A power of two no larger than 64: a request's shards are a bit set in a `u64`.
const SHARDS: usize = 64;
const _: () = assert!(SHARDS.is_power_of_two() && SHARDS <= 64);
/// Default bound of counter state: 64 MiB, a few hundred thousand typical counters.
pub(crate) const DEFAULT_MAX_BYTES: u64 = 64 << 20;
/// Bytes a counter costs beyond its key and log: the map and expiry-index slots, the shared
/// key's header and the state (measured against the allocator: about this, rounded up; the
/// stored hash added 16 to the table and index slots).
pub(crate) const ENTRY_OVERHEAD: u64 = 176;
/// Expired counters a commit drops on its way (the periodic sweep drops the rest).
const EXPIRE_PER_COMMIT: usize = 8;

/// A key's hash (SipHash, keyed at random per process: clients choose the keys), computed once
/// per request and used for its shard and its place in the shard's table.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Hash(u64);

impl Hash {
    /// The shard: bits the tables do not index by (they take the low bits for the bucket and
    /// the top seven for the tag), so a shard's keys still spread over its whole table.
    fn shard(self) -> usize {
        (self.0 >> 32) as usize % SHARDS
    }
}

struct Entry {
    key: Arc<[u8]>,
    hash: Hash,
    state: State,
    /// A rate limit's holds (a concurrency limit's are its state), once it has one.
    holds: Option<Box<Holds>>,
    expires_at: u64,
    bytes: u64,
}

impl Entry {
    /// A release of `id` owed to a refused replay (see [`Holds::owe`]).
    fn owe(&mut self, id: &HoldId) {
        let holds = match self.state.places_mut() {
            Some(places) => Some(places),
            None => self.holds.as_deref_mut(),
        };
        if let Some(holds) = holds {
            holds.owe(id);
        }
    }

    /// The live hold of `id` on this counter, if any.
    fn held(&self, id: &HoldId, now: u64) -> Option<Held> {
        self.state
            .places()
            .or(self.holds.as_deref())
            .and_then(|holds| holds.get(id, now))
    }
}

#[derive(Default)]
struct Shard {
    entries: HashTable<Entry>,
    /// (expiry, hash, key): the hash finds the entry without hashing the key again.
    by_expiry: BTreeSet<(u64, Hash, Arc<[u8]>)>,
    bytes: u64,
}

fn cost(key: &[u8], state: &State, holds: Option<&Holds>) -> u64 {
    let holds = holds.map_or(0, |h| std::mem::size_of::<Holds>() as u64 + h.heap_bytes());
    key.len() as u64 + ENTRY_OVERHEAD + state.heap_bytes() + holds
}

impl Shard {
    /// Drops the counter of `key`, if held; returns the bytes freed.
    fn remove(&mut self, hash: Hash, key: &[u8]) -> u64 {
        match self.entries.find_entry(hash.0, |e| *e.key == *key) {
            Ok(found) => {
                let (e, _) = found.remove();
                self.by_expiry.remove(&(e.expires_at, hash, e.key));
                self.bytes -= e.bytes;
                e.bytes
            }
            Err(_) => 0,
        }
    }

    /// Drops up to `max` counters that expired by `now`; returns the bytes freed.
    fn expire(&mut self, now: u64, max: usize) -> u64 {
        let mut freed = 0;
        for _ in 0..max {
            match self.by_expiry.first() {
                Some((at, hash, key)) if *at <= now => {
                    let (hash, key) = (*hash, key.clone());
                    freed += self.remove(hash, &key);
                }
                _ => break,
            }
        }
        freed
    }

    /// Gives up the counters closest to expiry (never `keep`) until `over` bytes are freed.
    /// Returns (bytes freed, counters given up).
    fn evict(&mut self, over: u64, keep: &[u8]) -> (u64, u64) {
        let (mut freed, mut evicted) = (0, 0);
        while freed < over {
            let victim = self
                .by_expiry
                .iter()
                .find(|(_, _, k)| k.as_ref() != keep)
                .map(|(_, h, k)| (*h, k.clone()));
            let Some((hash, key)) = victim else { break };
            freed += self.remove(hash, &key);
            evicted += 1;
        }
        (freed, evicted)
    }
}

impl Shard {
    /// Drops the holds of `key`'s rate limit, the first to end first, until the counter fits
    /// `budget` (or none is left): its hits stay counted, so a refund naming a dropped hold
    /// gives nothing back (the safe direction, as past [`super::hold::MAX_HOLDS`]). A
    /// concurrency limit's places are never dropped here: a place that would not fit is refused
    /// before it is taken. Returns (bytes freed, holds dropped).
    fn shed_holds(&mut self, budget: u64, hash: Hash, key: &[u8]) -> (u64, u64) {
        let Some(e) = self.entries.find_mut(hash.0, |e| *e.key == *key) else {
            return (0, 0);
        };
        let Some(holds) = e.holds.as_deref_mut() else {
            return (0, 0);
        };
        let mut dropped = 0;
        let mut bytes = e.bytes;
        while bytes > budget && holds.drop_first() {
            dropped += 1;
            bytes = cost(&e.key, &e.state, Some(holds));
        }
        if holds.len() == 0 {
            e.holds = None;
            bytes = cost(&e.key, &e.state, None);
        }
        let freed = e.bytes - bytes;
        e.bytes = bytes;
        self.bytes -= freed;
        (freed, dropped)
    }
}

/// In-process counters with the same semantics as the Redis backend.
pub struct MemoryBackend {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    /// The latest time read: the backend's time never moves backwards, whatever the wall clock
    /// does (an NTP step back would otherwise start every window afresh). While the clock is
    /// behind, time stands still: windows end late, which may over-reject, never over-admit.
    latest: AtomicU64,
    /// `--memory-max-bytes`: what the counters of every shard may hold together.
    max_bytes: u64,
    /// What they hold now (each shard's bytes, summed as they change).
    total: AtomicU64,
    /// The most one counter may keep, its holds included, and one shard's share of the bound
    /// (a shard within it keeps its counters when the process is past the bound).
    counter_share: u64,
    metrics: MemoryMetrics,
    /// How far past its limit a cost report may take a counter (`--max-debt`).
    max_debt: u64,
}

/// What a commit does to a counter.
#[derive(Clone, Copy)]
enum Change<'h> {
    /// Consume an admitted hit, under the hold it names if any (a concurrency limit: take
    /// its place).
    Admit(Option<&'h HoldId>),
    /// Record a cost report, fitting or not.
    Record,
    /// Give hits back.
    Refund,
    /// Give back at most the hits the hold took (a concurrency limit: its place), and end it.
    Release(&'h HoldId),
}

impl Default for MemoryBackend {
    fn default() -> Self {
        Self::new(Arc::new(SystemClock))
    }
}

impl MemoryBackend {
    /// A backend that reads time from `clock`, bounded by [`DEFAULT_MAX_BYTES`].
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self::bounded(clock, DEFAULT_MAX_BYTES, MemoryMetrics::default())
    }

    /// A backend holding at most `max_bytes` of counter state, reporting to `metrics`.
    pub fn bounded(clock: Arc<dyn Clock>, max_bytes: u64, metrics: MemoryMetrics) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            hasher: RandomState::new(),
            clock,
            latest: AtomicU64::new(0),
            max_bytes,
            total: AtomicU64::new(0),
            counter_share: max_bytes / SHARDS as u64,
            metrics,
            max_debt: DEFAULT_MAX_DEBT,
        }
    }

    /// The most bytes one counter may keep, its holds included (1/64 of the bound).
    pub(crate) fn counter_share(&self) -> u64 {
        self.counter_share
    }

    /// Counts `delta` bytes more (or fewer) held, in the total and the gauge.
    fn held(&self, delta: i64) {
        if delta > 0 {
            self.total.fetch_add(delta as u64, Ordering::Relaxed);
            self.metrics.bytes.inc_by(delta);
        } else if delta < 0 {
            self.total
                .fetch_sub(delta.unsigned_abs(), Ordering::Relaxed);
            self.metrics.bytes.dec_by(-delta);
        }
    }

    /// While the process is past its bound, gives up counters of `shard` past its share of
    /// the bound (never `keep`), closest to expiry first. A shard within its share keeps its
    /// counters: the shards past theirs hold what is over the bound.
    fn evict_from(&self, shard: &mut Shard, keep: &[u8]) {
        let over = self
            .over_bound()
            .min(shard.bytes.saturating_sub(self.counter_share));
        if over > 0 {
            let (freed, evicted) = shard.evict(over, keep);
            self.held(-(freed as i64));
            self.metrics.evictions.inc_by(evicted);
        }
    }

    /// [`MemoryBackend::evict_from`] each other shard, in shard order from `this` on, while
    /// the process is past its bound. A shard whose lock is held (by this request, or another
    /// thread) is passed over: it is never waited for, so no two requests wait on each other.
    fn evict_elsewhere(&self, this: usize) {
        for step in 1..SHARDS {
            if self.over_bound() == 0 {
                return;
            }
            if let Some(mut shard) = self.shards[(this + step) % SHARDS].try_lock() {
                self.evict_from(&mut shard, &[]);
            }
        }
    }

    /// Bytes the counters hold past the bound, if any.
    fn over_bound(&self) -> u64 {
        self.total
            .load(Ordering::Relaxed)
            .saturating_sub(self.max_bytes)
    }

    /// This backend with cost reports taking a counter at most `max_debt` times its limit past
    /// it (see [`State::record`]).
    pub fn with_max_debt(mut self, max_debt: u64) -> Self {
        self.max_debt = max_debt;
        self
    }

    /// The clock's time, or the latest seen if the clock has stepped back since.
    fn now(&self) -> u64 {
        let now = self.clock.now_us();
        self.latest.fetch_max(now, Ordering::Relaxed).max(now)
    }

    fn hash(&self, key: &[u8]) -> Hash {
        // The key's bytes alone: `hash_one` would hash a length prefix first, which only keeps
        // hashes of several values in a row unambiguous; a key is hashed on its own.
        let mut hasher = self.hasher.build_hasher();
        hasher.write(key);
        Hash(hasher.finish())
    }

    /// Number of counters held, expired or not.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().entries.len()).sum()
    }

    /// Bytes of counter state held, keys included.
    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.lock().bytes).sum()
    }

    /// Drops every expired counter now.
    pub fn sweep(&self) {
        let now = self.now();
        for shard in self.shards.iter() {
            let freed = shard.lock().expire(now, usize::MAX);
            self.held(-(freed as i64));
        }
    }

    /// Decides synchronously; [`Backend::decide`] wraps this.
    pub fn decide_now(&self, hits: &[Hit]) -> Outcome {
        let now = self.now();
        let hashes: SmallVec<[Hash; 8]> =
            hits.iter().map(|h| self.hash(h.key.as_bytes())).collect();
        // Locks in ascending shard order, so concurrent requests cannot deadlock. A shard's
        // guard sits at the number of wanted shards below it.
        let wanted = hashes.iter().fold(0u64, |set, h| set | 1 << h.shard());
        let mut guards: SmallVec<[MutexGuard<'_, Shard>; 8]> = SmallVec::new();
        let mut rest = wanted;
        while rest != 0 {
            guards.push(self.shards[rest.trailing_zeros() as usize].lock());
            rest &= rest - 1;
        }
        let at = |hash: Hash| (wanted & ((1u64 << hash.shard()) - 1)).count_ones() as usize;

        // What the request did to concurrency limits' places, by hit.
        let mut places: Vec<PlaceChange> = Vec::new();
        let mut note = |i: usize, (change, end, ended): (i64, u64, u64)| {
            if change == 0 && ended == 0 {
                return;
            }
            match places.iter_mut().find(|p| p.hit == i) {
                Some(p) => {
                    if change != 0 {
                        (p.change, p.end) = (change, end);
                    }
                    p.ended += ended;
                }
                None => places.push(PlaceChange {
                    hit: i,
                    change,
                    end,
                    at: now,
                    ended,
                }),
            }
        };
        // Refunds first: they happened, and the request's other hits see what they freed. On
        // a node that keeps holds, only a refund naming one gives anything back.
        for (i, (hit, &hash)) in hits.iter().zip(&hashes).enumerate() {
            if hit.kind == HitKind::Refund && hit.hits > 0 {
                let change = match &hit.hold {
                    Hold::Unheld => Change::Refund,
                    Hold::Named(id) => Change::Release(id),
                    Hold::Unnamed => continue,
                };
                note(
                    i,
                    self.commit(&mut guards[at(hash)], hit, hash, now, change),
                );
            }
        }
        let mut verdicts = Vec::with_capacity(hits.len());
        for (i, (hit, &hash)) in hits.iter().zip(&hashes).enumerate() {
            let key = hit.key.as_bytes();
            // A refund's verdict is its counter as the refund left it.
            let asked = if hit.kind == HitKind::Refund {
                0
            } else {
                hit.hits
            };
            let shard_bytes = guards[at(hash)].bytes;
            let mut verdict = match guards[at(hash)]
                .entries
                .find_mut(hash.0, |e| *e.key == *key)
            {
                Some(e) if e.state.is(hit.limit.algorithm) => {
                    let mut v = e.state.check(&hit.limit, now, asked);
                    // A hold already held is refused (a replayed id): what a refund can give
                    // back stays what one admission took. The refused request's release is
                    // owed to it, so that it never ends the hold it collided with.
                    if let Some(id) = hit.hold.id()
                        && hit.kind == HitKind::Admission
                        && asked > 0
                        && let Some(held) = e.held(id, now)
                    {
                        v = replayed(held, now);
                        e.owe(id);
                    }
                    if !v.over && !self.place_fits(hit, asked, Some(&*e), shard_bytes) {
                        v = self.no_room(e.state.places(), now);
                    }
                    note(i, (0, 0, e.state.take_ended()));
                    v
                }
                _ => {
                    let v = State::new(hit.limit.algorithm).check(&hit.limit, now, asked);
                    if !v.over && !self.place_fits(hit, asked, None, shard_bytes) {
                        self.no_room(None, now)
                    } else {
                        v
                    }
                }
            };
            // A refund's place verdict is never over, and the request it ends is done.
            if hit.limit.algorithm == Algorithm::Concurrency && hit.kind == HitKind::Refund {
                (verdict.over, verdict.reset) = (false, std::time::Duration::ZERO);
            }
            verdicts.push(verdict);
        }

        let admitted = admits(hits, |i| verdicts[i].over);
        for (i, ((hit, &hash), verdict)) in hits.iter().zip(&hashes).zip(&verdicts).enumerate() {
            let change = match hit.kind {
                // An over-limit shadow or quota admission has nothing to take.
                HitKind::Admission if admitted && !verdict.over => Change::Admit(hit.hold.id()),
                HitKind::Report => Change::Record,
                _ => continue,
            };
            if hit.hits > 0 {
                note(
                    i,
                    self.commit(&mut guards[at(hash)], hit, hash, now, change),
                );
            }
        }
        Outcome {
            admitted,
            verdicts,
            places,
        }
    }

    /// Applies `change` of `hit` to its counter, keeping the shard's bytes, expiry index and
    /// bound in step. Returns what it did to a concurrency limit's places: (1 taken or -1
    /// released, or 0; when that place ends; places that had ended and were dropped).
    fn commit(
        &self,
        shard: &mut Shard,
        hit: &Hit,
        hash: Hash,
        now: u64,
        change: Change<'_>,
    ) -> (i64, u64, u64) {
        let limit = &hit.limit;
        let mut delta = -(shard.expire(now, EXPIRE_PER_COMMIT) as i64);
        let key_bytes = hit.key.as_bytes();
        // The counter already held, else a new one, not in the expiry index yet.
        let (entry, indexed) = match shard.entries.find_mut(hash.0, |e| *e.key == *key_bytes) {
            Some(e) => {
                let indexed = Some(e.expires_at);
                (e, indexed)
            }
            // Nothing to give back: no counter is made for a refund. Nor for an admission
            // that takes nothing (a concurrency limit's without a hold).
            None if matches!(change, Change::Refund | Change::Release(_))
                || matches!(change, Change::Admit(None))
                    && hit.limit.algorithm == Algorithm::Concurrency =>
            {
                self.held(delta);
                return (0, 0, 0);
            }
            None => {
                let entry = Entry {
                    key: Arc::from(key_bytes),
                    hash,
                    state: State::new(limit.algorithm),
                    holds: None,
                    expires_at: 0,
                    bytes: 0,
                };
                let slot = shard.entries.insert_unique(hash.0, entry, |e| e.hash.0);
                (slot.into_mut(), None)
            }
        };
        if !entry.state.is(limit.algorithm) {
            entry.state = State::new(limit.algorithm);
            entry.holds = None;
        }
        let was_bytes = entry.bytes;
        if let Some(holds) = &mut entry.holds {
            holds.end_by(now);
        }
        let (mut placed, mut end) = (0, 0);
        match change {
            Change::Admit(hold) if limit.algorithm == Algorithm::Concurrency => {
                if let Some(id) = hold {
                    entry.state.take_place(limit, now, id);
                    (placed, end) = (1, now.saturating_add(limit.window_us));
                }
            }
            Change::Admit(hold) => {
                entry.state.commit(limit, now, hit.hits);
                if let Some(id) = hold {
                    let held = Held {
                        at: now,
                        hits: hit.hits,
                        end: entry.state.expires_at(limit),
                    };
                    entry.holds.get_or_insert_default().take(id.clone(), held);
                }
            }
            Change::Record => entry.state.record(limit, now, hit.hits, self.max_debt),
            Change::Refund => entry.state.refund(limit, now, hit.hits),
            Change::Release(id) if limit.algorithm == Algorithm::Concurrency => {
                if let Some(ends) = entry.state.release_place(limit, now, id) {
                    (placed, end) = (-1, ends);
                }
            }
            Change::Release(id) => {
                if let Some(held) = entry.holds.as_mut().and_then(|h| h.settle(id))
                    && held.end > now
                {
                    entry.state.refund_held(limit, now, held, hit.hits);
                }
            }
        }
        if entry.holds.as_ref().is_some_and(|h| h.len() == 0) {
            entry.holds = None;
        }
        let ended = entry.state.take_ended();
        entry.expires_at = entry.state.expires_at(limit);
        entry.bytes = cost(&entry.key, &entry.state, entry.holds.as_deref());
        let (expires_at, bytes) = (entry.expires_at, entry.bytes);
        // Most commits (a fixed window's) move no expiry: nothing to reindex.
        if indexed != Some(expires_at) {
            let key = entry.key.clone();
            if let Some(was) = indexed {
                shard.by_expiry.remove(&(was, hash, key.clone()));
            }
            shard.by_expiry.insert((expires_at, hash, key));
        }
        shard.bytes = shard.bytes - was_bytes + bytes;
        delta += bytes as i64 - was_bytes as i64;
        // A counter past its share gives up its own holds, never a neighbour's counter.
        if bytes > self.counter_share {
            let (freed, dropped) = shard.shed_holds(self.counter_share, hash, key_bytes);
            delta -= freed as i64;
            self.metrics.holds_dropped.inc_by(dropped);
        }
        // Most commits change no counter's size: no write to what every thread shares.
        if delta != 0 {
            self.held(delta);
            // The process past its bound: the counters closest to expiry of the shards past
            // their share go, this one's first, then this counter's own holds.
            if self.over_bound() > 0 {
                self.evict_from(shard, key_bytes);
                self.evict_elsewhere(hash.shard());
                let over = self.over_bound();
                if over > 0 {
                    let left = shard.entries.find(hash.0, |e| *e.key == *key_bytes);
                    let budget = left.map_or(0, |e| e.bytes.saturating_sub(over));
                    let (freed, dropped) = shard.shed_holds(budget, hash, key_bytes);
                    self.held(-(freed as i64));
                    self.metrics.holds_dropped.inc_by(dropped);
                }
            }
        }
        (placed, end, ended)
    }
}

impl MemoryBackend {
    /// Whether `hit`, if it takes a place, leaves its counter (`entry`, or a new one) within its
    /// share of the bound, and the process within the bound once the other counters of its
    /// shard (`shard_bytes` in all) are given up if need be: the places in use cannot be
    /// (they are never dropped silently).
    fn place_fits(&self, hit: &Hit, asked: u64, entry: Option<&Entry>, shard_bytes: u64) -> bool {
        let Some(id) = hit.hold.id() else {
            return true;
        };
        if hit.limit.algorithm != Algorithm::Concurrency
            || hit.kind != HitKind::Admission
            || asked == 0
        {
            return true;
        }
        let now = match entry {
            Some(e) => cost(&e.key, &e.state, e.holds.as_deref()),
            None => cost(
                hit.key.as_bytes(),
                &State::new(Algorithm::Concurrency),
                None,
            ),
        };
        let more = Holds::cost_of(id);
        let others = shard_bytes - entry.map_or(0, |e| e.bytes);
        now + more <= self.counter_share
            && self.total.load(Ordering::Relaxed) + more <= self.max_bytes + others
    }

    /// The verdict on a place refused for want of room: over until the first place in use ends.
    fn no_room(&self, places: Option<&Holds>, now: u64) -> super::Verdict {
        self.metrics.places_refused.inc();
        let end = places.and_then(Holds::first_end).unwrap_or(now);
        super::Verdict {
            over: true,
            remaining: 0,
            fits: 0,
            reset: std::time::Duration::from_micros(end.saturating_sub(now)),
        }
    }
}

/// The verdict on an admission whose hold is held already: over until that hold ends.
fn replayed(held: Held, now: u64) -> super::Verdict {
    super::Verdict {
        over: true,
        remaining: 0,
        fits: 0,
        reset: std::time::Duration::from_micros(held.end.saturating_sub(now)),
    }
}

impl MemoryBackend {
    /// Forgets the counters of `hits`; returns how many were held.
    pub fn reset_now(&self, hits: &[Hit]) -> usize {
        let mut removed = 0;
        for hit in hits {
            let key = hit.key.as_bytes();
            let hash = self.hash(key);
            let mut shard = self.shards[hash.shard()].lock();
            if shard.entries.find(hash.0, |e| *e.key == *key).is_some() {
                let freed = shard.remove(hash, key);
                self.held(-(freed as i64));
                removed += 1;
            }
        }
        removed
    }
}

impl MemoryBackend {
    /// The live holds of each hit's counter.
    pub fn holds_now(&self, hits: &[Hit]) -> Vec<Vec<HoldView>> {
        let now = self.now();
        hits.iter()
            .map(|hit| {
                let key = hit.key.as_bytes();
                let hash = self.hash(key);
                let shard = self.shards[hash.shard()].lock();
                shard
                    .entries
                    .find(hash.0, |e| *e.key == *key)
                    .and_then(|e| e.state.places().or(e.holds.as_deref()))
                    .map_or_else(Vec::new, |holds| holds.views(now))
            })
            .collect()
    }

    /// Ends every hold of `hits`' counters; returns how many there were.
    pub fn clear_holds_now(&self, hits: &[Hit]) -> usize {
        let now = self.now();
        let mut cleared = 0;
        for hit in hits {
            let key = hit.key.as_bytes();
            let hash = self.hash(key);
            let mut shard = self.shards[hash.shard()].lock();
            let Some(e) = shard.entries.find_mut(hash.0, |e| *e.key == *key) else {
                continue;
            };
            if let Some(holds) = e.holds.take() {
                cleared += holds.views(now).len();
            }
            if let State::Places(holds) = &mut e.state {
                cleared += holds.views(now).len();
                **holds = Holds::default();
            }
            // Its size shrinks; the next commit on it recounts it, the sweep drops it.
        }
        cleared
    }
}

impl Backend for MemoryBackend {
    fn decide<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<Outcome, BackendError>> {
        Box::pin(std::future::ready(Ok(self.decide_now(hits))))
    }

    fn decide_at_once(&self, hits: &[Hit]) -> Option<Outcome> {
        Some(self.decide_now(hits))
    }

    fn reset<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(std::future::ready(Ok(self.reset_now(hits))))
    }

    fn holds<'a>(
        &'a self,
        hits: &'a [Hit],
    ) -> BoxFuture<'a, Result<Vec<Vec<HoldView>>, BackendError>> {
        Box::pin(std::future::ready(Ok(self.holds_now(hits))))
    }

    fn clear_holds<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(std::future::ready(Ok(self.clear_holds_now(hits))))
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
                calendar: None,
            },
            hits: 1,
            enforcement: Enforcement::Enforce,
            kind: HitKind::Admission,
            hold: Hold::Unheld,
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
    fn reports_are_recorded_and_refunds_given_back_whatever_the_admissions_say() {
        let backend = MemoryBackend::new(Arc::new(ManualClock::new(T0)));
        let mut budget = hit("budget", Algorithm::TokenBucket, 10);
        let tight = hit("tight", Algorithm::FixedWindow, 1);
        assert!(backend.decide_now(std::slice::from_ref(&tight)).admitted);
        // A refused request: its admission takes nothing, its report is recorded anyway.
        budget.kind = HitKind::Report;
        budget.hits = 4;
        let out = backend.decide_now(&[tight.clone(), budget.clone()]);
        assert!(!out.admitted);
        assert_eq!(out.verdicts[1].remaining, 6);
        budget.hits = 0;
        budget.kind = HitKind::Admission;
        assert_eq!(
            backend.decide_now(&[budget.clone()]).verdicts[0].remaining,
            6
        );
        // A refund comes first: the same request's admission sees what it freed.
        let mut refund = tight.clone();
        refund.kind = HitKind::Refund;
        let out = backend.decide_now(&[tight.clone(), refund]);
        assert!(out.admitted, "{out:?}");
        assert_eq!(
            out.verdicts[1].remaining, 1,
            "the counter as the refund left it"
        );
        assert!(
            !backend.decide_now(&[tight]).admitted,
            "the admission was consumed"
        );
        // A refund on a counter never used makes no counter.
        let mut unused = hit("unused", Algorithm::SlidingLog, 3);
        unused.kind = HitKind::Refund;
        let held = backend.len();
        assert!(backend.decide_now(&[unused]).admitted);
        assert_eq!(backend.len(), held);
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
    fn the_byte_bound_holds_and_gives_up_the_counters_closest_to_expiry() {
        let clock = ManualClock::new(T0);
        let metrics = MemoryMetrics::default();
        let max = 64 * 4096; // 4 KiB per shard
        let backend = MemoryBackend::bounded(Arc::new(clock.clone()), max, metrics.clone());
        let mut long = hit("long-lived", Algorithm::FixedWindow, 1);
        long.limit.window_us = 86_400_000_000; // a day: never the closest to expiry
        assert!(backend.decide_now(&[long.clone()]).admitted);
        let value = "v".repeat(1000);
        for i in 0..20_000u64 {
            backend.decide_now(&[hit(&format!("{i}{value}"), Algorithm::SlidingLog, 10)]);
            assert!(backend.bytes() <= max, "{} > {max}", backend.bytes());
        }
        assert_eq!(metrics.bytes.get() as u64, backend.bytes());
        assert!(
            metrics.evictions.get() > 15_000,
            "{}",
            metrics.evictions.get()
        );
        assert!(
            !backend.decide_now(&[long]).admitted,
            "the day-long counter outlived every shorter one"
        );
    }

    #[test]
    fn holds_count_in_the_bound_and_a_place_in_use_is_never_dropped() {
        let metrics = MemoryMetrics::default();
        let max = 64 * 8192; // 8 KiB per shard
        let backend = MemoryBackend::bounded(Arc::new(ManualClock::new(T0)), max, metrics.clone());
        let id = |i: usize| Hold::Named(HoldId::new(format!("{i:064}").as_bytes()));
        // One counter's holds: past its share, the first to end go, their hits stay counted.
        let mut budget = hit("budget", Algorithm::FixedWindow, 1_000_000);
        budget.limit.window_us = 86_400_000_000;
        for i in 0..1_000 {
            budget.hold = id(i);
            assert!(backend.decide_now(&[budget.clone()]).admitted);
            assert!(backend.bytes() <= max, "{} > {max}", backend.bytes());
        }
        let dropped = metrics.holds_dropped.get();
        assert!(dropped > 900, "{dropped}");
        assert_eq!(metrics.bytes.get() as u64, backend.bytes());
        let mut refund = budget.clone();
        refund.kind = HitKind::Refund;
        refund.hold = id(0);
        let out = backend.decide_now(&[refund.clone()]);
        assert_eq!(
            out.verdicts[0].remaining,
            1_000_000 - 1_000,
            "dropped: nothing back"
        );
        refund.hold = id(999);
        let out = backend.decide_now(&[refund]);
        assert_eq!(
            out.verdicts[0].remaining,
            1_000_000 - 999,
            "kept: given back"
        );

        // Places: refused once the counter's share is full, each one taken still released.
        let mut place = hit("places", Algorithm::Concurrency, 10_000);
        place.limit.window_us = 600_000_000;
        let mut taken = 0;
        while taken < 10_000 {
            place.hold = id(taken);
            if !backend.decide_now(&[place.clone()]).admitted {
                break;
            }
            taken += 1;
            assert!(backend.bytes() <= max, "{} > {max}", backend.bytes());
        }
        assert!((10..100).contains(&taken), "{taken} places in 8 KiB");
        assert_eq!(metrics.places_refused.get(), 1);
        let out = backend.decide_now(&[place.clone()]);
        assert!(!out.admitted && out.verdicts[0].reset > Duration::from_secs(590));
        place.kind = HitKind::Refund;
        for i in 0..taken {
            place.hold = id(i);
            let out = backend.decide_now(&[place.clone()]);
            assert_eq!(out.places.first().map(|p| p.change), Some(-1), "place {i}");
        }
        place.kind = HitKind::Admission;
        for i in 0..taken {
            place.hold = id(10_000 + i);
            assert!(backend.decide_now(&[place.clone()]).admitted, "place {i}");
        }
        assert_eq!(metrics.holds_dropped.get(), dropped, "no place dropped");
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
        // ~10 000 live keys; each commit drops a few expired ones, the sweep the rest.
        assert!(held < 30_000, "{held} counters held");
        clock.advance(Duration::from_secs(5));
        backend.sweep();
        assert_eq!(backend.len(), 0);
    }
}
