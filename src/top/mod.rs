//! Who is being limited: per limit, the descriptors refused the most and those that asked for
//! the most hits, in fixed memory (two [`sketch::Summary`]s per limit: of refused hits, where a
//! descriptor refused often is found whatever its share of the traffic, and of every hit), fed
//! from decisions
//! already made (no extra Redis call on the request path), and shared among replicas in
//! [`wire`]'s form (the engine's `top` exchanges it through Redis).
//!
//! **Window.** Counts cover the current window of `--top-window` and the whole previous one:
//! every `window` the current summaries become the previous ones and the previous ones are
//! dropped, so `/top` reads between one and two windows of traffic.
//!
//! **Memory.** Each worker thread records into a shard of its own (no lock that every worker
//! takes on every request). A shard holds at most its share of `--top-memory-bytes`: a limit
//! costs two [`sketch::overhead`]s when first counted in a window and each descriptor kept its
//! entries' bytes in each summary that keeps it. A new limit that does not fit takes the place of the lightest (the previous
//! window's first; fewest hits of a few sampled, a request's own `limit` override before a
//! configured limit; an override never displaces a configured limit), so a flood of one-off
//! limits (a client's distinct overrides) churns among itself; hits that find no room are
//! counted in `untracked`. A descriptor whose entries do not fit is still counted, listed
//! without its entries. Other replicas' views are merged into one, each limit cut to the same
//! number of descriptors and the whole to the same memory bound ([`within_bytes`]).

mod hash;
pub(crate) mod sketch;
pub(crate) mod wire;

use std::cell::Cell;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use hashbrown::HashTable;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use self::hash::FoldState;
use self::sketch::{Summary, View, hash_entries};

/// How `/top` shows a limit's descriptor values (they may be API keys or addresses).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Values {
    /// As sent.
    #[default]
    Show,
    /// `sha256:` and the first 16 hex digits of the value's SHA-256: the same value gives the
    /// same hash on every replica, and an operator can check a suspect with `sha256sum`.
    Hash,
    /// Not shown at all (`null`).
    Hide,
}

impl Values {
    /// Every mode, in documentation order.
    pub(crate) const ALL: [Values; 3] = [Values::Show, Values::Hash, Values::Hide];

    /// The name used in config files and flags.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Values::Show => "show",
            Values::Hash => "hash",
            Values::Hide => "hide",
        }
    }

    /// Parses a config name, case-insensitively.
    pub(crate) fn parse(name: &str) -> Option<Values> {
        Values::ALL
            .into_iter()
            .find(|v| v.as_str().eq_ignore_ascii_case(name))
    }

    /// A value as a sketch of this mode keeps it (the value itself, or its SHA-256 where
    /// values are hashed or hidden), shown: as text naming its bytes (`crate::value::shown`),
    /// as the first 8 bytes of its SHA-256, or not at all.
    pub(crate) fn apply(self, kept: &[u8], longest: usize) -> Option<String> {
        match self {
            Values::Show => Some(crate::value::shown(kept, longest).into_owned()),
            Values::Hash => {
                // A sketch's values are digests already; one that is not (its limit was shown
                // before a reload) is hashed here, never shown.
                let digest = match <[u8; 32]>::try_from(kept) {
                    Ok(d) => d,
                    Err(_) => crate::value::digest(kept),
                };
                let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
                Some(format!("sha256:{hex}"))
            }
            Values::Hide => None,
        }
    }
}

/// How the sketches are sized and shared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopOptions {
    /// Descriptors counted per limit (Space-Saving's counters); 0 turns the sketches off.
    pub capacity: usize,
    /// Memory all sketches of this replica may hold (see the module's documentation).
    pub memory_bytes: usize,
    /// How long each window of counts lasts.
    pub window: Duration,
    /// How often this replica's view is published to Redis and the others' read.
    pub publish_every: Duration,
    /// How values are shown, at least (a limit's own `top_values` may show less).
    pub values: Values,
    /// Descriptors per limit exported on `/metrics` (`ratelimit_top_*`); 0: none.
    pub metrics: usize,
}

impl Default for TopOptions {
    fn default() -> Self {
        TopOptions {
            capacity: 64,
            memory_bytes: 4 << 20,
            window: Duration::from_secs(60),
            publish_every: Duration::from_secs(5),
            values: Values::Show,
            metrics: 0,
        }
    }
}

