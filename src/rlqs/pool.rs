//! Pools on this replica: who shares each limit, what each was last granted, and the fair shares
//! that decide the next grants.
//!
//! A pool is one limit's counter (the counter RLS would use); its participants are buckets of RLQS
//! streams. Every grant is a lease: the client holds it until its TTL runs out, whether or not its
//! stream is still open, so a pool's capacity is what its limit allows minus the leases others
//! hold. A grant never takes more than that, so the tokens granted per window add up to at most the
//! limit, leases of disconnected clients included, but for one exception: a grant is whole tokens
//! and at least one (Envoy's token bucket has no zero), so a participant that arrives while the
//! others hold the whole limit gets one token until their shares move down.
//!
//! Cost. Recomputing a pool's fair shares sorts its members; doing it for every change made a
//! report of n entries in a pool of n members cost n sorts, everyone else waiting on the lock
//! (`large_pool_report_cost`; docs/performance.md, "Measurements behind the code"). A change now
//! only marks the pool; the shares are recomputed once an eighth of its members have changed (or
//! [`REBALANCE_AFTER`] has passed, or at the next sweep): O(log n) per change, amortized. The
//! leases held are summed once per recomputation and kept up to date grant by grant, so a grant is
//! O(1). Between recomputations a grant follows shares a few changes old; it never takes more than
//! the leases leave, so the limit holds all the same.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::fair_share::fair_shares;

/// A participant: one bucket of one stream, unique in the process.
pub(crate) type ParticipantId = u64;

/// A share moving by more than this fraction (and at least one token) is pushed to its stream
/// at once; smaller moves ride on the answer to the client's next report.
pub(super) const SHARE_MOVE: f64 = 0.1;
/// A pool with changes recomputes its shares at least this often (while it is used or swept).
pub(super) const REBALANCE_AFTER: Duration = Duration::from_millis(100);
/// How much longer than the assignment TTL a grant is counted against its pool. A client
/// counts the TTL from when the answer reaches it, after the grant; the TTL sent is what is
/// left of the lease when the answer leaves, in whole seconds (see `server::rlqs`), so with an
/// answer on its way for less than this, the client holds it for the whole TTL and no longer
/// than the pool counts it (plus the network's delay).
pub(crate) const LEASE_GRACE: Duration = Duration::from_secs(1);
/// Weight of the newest report in the smoothed demand: the requests and the time reported are
/// smoothed apart and divided, so a slow client's reports of 0, 0, 0 and 4 requests read as
/// the 1 per interval it asks, not as a rate jumping between none and four.
const SMOOTHING: f64 = 0.25;

/// A client's demand: its reported requests over the time they took, both smoothed.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Demand {
    requests: f64,
    seconds: f64,
}

impl Demand {
    fn add(&mut self, requests: f64, seconds: f64) {
        if self.seconds == 0.0 {
            *self = Demand { requests, seconds };
        } else {
            self.requests += SMOOTHING * (requests - self.requests);
            self.seconds += SMOOTHING * (seconds - self.seconds);
        }
    }

    /// Adds a report's usage, if it measured any time.
    pub(super) fn measure(&mut self, usage: Option<Usage>) {
        if let Some(u) = usage
            && u.seconds > 0.0
        {
            self.add(u.requests as f64, u.seconds);
        }
    }

    /// Requests per second.
    pub(super) fn rate(&self) -> Option<f64> {
        (self.seconds > 0.0).then(|| self.requests / self.seconds)
    }
}

/// One report of a participant's usage: requests (allowed and denied) over `seconds`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Usage {
    pub(crate) requests: u64,
    pub(crate) seconds: f64,
}

/// How a stream learns that some of its buckets' grants moved.
#[derive(Default)]
pub(crate) struct Signal {
    /// Woken when `moved` gained participants.
    pub(crate) notify: Notify,
    /// The stream's participants whose grants should be sent again.
    moved: Mutex<HashSet<ParticipantId>>,
}

impl Signal {
    /// Up to `most` of the participants that moved since they were last taken, and whether
    /// more are waiting.
    pub(crate) fn take(&self, most: usize) -> (Vec<ParticipantId>, bool) {
        let mut moved = self.moved.lock();
        if moved.len() <= most {
            return (moved.drain().collect(), false);
        }
        let some: Vec<ParticipantId> = moved.iter().take(most).copied().collect();
        for pid in &some {
            moved.remove(pid);
        }
        (some, true)
    }

