//! Who is being limited, as `/top`, the admin API and `ratelimitd top` read it: each limit's
//! heaviest descriptors from the sketches (this replica's merged with the others'), their
//! values shown as the limit and the server say, and how much of the limit each has left now;
//! and the exchange of views among replicas through Redis.

use std::sync::Arc;
use std::time::Duration;

use super::request::LimitOverride;
use super::resolve::override_hit;
use super::{Engine, EngineError};
use crate::config::{NodeLimits, Unit};
use crate::limiter::key::KeyFormat;
use crate::limiter::redis::RedisBackend;
use crate::limiter::{Enforcement, Hit, HitKind};
use crate::shutdown::Tasks;
use crate::top::sketch::{Counter, decode};
use crate::top::{LimitInfo, LimitTop, OVERRIDE, Top, Values, wire};
use crate::value::OwnedEntries;

/// Descriptors listed per limit unless asked otherwise.
pub(crate) const DEFAULT_TOP_N: usize = 10;
/// Most descriptors whose `remaining` one report looks up (in one backend call).
pub(crate) const MAX_REMAINING_LOOKUPS: usize = 1024;

/// What to list.
#[derive(Clone, Debug, Default)]
pub(crate) struct TopQuery {
    /// Only this domain's limits.
    pub(crate) domain: Option<String>,
    /// Only limits whose rule path or name this is.
    pub(crate) limit: Option<String>,
    /// Only descriptors starting with these entries (key, value as bytes).
    pub(crate) prefix: OwnedEntries,
    /// Descriptors per limit (at most the sketches' capacity).
    pub(crate) n: usize,
}

/// One listed descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TopDescriptor {
    /// Its entries, each shown as the limit shows values. Empty when the descriptor was
    /// counted without its entries (see `elided`).
    pub(crate) entries: Vec<ShownEntry>,
    /// Counted without its entries (too long, or no memory left when it was first counted).
    pub(crate) elided: bool,
    /// Hits asked for; may overestimate by up to `error`.
    pub(crate) hits: u64,
    /// Hits refused (or that a shadow or soft limit would have refused), within
    /// `over_limit_error` of the true count.
    pub(crate) over_limit: u64,
    /// The most `hits` overestimates.
    pub(crate) error: u64,
    /// The most `over_limit` is off, either way.
    pub(crate) over_limit_error: u64,
    /// What is left of the limit for this descriptor now, where it could be looked up.
    pub(crate) remaining: Option<u64>,
}

/// One entry of a listed descriptor, as shown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ShownEntry {
    /// The key.
    pub(crate) key: String,
    /// The value as the limit shows values (`None`: hidden).
    pub(crate) value: Option<String>,
    /// The key or value is not UTF-8 (or the value too long) and is shown escaped
    /// (`crate::value`), so it reads back to its bytes and is never taken for a UTF-8 value
    /// that reads the same.
    pub(crate) escaped: bool,
}

/// One limit's heaviest descriptors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TopLimit {
    /// The limit.
    pub(crate) info: LimitInfo,
    /// How its values are shown.
    pub(crate) values: Values,
    /// Every hit counted for it in the window read.
    pub(crate) hits: u64,
    /// The most hits a descriptor the sketch does not hold may have had.
    pub(crate) floor: u64,
    /// The most refused first (from the sketch of refused hits), then the heaviest (most
    /// refused, then most hits, as the sketch of all hits counts them).
    pub(crate) descriptors: Vec<TopDescriptor>,
}

/// The answer to a [`TopQuery`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TopReport {
    /// The counts cover between one and two of these windows.
    pub(crate) window: Duration,
    /// Descriptors counted per limit.
    pub(crate) capacity: usize,
    /// Hits of limits this replica had no memory left to track.
    pub(crate) untracked_hits: u64,
    /// Bytes this replica's sketches hold now.
    pub(crate) memory_bytes: usize,
    /// The most they may hold (`--top-memory-bytes`).
    pub(crate) memory_limit_bytes: usize,
    /// Limits, by domain, then rule.
    pub(crate) limits: Vec<TopLimit>,
}

/// A limit as listed before `remaining` is known: its descriptors' entries (as sent) and
/// counts.
struct Listed {
    top: LimitTop,
    descriptors: Vec<(OwnedEntries, Counts)>,
}