/// One limit as the sketches tell limits apart: a change of any field is another limit
/// (after a reload, the old one ages out).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) struct LimitInfo {
    /// The config domain.
    pub(crate) domain: String,
    /// The rule's config path (`/rlconfig`'s), or `_override` for a request's own limit on a
    /// descriptor the config does not know.
    pub(crate) rule: String,
    /// The limit's place among its descriptor's limits; [`OVERRIDE`] for a request's own.
    pub(crate) index: u16,
    /// `rate_limit.name`, if any.
    pub(crate) name: Option<String>,
    /// fixed_window, sliding_window, sliding_log or token_bucket.
    pub(crate) algorithm: String,
    /// The unit as configured (SECOND, MINUTE, ...).
    pub(crate) unit: String,
    /// The window in seconds (unit × unit_multiplier).
    pub(crate) window_seconds: u64,
    /// Hits per window.
    pub(crate) requests_per_unit: u64,
}

/// [`LimitInfo::index`] of a request's own `limit` override.
pub(crate) const OVERRIDE: u16 = u16::MAX;

/// A limit as the request path names it, borrowed: nothing is allocated unless the limit is
/// new to the shard.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LimitRef<'a> {
    /// The config domain.
    pub(crate) domain: &'a str,
    /// The rule's config path.
    pub(crate) rule: &'a str,
    /// See [`LimitInfo::index`].
    pub(crate) index: u16,
    /// `rate_limit.name`.
    pub(crate) name: Option<&'a str>,
    /// The algorithm's name.
    pub(crate) algorithm: &'static str,
    /// The unit's name.
    pub(crate) unit: &'static str,
    /// The window in seconds.
    pub(crate) window_seconds: u64,
    /// Hits per window.
    pub(crate) requests_per_unit: u64,
    /// How the limit's values are shown.
    pub(crate) values: Values,
}

impl LimitRef<'_> {
    fn hash(&self, state: &FoldState) -> u64 {
        state.hash_one((
            self.domain,
            self.rule,
            self.index,
            self.window_seconds,
            self.requests_per_unit,
        ))
    }

    fn is(&self, info: &LimitInfo) -> bool {
        self.index == info.index
            && self.requests_per_unit == info.requests_per_unit
            && self.window_seconds == info.window_seconds
            && self.domain == info.domain
            && self.rule == info.rule
            && self.algorithm == info.algorithm
            && self.unit == info.unit
            && self.name == info.name.as_deref()
    }

    fn info(&self) -> LimitInfo {
        LimitInfo {
            domain: self.domain.to_owned(),
            rule: self.rule.to_owned(),
            index: self.index,
            name: self.name.map(str::to_owned),
            algorithm: self.algorithm.to_owned(),
            unit: self.unit.to_owned(),
            window_seconds: self.window_seconds,
            requests_per_unit: self.requests_per_unit,
        }
    }
}

/// One limit's summaries in one shard and window: of every hit, and of refused hits alone.
struct LimitSketch {
    hash: u64,
    info: Arc<LimitInfo>,
    values: Values,
    summary: Summary,
    /// Refused hits only: a descriptor refused often is kept here whatever its share of all
    /// hits (in `summary`, refusals among a heavy tail of traffic are noise).
    refused: Summary,
}

impl LimitSketch {
    /// What it holds against the shard's budget.
    fn bytes(&self, capacity: usize) -> usize {
        limit_cost(&self.info, capacity) + self.summary.item_bytes() + self.refused.item_bytes()
    }
}

/// What a limit holds against the budget besides its descriptors' bytes: its two summaries.
fn limit_cost(info: &LimitInfo, capacity: usize) -> usize {
    2 * sketch::overhead(capacity)
        + std::mem::size_of::<LimitSketch>()
        + info.domain.len()
        + info.rule.len()
        + info.name.as_ref().map_or(0, String::len)
}

/// One worker's sketches.
struct SketchShard {
    /// This window's limits, found through `index` (positions in `current`).
    current: Vec<LimitSketch>,
    index: HashTable<u32>,
    previous: Vec<LimitSketch>,
    /// Bytes of the shard's budget not yet held.
    room: usize,
    /// A xorshift state, for sampling limits to evict.
    seed: u64,
}

/// Limits sampled for the one with the fewest hits when a new limit needs room.
const EVICTION_SAMPLE: usize = 8;