    pub(super) fn mark(&self, pid: ParticipantId) {
        self.moved.lock().insert(pid);
        self.notify.notify_one();
    }
}

/// A limit as a pool applies it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PoolSpec {
    /// The counter's key: the pool's identity.
    pub(crate) key: Box<[u8]>,
    /// Tokens per window (the limit's requests_per_unit, > 0).
    pub(crate) limit: u64,
    /// The window in whole seconds.
    pub(crate) window_s: u64,
    /// Most tokens that may be spent at once, over all participants.
    pub(crate) burst: u64,
}

impl PoolSpec {
    /// A grant of `tokens`' part of the burst: its share of the limit, at least one.
    pub(crate) fn burst_part(&self, tokens: u64) -> u64 {
        let part = u128::from(self.burst) * u128::from(tokens) / u128::from(self.limit.max(1));
        (part as u64).max(1)
    }
}

/// A participant's part of one pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Grant {
    /// Tokens per window of the pool.
    pub(crate) tokens: u64,
    /// Its part of the pool's burst.
    pub(crate) max_tokens: u64,
    /// When this replica stops counting it (by its own clock, at the latest): the TTL sent
    /// with it is what is left of that when the answer leaves.
    pub(crate) until: Instant,
}

struct Member {
    /// Smoothed demand.
    demand: Demand,
    /// When it last reported.
    reported: Instant,
    /// Its fair share, tokens per window.
    share: f64,
    /// What it was last granted (with until when it may use it).
    held: Option<Grant>,
    /// Its tokens in the pool's `held` sum.
    counted: u64,
    connected: bool,
    signal: Weak<Signal>,
}

impl Member {
    fn holds(&self, now: Instant) -> Option<Grant> {
        self.held.filter(|g| g.until > now)
    }
}

struct Pool {
    spec: PoolSpec,
    members: HashMap<ParticipantId, Member>,
    /// Tokens of the leases held, as of the last recomputation and every grant since (a lease
    /// that ran out meanwhile still counts: the next grants are smaller, never larger).
    held: u64,
    /// Changes since the shares were last recomputed.
    changes: usize,
    /// When they were.
    balanced: Option<Instant>,
    /// Emptied and taken out of the map: a joiner that still found it makes a new one.
    dead: bool,
}

/// Whole tokens of a share: rounded down, at least one.
pub(super) fn whole(share: f64) -> u64 {
    (share.floor() as u64).max(1)
}

/// Whether a member holding `holds` tokens, whose share is now worth `next`, is pushed a new
/// grant at once: a move of more than [`SHARE_MOVE`] of what it holds, and at least one token.
pub(super) fn moved_far(holds: u64, next: u64) -> bool {
    (next as f64 - holds as f64).abs() > (holds as f64 * SHARE_MOVE).max(1.0)
}

impl Pool {
    /// A new, empty pool.
    fn new(spec: PoolSpec) -> Pool {
        Pool {
            spec,
            members: HashMap::new(),
            held: 0,
            changes: 0,
            balanced: None,
            dead: false,
        }
    }

    /// Notes a change; recomputes the shares once enough have piled up (see the module).
    fn changed(&mut self, now: Instant, stale: Duration) {
        self.changes += 1;
        let enough = self.changes >= (self.members.len() / 8).max(1);
        let due = self
            .balanced
            .is_none_or(|at| now.duration_since(at) >= REBALANCE_AFTER);
        if enough || due {
            self.rebalance(now, stale);
        }
    }