/// A listed descriptor's counts, from both sketches (see [`TopDescriptor`]).
pub(crate) struct Counts {
    /// Counted with its entries.
    pub(crate) kept: bool,
    pub(crate) hits: u64,
    pub(crate) error: u64,
    pub(crate) over: u64,
    pub(crate) over_error: u64,
}

/// Up to `n` of `top`'s descriptors that start with `prefix`: the most refused first, as the
/// sketch of refused hits counts them (found there whatever their share of all hits), then
/// the heaviest of the sketch of all hits not listed yet. A descriptor's hits come from the
/// sketch of all hits (where it is absent, from that sketch's floor: the most it may have
/// had), its refusals from the sketch of refused hits (where it is absent, at most that
/// sketch's floor, at least what the other counted).
pub(crate) fn listing(
    top: &mut LimitTop,
    prefix: &OwnedEntries,
    n: usize,
) -> Vec<(OwnedEntries, Counts)> {
    let entries_of = |c: &Counter| -> Option<OwnedEntries> {
        match &c.item {
            Some(item) => Some(
                decode(item)?
                    .into_iter()
                    .map(|(k, v)| (k.to_vec(), v.to_vec()))
                    .collect(),
            ),
            None => Some(Vec::new()),
        }
    };
    top.view.sort();
    top.refused.sort();
    let (view, refused) = (&top.view, &top.refused);
    let by_item: std::collections::HashMap<&[u8], &Counter> = view
        .counters
        .iter()
        .filter_map(|c| Some((c.item.as_deref()?, c)))
        .collect();
    let mut listed: std::collections::HashSet<&[u8]> = std::collections::HashSet::new();
    let mut out = Vec::new();
    for r in &refused.counters {
        if out.len() == n {
            return out;
        }
        let Some(entries) = entries_of(r).filter(|e| e.starts_with(prefix)) else {
            continue;
        };
        let (over, over_error) = (r.hits, r.error);
        let counted = r.item.as_deref().and_then(|i| by_item.get(i));
        let (hits, error) = match counted {
            Some(c) => (c.hits, c.error),
            None => {
                let hits = view.floor.max(over);
                (hits, hits - over.saturating_sub(over_error))
            }
        };
        if let Some(item) = r.item.as_deref() {
            listed.insert(item);
        }
        let kept = r.item.is_some();
        out.push((
            entries,
            Counts {
                kept,
                hits,
                error,
                over,
                over_error,
            },
        ));
    }
    for c in &view.counters {
        if out.len() == n {
            break;
        }
        if c.item.as_deref().is_some_and(|i| listed.contains(i)) {
            continue;
        }
        let Some(entries) = entries_of(c).filter(|e| e.starts_with(prefix)) else {
            continue;
        };
        let counts = Counts {
            kept: c.item.is_some(),
            hits: c.hits,
            error: c.error,
            over: c.over,
            over_error: refused.floor.saturating_sub(c.over),
        };
        out.push((entries, counts));
    }
    out
}

impl Engine {
    /// Starts the sketches' window rotation and, with Redis, their exchange among replicas,
    /// as tasks that end with the service.
    pub(crate) fn spawn_top(&self, redis: Option<Arc<RedisBackend>>, tasks: &mut Tasks) {
        let top = self.top();
        if !top.is_on() {
            return;
        }
        tasks.push(tokio::spawn(crate::top::rotate_every(
            top.clone(),
            top.options().window,
        )));
        if let Some(redis) = redis {
            tasks.push(tokio::spawn(exchange(
                top.clone(),
                redis,
                self.keys.clone(),
            )));
        }
    }