/// The lightest of [`EVICTION_SAMPLE`] limits of `limits` drawn at random (xorshift on
/// `seed`): an override before a configured limit, then the fewest hits. `None` if empty.
fn lightest(limits: &[LimitSketch], seed: &mut u64) -> Option<usize> {
    let weight = |t: &LimitSketch| (t.info.index != OVERRIDE, t.summary.total());
    let mut found: Option<usize> = None;
    for _ in 0..EVICTION_SAMPLE.min(limits.len()) {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        let i = (*seed % limits.len() as u64) as usize;
        if found.is_none_or(|l| weight(&limits[i]) < weight(&limits[l])) {
            found = Some(i);
        }
    }
    found
}

impl SketchShard {
    /// Makes room for `cost` more bytes by dropping limits: the previous window's first, then
    /// this window's, each time the lightest of [`EVICTION_SAMPLE`] sampled (a request's own
    /// `limit` override before any configured limit, then the fewest hits). Configured limits
    /// are as many as the config says; overrides are the clients' to multiply, so a new
    /// override never displaces a configured limit, and a flood of one-hit overrides churns
    /// among itself. Whether the room is there now.
    fn make_room(&mut self, cost: usize, overriding: bool, capacity: usize) -> bool {
        let displaceable = |t: &LimitSketch| !overriding || t.info.index == OVERRIDE;
        while self.room < cost {
            if let Some(i) = lightest(&self.previous, &mut self.seed)
                && displaceable(&self.previous[i])
            {
                let gone = self.previous.swap_remove(i);
                self.room += gone.bytes(capacity);
            } else if let Some(i) = lightest(&self.current, &mut self.seed)
                && displaceable(&self.current[i])
            {
                self.remove(i, capacity);
            } else {
                return false;
            }
        }
        true
    }

    /// Drops this window's limit at `i`, giving its bytes back.
    fn remove(&mut self, i: usize, capacity: usize) {
        let hash = self.current[i].hash;
        if let Ok(e) = self.index.find_entry(hash, |&j| j as usize == i) {
            e.remove();
        }
        let gone = self.current.swap_remove(i);
        self.room += gone.bytes(capacity);
        if i < self.current.len() {
            // The last limit moved to `i`.
            let moved = self.current[i].hash;
            let last = self.current.len() as u32;
            if let Some(j) = self.index.find_mut(moved, |&j| j == last) {
                *j = i as u32;
            }
        }
    }
}

/// A shard padded to its own cache lines, so workers' locks do not share one.
#[repr(align(128))]
struct Padded(Mutex<SketchShard>);

/// One limit's heaviest descriptors, merged from every shard, window and replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LimitTop {
    /// The limit.
    pub(crate) info: LimitInfo,
    /// How its values are shown (the stricter of the limit's and the server's).
    pub(crate) values: Values,
    /// Its descriptors, by hits.
    pub(crate) view: View,
    /// Its descriptors, by refused hits (each counter's `hits` and `over` are refused hits).
    pub(crate) refused: View,
}

impl LimitTop {
    /// The bytes of descriptors both views keep.
    fn item_bytes(&self) -> usize {
        self.view
            .counters
            .iter()
            .chain(&self.refused.counters)
            .map(|c| c.item.as_ref().map_or(0, |i| i.len()))
            .sum()
    }
}

/// Every limit's sketches, this replica's and (with Redis) the others'.
pub(crate) struct Top {
    options: TopOptions,
    shards: Box<[Padded]>,
    hasher: FoldState,
    /// Hits of limits that found no room in their shard.
    untracked: AtomicU64,
    /// The other replicas' views, merged, as last read from Redis.
    remote: Mutex<Arc<Vec<LimitTop>>>,
}

/// Which shard the calling thread records into: threads take shards in turn on their first
/// record, so each worker has its own until there are more workers than shards.
fn shard_of(shards: usize) -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local!(static MINE: Cell<Option<usize>> = const { Cell::new(None) });
    MINE.with(|mine| {
        let i = mine
            .get()
            .unwrap_or_else(|| NEXT.fetch_add(1, Ordering::Relaxed));
        mine.set(Some(i));
        i % shards
    })
}

impl Top {
    /// Sketches as `options` size them, one shard per core.
    pub(crate) fn new(options: TopOptions) -> Top {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Top::with_shards(options, cores.clamp(1, 64))
    }