    /// Drops what no longer counts, recomputes every connected member's share and marks the
    /// members whose grant should move at once.
    fn rebalance(&mut self, now: Instant, stale: Duration) {
        self.members
            .retain(|_, m| m.connected || m.holds(now).is_some());
        self.held = 0;
        for m in self.members.values_mut() {
            m.counted = m.holds(now).map_or(0, |g| g.tokens);
            self.held += m.counted;
        }
        self.changes = 0;
        self.balanced = Some(now);
        let leased: u64 = self
            .members
            .values()
            .filter(|m| !m.connected)
            .filter_map(|m| m.holds(now))
            .map(|g| g.tokens)
            .sum();
        let capacity = self.spec.limit.saturating_sub(leased) as f64;
        let window = self.spec.window_s as f64;
        let (ids, demands): (Vec<ParticipantId>, Vec<Option<f64>>) = self
            .members
            .iter()
            .filter(|(_, m)| m.connected)
            .map(|(id, m)| {
                // A member that stopped reporting is idle, whatever it asked before.
                let fresh = now.duration_since(m.reported) <= stale;
                (*id, m.demand.rate().filter(|_| fresh).map(|d| d * window))
            })
            .unzip();
        for (id, share) in ids.into_iter().zip(fair_shares(capacity, &demands)) {
            self.members.get_mut(&id).expect("listed above").share = share;
        }
        self.push_moved(now);
    }

    /// Marks the connected members whose share is far from what they hold, so their streams
    /// send them a new grant now.
    fn push_moved(&self, now: Instant) {
        for (id, m) in &self.members {
            if !m.connected {
                continue;
            }
            if let Some(held) = m.holds(now)
                && moved_far(held.tokens, whole(m.share))
                && let Some(signal) = m.signal.upgrade()
            {
                signal.mark(*id);
            }
        }
    }

    /// What `pid` may hold now: its share, within what the others' leases leave.
    fn grant(
        &mut self,
        pid: ParticipantId,
        now: Instant,
        ttl: Duration,
        stale: Duration,
    ) -> Option<Grant> {
        let m = self.members.get_mut(&pid)?;
        let others = self.held.saturating_sub(m.counted);
        let free = self.spec.limit.saturating_sub(others);
        let before = m.holds(now).map_or(0, |g| g.tokens);
        let tokens = whole(m.share).min(free).max(1);
        let g = Grant {
            tokens,
            max_tokens: self.spec.burst_part(tokens),
            until: now + ttl,
        };
        m.held = Some(g);
        self.held = others + tokens;
        m.counted = tokens;
        if tokens < before {
            // Capacity freed: those waiting for it to grow get it when the shares are next
            // recomputed (at once in a small pool), not at their next report.
            self.changed(now, stale);
        }
        Some(g)
    }
}

/// A pool behind its own lock.
type Locked = Arc<Mutex<Pool>>;

/// Every pool of this replica. Each pool has a lock of its own: the map's lock is held only
/// to find or add a pool, never across a rebalance, so a large pool's recomputation stalls
/// only the reports on that pool.
pub(crate) struct LocalPools {
    pools: Mutex<HashMap<Box<[u8]>, Locked>>,
    ttl: Duration,
    /// A demand older than this no longer counts (a few report intervals).
    stale: Duration,
}

impl LocalPools {
    /// Pools whose grants last `ttl` (counted [`LEASE_GRACE`] longer), for clients reporting
    /// every `report_interval`.
    pub(crate) fn new(ttl: Duration, report_interval: Duration) -> LocalPools {
        LocalPools {
            pools: Mutex::default(),
            ttl: ttl + LEASE_GRACE,
            stale: report_interval * 3,
        }
    }

    /// The pool of `key`, if there is one.
    fn get(&self, key: &[u8]) -> Option<Locked> {
        self.pools.lock().get(key).cloned()
    }

    /// Takes `pool` out of the map once it is empty (marked `dead` first, under its own lock,
    /// so that whoever finds it in the map meanwhile replaces it rather than joins it).
    fn drop_if_empty(&self, key: &[u8], pool: &Locked) {
        {
            let mut p = pool.lock();
            if !p.members.is_empty() {
                return;
            }
            p.dead = true;
        }
        self.forget(key, pool);
    }

    /// Takes `key` out of the map if it still names `pool` (a dead one).
    fn forget(&self, key: &[u8], pool: &Locked) {
        let mut pools = self.pools.lock();
        if pools.get(key).is_some_and(|p| Arc::ptr_eq(p, pool)) {
            pools.remove(key);
        }
    }

