//! The Redis backend: every counter of a request decided by ONE atomic Lua script call
//! (`script.lua`), so replicas sharing a Redis never admit more than the limit between them.
//!
//! Keys are `<prefix>{<tag>}<rest>`. With `--redis-hash-tag domain` (default) the tag is the
//! domain: a request's keys share one cluster slot and one script call decides them exactly.
//! With `--redis-hash-tag descriptor` each descriptor's keys carry their own tag so a busy
//! domain spreads over the cluster; the request's keys are grouped by slot, one script runs per
//! group in parallel, and when any group rejects, the admissions of the groups that consumed
//! are undone (their cost reports and refunds stand: they happened). That mode may over-reject
//! for one round trip (a concurrent request can see the consumed-then-undone hits); it never
//! over-admits.
//!
//! With a per-second store (`--redis-per-second-*`, envoyproxy/ratelimit's `REDIS_PERSECOND`),
//! the counters of windows shorter than a minute live in a second Redis deployment and the
//! rest in the main one: a request touching both is two groups, one call in each store, in
//! parallel, undone the same way. Each store has its own connection, calls and circuit, so a
//! request touching only a store that answers is decided while the other is down.

mod batch;
mod cache;
mod circuit;
pub(crate) mod connection;
mod error;
mod eviction;
pub(crate) mod presence;
pub(crate) mod rlqs;
mod switch;
mod url;
mod wire;

use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use futures_util::future::join_all;
use redis::RedisError;
use smallvec::SmallVec;
use tokio::sync::oneshot;

pub(crate) use self::batch::BatchOptions;
use self::batch::{Batcher, CallError, Part, Reply};
use self::cache::OverLimitCache;
use self::circuit::{StoreHealth, UpGauge};
pub(crate) use self::connection::{Conn, Credentials, RedisTlsFiles, Topology};
pub use self::connection::{RedisUrl, SetupError};
use self::error::ErrorKind;
pub use self::wire::SCRIPT;
use self::wire::{Args, Decided, Mode};
use super::{
    Algorithm, Backend, BackendError, BoxFuture, Clock, Degrade, Enforcement, Hit, HitKind, HoldId,
    HoldView, Outcome, PlaceChange, SystemClock, Verdict, admits,
};
use crate::logs::{self, Throttle};
use crate::metrics::{BackendMetrics, KindLabels};

/// Everything the Redis backend needs (keys come built: see [`crate::limiter::key`]).
#[derive(Clone, Debug)]
pub(crate) struct RedisOptions {
    /// Where Redis is.
    pub target: Topology,
    /// TLS files for `rediss://`.
    pub tls: RedisTlsFiles,
    /// Budget for one request's calls, queueing, redirections and retries included.
    pub timeout: Duration,
    /// Bytes of the over-limit cache, keys included; 0 turns it off.
    pub local_cache_bytes: u64,
    /// Script calls in flight at once on the connection (per process).
    pub pipeline: usize,
    /// Most requests one script call carries.
    pub max_batch: usize,
    /// How far past its limit a cost report may take a counter (`--max-debt`).
    pub max_debt: u64,
    /// Where the counters of windows shorter than a minute live, when not in `target`
    /// (same TLS files, timeout and call bounds).
    pub per_second: Option<Topology>,
}

/// One Redis deployment the backend counts in, with its own calls and circuit.
struct Store {
    conn: Conn,
    batcher: Batcher,
    health: Arc<StoreHealth>,
    /// Probes at once when notified (a sentinel announced a new master).
    wake: Arc<tokio::sync::Notify>,
    /// The store's sentinels (none for another shape), listened to by the probe.
    sentinels: Vec<redis::Client>,
    /// The master's name the sentinels watch.
    master: Option<String>,
}

/// Index of the main store in [`RedisBackend::stores`].
const MAIN: u8 = 0;
/// Index of the per-second store, when there is one.
const PER_SECOND: u8 = 1;

