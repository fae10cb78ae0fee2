//! Rate-limit configuration: envoyproxy/ratelimit's YAML files, parsed once into an immutable
//! [`Snapshot`] of per-domain rule trees, and matched against request descriptors.
//!
//! A snapshot is built all-or-nothing: one bad file fails the whole load, and the previous
//! snapshot (if any) stays in force. Nothing here knows about gRPC.

pub(crate) mod answer;
mod compile;
mod error;
mod load;
mod matcher;
pub(crate) mod overrides;
mod retired;
pub(crate) mod schema;
pub(crate) mod watch;

use std::collections::HashMap;
use std::fmt::{self, Write as _};
use std::sync::Arc;

use crate::limiter::key::LimitIdentity;
use crate::limiter::{Accounting, Algorithm, Calendar, CalendarUnit, Limit};

pub(crate) use compile::CompileOptions;
pub use compile::compile_file;
pub(crate) use compile::{compile_file_with, compile_parsed, unlocated};
pub use error::ConfigError;
pub(crate) use load::LoadedConfig;
pub use load::load_paths;
pub(crate) use load::load_paths_with;
pub(crate) use matcher::Matched;

/// A time unit of a limit. Month is 30 days and year 365 days, as in envoyproxy/ratelimit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    /// One second.
    Second,
    /// 60 seconds.
    Minute,
    /// 3,600 seconds.
    Hour,
    /// 86,400 seconds.
    Day,
    /// Seven days.
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    /// Every unit, shortest first.
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    /// Length in seconds.
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }

    /// The upper-case name used by the protocol and by `/rlconfig`.
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Second => "SECOND",
            Unit::Minute => "MINUTE",
            Unit::Hour => "HOUR",
            Unit::Day => "DAY",
            Unit::Week => "WEEK",
            Unit::Month => "MONTH",
            Unit::Year => "YEAR",
        }
    }

    /// The calendar unit of this unit: `None` for seconds and minutes, whose length is the
    /// same in every zone.
    pub fn calendar_unit(self) -> Option<CalendarUnit> {
        match self {
            Unit::Second | Unit::Minute => None,
            Unit::Hour => Some(CalendarUnit::Hour),
            Unit::Day => Some(CalendarUnit::Day),
            Unit::Week => Some(CalendarUnit::Week),
            Unit::Month => Some(CalendarUnit::Month),
            Unit::Year => Some(CalendarUnit::Year),
        }
    }

    /// Parses a unit name, case-insensitively.
    pub fn parse(name: &str) -> Option<Unit> {
        Unit::ALL
            .into_iter()
            .find(|u| u.as_str().eq_ignore_ascii_case(name))
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One limit of a rule, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LimitRule {
    /// `rate_limit.name`, used by `replaces` and reported in `current_limit.name`.
    pub name: Option<Arc<str>>,
    /// Names of the limits this one switches off when both apply to a request.
    pub replaces: Vec<Arc<str>>,
    /// The unit as written (reported to Envoy).
    pub unit: Unit,
    /// Window = unit × multiplier.
    pub unit_multiplier: u64,
    /// Hits per window; 0 blocks everything. Fits in u32 (the protocol's width).
    pub requests_per_unit: u64,
    /// How hits are counted.
    pub algorithm: Algorithm,
    /// Token-bucket capacity (equals `requests_per_unit` unless configured).
    pub burst: u64,
    /// How this limit counts a descriptor's hits; `None`: as `--accounting` says.
    pub accounting: Option<Accounting>,
    /// Windows that follow a time zone's calendar (`calendar`, or `--calendar-timezone`);
    /// `None`: fixed lengths from the Unix epoch, as envoyproxy/ratelimit counts.
    pub calendar: Option<Calendar>,
    /// How `/top` shows this limit's descriptor values (`top_values`; the server's
    /// `--top-values` may show less).
    pub top_values: crate::top::Values,
    /// Which counter of its descriptor this limit keeps: the number of limits before it on the
    /// same descriptor with the same algorithm and window. With the algorithm and window it
    /// names the counter, so reordering limits, adding one with another window, renaming one
    /// or changing its `requests_per_unit` keeps every count where it was (only limits that
    /// share an algorithm and window are told apart by their order). A concurrency limit's
    /// lifetime is not its counter's window: changing it keeps the places in flight. Set with
    /// [`LimitRule::set_ordinal`], which keeps `identity` in step.
    pub ordinal: u16,
    /// The end of this limit's counter keys (algorithm, window, ordinal), built once here
    /// rather than for every request.
    pub identity: LimitIdentity,
    /// What a client is told about it (`answer`: its own, else its descriptor's or the
    /// nearest above); `None`: the server's default.
    pub answer: Option<Arc<answer::Answer>>,
    /// `soft` (its own, or its descriptor's): over it, the request goes on and the upstream
    /// is told; it never refuses.
    pub soft: bool,
}

impl LimitRule {
    /// The limit as the backend applies it.
    pub fn limit(&self) -> Limit {
        Limit {
            algorithm: self.algorithm,
            requests_per_unit: self.requests_per_unit,
            window_us: self.window_seconds() * 1_000_000,
            burst: self.burst,
            calendar: self.calendar,
        }
    }

    /// Makes this the `ordinal`-th limit of its descriptor with its algorithm and window.
    pub fn set_ordinal(&mut self, ordinal: u16) {
        self.ordinal = ordinal;
        self.identity = LimitIdentity::new(&self.limit(), ordinal);
    }

    /// Window length in seconds.
    pub fn window_seconds(&self) -> u64 {
        self.unit.seconds() * self.unit_multiplier
    }
}

/// What a descriptor node does when a request's last entry lands on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeLimits {
    /// `unlimited: true`: matched, never limited, not counted.
    Unlimited,
    /// One or more limits, all applied (`rate_limit` or the `rate_limits` extension).
    Limits(Vec<LimitRule>),
}