    /// Makes `pid` a connected participant of `spec`'s pool (taking the spec's limit as the
    /// pool's from now on) and rebalances.
    pub(crate) fn join(
        &self,
        spec: &PoolSpec,
        pid: ParticipantId,
        signal: &Arc<Signal>,
        now: Instant,
    ) {
        let pool = self
            .pools
            .lock()
            .entry(spec.key.clone())
            .or_insert_with(|| Arc::new(Mutex::new(Pool::new(spec.clone()))))
            .clone();
        let mut locked = pool.lock();
        if locked.dead {
            // Emptied and on its way out of the map: put a new pool in its place and join that.
            drop(locked);
            self.forget(&spec.key, &pool);
            return self.join(spec, pid, signal, now);
        }
        let pool = &mut *locked;
        pool.spec = spec.clone();
        let m = pool.members.entry(pid).or_insert_with(|| Member {
            demand: Demand::default(),
            reported: now,
            share: 0.0,
            held: None,
            counted: 0,
            connected: true,
            signal: Arc::downgrade(signal),
        });
        m.connected = true;
        pool.changed(now, self.stale);
    }

    /// Records `pid`'s usage (`None`: no measure in this report),
    /// rebalances, and grants it its part.
    pub(crate) fn report(
        &self,
        key: &[u8],
        pid: ParticipantId,
        usage: Option<Usage>,
        now: Instant,
    ) -> Option<Grant> {
        let pool = self.get(key)?;
        let mut pool = pool.lock();
        let m = pool.members.get_mut(&pid)?;
        m.reported = now;
        m.demand.measure(usage);
        pool.changed(now, self.stale);
        pool.grant(pid, now, self.ttl, self.stale)
    }

    /// Grants `pid` its current part without a new measure (a push).
    pub(crate) fn regrant(&self, key: &[u8], pid: ParticipantId, now: Instant) -> Option<Grant> {
        self.get(key)?.lock().grant(pid, now, self.ttl, self.stale)
    }

    /// `pid`'s stream no longer asks for this pool: its lease counts until it runs out.
    pub(crate) fn leave(&self, key: &[u8], pid: ParticipantId, now: Instant) {
        let Some(pool) = self.get(key) else {
            return;
        };
        {
            let mut p = pool.lock();
            if let Some(m) = p.members.get_mut(&pid) {
                m.connected = false;
            }
            p.changed(now, self.stale);
        }
        self.drop_if_empty(key, &pool);
    }

    /// Drops expired leases and empty pools; the members left get the capacity freed, and
    /// changes not yet counted in the shares are. One pool at a time, each under its own lock.
    pub(crate) fn sweep(&self, now: Instant) {
        let stale = self.stale;
        let all: Vec<(Box<[u8]>, Locked)> = self
            .pools
            .lock()
            .iter()
            .map(|(k, p)| (k.clone(), p.clone()))
            .collect();
        for (key, pool) in all {
            {
                let mut p = pool.lock();
                let expired = p
                    .members
                    .values()
                    .any(|m| !m.connected && m.holds(now).is_none());
                if expired || p.changes > 0 {
                    p.rebalance(now, stale);
                }
            }
            self.drop_if_empty(&key, &pool);
        }
    }