    fn with_shards(options: TopOptions, shards: usize) -> Top {
        let room = options.memory_bytes / shards;
        Top {
            options,
            shards: (0..shards)
                .map(|_| {
                    Padded(Mutex::new(SketchShard {
                        current: Vec::new(),
                        index: HashTable::new(),
                        previous: Vec::new(),
                        room,
                        seed: 0x9E37_79B9_7F4A_7C15,
                    }))
                })
                .collect(),
            hasher: FoldState::new(),
            untracked: AtomicU64::new(0),
            remote: Mutex::new(Arc::new(Vec::new())),
        }
    }

    /// Whether anything is counted (`--top-capacity` > 0).
    pub(crate) fn is_on(&self) -> bool {
        self.options.capacity > 0
    }

    /// The options in force.
    pub(crate) fn options(&self) -> &TopOptions {
        &self.options
    }

    /// Counts `hits` the descriptor `entries` asked of `limit`, refused if `over`.
    pub(crate) fn record(
        &self,
        limit: &LimitRef<'_>,
        entries: &[(impl AsRef<[u8]>, impl AsRef<[u8]>)],
        hits: u64,
        over: bool,
    ) {
        if hits == 0 || !self.is_on() {
            return;
        }
        let values = limit.values.max(self.options.values);
        if values == Values::Show {
            return self.record_as(limit, values, entries, hits, over);
        }
        // Hashed or hidden values are kept as their SHA-256 only, so that neither this
        // replica's memory nor the view it publishes to Redis holds them in clear.
        let digested: smallvec::SmallVec<[(&[u8], [u8; 32]); 4]> = entries
            .iter()
            .map(|(k, v)| (k.as_ref(), crate::value::digest(v.as_ref())))
            .collect();
        self.record_as(limit, values, &digested, hits, over);
    }

    fn record_as(
        &self,
        limit: &LimitRef<'_>,
        values: Values,
        entries: &[(impl AsRef<[u8]>, impl AsRef<[u8]>)],
        hits: u64,
        over: bool,
    ) {
        let capacity = self.options.capacity;
        let lh = limit.hash(&self.hasher);
        let dh = hash_entries(&self.hasher, entries);
        let mut shard = self.shards[shard_of(self.shards.len())].0.lock();
        let shard = &mut *shard;
        let found = {
            let current = &shard.current;
            shard
                .index
                .find(lh, |&i| {
                    let t = &current[i as usize];
                    t.hash == lh && limit.is(&t.info)
                })
                .copied()
        };
        let i = match found {
            Some(i) => i as usize,
            None => {
                let info = limit.info();
                let cost = limit_cost(&info, capacity);
                if !shard.make_room(cost, limit.index == OVERRIDE, capacity) {
                    self.untracked.fetch_add(hits, Ordering::Relaxed);
                    return;
                }
                shard.room -= cost;
                let i = shard.current.len();
                shard.current.push(LimitSketch {
                    hash: lh,
                    info: Arc::new(info),
                    values,
                    summary: Summary::new(capacity),
                    refused: Summary::new(capacity),
                });
                let current = &shard.current;
                shard
                    .index
                    .insert_unique(lh, i as u32, |&j| current[j as usize].hash);
                i
            }
        };
        let tracked = &mut shard.current[i];
        tracked.values = values;
        tracked
            .summary
            .record(dh, entries, hits, over, &mut shard.room);
        if over {
            tracked
                .refused
                .record(dh, entries, hits, true, &mut shard.room);
        }
    }

    /// Ends the current window: its summaries become the previous ones, and the previous
    /// ones' memory is given back.
    pub(crate) fn rotate(&self) {
        let capacity = self.options.capacity;
        for shard in self.shards.iter() {
            let mut shard = shard.0.lock();
            let shard = &mut *shard;
            for old in shard.previous.drain(..) {
                shard.room += old.bytes(capacity);
            }
            shard.index.clear();
            shard.previous.append(&mut shard.current);
        }
    }

    /// Hits of limits no shard had room for, since the start.
    pub(crate) fn untracked(&self) -> u64 {
        self.untracked.load(Ordering::Relaxed)
    }