    /// Each limit's heaviest descriptors, as `query` asks.
    pub(crate) async fn top_report(&self, query: &TopQuery) -> Result<TopReport, EngineError> {
        let top = self.top();
        let n = query.n.min(top.options().capacity);
        let wanted = |l: &LimitInfo| {
            query.domain.as_ref().is_none_or(|d| *d == l.domain)
                && query
                    .limit
                    .as_ref()
                    .is_none_or(|w| *w == l.rule || Some(w) == l.name.as_ref())
        };
        let listed: Vec<Listed> = top
            .merged(wanted)
            .into_iter()
            .map(|mut top| {
                let descriptors = listing(&mut top, &query.prefix, n);
                Listed { top, descriptors }
            })
            .filter(|l| query.prefix.is_empty() || !l.descriptors.is_empty())
            .collect();
        let mut remaining = self.remaining(&listed).await.into_iter();
        let longest = self.longest_value();
        let limits = listed
            .into_iter()
            .map(|Listed { top, descriptors }| TopLimit {
                descriptors: descriptors
                    .into_iter()
                    .map(|(entries, c)| TopDescriptor {
                        elided: !c.kept,
                        entries: entries
                            .into_iter()
                            .map(|(k, v)| ShownEntry {
                                key: crate::value::shown(&k, longest).into_owned(),
                                value: top.values.apply(&v, longest),
                                escaped: crate::value::is_escaped(&k, longest)
                                    || (top.values == Values::Show
                                        && crate::value::is_escaped(&v, longest)),
                            })
                            .collect(),
                        hits: c.hits,
                        over_limit: c.over,
                        error: c.error,
                        over_limit_error: c.over_error,
                        remaining: remaining.next().flatten(),
                    })
                    .collect(),
                hits: top.view.total,
                floor: top.view.floor,
                info: top.info,
                values: top.values,
            })
            .collect();
        Ok(TopReport {
            window: top.options().window,
            capacity: top.options().capacity,
            untracked_hits: top.untracked(),
            memory_bytes: top.held_bytes(),
            memory_limit_bytes: top.options().memory_bytes,
            limits,
        })
    }

    /// What is left now of each listed descriptor's limit, in listing order: one backend call
    /// checking (consuming nothing) every counter that still exists in the config in force.
    async fn remaining(&self, listed: &[Listed]) -> Vec<Option<u64>> {
        let snapshot = self.config.load();
        let mut hits: Vec<Hit> = Vec::new();
        let mut at: Vec<Option<usize>> = Vec::new();
        for l in listed {
            for (entries, c) in &l.descriptors {
                // Hashed and hidden values are kept as digests: no counter can be named.
                let hit =
                    (c.kept && l.top.values == Values::Show && hits.len() < MAX_REMAINING_LOOKUPS)
                        .then(|| self.counter_of(&snapshot, &l.top.info, entries))
                        .flatten();
                at.push(hit.map(|h| {
                    hits.push(h);
                    hits.len() - 1
                }));
            }
        }
        if hits.is_empty() {
            return at.into_iter().map(|_| None).collect();
        }
        let outcome = match self.backend.decide_at_once(&hits) {
            Some(o) => Some(o),
            None => self.backend.decide(&hits).await.ok(),
        };
        at.into_iter()
            .map(|i| Some(outcome.as_ref()?.verdicts[i?].remaining))
            .collect()
    }

    /// A check (0 hits) of the counter `info`'s limit keeps for `entries`, if the config in
    /// force still has that limit.
    fn counter_of(
        &self,
        snapshot: &crate::config::Snapshot,
        info: &LimitInfo,
        entries: &[(Vec<u8>, Vec<u8>)],
    ) -> Option<Hit> {
        let entries = crate::value::borrowed(entries);
        if info.index == OVERRIDE {
            let unit = Unit::parse(&info.unit)?;
            let o = LimitOverride {
                requests_per_unit: info.requests_per_unit,
                unit,
            };
            return Some(override_hit(
                &self.keys,
                &info.domain,
                &entries,
                o,
                0,
                HitKind::Admission,
            ));
        }
        let matched = snapshot
            .domain(&info.domain)?
            .lookup(&entries, &self.keys)?;
        let Some(NodeLimits::Limits(rules)) = &matched.node.limits else {
            return None;
        };
        let rule = rules.get(usize::from(info.index))?;
        if *matched.node.path != info.rule
            || rule.requests_per_unit != info.requests_per_unit
            || rule.window_seconds() != info.window_seconds
            || rule.algorithm.as_str() != info.algorithm
        {
            return None;
        }
        Some(Hit {
            key: matched.key.for_identity(&rule.identity),
            limit: rule.limit(),
            hits: 0,
            enforcement: Enforcement::Enforce,
            kind: HitKind::Admission,
            // A look at the counter: no hold taken.
            hold: crate::limiter::Hold::Unheld,
        })
    }
}