/// A node of a domain's descriptor tree. Its key is the one its [`Level`] files it under.
#[derive(Debug)]
pub struct Node {
    /// The configured value: exact, a wildcard pattern, or none (any value).
    pub value: Option<Box<str>>,
    /// The node's key escaped for counter keys, once, here, where escaping changes it; `None`
    /// (no allocation) where it is safe as it is.
    pub escaped_key: Option<Box<[u8]>>,
    /// Which value a request that lands here counts, and how it is written into the key.
    pub counted: Counted,
    /// The limit applied when a descriptor ends here.
    pub limits: Option<NodeLimits>,
    /// Counted and reported, never rejects.
    pub shadow_mode: bool,
    /// Metric labels carry the request's values (every entry's).
    pub detailed_metric: bool,
    /// Every value matching this wildcard shares one counter.
    pub share_threshold: bool,
    /// The metric label carries this entry's request value.
    pub value_to_metric: bool,
    /// Soft limit (the file's `quota_mode`): fails the request only when all of its soft
    /// descriptors are over.
    pub soft: bool,
    /// What few nodes carry (`metadata`, `hold_key`), boxed together: a node without them
    /// costs one pointer (a per-customer config has tens of thousands of nodes).
    pub extra: Option<Box<Extra>>,
    /// Nested descriptors.
    pub children: Level,
    /// The rule's config path for metrics and `/rlconfig`, e.g. `key1_value1.subkey1`.
    pub path: Arc<String>,
    /// The line of its file it is defined on (0: not from a file), for errors found later.
    pub line: u64,
    /// Its decision counters, looked up on first use (for labels without request values).
    pub counters: crate::metrics::RuleCounters,
}

/// A node's rarely set fields.
#[derive(Debug, Default)]
pub struct Extra {
    /// Arbitrary user data (accepted; later returned as dynamic metadata).
    pub metadata: Option<serde_json::Value>,
    /// `hold_key`: the key of the entry after this node's that names a request's hold (never
    /// matched as a child, never part of a counter's key).
    pub hold_key: Option<Box<str>>,
}

impl Node {
    /// Its `metadata`, if any.
    pub fn metadata(&self) -> Option<&serde_json::Value> {
        self.extra.as_ref()?.metadata.as_ref()
    }