    /// Bytes the shards hold now (at most `--top-memory-bytes`).
    pub(crate) fn held_bytes(&self) -> usize {
        let per_shard = self.options.memory_bytes / self.shards.len();
        self.shards
            .iter()
            .map(|s| per_shard - s.0.lock().room)
            .sum()
    }

    /// This replica's view of every limit `wanted` accepts: shards and both windows merged.
    pub(crate) fn local(&self, wanted: impl Fn(&LimitInfo) -> bool) -> Vec<LimitTop> {
        let mut all = Vec::new();
        for shard in self.shards.iter() {
            let shard = shard.0.lock();
            all.extend(
                shard
                    .current
                    .iter()
                    .chain(&shard.previous)
                    .filter(|t| wanted(&t.info))
                    .map(|t| LimitTop {
                        info: (*t.info).clone(),
                        values: t.values,
                        view: t.summary.view(),
                        refused: t.refused.view(),
                    }),
            );
        }
        merge_limits(all, usize::MAX)
    }

    /// Every limit `wanted` accepts, this replica's view merged with the others' last read.
    pub(crate) fn merged(&self, wanted: impl Fn(&LimitInfo) -> bool) -> Vec<LimitTop> {
        let remote = self.remote.lock().clone();
        let mut all = self.local(&wanted);
        all.extend(remote.iter().filter(|l| wanted(&l.info)).cloned());
        let mut limits = merge_limits(all, usize::MAX);
        for l in &mut limits {
            l.values = l.values.max(self.options.values);
        }
        limits
    }

    /// Replaces the other replicas' views.
    pub(crate) fn set_remote(&self, views: Vec<LimitTop>) {
        *self.remote.lock() = Arc::new(views);
    }
}

/// `limits` cut to what `budget` bytes hold, counted as the shards count them: the limits with
/// the most hits are kept, those past the budget left out (the other replicas' merged view is
/// held to `--top-memory-bytes` this way, however many replicas and limits there are).
pub(crate) fn within_bytes(
    mut limits: Vec<LimitTop>,
    capacity: usize,
    budget: usize,
) -> Vec<LimitTop> {
    limits.sort_by_key(|l| std::cmp::Reverse(l.view.total));
    let mut left = budget;
    limits.retain(|l| {
        let bytes = limit_cost(&l.info, capacity) + l.item_bytes();
        let fits = bytes <= left;
        if fits {
            left -= bytes;
        }
        fits
    });
    limits.sort_by(|a, b| a.info.cmp(&b.info));
    limits
}

/// `limits` (several views of the same limits) merged per limit, each cut to `capacity`
/// descriptors, in the limits' order.
pub(crate) fn merge_limits(limits: Vec<LimitTop>, capacity: usize) -> Vec<LimitTop> {
    type Views = (Values, Vec<View>, Vec<View>);
    let mut by_limit: HashMap<LimitInfo, Views> = HashMap::new();
    for l in limits {
        let (values, views, refused) =
            by_limit
                .entry(l.info)
                .or_insert((l.values, Vec::new(), Vec::new()));
        *values = (*values).max(l.values);
        views.push(l.view);
        refused.push(l.refused);
    }
    let merged = |views: Vec<View>| {
        let mut view = if views.len() == 1 {
            views.into_iter().next().expect("one view")
        } else {
            View::merge(&views)
        };
        view.truncate(capacity);
        view
    };
    let mut out: Vec<LimitTop> = by_limit
        .into_iter()
        .map(|(info, (values, views, refused))| LimitTop {
            info,
            values,
            view: merged(views),
            refused: merged(refused),
        })
        .collect();
    out.sort_by(|a, b| a.info.cmp(&b.info));
    out
}