/// Counters in Redis.
pub(crate) struct RedisBackend {
    /// The main store, then the per-second store if there is one.
    stores: SmallVec<[Store; 2]>,
    opts: RedisOptions,
    cache: Option<OverLimitCache>,
    /// The RLQS pools' calls: a lane of their own (see [`rlqs::Lane`]).
    rlqs: rlqs::Lane,
    metrics: BackendMetrics,
    nonce_base: u64,
    nonce: AtomicU64,
    /// This service's clock, and how far Redis' clock is ahead of it (µs, from the last
    /// reply's TIME): where calendar windows' boundaries are sent around. Redis' clock decides
    /// which window holds a call; this only keeps the guess close (see script.lua).
    clock: Arc<dyn Clock>,
    redis_ahead_us: AtomicI64,
    /// Replicas alive on this Redis as last counted there (`presence.rs`; 1 until counted).
    replicas: crate::limiter::share::ReplicaCount,
    /// This replica's name on Redis (`presence.rs`).
    name: String,
}

/// How far the estimate of Redis' clock may drift before a reply's TIME replaces it (µs): a
/// calendar window is an hour at least, so a second is nothing, and most replies leave the
/// shared value unwritten.
const REDIS_CLOCK_SLACK_US: i64 = 1_000_000;

/// One script call's share of a request: the indices of its hits, all in one slot of one store.
struct Group {
    store: u8,
    slot: u16,
    hits: SmallVec<[usize; 8]>,
}