    /// Its `hold_key`, if any.
    pub fn hold_key(&self) -> Option<&str> {
        self.extra.as_ref()?.hold_key.as_deref()
    }
}

/// The value a descriptor entry counts in its counter's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Counted {
    /// The request's own value, escaped per request (a wildcard, or a key with no value).
    AsSent,
    /// The node's value, safe as it is: an exact value (the request's is the same), or the
    /// pattern of a wildcard whose matches share one counter (`share_threshold`).
    Fixed,
    /// The node's value as [`Counted::Fixed`], escaped once, here.
    FixedEscaped(Box<[u8]>),
}

/// Whether a configured value is a wildcard pattern (contains `*`).
fn is_wildcard(value: Option<&str>) -> bool {
    value.is_some_and(|v| v.contains('*'))
}

/// The nodes of one tree level, indexed for matching.
#[derive(Debug, Default)]
pub struct Level {
    keys: Index<KeyNodes>,
}

impl Level {
    /// The nodes of a request's key: bytes as sent, so a key that is not UTF-8 names none
    /// (the config's keys are text).
    fn key(&self, key: &[u8]) -> Option<&KeyNodes> {
        self.keys.get(std::str::from_utf8(key).ok()?)
    }
}

/// All nodes of one level that share a key, in matching order.
#[derive(Debug, Default)]
struct KeyNodes {
    /// The key's place among the level's keys in the file (for RLQS's unordered bucket ids).
    first: u32,
    exact: Index<Node>,
    /// Wildcard patterns in file order.
    wildcards: Vec<(Wildcard, Node)>,
    any: Option<Box<Node>>,
}

/// Most entries an [`Index`] searches in order before it hashes.
const FEW: usize = 8;

/// Entries by name, sized for what a config holds: most levels have a key or two and a node a
/// value or two (a short list, searched in order: no hash table per node), while a
/// per-customer file has thousands of values at one level (a hash map).
#[derive(Debug)]
enum Index<V> {
    Few(Vec<(Box<str>, V)>),
    #[allow(
        clippy::box_collection,
        reason = "an index in every node: boxed, the rare large one keeps the common small one at 24 bytes, not 48"
    )]
    Many(Box<HashMap<Box<str>, V>>),
}

impl<V> Default for Index<V> {
    fn default() -> Self {
        Index::Few(Vec::new())
    }
}

impl<V> Index<V> {
    /// The index of `map`'s entries, in the smallest form that serves them.
    fn new(map: HashMap<Box<str>, V>) -> Index<V> {
        if map.len() <= FEW {
            // Exactly as long as it needs (`collect` would round a short list up to four).
            let mut entries = Vec::with_capacity(map.len());
            entries.extend(map);
            Index::Few(entries)
        } else {
            let mut map = map;
            map.shrink_to_fit();
            Index::Many(Box::new(map))
        }
    }

    fn get(&self, name: &str) -> Option<&V> {
        match self {
            Index::Few(entries) => entries.iter().find(|(k, _)| **k == *name).map(|(_, v)| v),
            Index::Many(map) => map.get(name),
        }
    }

    fn values(&self) -> impl Iterator<Item = &V> {
        let (few, many) = match self {
            Index::Few(entries) => (Some(entries.iter().map(|(_, v)| v)), None),
            Index::Many(map) => (None, Some(map.values())),
        };
        few.into_iter().flatten().chain(many.into_iter().flatten())
    }

    fn len(&self) -> usize {
        match self {
            Index::Few(entries) => entries.len(),
            Index::Many(map) => map.len(),
        }
    }

    fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        let (few, many) = match self {
            Index::Few(entries) => (Some(entries.iter().map(|(k, v)| (&**k, v))), None),
            Index::Many(map) => (None, Some(map.iter().map(|(k, v)| (&**k, v)))),
        };
        few.into_iter().flatten().chain(many.into_iter().flatten())
    }

    fn get_mut(&mut self, name: &str) -> Option<&mut V> {
        match self {
            Index::Few(entries) => entries
                .iter_mut()
                .find(|(k, _)| **k == *name)
                .map(|(_, v)| v),
            Index::Many(map) => map.get_mut(name),
        }
    }

    fn into_entries(self) -> Vec<(Box<str>, V)> {
        match self {
            Index::Few(entries) => entries,
            Index::Many(map) => map.into_iter().collect(),
        }
    }

    /// Adds an entry whose name is not there yet.
    fn insert(&mut self, name: Box<str>, value: V) {
        match self {
            Index::Few(entries) if entries.len() < FEW => entries.push((name, value)),
            Index::Few(entries) => {
                let mut map: HashMap<Box<str>, V> = std::mem::take(entries).into_iter().collect();
                map.insert(name, value);
                *self = Index::Many(Box::new(map));
            }
            Index::Many(map) => {
                map.insert(name, value);
            }
        }
    }
}

/// A value pattern where `*` matches any run of characters (including none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wildcard {
    parts: Vec<String>,
}

impl Wildcard {
    /// Compiles `pattern`, or `None` when it has no `*` (it is an exact value, not a pattern).
    pub fn new(pattern: &str) -> Option<Wildcard> {
        pattern.contains('*').then(|| Wildcard {
            parts: pattern.split('*').map(str::to_owned).collect(),
        })
    }

    /// Whether `value` (any bytes, any length) matches the whole pattern: each part found
    /// leftmost in turn (memchr's substring search: linear in the value's length).
    pub fn matches(&self, value: &[u8]) -> bool {
        let (first, rest) = self.parts.split_first().expect("split yields one part");
        let Some(mut tail) = value.strip_prefix(first.as_bytes()) else {
            return false;
        };
        let (last, middle) = rest.split_last().expect("a wildcard has two parts");
        for part in middle {
            match memchr::memmem::find(tail, part.as_bytes()) {
                Some(at) => tail = &tail[at + part.len()..],
                None => return false,
            }
        }
        tail.len() >= last.len() && tail.ends_with(last.as_bytes())
    }
}

/// The config path of every rule of a snapshot, by domain ([`Snapshot::rule_paths`]).
#[derive(Debug, Default)]
pub(crate) struct RulePaths(std::collections::HashMap<String, std::collections::HashSet<String>>);

impl RulePaths {
    /// Whether `domain` has a rule at `path`.
    pub(crate) fn contains(&self, domain: &str, path: &str) -> bool {
        self.0.get(domain).is_some_and(|rules| rules.contains(path))
    }

    /// Whether `domain` is configured.
    pub(crate) fn has_domain(&self, domain: &str) -> bool {
        self.0.contains_key(domain)
    }
}

/// The compiled rules of one domain (one file).
#[derive(Debug)]
pub struct Domain {
    /// The domain name.
    pub name: Arc<String>,
    /// The name escaped for counter keys, once.
    pub escaped_name: Box<[u8]>,
    /// Top-level descriptors.
    pub root: Level,
    /// Line of the `domain` field.
    pub line: u64,
}

impl Domain {
    /// Adds `other`'s descriptors (the same domain, from another file or config), as
    /// `MERGE_DOMAIN_CONFIG` does; a descriptor both define is an error naming its path.
    pub(crate) fn merge(&mut self, other: Domain) -> Result<(), (String, u64)> {
        self.root.merge(other.root)
    }

    /// The domain `name` with `root`'s descriptors, its `domain` field on `line`.
    pub(crate) fn new(name: String, root: Level, line: u64) -> Domain {
        Domain {
            escaped_name: crate::limiter::key::escaped(&name),
            name: Arc::new(name),
            root,
            line,
        }
    }
}

/// Domains as their sources give them (files, or xDS configs), one per name: a name given again
/// is refused, or, with `merge` (`MERGE_DOMAIN_CONFIG`), its descriptors join the first's. `O`
/// is where each came from, for errors that name both places.
pub(crate) struct Domains<O> {
    merge: bool,
    domains: Vec<Domain>,
    /// Name → its place in `domains`, and where it was first given.
    first: HashMap<Arc<String>, (usize, O)>,
}