/// The Redis keys of the exchange, all under one hash tag (one slot: one MGET reads many
/// views, on a cluster too).
struct ExchangeKeys {
    /// The set of replicas publishing.
    replicas: Vec<u8>,
    /// Each replica's own view: `view:<replica>`.
    view_prefix: Vec<u8>,
    /// The other replicas' views merged, for each replica: `others:<replica>`.
    others_prefix: Vec<u8>,
    /// Who merges in an interval: `turn:<interval number>`.
    turn_prefix: Vec<u8>,
}

impl ExchangeKeys {
    fn new(keys: &KeyFormat) -> ExchangeKeys {
        let base = [keys.prefix(), b"{ratelimitd-top}:"].concat();
        ExchangeKeys {
            replicas: [&base[..], b"replicas"].concat(),
            view_prefix: [&base[..], b"view:"].concat(),
            others_prefix: [&base[..], b"others:"].concat(),
            turn_prefix: [&base[..], b"turn:"].concat(),
        }
    }

    fn view(&self, replica: &str) -> Vec<u8> {
        [&self.view_prefix[..], replica.as_bytes()].concat()
    }

    fn others(&self, replica: &str) -> Vec<u8> {
        [&self.others_prefix[..], replica.as_bytes()].concat()
    }

    fn turn(&self, interval: u64) -> Vec<u8> {
        [&self.turn_prefix[..], interval.to_string().as_bytes()].concat()
    }
}

/// Most replicas whose views are merged.
pub(crate) const MAX_REPLICAS: usize = 256;

/// Where the wall clock is in intervals of `every`: the interval's number and how long until
/// the next begins. Every replica's intervals begin at the same instants (as far as their
/// clocks agree), so the exchange's steps line up across the fleet. The system's clock, as
/// the sleeps between the steps are in real time.
fn interval_of(every: Duration) -> (u64, Duration) {
    use crate::limiter::clock::Clock;
    let now = u128::from(crate::limiter::clock::SystemClock.now_us() / 1000);
    let every = every.as_millis().max(1);
    let next = (now / every + 1) * every;
    (
        (now / every) as u64,
        Duration::from_millis((next - now) as u64),
    )
}

/// The exchange of views among the replicas on one Redis, until the service stops. What Redis
/// sends each replica per interval does not grow with the replicas: at the start of each
/// interval of `--top-publish-interval` (on the wall clock), every replica publishes its own
/// view (expiring after two intervals, so a dead replica's ages out); the first to take the
/// interval's turn merges, a quarter interval later, every view into one per replica (all the
/// others' views: each replica's share counted once, never its own) and writes them; at half
/// the interval every other replica reads the one written for it. The merging replica reads
/// every view once (on average one per replica), each other replica one merged view.
pub(crate) async fn exchange(top: Arc<Top>, redis: Arc<RedisBackend>, keys: KeyFormat) {
    let replica = redis.replica_name().to_owned();
    let every = top.options().publish_every;
    let keys = ExchangeKeys::new(&keys);
    let mut failing = false;
    // Intervals since a merged view was last read: past three, the others' views are dropped.
    let mut unread = 0u32;
    loop {
        let (_, wait) = interval_of(every);
        tokio::time::sleep(wait).await;
        let (interval, _) = interval_of(every);
        let done = exchange_once(&top, &redis, &keys, &replica, interval, every).await;
        match done {
            Ok(read) => {
                unread = if read { 0 } else { unread + 1 };
                if failing {
                    failing = false;
                    tracing::info!("heavy-hitter views: exchanging through Redis again");
                }
            }
            Err(e) => {
                unread += 1;
                if !failing {
                    failing = true;
                    tracing::warn!(error = %e, "heavy-hitter views: cannot exchange through Redis; /top shows this replica's own until it can");
                }
            }
        }
        if unread > 3 {
            top.set_remote(Vec::new());
        }
    }
}