/// CRC16 (XMODEM) of the hash tag, mod 16384: the Redis Cluster slot.
pub fn slot(tag: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in tag {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

impl RedisBackend {
    /// Prepares the backend without connecting (Redis may be down at start).
    pub(crate) fn new(
        opts: RedisOptions,
        metrics: BackendMetrics,
    ) -> Result<RedisBackend, SetupError> {
        crate::metrics::at_zero(
            &metrics.errors,
            ErrorKind::ALL.map(|kind| KindLabels { kind: kind.label() }),
        );
        let targets: SmallVec<[(&'static str, &Topology); 2]> = [("redis", &opts.target)]
            .into_iter()
            .chain(opts.per_second.iter().map(|t| ("per-second redis", t)))
            .collect();
        let gauges = UpGauge::per_store(&metrics, targets.len());
        let stores = targets
            .into_iter()
            .zip(gauges)
            .map(|((name, target), gauge)| {
                let conn = Conn::new(target, &opts.tls, opts.timeout)?;
                let ping = Conn::new(target, &opts.tls, opts.timeout)?;
                let health = Arc::new(StoreHealth::new(name, ping, Some(gauge)));
                let batcher = Batcher::new(
                    conn.clone(),
                    matches!(target, Topology::Cluster(_)),
                    BatchOptions {
                        pipeline: opts.pipeline,
                        max_requests: opts.max_batch,
                        timeout: opts.timeout,
                        max_debt: opts.max_debt,
                    },
                    metrics.clone(),
                    health.clone(),
                );
                Ok(Store {
                    conn,
                    batcher,
                    health,
                    wake: Arc::new(tokio::sync::Notify::new()),
                    sentinels: connection::sentinel_clients(target, &opts.tls)?,
                    master: match target {
                        Topology::Sentinel { master, .. } => Some(master.clone()),
                        _ => None,
                    },
                })
            })
            .collect::<Result<_, SetupError>>()?;
        let rlqs = rlqs::Lane::new(&opts)?;
        Ok(RedisBackend {
            stores,
            cache: (opts.local_cache_bytes > 0)
                .then(|| OverLimitCache::new(opts.local_cache_bytes)),
            rlqs,
            metrics,
            nonce_base: RandomState::new().hash_one(std::process::id()),
            nonce: AtomicU64::new(0),
            clock: Arc::new(SystemClock),
            redis_ahead_us: AtomicI64::new(0),
            replicas: Default::default(),
            name: presence::new_name(),
            opts,
        })
    }

    /// This backend with `clock` as the service's own (the estimate of Redis' clock starts
    /// from it; answers never do).
    pub(crate) fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Where Redis' clock is expected to be now (µs).
    fn redis_now(&self) -> u64 {
        let ahead = self.redis_ahead_us.load(Ordering::Relaxed);
        self.clock.now_us().saturating_add_signed(ahead)
    }

    /// Learns Redis' clock from a reply's TIME (µs).
    fn learn_redis_time(&self, at: i64) {
        let ahead = at.saturating_sub(self.clock.now_us() as i64);
        let known = self.redis_ahead_us.load(Ordering::Relaxed);
        if ahead.abs_diff(known) > REDIS_CLOCK_SLACK_US as u64 {
            self.redis_ahead_us.store(ahead, Ordering::Relaxed);
        }
    }

    /// Readies every store for the first burst (see `Batcher::warm`) and probes it, within
    /// `within` for all: called before the service listens, so that a replica that says
    /// SERVING decides its first calls as fast as its later ones. A store that cannot be
    /// readied is marked unreachable, so the failure mode answers at once instead of each first
    /// call waiting out its budget; the probes bring it back. Returns the stores that could not
    /// be readied (each logged with why).
    pub(crate) async fn warm(&self, within: Duration) -> Vec<&'static str> {
        let stores = self.stores.iter().map(|store| async move {
            let ready = async {
                store.batcher.warm().await.map_err(|e| e.to_string())?;
                store.health.probe(&store.conn, self.opts.timeout).await
            };
            let outcome = match tokio::time::timeout(within, ready).await {
                Ok(r) => r,
                Err(_) => Err(format!("not ready within {within:?}")),
            };
            match outcome {
                Ok(()) => {
                    store.health.on_answer();
                    None
                }
                Err(why) => {
                    store.health.down_at_start(&why);
                    Some(store.health.name())
                }
            }
        });
        futures_util::future::join_all(stores)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Whether the last call or probe reached every store.
    pub(crate) fn is_reachable(&self) -> bool {
        self.stores.iter().all(|s| s.health.is_reachable())
    }

    /// Pings each store every `every` so health and metrics tell the truth without traffic,
    /// and a recovered store closes its circuit without waiting for a request to probe it.
    /// One task per store, so a slow store does not delay the other's probe.
    ///
    /// While a store is down it is probed ten times as often, so a store that is back is used
    /// again within a tenth of `every` (and its circuit closes) rather than within `every`.
    pub(crate) fn spawn_probes(
        self: &Arc<Self>,
        every: Duration,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let mut tasks = Vec::new();
        for (store, s) in self.stores.iter().enumerate() {
            if let Some(master) = &s.master {
                for sentinel in &s.sentinels {
                    tasks.push(switch::listen(
                        sentinel.clone(),
                        master.clone(),
                        s.wake.clone(),
                    ));
                }
            }
            let backend = Arc::downgrade(self);
            let wake = s.wake.clone();
            tasks.push(tokio::spawn(async move {
                loop {
                    let up = backend
                        .upgrade()
                        .is_some_and(|b| b.stores[store].health.is_reachable());
                    tokio::select! {
                        () = tokio::time::sleep(if up { every } else { every / 10 }) => {}
                        () = wake.notified() => {}
                    }
                    let Some(b) = backend.upgrade() else { return };
                    let health = &b.stores[store].health;
                    // As long as a timed-out call's confirming PING: a Redis slow under one
                    // client's load is not down.
                    match health.probe(&b.stores[store].conn, b.opts.timeout).await {
                        Ok(()) => {
                            if !health.is_reachable() {
                                tracing::info!("{} reachable again", health.name());
                            }
                            health.on_answer();
                        }
                        Err(why) => {
                            if health.is_reachable() {
                                tracing::warn!("{} unreachable ({why})", health.name());
                            }
                            health.on_unreachable(&why);
                        }
                    }
                }
            }));
        }
        tasks
    }

    /// Which store keeps `hit`'s counter.
    fn store_of(&self, hit: &Hit) -> u8 {
        if self.stores.len() > 1 && hit.limit.is_short() {
            PER_SECOND
        } else {
            MAIN
        }
    }

    /// The request's hits by store and cluster slot (of each key's hash tag), in order of
    /// appearance. With the domain as the tag, every hit of a request in one store lands in
    /// one group.
    fn groups(&self, hits: &[Hit]) -> SmallVec<[Group; 2]> {
        let mut groups: SmallVec<[Group; 2]> = SmallVec::new();
        for (i, hit) in hits.iter().enumerate() {
            let s = slot(hit.key.tag());
            let store = self.store_of(hit);
            match groups.iter_mut().find(|g| g.slot == s && g.store == store) {
                Some(g) => g.hits.push(i),
                None => groups.push(Group {
                    store,
                    slot: s,
                    hits: SmallVec::from_slice(&[i]),
                }),
            }
        }
        groups
    }

    /// Submits `group`'s share of a request to the batcher. For an undo, `consumed[i]` says
    /// whether the decide took admission `i` (it did not when that limit was over, nor for a
    /// report or a refund): only what was taken is given back.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        hits: &[Hit],
        group: &Group,
        mode: Mode,
        nonce: ([u8; 33], u8),
        at: i64,
        soft_split: bool,
        consumed: Option<&[bool]>,
    ) -> oneshot::Receiver<Result<Reply, CallError>> {
        let (reply, answer) = oneshot::channel();
        let bytes = group
            .hits
            .iter()
            .map(|&i| hits[i].key.as_bytes().len())
            .sum();
        let nonce = &nonce.0[..nonce.1 as usize];
        let mut args = match mode {
            Mode::Decide => Args::decide(nonce, bytes),
            Mode::Undo => {
                let through_tag = hits[group.hits[0]].key.through_tag();
                let mut marker = Vec::with_capacity(through_tag.len() + 5 + nonce.len());
                marker.extend_from_slice(through_tag);
                marker.extend_from_slice(b"undo:");
                marker.extend_from_slice(nonce);
                Args::undo(nonce, at, marker, bytes)
            }
        };
        for &i in &group.hits {
            let hit = &hits[i];
            let (given, kind) = match consumed {
                Some(c) => (if c[i] { hit.hits } else { 0 }, HitKind::Admission),
                None => (hit.hits, hit.kind),
            };
            // Across several calls no one call can judge "every quota limit is over".
            let enforcement = match hit.enforcement {
                Enforcement::Soft if soft_split => Enforcement::Shadow,
                e => e,
            };
            args.push(
                hit.key.as_bytes(),
                &hit.limit,
                given,
                enforcement,
                kind,
                &hit.hold,
                || self.redis_now(),
            );
        }
        let part = Part {
            args,
            slot: group.slot,
            reply,
        };
        self.stores[group.store as usize].batcher.submit(part);
        answer
    }

    /// A failure of `kind` as a [`BackendError`], counted.
    fn error(&self, kind: ErrorKind, detail: impl Into<String>) -> BackendError {
        self.metrics.error(kind.label());
        kind.error(detail)
    }

    /// A failed Redis operation as a [`BackendError`], counted by kind.
    fn redis_error(&self, e: &RedisError) -> BackendError {
        self.error(ErrorKind::of(e), format!("redis: {e}"))
    }

    fn timeout_error(&self) -> BackendError {
        let detail = format!("redis did not answer within {:?}", self.opts.timeout);
        self.error(ErrorKind::Timeout, detail)
    }

    /// Runs `op` on `conn` within the call budget (for the admin reset's direct commands). A
    /// failure becomes a [`BackendError`], counted by kind; a connection the error says is
    /// dead is dropped.
    async fn bounded<T>(
        &self,
        conn: &Conn,
        op: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, BackendError> {
        match tokio::time::timeout(self.opts.timeout, op).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                conn.on_error(&e).await;
                Err(self.redis_error(&e))
            }
            Err(_) => Err(self.timeout_error()),
        }
    }

    /// Sends `cmd` on `conn` within the call budget (the admin API's few commands).
    async fn ask<T: redis::FromRedisValue>(
        &self,
        conn: &Conn,
        cmd: &redis::Cmd,
    ) -> Result<T, BackendError> {
        self.bounded(conn, conn.query(cmd, self.opts.timeout)).await
    }

    /// Sends `cmd` to the main store within the call budget: for the few commands a task
    /// sends every few seconds off the request path (the heavy-hitter views' exchange).
    pub(crate) async fn command<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
    ) -> Result<T, BackendError> {
        let conn = &self.stores[MAIN as usize].conn;
        self.bounded(conn, conn.query(cmd, self.opts.timeout)).await
    }

    /// Waits for a submitted part's reply, within what is left of the request's budget. The
    /// circuit hears of each call's outcome from the call itself, once, not from here.
    async fn answer(
        &self,
        answer: oneshot::Receiver<Result<Reply, CallError>>,
        deadline: tokio::time::Instant,
    ) -> Result<Reply, BackendError> {
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(Ok(reply))) => Ok(reply),
            Ok(Ok(Err(CallError::Redis(e)))) => Err(self.redis_error(&e)),
            Ok(Ok(Err(CallError::Timeout))) | Err(_) => Err(self.timeout_error()),
            Ok(Ok(Err(CallError::Reply(detail)))) => Err(self.error(ErrorKind::Reply, detail)),
            Ok(Ok(Err(CallError::Closed))) | Ok(Err(_)) => {
                Err(self.error(ErrorKind::Closed, "the redis backend is shutting down"))
            }
            Ok(Ok(Err(CallError::Overloaded))) => {
                Err(self.error(ErrorKind::Overloaded, "the queue of script calls is full"))
            }
        }
    }

    fn next_nonce(&self) -> ([u8; 33], u8) {
        let mut buf = [0u8; 33];
        let mut len = push_hex(&mut buf, 0, self.nonce_base);
        buf[len] = b'.';
        len = push_hex(
            &mut buf,
            len + 1,
            self.nonce.fetch_add(1, Ordering::Relaxed),
        );
        (buf, len as u8)
    }

    /// Whether calls may go to `group`'s store now: `None`, or its open circuit as a counted
    /// error.
    fn circuit(&self, group: &Group) -> Option<BackendError> {
        let health = &self.stores[group.store as usize].health;
        (!health.allow()).then(|| {
            let detail = format!("{} circuit open after repeated failures", health.name());
            self.error(ErrorKind::CircuitOpen, detail)
        })
    }

    /// Whether calls may go to every store `groups` name now; an open circuit is a counted
    /// error.
    fn circuits_closed(&self, groups: &[Group]) -> Result<(), BackendError> {
        let mut seen = 0u8;
        for g in groups {
            if seen & (1 << g.store) != 0 {
                continue;
            }
            seen |= 1 << g.store;
            let health = &self.stores[g.store as usize].health;
            if !health.allow() {
                let detail = format!("{} circuit open after repeated failures", health.name());
                return Err(self.error(ErrorKind::CircuitOpen, detail));
            }
        }
        Ok(())
    }

    /// Decides `hits` in the stores they live in. With `degrade`, the groups of a store that
    /// failed (its circuit open, or its call) while others answered are decided by it.
    async fn decide_remote(
        &self,
        hits: &[Hit],
        degrade: Option<&Degrade<'_>>,
    ) -> Result<Outcome, BackendError> {
        let groups = self.groups(hits);
        // A group whose store's circuit is open is failed up front; without a way to decide
        // it apart, so is the request.
        let open: SmallVec<[Option<BackendError>; 2]> = match degrade {
            Some(_) if self.stores.len() > 1 => groups.iter().map(|g| self.circuit(g)).collect(),
            _ => {
                self.circuits_closed(&groups)?;
                groups.iter().map(|_| None).collect()
            }
        };
        if open.iter().all(Option::is_some) {
            let first = open.into_iter().flatten().next();
            return Err(first.expect("at least one group"));
        }
        let deadline = tokio::time::Instant::now() + self.opts.timeout;
        let nonce = self.next_nonce();
        let soft_split = groups.len() > 1;
        let answers: SmallVec<[_; 2]> = groups
            .iter()
            .zip(&open)
            .filter(|(_, open)| open.is_none())
            .map(|(g, _)| self.submit(hits, g, Mode::Decide, nonce, 0, soft_split, None))
            .collect();
        let answered: SmallVec<[_; 2]> = if answers.len() == 1 {
            let only = answers.into_iter().next().expect("one group");
            let mut results = SmallVec::new();
            results.push(self.answer(only, deadline).await);
            results
        } else {
            join_all(answers.into_iter().map(|a| self.answer(a, deadline)))
                .await
                .into_iter()
                .collect()
        };
        let mut answered = answered.into_iter();
        let mut results: SmallVec<[Result<Reply, BackendError>; 2]> = open
            .into_iter()
            .map(|open| match open {
                Some(e) => Err(e),
                None => answered.next().expect("an answer per group submitted"),
            })
            .collect();
        // A calendar window whose boundaries missed Redis' clock (this service's idea of it was
        // off by more than a window: at start, or after either clock jumped): nothing was
        // written for that group. Once more, around the time its reply carried. Only requests
        // with a calendar limit learn Redis' clock: the others have no use for it.
        let calendar = hits.iter().any(|h| h.limit.calendar.is_some());
        for (g, result) in results.iter_mut().enumerate().filter(|_| calendar) {
            let Ok(reply) = result else { continue };
            self.learn_redis_time(reply.at());
            if matches!(Decided::parse(reply.values(), reply.at()), Decided::Stale) {
                let again = self.submit(hits, &groups[g], Mode::Decide, nonce, 0, soft_split, None);
                *result = self.answer(again, deadline).await;
            }
        }

        let mut verdicts = vec![
            Verdict {
                over: false,
                remaining: 0,
                fits: 0,
                reset: Duration::ZERO
            };
            hits.len()
        ];
        let mut committed: SmallVec<[(usize, i64); 2]> = SmallVec::new(); // (group, time)
        let mut places: Vec<PlaceChange> = Vec::new();
        let mut first_error = None;
        // Groups whose store could not be reached: the failure mode may decide them apart.
        let mut unreachable: SmallVec<[usize; 2]> = SmallVec::new();
        let mut degradable = true;
        for (g, result) in results.into_iter().enumerate() {
            let reply = match result {
                Ok(reply) => reply,
                Err(e) => {
                    if e.is_transient() {
                        unreachable.push(g);
                    } else {
                        degradable = false;
                    }
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            match Decided::parse(reply.values(), reply.at()) {
                Decided::Stale => {
                    degradable = false;
                    first_error.get_or_insert(self.error(
                        ErrorKind::Clock,
                        "redis' clock left a calendar window between two calls of one request",
                    ));
                }
                Decided::ForeignData => {
                    // This request alone could not be decided; the others in its call were.
                    degradable = false;
                    first_error.get_or_insert(self.error(
                        ErrorKind::ForeignData,
                        "a counter key holds data this service did not write",
                    ));
                }
                Decided::Answered {
                    admitted,
                    at,
                    limits,
                } => {
                    if admitted {
                        committed.push((g, at));
                    }
                    let algorithms = groups[g].hits.iter().map(|&i| hits[i].limit.algorithm);
                    for (&i, (verdict, change)) in groups[g]
                        .hits
                        .iter()
                        .zip(wire::verdicts(limits, algorithms))
                    {
                        verdicts[i] = verdict;
                        if let Some((change, end, ended)) = change
                            && (change != 0 || ended != 0)
                        {
                            places.push(PlaceChange {
                                hit: i,
                                change,
                                end,
                                at: at.max(0) as u64,
                                ended,
                            });
                        }
                    }
                }
            }
        }
        let mut degraded: SmallVec<[usize; 8]> = SmallVec::new();
        if let Some(degrade) = degrade
            && degradable
            && !unreachable.is_empty()
            && unreachable.len() < groups.len()
            && let Some(err) = first_error.take()
        {
            degraded = unreachable
                .iter()
                .flat_map(|&g| groups[g].hits.iter().copied())
                .collect();
            // When the stores that answered already refuse, the others' admissions are only
            // looked at (0 hits): a refused request takes nothing anywhere.
            let refused = !admits(hits, |i| !degraded.contains(&i) && verdicts[i].over);
            let apart: Vec<Hit> = degraded
                .iter()
                .map(|&i| {
                    let mut hit = hits[i].clone();
                    if refused && hit.kind == HitKind::Admission {
                        hit.hits = 0;
                    }
                    hit
                })
                .collect();
            match degrade(&apart, err) {
                Ok(outcome) => {
                    for (&i, verdict) in degraded.iter().zip(outcome.verdicts) {
                        verdicts[i] = verdict;
                    }
                    places.extend(outcome.places.into_iter().map(|p| PlaceChange {
                        hit: degraded[p.hit],
                        ..p
                    }));
                }
                Err(e) => first_error = Some(e),
            }
        }
        let admitted = first_error.is_none() && admits(hits, |i| verdicts[i].over);
        if !admitted && groups.len() > 1 {
            // Undo the groups that consumed, and in them only the admissions that were taken
            // (an over limit, shadow or quota, took nothing; reports and refunds stand); never
            // over-admit, may over-reject briefly.
            let consumed: Vec<bool> = hits
                .iter()
                .zip(&verdicts)
                .map(|(h, v)| h.kind == HitKind::Admission && !v.over)
                .collect();
            let deadline = tokio::time::Instant::now() + self.opts.timeout;
            let undos = committed
                .iter()
                .filter(|&&(g, _)| groups[g].hits.iter().any(|&i| consumed[i]))
                .map(|&(g, at)| {
                    let answer = self.submit(
                        hits,
                        &groups[g],
                        Mode::Undo,
                        nonce,
                        at,
                        soft_split,
                        Some(&consumed),
                    );
                    self.answer(answer, deadline)
                });
            let undone: SmallVec<[usize; 2]> = committed
                .iter()
                .filter(|&&(g, _)| groups[g].hits.iter().any(|&i| consumed[i]))
                .map(|&(g, _)| g)
                .collect();
            for (result, g) in join_all(undos).await.into_iter().zip(undone) {
                static LOG: Throttle = Throttle::new(logs::EVERY);
                match result {
                    // The places its decide took are given back with it.
                    Ok(_) => {
                        for p in places.iter_mut() {
                            if p.change == 1 && groups[g].hits.contains(&p.hit) {
                                p.change = 0;
                            }
                        }
                    }
                    Err(e) => {
                        if let Some(held_back) = LOG.pass() {
                            tracing::warn!(error = %e, held_back, "undo failed; the hits stay counted until their window ends");
                        }
                    }
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        if let Some(cache) = &self.cache {
            let now = Instant::now();
            for (i, (hit, v)) in hits.iter().zip(&verdicts).enumerate() {
                if degraded.contains(&i) {
                    continue; // decided apart, not by Redis
                }
                if hit.kind == HitKind::Refund {
                    // What was known over may fit again.
                    cache.remove(hit.key.as_bytes());
                } else if v.over
                    && hit.enforcement == Enforcement::Enforce
                    // A place may be released (on any replica) before its lifetime ends.
                    && hit.limit.algorithm != Algorithm::Concurrency
                {
                    let limit = (hit.limit.requests_per_unit, hit.limit.burst);
                    cache.insert(hit.key.as_bytes(), limit, now, now + v.reset, hit.hits);
                }
            }
        }
        Ok(Outcome {
            admitted,
            verdicts,
            places,
        })
    }

    /// A decision: from the over-limit cache, else in Redis (`degrade` as in
    /// [`RedisBackend::decide_remote`]).
    async fn decide_with(
        &self,
        hits: &[Hit],
        degrade: Option<&Degrade<'_>>,
    ) -> Result<Outcome, BackendError> {
        if let Some(outcome) = self.decide_cached(hits) {
            return Ok(outcome);
        }
        if crate::trace::enabled() {
            use tracing::Instrument;
            // A child of the request's span: this request's wait for Redis (its script call
            // may carry other requests too).
            let span = tracing::info_span!(
                target: crate::trace::SPAN_TARGET,
                "redis",
                counters = hits.len()
            );
            return self.decide_remote(hits, degrade).instrument(span).await;
        }
        self.decide_remote(hits, degrade).await
    }

    /// Answers from the over-limit cache when an enforced hit is known to be over. Never for a
    /// request carrying a cost report or a refund: those must reach Redis, over or not.
    fn decide_cached(&self, hits: &[Hit]) -> Option<Outcome> {
        let cache = self.cache.as_ref()?;
        if hits.iter().any(|h| h.kind != HitKind::Admission) {
            return None;
        }
        let now = Instant::now();
        let mut any = false;
        let verdicts: Vec<Verdict> = hits
            .iter()
            .map(|hit| {
                let limit = (hit.limit.requests_per_unit, hit.limit.burst);
                let until = (hit.enforcement == Enforcement::Enforce)
                    .then(|| cache.over_until(hit.key.as_bytes(), limit, hit.hits, now))
                    .flatten();
                match until {
                    Some(until) => {
                        any = true;
                        Verdict {
                            over: true,
                            remaining: 0,
                            fits: 0,
                            reset: until - now,
                        }
                    }
                    // Unknown without a round trip; the request is rejected anyway.
                    None => Verdict {
                        over: false,
                        remaining: 0,
                        fits: 0,
                        reset: Duration::ZERO,
                    },
                }
            })
            .collect();
        if !any {
            return None;
        }
        self.metrics.local_cache_hits.inc();
        Some(Outcome {
            admitted: false,
            verdicts,
            places: Vec::new(),
        })
    }
}

impl Backend for RedisBackend {
    fn decide<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<Outcome, BackendError>> {
        Box::pin(self.decide_with(hits, None))
    }

    fn decide_degrading<'a>(
        &'a self,
        hits: &'a [Hit],
        degrade: &'a Degrade<'a>,
    ) -> BoxFuture<'a, Result<Outcome, BackendError>> {
        Box::pin(self.decide_with(hits, Some(degrade)))
    }

    fn reset<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let mut removed = 0;
            // One DEL per key: with per-descriptor hash tags they may live in different slots.
            for hit in hits {
                if let Some(cache) = &self.cache {
                    cache.remove(hit.key.as_bytes());
                }
                let conn = &self.stores[self.store_of(hit) as usize].conn;
                removed += self
                    .bounded(conn, conn.del(hit.key.as_bytes(), self.opts.timeout))
                    .await?;
                for key in hold_keys(hit) {
                    self.bounded(conn, conn.del(&key, self.opts.timeout))
                        .await?;
                }
            }
            Ok(removed)
        })
    }

    fn holds<'a>(
        &'a self,
        hits: &'a [Hit],
    ) -> BoxFuture<'a, Result<Vec<Vec<HoldView>>, BackendError>> {
        Box::pin(async move {
            let mut all = Vec::with_capacity(hits.len());
            for hit in hits {
                let conn = &self.stores[self.store_of(hit) as usize].conn;
                let (seconds, micros): (u64, u64) = self.ask(conn, &redis::cmd("TIME")).await?;
                let now = seconds * 1_000_000 + micros;
                // (id, end) of each hold, and what each took (a place: 1).
                let by_end_key = match hit.limit.algorithm {
                    Algorithm::Concurrency => hit.key.as_bytes().to_vec(),
                    _ => match hold_keys(hit).next() {
                        Some(key) => key,
                        None => {
                            all.push(Vec::new());
                            continue;
                        }
                    },
                };
                let mut zrange = redis::cmd("ZRANGE");
                zrange.arg(&by_end_key).arg(0).arg(-1).arg("WITHSCORES");
                let ends: Vec<(Vec<u8>, f64)> = self.ask(conn, &zrange).await?;
                let taken: std::collections::HashMap<Vec<u8>, u64> = match hold_keys(hit).nth(1) {
                    Some(key) => {
                        let mut hgetall = redis::cmd("HGETALL");
                        hgetall.arg(key);
                        self.ask(conn, &hgetall).await?
                    }
                    None => Default::default(),
                };
                all.push(
                    ends.into_iter()
                        .filter(|(_, end)| *end > now as f64)
                        .filter_map(|(id, end)| {
                            Some(HoldView {
                                hits: taken.get(&id).copied().unwrap_or(1),
                                id: HoldId::from_stored(&id)?,
                                ends_in: Duration::from_micros((end - now as f64) as u64),
                            })
                        })
                        .collect(),
                );
            }
            Ok(all)
        })
    }

    fn clear_holds<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let listed = self.holds(hits).await?;
            for hit in hits {
                let conn = &self.stores[self.store_of(hit) as usize].conn;
                let keys: Vec<Vec<u8>> = match hit.limit.algorithm {
                    Algorithm::Concurrency => std::iter::once(hit.key.as_bytes().to_vec())
                        .chain(hold_keys(hit))
                        .collect(),
                    _ => hold_keys(hit).collect(),
                };
                for key in keys {
                    self.bounded(conn, conn.del(&key, self.opts.timeout))
                        .await?;
                }
            }
            Ok(listed.iter().map(Vec::len).sum())
        })
    }

    fn is_reachable(&self) -> bool {
        RedisBackend::is_reachable(self)
    }
}