/// Why [`Domains::add`] refused a domain; each names where the domain was first given.
pub(crate) enum Refused<'a, O> {
    /// The name again, without `merge`.
    Domain(&'a O),
    /// A descriptor both define (its path, and its line in the domain refused), with `merge`.
    Descriptor(&'a O, String, u64),
}

impl<O> Domains<O> {
    /// No domain yet; `merge` as `CompileOptions::merge_domains`.
    pub(crate) fn new(merge: bool) -> Domains<O> {
        Domains {
            merge,
            domains: Vec::new(),
            first: HashMap::new(),
        }
    }

    /// Adds `domain`, given by `origin`.
    pub(crate) fn add(&mut self, domain: Domain, origin: O) -> Result<(), Refused<'_, O>> {
        if !self.first.contains_key(&domain.name) {
            self.first
                .insert(domain.name.clone(), (self.domains.len(), origin));
            self.domains.push(domain);
            return Ok(());
        }
        let (at, first) = &self.first[&domain.name];
        if !self.merge {
            return Err(Refused::Domain(first));
        }
        self.domains[*at]
            .merge(domain)
            .map_err(|(path, line)| Refused::Descriptor(first, path, line))
    }

    /// The snapshot of every domain added.
    pub(crate) fn into_snapshot(self) -> Snapshot {
        Snapshot::new(self.domains)
    }
}

/// An immutable, validated set of domains. Requests in flight keep the snapshot they started
/// with while a reload swaps in the next one.
#[derive(Debug)]
pub struct Snapshot {
    /// Looked up by every request: most configs have a few domains, found by comparing names
    /// (a SipHash of the request's domain cost more than the rest of the lookup).
    domains: Arc<Index<Domain>>,
    /// False only for the stand-in of a service started before its first config.
    loaded: bool,
    /// Earlier configs kept for the releases of places this one has not (`retired.rs`).
    retired: Vec<retired::Retired>,
}

impl Snapshot {
    /// The stand-in until a first config arrives (a service started without one): no domain,
    /// and [`Snapshot::is_loaded`] false, so requests are answered with an error, not OK.
    pub(crate) fn not_loaded() -> Snapshot {
        Snapshot {
            domains: Arc::default(),
            loaded: false,
            retired: Vec::new(),
        }
    }

    /// False for [`Snapshot::not_loaded`].
    pub(crate) fn is_loaded(&self) -> bool {
        self.loaded
    }

    /// A snapshot of `domains`; the caller has checked they are distinct.
    pub fn new(domains: Vec<Domain>) -> Snapshot {
        Snapshot {
            loaded: true,
            domains: Arc::new(Index::new(
                domains
                    .into_iter()
                    .map(|d| (Box::from(d.name.as_str()), d))
                    .collect(),
            )),
            retired: Vec::new(),
        }
    }

    /// The rules of `domain`, if configured.
    pub fn domain(&self, domain: &str) -> Option<&Domain> {
        self.domains.get(domain)
    }

    /// Number of domains.
    pub fn len(&self) -> usize {
        self.domains.len()
    }

    /// True when no domain is configured.
    pub fn is_empty(&self) -> bool {
        self.domains.len() == 0
    }

    /// The config path of every rule with limits (or `unlimited`), by domain.
    pub(crate) fn rule_paths(&self) -> RulePaths {
        let mut paths = RulePaths::default();
        for domain in self.domains.values() {
            let rules = paths.0.entry(domain.name.to_string()).or_default();
            domain.root.visit(&mut |node| {
                if node.limits.is_some() {
                    rules.insert(node.path.to_string());
                }
            });
        }
        paths
    }

    /// Number of limits (an unlimited rule counts as one).
    pub fn rule_count(&self) -> usize {
        let mut n = 0;
        for domain in self.domains.values() {
            domain.root.visit(&mut |node| {
                n += match &node.limits {
                    Some(NodeLimits::Limits(l)) => l.len(),
                    Some(NodeLimits::Unlimited) => 1,
                    None => 0,
                }
            });
        }
        n
    }