/// Ends a window every `window` until the service stops.
pub(crate) async fn rotate_every(top: Arc<Top>, window: Duration) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + window, window);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        top.rotate();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(rule: &str) -> LimitRef<'_> {
        LimitRef {
            domain: "d",
            rule,
            index: 0,
            name: None,
            algorithm: "fixed_window",
            unit: "SECOND",
            window_seconds: 1,
            requests_per_unit: 10,
            values: Values::Show,
        }
    }

    fn override_limit(rule: &str) -> LimitRef<'_> {
        LimitRef {
            index: OVERRIDE,
            ..limit(rule)
        }
    }

    #[test]
    fn shards_and_windows_merge_and_age_out() {
        let top = Top::with_shards(
            TopOptions {
                capacity: 4,
                ..TopOptions::default()
            },
            3,
        );
        let hits = |n| {
            std::thread::scope(|s| {
                for _ in 0..3 {
                    s.spawn(|| {
                        for _ in 0..n {
                            top.record(&limit("a"), &[("k", "x")], 1, false);
                        }
                        top.record(&limit("b"), &[("k", "y")], 5, true);
                    });
                }
            })
        };
        hits(10);
        let count = |rule: &str| {
            top.local(|l| l.rule == rule)
                .first()
                .map(|l| (l.view.counters[0].hits, l.view.counters[0].over))
        };
        assert_eq!(count("a"), Some((30, 0)));
        assert_eq!(count("b"), Some((15, 15)));
        top.rotate();
        hits(1);
        assert_eq!(
            count("a"),
            Some((33, 0)),
            "the previous window still counts"
        );
        top.rotate();
        assert_eq!(count("a"), Some((3, 0)));
        top.rotate();
        assert_eq!(count("a"), None, "two windows later it is gone");
        assert_eq!(top.held_bytes(), 0, "and its memory given back");
    }

    #[test]
    fn memory_is_bounded_and_a_flood_of_limits_churns_among_itself() {
        let top = Top::with_shards(
            TopOptions {
                capacity: 8,
                memory_bytes: 64 << 10,
                ..TopOptions::default()
            },
            1,
        );
        let rules: Vec<String> = (0..1000).map(|i| format!("r{i}")).collect();
        let value = "v".repeat(4000);
        for (i, rule) in rules.iter().enumerate() {
            top.record(&limit("real"), &[("k", "heavy")], 1, false);
            top.record(&limit(rule), &[("k", &format!("{value}{i}"))], 1, false);
            assert!(top.held_bytes() <= 64 << 10);
        }
        let limits = top.local(|_| true);
        assert!(limits.len() < 100, "{} limits held", limits.len());
        let real = limits.iter().find(|l| l.info.rule == "real").expect("kept");
        assert_eq!(real.view.counters[0].hits, 1000);
        // A new window whose previous one holds the whole budget: the configured limit is
        // counted again at once (the previous window's overrides give way), and a flood of
        // overrides still cannot displace it.
        top.rotate();
        for (i, rule) in rules.iter().enumerate() {
            top.record(
                &override_limit(rule),
                &[("k", &format!("{value}{i}"))],
                1,
                false,
            );
            top.record(&limit("real"), &[("k", "heavy")], 1, false);
            assert!(top.held_bytes() <= 64 << 10);
        }
        let real: u64 = top
            .local(|l| l.rule == "real")
            .iter()
            .map(|l| l.view.counters[0].hits)
            .sum();
        assert_eq!(real, 2000, "both windows, every hit");
        // A limit alone bigger than the budget finds no room at all.
        let tiny = Top::with_shards(
            TopOptions {
                capacity: 8,
                memory_bytes: 100,
                ..TopOptions::default()
            },
            1,
        );
        tiny.record(&limit("a"), &[("k", "v")], 3, false);
        assert_eq!(tiny.untracked(), 3);
        assert_eq!(tiny.held_bytes(), 0);
    }

    #[test]
    fn a_view_is_cut_to_its_budget_keeping_the_heaviest_limits() {
        let top = Top::with_shards(TopOptions::default(), 1);
        for (rule, n) in [("a", 5), ("b", 50), ("c", 1)] {
            for i in 0..n {
                top.record(&limit(rule), &[("k", &format!("v{i}"))], 1, false);
            }
        }
        let all = top.local(|_| true);
        let one = limit_cost(&all[0].info, 64) + 64 * 14;
        let kept = within_bytes(all.clone(), 64, one);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].info.rule, "b");
        assert_eq!(within_bytes(all, 64, usize::MAX).len(), 3);
    }

    #[test]
    fn values_are_hashed_the_same_everywhere() {
        assert_eq!(Values::Show.apply(b"a\"b", 64), Some("a\"b".to_owned()));
        assert_eq!(
            Values::Hash.apply(&crate::value::digest(b"abc"), 64),
            Some("sha256:ba7816bf8f01cfea".to_owned())
        );
        assert_eq!(Values::Hide.apply(b"abc", 64), None);
        assert_eq!(Values::parse("HASH"), Some(Values::Hash));
    }
}