/// The two keys beside a counter that keep its holds (wire.rs, `Args::push`), when its node
/// keeps holds: a rate limit's holds by end, and what each took with the releases owed to
/// refused replays; a concurrency limit's counter is its holds, and only the second is used,
/// for the releases owed.
fn hold_keys(hit: &Hit) -> impl Iterator<Item = Vec<u8>> + '_ {
    let held = hit.hold.is_held();
    [&b":e"[..], b":h"]
        .into_iter()
        .filter(move |_| held)
        .map(|suffix| [hit.key.as_bytes(), suffix].concat())
}

/// Writes `n` in lower-case hex at `buf[at..]`; returns where it ends.
fn push_hex(buf: &mut [u8], at: usize, n: u64) -> usize {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digits = (16 - n.leading_zeros() as usize / 4).max(1);
    for d in 0..digits {
        buf[at + d] = HEX[((n >> (4 * (digits - 1 - d))) & 15) as usize];
    }
    at + digits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis() {
        // Values from CLUSTER KEYSLOT.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"bar"), 5061);
        assert_eq!(slot(b"hello"), 866);
        assert_eq!(slot(b"123456789"), 0x31C3, "the CRC16-XMODEM check value");
    }

    #[test]
    fn nonces_are_hex() {
        for n in [0u64, 9, 0xabc, u64::MAX] {
            let mut buf = [0u8; 33];
            let end = push_hex(&mut buf, 0, n);
            assert_eq!(&buf[..end], format!("{n:x}").as_bytes());
        }
    }
}