    /// A text dump of every rule: `<domain>.<path>: unit=… requests_per_unit=…, …`, sorted.
    pub fn dump(&self) -> String {
        let mut lines = Vec::new();
        for domain in self.domains.values() {
            domain.root.visit(&mut |node| {
                let full = format!("{}.{}", domain.name, node.path);
                match &node.limits {
                    Some(NodeLimits::Unlimited) => lines.push(format!(
                        "{full}: unlimited, shadow_mode: {}",
                        node.shadow_mode
                    )),
                    Some(NodeLimits::Limits(limits)) => {
                        for l in limits {
                            let mut line = format!(
                                "{full}: unit={} requests_per_unit={}",
                                l.unit, l.requests_per_unit
                            );
                            if l.unit_multiplier != 1 {
                                let _ = write!(line, " unit_multiplier={}", l.unit_multiplier);
                            }
                            let _ = write!(line, ", algorithm={}", l.algorithm);
                            if l.algorithm == Algorithm::TokenBucket {
                                let _ = write!(line, " burst={}", l.burst);
                            }
                            if let Some(accounting) = l.accounting {
                                let _ = write!(line, " accounting={}", accounting.as_str());
                            }
                            if let Some(calendar) = &l.calendar {
                                let _ = write!(line, " calendar={}", calendar.zone().name());
                            }
                            if let Some(name) = &l.name {
                                let _ = write!(line, ", name={name}");
                            }
                            if let Some(hold_key) = node.hold_key() {
                                let _ = write!(line, ", hold_key={hold_key}");
                            }
                            let _ = write!(line, ", shadow_mode: {}", node.shadow_mode);
                            if node.soft {
                                line.push_str(", quota_mode: true");
                            }
                            lines.push(line);
                        }
                    }
                    None => {}
                }
            });
        }
        lines.sort();
        let mut out = lines.join("\n");
        out.push('\n');
        out
    }
}

impl Level {
    /// Moves `other`'s descriptors into this level, as envoyproxy/ratelimit merges a domain's
    /// files: a key new here keeps its nodes, a known key gains the other's values. A
    /// descriptor present in both (same key and value, or both value-less) is an error naming
    /// it, and nothing is moved then.
    fn merge(&mut self, other: Level) -> Result<(), (String, u64)> {
        let other = other.keys.into_entries();
        for (key, theirs) in &other {
            let Some(ours) = self.keys.get(key) else {
                continue;
            };
            let twice = theirs
                .exact
                .iter()
                .find_map(|(value, n)| ours.exact.get(value).map(|_| n))
                .or_else(|| {
                    theirs
                        .wildcards
                        .iter()
                        .find(|(w, _)| ours.wildcards.iter().any(|(o, _)| o == w))
                        .map(|(_, n)| n)
                })
                .or_else(|| theirs.any.as_deref().filter(|_| ours.any.is_some()));
            if let Some(node) = twice {
                return Err((node.path.to_string(), node.line));
            }
        }
        let after = self
            .keys
            .values()
            .map(|k| k.first)
            .max()
            .map_or(0, |f| f + 1);
        for (key, theirs) in other {
            match self.keys.get_mut(&key) {
                None => self.keys.insert(
                    key,
                    KeyNodes {
                        first: after + theirs.first,
                        ..theirs
                    },
                ),
                Some(ours) => {
                    for (value, node) in theirs.exact.into_entries() {
                        ours.exact.insert(value, node);
                    }
                    ours.wildcards.extend(theirs.wildcards);
                    if theirs.any.is_some() {
                        ours.any = theirs.any;
                    }
                }
            }
        }
        Ok(())
    }

    fn visit<'a>(&'a self, f: &mut impl FnMut(&'a Node)) {
        for nodes in self.keys.values() {
            let all = nodes
                .exact
                .values()
                .chain(nodes.wildcards.iter().map(|(_, n)| n))
                .chain(nodes.any.as_deref());
            for node in all {
                f(node);
                node.children.visit(f);
            }
        }
    }
}