/// One interval's exchange: publishes this replica's view, then merges every view (if this
/// replica takes the turn) or reads the merge written for it. Whether the others' views were
/// read.
async fn exchange_once(
    top: &Top,
    redis: &RedisBackend,
    keys: &ExchangeKeys,
    replica: &str,
    interval: u64,
    every: Duration,
) -> Result<bool, crate::limiter::BackendError> {
    let capacity = top.options().capacity;
    let budget = top.options().memory_bytes;
    let view = wire::encode(top.local(|_| true), capacity);
    let ms = every.as_millis().max(1) as u64;
    redis
        .command::<()>(
            redis::cmd("SET")
                .arg(keys.view(replica))
                .arg(view)
                .arg("PX")
                .arg(ms * 2),
        )
        .await?;
    redis
        .command::<()>(redis::cmd("SADD").arg(&keys.replicas).arg(replica))
        .await?;
    redis
        .command::<()>(
            redis::cmd("PEXPIRE")
                .arg(&keys.replicas)
                .arg(ms.saturating_mul(20)),
        )
        .await?;
    let turn: Option<String> = redis
        .command(
            redis::cmd("SET")
                .arg(keys.turn(interval))
                .arg(replica)
                .arg("NX")
                .arg("PX")
                .arg(ms * 2),
        )
        .await?;
    if turn.is_some() {
        // The others publish at the same instant, give or take their clocks' skew.
        tokio::time::sleep(every / 4).await;
        let others = merge_fleet(redis, keys, replica, capacity, budget, ms * 3).await?;
        top.set_remote(others);
        return Ok(true);
    }
    tokio::time::sleep(every / 2).await;
    let blob: Option<Vec<u8>> = redis
        .command(redis::cmd("GET").arg(keys.others(replica)))
        .await?;
    let Some(others) = blob.as_deref().and_then(wire::decode_view) else {
        // Not merged yet (a replica that just started), or the merging replica died: the last
        // read stands for a few intervals.
        return Ok(false);
    };
    top.set_remote(crate::top::within_bytes(others, capacity, budget));
    Ok(true)
}

/// Reads every replica's view and writes, for each, the merge of all the others' (each cut
/// to `capacity` descriptors per limit and `budget` bytes, expiring after `ttl_ms`); the
/// merge of the views other than `replica`'s is returned instead of written. Each merge is
/// made from one prefix and one suffix of the replicas' views (every view merged about three
/// times in all, whatever the number of replicas); replicas whose view has expired leave the
/// set.
async fn merge_fleet(
    redis: &RedisBackend,
    keys: &ExchangeKeys,
    replica: &str,
    capacity: usize,
    budget: usize,
    ttl_ms: u64,
) -> Result<Vec<LimitTop>, crate::limiter::BackendError> {
    let mut members: Vec<String> = redis
        .command(redis::cmd("SMEMBERS").arg(&keys.replicas))
        .await?;
    members.sort();
    members.truncate(MAX_REPLICAS);
    let mut views: Vec<(String, Vec<LimitTop>)> = Vec::new();
    let mut gone = Vec::new();
    for chunk in members.chunks(16) {
        let mut mget = redis::cmd("MGET");
        for r in chunk {
            mget.arg(keys.view(r));
        }
        let blobs: Vec<Option<Vec<u8>>> = redis.command(&mget).await?;
        for (r, blob) in chunk.iter().zip(blobs) {
            match blob {
                Some(b) => views.push((r.clone(), wire::decode_view(&b).unwrap_or_default())),
                None => gone.push(r.clone()),
            }
        }
    }
    if !gone.is_empty() {
        redis
            .command::<()>(redis::cmd("SREM").arg(&keys.replicas).arg(&gone))
            .await?;
    }
    let merge = |mut a: Vec<LimitTop>, b: &[LimitTop]| {
        a.extend_from_slice(b);
        crate::top::within_bytes(crate::top::merge_limits(a, capacity), capacity, budget)
    };
    // suffix[i]: the views from the i-th on, merged (the first's, all of them, is never
    // wanted: each replica's merge leaves its own view out).
    let mut suffix: Vec<Vec<LimitTop>> = vec![Vec::new(); views.len() + 1];
    for i in (1..views.len()).rev() {
        suffix[i] = merge(suffix[i + 1].clone(), &views[i].1);
    }
    let mut prefix: Vec<LimitTop> = Vec::new();
    let mut own = Vec::new();
    for (i, (r, view)) in views.iter().enumerate() {
        let others = merge(std::mem::take(&mut suffix[i + 1]), &prefix);
        if r == replica {
            own = others;
        } else {
            redis
                .command::<()>(
                    redis::cmd("SET")
                        .arg(keys.others(r))
                        .arg(wire::encode(others, capacity))
                        .arg("PX")
                        .arg(ttl_ms),
                )
                .await?;
        }
        prefix = merge(prefix, view);
    }
    Ok(own)
}