    /// Pools held now.
    pub(crate) fn len(&self) -> usize {
        self.pools.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU time of this thread, in clock ticks (10 ms) of user and system time.
    fn cpu() -> Duration {
        let t = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let fields: Vec<&str> = t.rsplit(')').next().unwrap().split_whitespace().collect();
        // utime and stime, the 12th and 13th fields after the command.
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        Duration::from_millis(ticks * 10)
    }

    /// Shares recomputed only every few changes in a large pool: whatever order the reports
    /// come in, the leases held never add up past the limit, and after a sweep every share is
    /// current again.
    #[tokio::test(start_paused = true)]
    async fn grants_stay_within_the_limit_while_shares_lag() {
        let pools = LocalPools::new(Duration::from_secs(20), Duration::from_secs(5));
        let s = Arc::new(Signal::default());
        let now = Instant::now();
        let sp = spec(1_000);
        const N: u64 = 200;
        for pid in 0..N {
            pools.join(&sp, pid, &s, now);
        }
        let held = |pools: &LocalPools| -> u64 {
            let pool = pools.get(&sp.key).unwrap();
            let pool = pool.lock();
            pool.members
                .values()
                .filter_map(|m| m.holds(now))
                .map(|g| g.tokens)
                .sum()
        };
        for round in 0..6u64 {
            for pid in 0..N {
                // Demands that shift every round: a lagging share is often wrong.
                let requests = (pid * 7 + round * 13) % 50;
                let usage = Some(Usage {
                    requests,
                    seconds: 5.0,
                });
                pools.report(&sp.key, pid, usage, now).expect("a member");
                let total = held(&pools);
                assert!(total <= 1_000, "round {round}, member {pid}: {total} held");
            }
        }
        pools.sweep(now);
        let pool = pools.get(&sp.key).unwrap();
        let pool = pool.lock();
        assert_eq!(pool.changes, 0, "the sweep recomputed the shares");
        let shares: f64 = pool.members.values().map(|m| m.share).sum();
        assert!((shares - 1_000.0).abs() < 1e-6, "{shares}");
    }

    /// The cost the issue measured, at its size: one report of `REPORT` entries in a pool of
    /// `MEMBERS` participants (each its first report: a join and a report). Run in release:
    /// `cargo test --release --lib large_pool -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, run by hand in release"]
    fn large_pool_report_cost() {
        for (members, report) in [(3_000, 3_000), (30_000, 10_000)] {
            let pools = LocalPools::new(Duration::from_secs(20), Duration::from_secs(5));
            let s = Arc::new(Signal::default());
            let now = Instant::now();
            let sp = spec(600_000);
            let usage = Some(Usage {
                requests: 5,
                seconds: 5.0,
            });
            for pid in 0..members as u64 - report as u64 {
                pools.join(&sp, pid, &s, now);
                pools.report(&sp.key, pid, usage, now);
            }
            let (started, wall) = (cpu(), tokio::time::Instant::now());
            for pid in (members - report) as u64..members as u64 {
                pools.join(&sp, pid, &s, now);
                pools.report(&sp.key, pid, usage, now);
            }
            println!(
                "a report of {report} new buckets in a pool of {members}: {:?} of CPU \
                 (10 ms ticks), {:?} on the clock",
                cpu() - started,
                wall.elapsed()
            );
        }
    }

    fn spec(limit: u64) -> PoolSpec {
        PoolSpec {
            key: b"k".as_slice().into(),
            limit,
            window_s: 60,
            burst: limit,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn grants_never_add_up_past_the_limit_and_leases_outlive_streams() {
        let pools = LocalPools::new(Duration::from_secs(20), Duration::from_secs(5));
        let s = Arc::new(Signal::default());
        let now = Instant::now();
        let sp = spec(600);
        for pid in 1..=3 {
            pools.join(&sp, pid, &s, now);
        }
        // Demands of 1, 6 and 20 per second, reported a few times.
        let mut grants = [None; 3];
        for _ in 0..5 {
            for (i, d) in [1, 6, 20].into_iter().enumerate() {
                let u = Usage {
                    requests: d * 5,
                    seconds: 5.0,
                };
                grants[i] = pools.report(&sp.key, i as u64 + 1, Some(u), now);
            }
        }
        let tokens: Vec<u64> = grants.iter().map(|g| g.unwrap().tokens).collect();
        assert!(tokens.iter().sum::<u64>() <= 600, "{tokens:?}");
        assert!(
            tokens[0] >= 60,
            "the small client keeps what it needs: {tokens:?}"
        );
        assert!(tokens[1].abs_diff(tokens[2]) <= 1, "{tokens:?}");

        // The big client leaves: its lease still counts until it runs out.
        pools.leave(&sp.key, 3, now);
        let g = pools
            .report(
                &sp.key,
                2,
                Some(Usage {
                    requests: 30,
                    seconds: 5.0,
                }),
                now,
            )
            .unwrap();
        assert!(g.tokens + tokens[0] + tokens[2] <= 600);
        let later = now + Duration::from_secs(21);
        pools.sweep(later);
        let g2 = pools
            .report(
                &sp.key,
                2,
                Some(Usage {
                    requests: 30,
                    seconds: 5.0,
                }),
                later,
            )
            .unwrap();
        assert!(g2.tokens > g.tokens, "{g2:?} after {g:?}");
        assert!(s.take(usize::MAX).0.len() <= 3);
    }
}
