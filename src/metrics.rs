//! Every metric the service exports, named in one place (Prometheus text format on /metrics).
//! One registry per server instance, so tests can run several servers in one process.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The heavy-hitter families (`--top-metrics`): each limit's heaviest descriptors' hits and
/// refusals, written at scrape time from the sketches by the HTTP port (`server::top`), beside
/// this registry's families: their series come and go with the sketches.
pub(crate) const TOP_FAMILIES: [(&str, &str); 2] = [
    (
        "ratelimit_top_hits",
        "Hits each limit's heaviest descriptors asked for in /top's window (--top-metrics per limit).",
    ),
    (
        "ratelimit_top_over_limit",
        "Hits refused to each limit's heaviest descriptors in /top's window (--top-metrics per limit).",
    ),
];

/// Exports each of `labels` in `family` at 0 from now on, before its first count: a dashboard
/// shows none rather than no data, and `rate()` sees the first increment. For families whose
/// labels are a fixed set.
pub(crate) fn at_zero<S, M, C>(family: &Family<S, M, C>, labels: impl IntoIterator<Item = S>)
where
    S: Clone + std::hash::Hash + Eq,
    C: prometheus_client::metrics::family::MetricConstructor<M>,
{
    for label in labels {
        let _ = family.get_or_create(&label);
    }
}

/// The outcome of one limit for one descriptor.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Decision {
    /// Within the limit, below the near-limit ratio.
    within_limit,
    /// Within the limit, past `--near-limit-ratio` of it.
    near_limit,
    /// Over the limit and enforced.
    over_limit,
    /// Over the limit of a shadow-mode rule (reported, not enforced).
    shadow_mode,
    /// Over a soft limit (admitted, the upstream told).
    soft_limit,
}

/// Labels of `ratelimit_decisions_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// The request's domain.
    pub domain: Arc<String>,
    /// The rule's config path (request values only where the config asks for them).
    pub rule: Arc<String>,
    /// What happened.
    pub decision: Decision,
}

/// Hits counted beside a decision: usage recorded although it took a limit over, and units
/// given back.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Accounted {
    /// A cost report's hits, recorded although they took the limit over.
    report_over_limit,
    /// A refund's hits (as asked; a counter is never taken below empty).
    refund,
}

/// Labels of `ratelimit_places_in_use` and `ratelimit_places_ended_total`: a concurrency
/// rule's config path, never a request value.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PlaceLabels {
    /// The request's domain.
    pub domain: Arc<String>,
    /// The rule's config path.
    pub rule: Arc<String>,
}

/// Labels of the per-limit families (`ratelimit_rule_*`): the config's, never a request value,
/// so the series are as many as the config's limits.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabels {
    /// The request's domain.
    pub domain: Arc<String>,
    /// The rule's config path (without the request values `detailed_metric` adds to
    /// `ratelimit_decisions_total`'s).
    pub rule: Arc<String>,
    /// The limit's `name`, else its place among the rule's limits (`0`, `1`, …); `request` for
    /// a limit the request sent.
    pub limit: Arc<String>,
}

/// The `limit` label of a limit the request sent.
pub(crate) const REQUEST_LIMIT: &str = "request";
/// The `limit` label of an operator's override (`PUT /v1/overrides`), whichever of its limits.
pub(crate) const OPERATOR_LIMIT: &str = "override";

/// One limit of a rule, as the per-limit families label and gauge it.
pub struct LimitSpec {
    /// Its `limit` label ([`LimitLabels::limit`]).
    pub label: Arc<String>,
    /// Hits per window.
    pub requests_per_unit: u64,
    /// The window in seconds.
    pub window_seconds: u64,
    /// A soft limit (its rule's `soft_limit` decisions are counted).
    pub soft: bool,
}

/// Labels of `ratelimit_accounted_hits_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AccountedLabels {
    /// The request's domain.
    pub domain: Arc<String>,
    /// The rule's config path, as in `ratelimit_decisions_total`.
    pub rule: Arc<String>,
    /// What the hits were.
    pub kind: Accounted,
}

/// Labels of envoyproxy/ratelimit's per-rule families, as Envoy Gateway's statsd mapping cuts
/// them from that service's stat key `domain.key1.key2…`: `key2` only for rules two levels or
/// more deep (the mapping's two rules).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct ReferenceLabels {
    /// The domain.
    pub domain: Arc<String>,
    /// The rule path's first level (`key` or `key_value`).
    pub key1: Arc<str>,
    /// Its second level, if any.
    pub key2: Option<Arc<str>>,
}

impl ReferenceLabels {
    /// The labels of `rule` (a config path, levels joined by `.`) in `domain`.
    pub fn of(domain: &Arc<String>, rule: &str) -> ReferenceLabels {
        let mut levels = rule.split('.');
        ReferenceLabels {
            domain: domain.clone(),
            key1: levels.next().unwrap_or_default().into(),
            key2: levels.next().map(Into::into),
        }
    }
}

impl prometheus_client::encoding::EncodeLabelSet for ReferenceLabels {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel;
        ("domain", self.domain.as_str()).encode(encoder.encode_label())?;
        ("key1", &*self.key1).encode(encoder.encode_label())?;
        if let Some(key2) = &self.key2 {
            ("key2", &**key2).encode(encoder.encode_label())?;
        }
        Ok(())
    }
}

/// A monotonic count exposed without the `_total` suffix OpenMetrics gives counters: the names
/// Envoy Gateway's dashboard queries are the statsd exporter's, which have none.
pub(crate) type BareCounter = Gauge<u64, std::sync::atomic::AtomicU64>;

/// envoyproxy/ratelimit's per-rule families, `ratelimit_service_rate_limit_*`, counted as
/// that service counts them (hits, not calls; see `engine::report::reference_counts`).
#[derive(Clone, Default)]
pub struct ReferenceMetrics {
    /// `total_hits`.
    pub total_hits: Family<ReferenceLabels, BareCounter>,
    /// `within_limit`.
    pub within_limit: Family<ReferenceLabels, BareCounter>,
    /// `near_limit`.
    pub near_limit: Family<ReferenceLabels, BareCounter>,
    /// `over_limit`.
    pub over_limit: Family<ReferenceLabels, BareCounter>,
    /// `shadow_mode`.
    pub shadow_mode: Family<ReferenceLabels, BareCounter>,
}

impl ReferenceMetrics {
    /// The families in the order of `engine::report::reference_counts`.
    pub fn families(&self) -> [&Family<ReferenceLabels, BareCounter>; 5] {
        [
            &self.total_hits,
            &self.within_limit,
            &self.near_limit,
            &self.over_limit,
            &self.shadow_mode,
        ]
    }
}

/// envoyproxy/ratelimit's per-rule stats for the statsd sink (`--statsd-addr`): the five
/// counts of [`ReferenceMetrics`], kept per rule's full path (the Prometheus families keep two
/// levels), read by the sink at each flush and never exported on `/metrics`. Bounded as the
/// rules are: by the config, plus the capped labels that carry request values.
#[derive(Clone, Default)]
pub(crate) struct StatsdRules(Arc<std::sync::Mutex<StatsdRuleMap>>);

type StatsdRuleMap = std::collections::HashMap<(Arc<String>, Arc<String>), Arc<RuleStats>>;

/// One rule's five counts (`engine::report::reference_counts`: total, within, near, over,
/// shadow), kept so that the common decision, within the limit and short of near, adds to one
/// counter: the hits of requests within (which are also their total) and the hits of requests
/// over apart, the total being their sum.
#[derive(Default)]
pub(crate) struct RuleStats([std::sync::atomic::AtomicU64; 5]);

impl RuleStats {
    /// Adds `counts` (total, within, near, over, shadow).
    fn add(&self, [total, within, near, over, shadow]: [u64; 5]) {
        let kept = [within, total.saturating_sub(within), near, over, shadow];
        for (counter, n) in self.0.iter().zip(kept) {
            if n > 0 {
                counter.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// The counts so far: total, within, near, over, shadow.
    pub(crate) fn get(&self) -> [u64; 5] {
        let [within, over_requests, near, over, shadow] = self
            .0
            .each_ref()
            .map(|c| c.load(std::sync::atomic::Ordering::Relaxed));
        [
            within.wrapping_add(over_requests),
            within,
            near,
            over,
            shadow,
        ]
    }
}

impl StatsdRules {
    /// `rule`'s counts in `domain`, made the first time.
    fn of(&self, domain: &Arc<String>, rule: &Arc<String>) -> Arc<RuleStats> {
        let mut rules = self.0.lock().unwrap_or_else(|e| e.into_inner());
        rules
            .entry((domain.clone(), rule.clone()))
            .or_default()
            .clone()
    }

    /// Forgets `rule`'s counts in `domain` (a rule gone from the config).
    fn forget(&self, domain: &Arc<String>, rule: &Arc<String>) {
        let mut rules = self.0.lock().unwrap_or_else(|e| e.into_inner());
        rules.remove(&(domain.clone(), rule.clone()));
    }

    /// Every rule's counts so far: (domain, rule, counts).
    pub(crate) fn snapshot(&self) -> Vec<(Arc<String>, Arc<String>, [u64; 5])> {
        let rules = self.0.lock().unwrap_or_else(|e| e.into_inner());
        rules
            .iter()
            .map(|((domain, rule), stats)| (domain.clone(), rule.clone(), stats.get()))
            .collect()
    }
}

/// What the engine records for each decided limit.
#[derive(Clone, Default)]
pub struct DecisionMetrics {
    /// `ratelimit_decisions_total{domain,rule,decision}`.
    pub decisions: Family<DecisionLabels, Counter>,
    /// `ratelimit_accounted_hits_total{domain,rule,kind}`: cost reports recorded past a limit,
    /// and refunds, in hits.
    pub accounted: Family<AccountedLabels, Counter>,
    /// envoyproxy/ratelimit's families, when enabled (`--reference-metrics`).
    pub reference: Option<ReferenceMetrics>,
    /// The same counts per rule for the statsd sink, when it is on.
    pub(crate) statsd: Option<StatsdRules>,
    /// `ratelimit_places_in_use{domain,rule}`: a concurrency rule's places this replica took
    /// and that have not ended, less those it released that had not ended: summed over the
    /// replicas of one store, the places in use.
    pub places_in_use: Family<PlaceLabels, Gauge>,
    /// `ratelimit_places_ended_total{domain,rule}`: places that ended unreleased, counted when
    /// a request on their counter found them.
    pub places_ended: Family<PlaceLabels, Counter>,
    /// `ratelimit_rule_hits_total{domain,rule,limit}`: hits asked of each limit.
    pub rule_hits: Family<LimitLabels, Counter>,
    /// `ratelimit_rule_over_limit_hits_total{domain,rule,limit}`: hits over each limit (refused,
    /// or for a shadow-mode rule, that would have been).
    pub rule_over_limit_hits: Family<LimitLabels, Counter>,
    /// `ratelimit_rule_limit{domain,rule,limit}`: each limit's `requests_per_unit`, from its
    /// rule's first decision under the config in force (cleared when another comes in force).
    pub rule_limit: Family<LimitLabels, Gauge>,
    /// `ratelimit_rule_window_seconds{domain,rule,limit}`: each limit's window, as
    /// `rule_limit`.
    pub rule_window: Family<LimitLabels, Gauge>,
    /// `ratelimit_calls_undone_total`: admitted calls whose answer never reached the caller
    /// (cancelled, or past their deadline, before it went out), given back.
    pub calls_undone: Counter,
    /// Who these families are, for [`RuleCounters`]: clones share it.
    owner: Arc<()>,
    /// The per-rule series made so far, by rule: what lets a removed rule's be dropped.
    series: Arc<RuleSeries>,
}

impl DecisionMetrics {
    /// Metrics recording into `decisions` and, if set, `reference`.
    pub fn new(
        decisions: Family<DecisionLabels, Counter>,
        reference: Option<ReferenceMetrics>,
    ) -> DecisionMetrics {
        DecisionMetrics {
            decisions,
            accounted: Family::default(),
            reference,
            statsd: None,
            places_in_use: Family::default(),
            places_ended: Family::default(),
            rule_hits: Family::default(),
            rule_over_limit_hits: Family::default(),
            rule_limit: Family::default(),
            rule_window: Family::default(),
            calls_undone: Counter::default(),
            owner: Arc::default(),
            series: Arc::default(),
        }
    }

    /// Whether a decision's reference counts are wanted (`engine::report::reference_counts`).
    pub fn wants_reference_counts(&self) -> bool {
        self.reference.is_some() || self.statsd.is_some()
    }

    /// Counts `hits` of `rule` in `domain` as `kind`: reports and refunds are rare next to
    /// decisions, so their labels are looked up each time.
    /// `path` is the config path of the rule `rule` labels.
    pub fn record_accounted(
        &self,
        domain: &Arc<String>,
        path: &str,
        rule: Arc<String>,
        kind: Accounted,
        hits: u64,
    ) {
        let labels = AccountedLabels {
            domain: domain.clone(),
            rule,
            kind,
        };
        if self.accounted.get(&labels).is_none() {
            self.series.note(domain, path, Some(&labels.rule), None);
        }
        self.accounted.get_or_create(&labels).inc_by(hits);
    }

    /// Counts one decision of `rule` in `domain`, with `reference` (from
    /// `engine::report::reference_counts`) added to the reference families if they are on.
    /// Looks the labels up in each family: the path for labels that carry request values.
    /// `path` is the config path of the rule `rule` labels.
    pub fn record(
        &self,
        domain: &Arc<String>,
        path: &str,
        rule: Arc<String>,
        decision: Decision,
        reference: Option<[u64; 5]>,
    ) {
        let labels = DecisionLabels {
            domain: domain.clone(),
            rule,
            decision,
        };
        if self.decisions.get(&labels).is_none() {
            self.series.note(domain, path, Some(&labels.rule), None);
        }
        let rule = &labels.rule;
        if let (Some(families), Some(counts)) = (&self.reference, reference) {
            let labels = ReferenceLabels::of(domain, rule);
            for (family, n) in families.families().into_iter().zip(counts) {
                if n > 0 {
                    family.get_or_create(&labels).inc_by(n);
                }
            }
        }
        if let (Some(rules), Some(counts)) = (&self.statsd, reference) {
            rules.of(domain, rule).add(counts);
        }
        self.decisions.get_or_create(&labels).inc();
    }

    /// `slot`'s counters for the rule at config path `rule` in `domain`, looked up in these
    /// families the first time (its limits, from `limits`, gauged then); `None` if another
    /// server's metrics filled the slot first. The decision counters are made only for a rule
    /// whose `ratelimit_decisions_total` label is its path (`fixed`): one whose label carries
    /// request values is recorded through [`DecisionMetrics::record`].
    pub fn rule<'a>(
        &self,
        slot: &'a RuleCounters,
        domain: &Arc<String>,
        rule: &Arc<String>,
        fixed: bool,
        limits: impl FnOnce() -> Vec<LimitSpec>,
    ) -> Option<&'a RuleHandles> {
        let handles = slot.0.get_or_init(|| {
            let specs = limits();
            let soft = specs.iter().any(|s| s.soft);
            for spec in &specs {
                self.series
                    .note(domain, rule, Some(rule), Some(&spec.label));
            }
            let counters: Vec<LimitCounters> = specs
                .into_iter()
                .map(|spec| {
                    let labels = LimitLabels {
                        domain: domain.clone(),
                        rule: rule.clone(),
                        limit: spec.label,
                    };
                    let gauge = |g: &Family<LimitLabels, Gauge>, v: u64| {
                        g.get_or_create(&labels)
                            .set(i64::try_from(v).unwrap_or(i64::MAX));
                    };
                    gauge(&self.rule_limit, spec.requests_per_unit);
                    gauge(&self.rule_window, spec.window_seconds);
                    LimitCounters {
                        hits: self.rule_hits.get_or_create(&labels).clone(),
                        over: self.rule_over_limit_hits.get_or_create(&labels).clone(),
                    }
                })
                .collect();
            Box::new(RuleHandles {
                owner: self.owner.clone(),
                decisions: fixed.then(|| {
                    [
                        Decision::within_limit,
                        Decision::near_limit,
                        Decision::over_limit,
                        Decision::shadow_mode,
                        Decision::soft_limit,
                    ]
                    .map(|decision| {
                        // `soft_limit` only for a rule with a soft limit: a series per rule
                        // less; the others count into a counter no family holds, never.
                        if decision == Decision::soft_limit && !soft {
                            return Counter::default();
                        }
                        self.decisions
                            .get_or_create(&DecisionLabels {
                                domain: domain.clone(),
                                rule: rule.clone(),
                                decision,
                            })
                            .clone()
                    })
                }),
                reference: self.reference.as_ref().filter(|_| fixed).map(|families| {
                    let labels = ReferenceLabels::of(domain, rule);
                    families
                        .families()
                        .map(|family| family.get_or_create(&labels).clone())
                }),
                statsd: self
                    .statsd
                    .as_ref()
                    .filter(|_| fixed)
                    .map(|rules| rules.of(domain, rule)),
                limits: counters.into_boxed_slice(),
            })
        });
        Arc::ptr_eq(&handles.owner, &self.owner).then_some(handles)
    }

    /// Counts `hits` asked of the limit `limit` of `rule` in `domain`, looked up in the
    /// families each time: for a limit no config rule holds (a request's own limit on a
    /// descriptor no rule matches) and a rule whose handles another server's metrics hold.
    pub fn count_limit(
        &self,
        domain: &Arc<String>,
        rule: &Arc<String>,
        limit: Arc<String>,
        hits: u64,
        over: bool,
    ) {
        let labels = LimitLabels {
            domain: domain.clone(),
            rule: rule.clone(),
            limit,
        };
        if self.rule_hits.get(&labels).is_none() {
            self.series.note(domain, rule, None, Some(&labels.limit));
        }
        self.rule_hits.get_or_create(&labels).inc_by(hits);
        if over {
            self.rule_over_limit_hits
                .get_or_create(&labels)
                .inc_by(hits);
        }
    }

    /// Notes that the places of rule `path` in `domain` have series (`places`).
    pub(crate) fn note_places(&self, labels: &PlaceLabels) {
        if self.places_ended.get(labels).is_none() {
            self.series
                .note(&labels.domain, &labels.rule, Some(&labels.rule), None);
        }
    }

    /// A new config is in force, whose rules `in_force(domain, path)` says: the limits'
    /// gauges are set again by each rule's first decision under it, and the series of rules
    /// it no longer has are dropped after their grace ([`RuleSeries`]).
    pub fn config_changed(&self, in_force: impl Fn(&str, &str) -> bool) {
        self.rule_limit.clear();
        self.rule_window.clear();
        let gone = self.series.config_changed(in_force);
        self.drop_series(gone);
    }

    /// How long a removed rule's series stay (`--removed-series-grace`).
    pub fn set_removed_series_grace(&self, grace: Duration) {
        let ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        self.series.grace_ms.store(ms, Ordering::Relaxed);
    }

    /// `/metrics` was scraped: the series of rules gone from the config for longer than the
    /// grace are dropped.
    pub fn scraped(&self) {
        let gone = self.series.scraped();
        self.drop_series(gone);
    }

    /// Removes `gone`'s series from every per-rule family.
    fn drop_series(&self, gone: Vec<Gone>) {
        if gone.is_empty() {
            return;
        }
        let live = self.series.reference_labels();
        for g in gone {
            for rule in &g.labels {
                for decision in [
                    Decision::within_limit,
                    Decision::near_limit,
                    Decision::over_limit,
                    Decision::shadow_mode,
                    Decision::soft_limit,
                ] {
                    self.decisions.remove(&DecisionLabels {
                        domain: g.domain.clone(),
                        rule: rule.clone(),
                        decision,
                    });
                }
                for kind in [Accounted::report_over_limit, Accounted::refund] {
                    self.accounted.remove(&AccountedLabels {
                        domain: g.domain.clone(),
                        rule: rule.clone(),
                        kind,
                    });
                }
                if let Some(families) = &self.reference {
                    // Rules that share their first two levels share these series.
                    let labels = ReferenceLabels::of(&g.domain, rule);
                    if !live.contains(&labels) {
                        for family in families.families() {
                            family.remove(&labels);
                        }
                    }
                }
                if let Some(rules) = &self.statsd {
                    rules.forget(&g.domain, rule);
                }
                let places = PlaceLabels {
                    domain: g.domain.clone(),
                    rule: rule.clone(),
                };
                // A place still counted in use keeps its gauge: its end or release comes.
                if self.places_in_use.get(&places).is_none_or(|p| p.get() == 0) {
                    self.places_in_use.remove(&places);
                    self.places_ended.remove(&places);
                }
            }
            for limit in &g.limits {
                let labels = LimitLabels {
                    domain: g.domain.clone(),
                    rule: g.path.clone(),
                    limit: limit.clone(),
                };
                self.rule_hits.remove(&labels);
                self.rule_over_limit_hits.remove(&labels);
            }
        }
    }
}

/// How many configs may come in force after the one that removed a rule before its series are
/// dropped, whatever the time: what bounds the series kept through a burst of reloads.
const SERIES_GRACE_CONFIGS: u32 = 2;
/// `--removed-series-grace`'s default.
const SERIES_GRACE: Duration = Duration::from_secs(600);

/// The per-rule series made so far, by the config rule (domain and path) they belong to. A
/// rule's series are noted when each is made (once per rule and config for the families a
/// rule's handles hold, on a family miss otherwise), so that once the rule has left the config
/// they can be dropped: at the first scrape or config change once the grace has passed since it
/// left (time, not scrapes: any number of scrapers see its last increase), or when the second
/// config after the one that removed it comes in force, whichever is first. So the per-rule
/// series are at most those of the rules of the config in force and of the two before it,
/// whatever the reload history.
pub(crate) struct RuleSeries {
    rules: std::sync::Mutex<SeriesByRule>,
    /// The grace, in milliseconds.
    grace_ms: AtomicU64,
}

impl Default for RuleSeries {
    fn default() -> Self {
        RuleSeries {
            rules: Default::default(),
            grace_ms: AtomicU64::new(SERIES_GRACE.as_millis() as u64),
        }
    }
}

/// Each rule's series, by (domain, config path).
type SeriesByRule = HashMap<(Arc<String>, Arc<String>), Series>;

/// One rule's series.
#[derive(Default)]
struct Series {
    /// Its labels in the `rule` label: its path, or its path with request values.
    labels: HashSet<Arc<String>>,
    /// Its limits' labels in the `ratelimit_rule_*` families.
    limits: HashSet<Arc<String>>,
    /// Since the rule left the config: the configs come in force after the one that removed
    /// it, and when it left.
    gone: Option<(u32, Instant)>,
}

/// A rule's series to drop.
struct Gone {
    domain: Arc<String>,
    path: Arc<String>,
    labels: HashSet<Arc<String>>,
    limits: HashSet<Arc<String>>,
}

impl RuleSeries {
    fn lock(&self) -> std::sync::MutexGuard<'_, SeriesByRule> {
        self.rules.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn grace(&self) -> Duration {
        Duration::from_millis(self.grace_ms.load(Ordering::Relaxed))
    }

    /// Notes a series of rule `path` in `domain`: one labelled `label`, or of limit `limit`.
    fn note(
        &self,
        domain: &Arc<String>,
        path: &str,
        label: Option<&Arc<String>>,
        limit: Option<&Arc<String>>,
    ) {
        let mut rules = self.lock();
        let key = (domain.clone(), Arc::new(path.to_owned()));
        let series = rules.entry(key).or_default();
        if let Some(label) = label {
            series.labels.insert(label.clone());
        }
        if let Some(limit) = limit {
            series.limits.insert(limit.clone());
        }
    }

    /// Marks the rules `in_force` does not hold as gone (counting this config for those gone
    /// already), clears the mark of those back in force; returns those past their grace.
    fn config_changed(&self, in_force: impl Fn(&str, &str) -> bool) -> Vec<Gone> {
        let grace = self.grace();
        let mut rules = self.lock();
        let now = Instant::now();
        for ((domain, path), series) in rules.iter_mut() {
            series.gone = match (in_force(domain, path), series.gone) {
                (true, _) => None,
                (false, None) => Some((0, now)),
                (false, Some((configs, since))) => Some((configs + 1, since)),
            };
        }
        Self::take_past_grace(&mut rules, grace)
    }

    /// At a scrape: returns the rules gone past their grace.
    fn scraped(&self) -> Vec<Gone> {
        let grace = self.grace();
        let mut rules = self.lock();
        Self::take_past_grace(&mut rules, grace)
    }

    fn take_past_grace(rules: &mut SeriesByRule, grace: Duration) -> Vec<Gone> {
        let past = |s: &Series| {
            s.gone.is_some_and(|(configs, since)| {
                configs >= SERIES_GRACE_CONFIGS || since.elapsed() >= grace
            })
        };
        let keys: Vec<_> = rules
            .iter()
            .filter(|(_, s)| past(s))
            .map(|(k, _)| k.clone())
            .collect();
        keys.into_iter()
            .filter_map(|k| {
                let s = rules.remove(&k)?;
                Some(Gone {
                    domain: k.0,
                    path: k.1,
                    labels: s.labels,
                    limits: s.limits,
                })
            })
            .collect()
    }

    /// The reference families' labels of every rule still noted.
    fn reference_labels(&self) -> HashSet<ReferenceLabels> {
        let rules = self.lock();
        rules
            .iter()
            .flat_map(|((domain, _), s)| s.labels.iter().map(|l| ReferenceLabels::of(domain, l)))
            .collect()
    }
}

/// The counters of one rule whose labels are fixed (no request values in them), kept on the
/// config node the rule belongs to and looked up once per config: a decision then costs one
/// atomic add per counter, not a lookup under each family's lock with its labels hashed and
/// their strings' reference counts bumped — shared cache lines every worker thread writes.
/// Boxed: a slot on every node of a large config costs 16 bytes until its rule decides.
#[derive(Default)]
pub struct RuleCounters(OnceLock<Box<RuleHandles>>);

impl std::fmt::Debug for RuleCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RuleCounters")
    }
}

/// A rule's counters in one server's families.
pub struct RuleHandles {
    /// The [`DecisionMetrics`] they belong to (kept alive, so the address is never reused).
    owner: Arc<()>,
    /// By [`Decision`], in declaration order; `None` for a rule whose label carries request
    /// values.
    decisions: Option<[Counter; 5]>,
    /// As [`ReferenceMetrics::families`], when those are on.
    reference: Option<[BareCounter; 5]>,
    /// The rule's statsd counts, when the sink is on.
    statsd: Option<Arc<RuleStats>>,
    /// By the limit's place on the rule.
    limits: Box<[LimitCounters]>,
}

/// One limit's hits and hits over it.
struct LimitCounters {
    hits: Counter,
    over: Counter,
}

impl RuleHandles {
    /// Counts `hits` asked of the limit at `index` on the rule, over the limit if `over`;
    /// `false` for a limit the rule does not have (the request's own: counted through
    /// [`DecisionMetrics::count_limit`], so that a rule no request overrides has no series for
    /// it).
    pub fn count(&self, index: u16, hits: u64, over: bool) -> bool {
        let Some(c) = self.limits.get(usize::from(index)) else {
            return false;
        };
        c.hits.inc_by(hits);
        if over {
            c.over.inc_by(hits);
        }
        true
    }

    /// Counts one decision, as [`DecisionMetrics::record`] does.
    pub fn record(&self, decision: Decision, reference: Option<[u64; 5]>) {
        if let (Some(counters), Some(counts)) = (&self.reference, reference) {
            for (counter, n) in counters.iter().zip(counts) {
                if n > 0 {
                    counter.inc_by(n);
                }
            }
        }
        if let (Some(stats), Some(counts)) = (&self.statsd, reference) {
            stats.add(counts);
        }
        if let Some(decisions) = &self.decisions {
            decisions[decision as usize].inc();
        }
    }
}

/// Result of a config load.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum LoadResult {
    /// The new snapshot is in force.
    success,
    /// Refused; the previous snapshot stays in force.
    error,
}

/// Labels of `ratelimit_config_loads_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoadLabels {
    /// success or error.
    pub result: LoadResult,
}

/// Labels of `ratelimit_grpc_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// The gRPC status code name (invalid_argument, unavailable, …).
    pub code: String,
}

/// Labels of `ratelimit_grpc_resets_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResetLabels {
    /// rst_stream (one call) or goaway (every call of a connection).
    pub frame: &'static str,
    /// The HTTP/2 error code's name: protocol_error, refused_stream, …
    pub code: &'static str,
}

/// Labels of `ratelimit_backend_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// timeout, connection, cluster, noscript, circuit_open or other.
    pub kind: &'static str,
}

/// Labels of `ratelimit_failure_mode_decisions_total` and `ratelimit_rlqs_failure_mode_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabels {
    /// error, allow, deny or local.
    pub mode: &'static str,
}

/// What the memory backend (or the `local` failure mode) reports: bytes of counter state held
/// and what the `--memory-max-bytes` bound gave up or refused.
#[derive(Clone, Default)]
pub struct MemoryMetrics {
    /// `ratelimit_memory_bytes`.
    pub bytes: Gauge,
    /// `ratelimit_memory_evictions_total`.
    pub evictions: Counter,
    /// `ratelimit_memory_holds_dropped_total`: rate limits' holds given up to keep their
    /// counter within its share of the bound (their hits stay counted).
    pub holds_dropped: Counter,
    /// `ratelimit_memory_places_refused_total`: places refused because their counter had no
    /// room left in its share of the bound.
    pub places_refused: Counter,
}

/// What a backend records: its calls' errors and durations, whether its store answers, the
/// over-limit cache's hits and the failure mode's decisions. A cheap clone of shared counters.
#[derive(Clone)]
pub struct BackendMetrics {
    /// `ratelimit_backend_errors_total{kind}`: failed backend calls.
    pub errors: Family<KindLabels, Counter>,
    /// `ratelimit_backend_duration_seconds`: one backend round trip (one script call).
    pub duration: Histogram,
    /// `ratelimit_backend_up`: 1 while the backend is reachable.
    pub up: Gauge,
    /// `ratelimit_local_cache_hits_total`: requests answered by the over-limit cache.
    pub local_cache_hits: Counter,
    /// `ratelimit_failure_mode_decisions_total{mode}`: requests decided by the failure mode.
    pub failure_mode_decisions: Family<ModeLabels, Counter>,
    /// `ratelimit_redis_batch_requests`: requests decided by one script call.
    pub batch_requests: Histogram,
    /// `ratelimit_redis_replicas`: replicas alive on Redis as last counted there (the `share`
    /// failure mode cuts each limit by it; 0 in the other modes, which do not count).
    pub replicas: Gauge,
    /// `ratelimit_share_written_back_hits_total`: hits admitted alone (`share`) and written
    /// back to Redis after it.
    pub written_back: Counter,
    /// `ratelimit_share_lost_hits_total`: hits admitted alone that Redis did not take back.
    pub written_back_lost: Counter,
}

impl Default for BackendMetrics {
    fn default() -> Self {
        let up = Gauge::default();
        up.set(1);
        BackendMetrics {
            errors: Family::default(),
            duration: Histogram::new([
                0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25, 1.0,
            ]),
            up,
            local_cache_hits: Counter::default(),
            failure_mode_decisions: Family::default(),
            batch_requests: Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]),
            replicas: Gauge::default(),
            written_back: Counter::default(),
            written_back_lost: Counter::default(),
        }
    }
}

impl BackendMetrics {
    /// Counts a failed backend call.
    pub fn error(&self, kind: &'static str) {
        self.errors.get_or_create(&KindLabels { kind }).inc();
    }

    /// Counts a request decided by the failure mode `mode`.
    pub fn failure_mode(&self, mode: &'static str) {
        self.failure_mode_decisions
            .get_or_create(&ModeLabels { mode })
            .inc();
    }
}

/// Labels of the RLQS families counted by a fixed set of names.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NameLabels {
    /// allow_all, deny_all or token_bucket (assignments); the fault (skipped entries).
    pub kind: &'static str,
}

/// The quota server's (RLQS) metrics; never labelled by bucket id, which clients choose.
#[derive(Clone, Default)]
pub struct RlqsMetrics {
    /// `ratelimit_rlqs_streams`: open streams.
    pub streams: Gauge,
    /// `ratelimit_rlqs_buckets`: buckets the open streams hold.
    pub buckets: Gauge,
    /// `ratelimit_rlqs_pools`: RLQS pools held in this process (leases of closed streams
    /// included; with Redis, only those the `local` failure mode used).
    pub pools: Gauge,
    /// `ratelimit_rlqs_bytes`: the open streams' buckets, as charged to `--rlqs-max-bytes`.
    pub bytes: Gauge,
    /// `ratelimit_rlqs_assignments_total{kind}`: assignments sent, by strategy.
    pub assignments: Family<NameLabels, Counter>,
    /// `ratelimit_rlqs_skipped_entries_total{kind}`: report entries skipped, by fault.
    pub skipped: Family<NameLabels, Counter>,
    /// `ratelimit_rlqs_abandons_total`: idle buckets abandoned.
    pub abandons: Counter,
    /// `ratelimit_rlqs_failure_mode_total{mode}`: assignments the failure mode decided while
    /// Redis could not answer, by mode (`error`: none was sent); the label is
    /// `ratelimit_failure_mode_decisions_total`'s.
    pub failure_mode_decisions: Family<ModeLabels, Counter>,
}

impl RlqsMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "ratelimit_rlqs_streams",
            "Open RLQS streams",
            self.streams.clone(),
        );
        registry.register(
            "ratelimit_rlqs_buckets",
            "Buckets the open RLQS streams hold",
            self.buckets.clone(),
        );
        registry.register(
            "ratelimit_rlqs_pools",
            "RLQS pools held in this process, leases of closed streams included",
            self.pools.clone(),
        );
        registry.register(
            "ratelimit_rlqs_bytes",
            "Bytes the open RLQS streams' buckets are charged against --rlqs-max-bytes",
            self.bytes.clone(),
        );
        registry.register(
            "ratelimit_rlqs_assignments",
            "RLQS assignments sent, by strategy",
            self.assignments.clone(),
        );
        registry.register(
            "ratelimit_rlqs_skipped_entries",
            "RLQS report entries skipped (the stream goes on), by fault",
            self.skipped.clone(),
        );
        registry.register(
            "ratelimit_rlqs_abandons",
            "Idle RLQS buckets told to go away",
            self.abandons.clone(),
        );
        registry.register(
            "ratelimit_rlqs_failure_mode",
            "RLQS assignments decided by the failure mode while Redis could not answer, by mode",
            self.failure_mode_decisions.clone(),
        );
    }
}

/// The service's metrics and the registry that exports them.
pub struct Metrics {
    registry: Registry,
    /// What the engine records per decided limit.
    pub decisions: DecisionMetrics,
    /// `process_resident_memory_bytes` and `process_virtual_memory_bytes`, read at each scrape
    /// (the chart's dashboard and Envoy Gateway's show them).
    process: (Gauge, Gauge),
    /// `ratelimit_worker_threads_active`: tokio workers taking tasks, read at each scrape (the
    /// worker gate holds the others; without it, every worker of the runtime).
    workers_active: Gauge,
    /// `ratelimit_config_loads_total{result}`.
    pub config_loads: Family<LoadLabels, Counter>,
    /// `ratelimit_config_rules`: rules in the snapshot in force.
    pub config_rules: Gauge,
    /// `ratelimit_config_last_load_success`: 1 when the last load succeeded, 0 after a failed
    /// one (the config before it still in force) or before the first.
    config_last_load: Gauge,
    /// `ratelimit_statsd_flushes_total{result}`: the statsd sink's flushes.
    statsd_flushes: Family<LoadLabels, Counter>,
    /// `ratelimit_statsd_lines_lost_total`: lines the collector may not have had.
    statsd_lines_lost: Counter,
    /// `ratelimit_request_duration_seconds`: ShouldRateLimit handling time.
    pub request_duration: Histogram,
    /// `ratelimit_grpc_errors_total{code}`: requests answered with a gRPC error.
    pub grpc_errors: Family<ErrorLabels, Counter>,
    /// `ratelimit_requests_in_flight`: ShouldRateLimit calls being handled now.
    pub in_flight: Gauge,
    /// `ratelimit_grpc_resets_total{frame,code}`: streams and connections the gRPC port
    /// ended with an error, before the service saw or answered their calls.
    pub grpc_resets: Family<ResetLabels, Counter>,
    /// What the backends record.
    pub backend: BackendMetrics,
    /// The memory backend's bytes and evictions.
    pub memory: MemoryMetrics,
    /// `ratelimit_tls_reloads_total{result}`: reloads of the gRPC listener's TLS files.
    pub tls_reloads: Family<LoadLabels, Counter>,
    /// The quota server's.
    pub rlqs: RlqsMetrics,
    /// The operator's overrides and the admin listener's.
    pub admin: AdminMetrics,
}

/// Labels of `ratelimit_override_changes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    /// set, delete or expire.
    pub action: &'static str,
}

/// Labels of `ratelimit_admin_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdminLabels {
    /// ok, unauthenticated, invalid or refused.
    pub result: &'static str,
}

/// The overrides in force, their changes by action (never by value), and the admin
/// listener's calls by result.
#[derive(Clone, Default)]
pub struct AdminMetrics {
    /// `ratelimit_overrides`: overrides in force on this replica.
    pub overrides: Gauge,
    /// `ratelimit_override_changes_total{action}`.
    pub changes: Family<ActionLabels, Counter>,
    /// `ratelimit_admin_requests_total{result}`.
    pub requests: Family<AdminLabels, Counter>,
}

impl AdminMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "ratelimit_overrides",
            "Operator overrides of limits in force on this replica",
            self.overrides.clone(),
        );
        registry.register(
            "ratelimit_override_changes",
            "Overrides set, deleted or ended by their TTL (the last counted by the replica that saw it end)",
            self.changes.clone(),
        );
        registry.register(
            "ratelimit_admin_requests",
            "Calls on the admin listener by result (unauthenticated: no valid token)",
            self.requests.clone(),
        );
    }

    /// Counts one change of the overrides.
    pub fn changed(&self, action: &'static str) {
        self.changes.get_or_create(&ActionLabels { action }).inc();
    }

    /// Counts one call of the admin listener.
    pub fn request(&self, result: &'static str) {
        self.requests.get_or_create(&AdminLabels { result }).inc();
    }
}

impl ReferenceMetrics {
    /// envoyproxy/ratelimit's per-rule families, registered as Envoy Gateway's dashboard reads
    /// them.
    fn registered(registry: &mut Registry) -> ReferenceMetrics {
        let r = ReferenceMetrics::default();
        for (name, help, family) in [
            ("total_hits", "Hits on the rule", &r.total_hits),
            ("within_limit", "Hits within the limit", &r.within_limit),
            (
                "near_limit",
                "Hits past the near-limit ratio",
                &r.near_limit,
            ),
            ("over_limit", "Hits over the limit", &r.over_limit),
            (
                "shadow_mode",
                "Hits over a shadow-mode limit",
                &r.shadow_mode,
            ),
        ] {
            registry.register(
                format!("ratelimit_service_rate_limit_{name}"),
                help,
                family.clone(),
            );
        }
        r
    }
}

/// The process's resident and virtual memory gauges (set at each scrape from
/// [`ProcessStatus`]), registered.
fn process_gauges(registry: &mut Registry) -> (Gauge, Gauge) {
    let (rss, vsz) = (Gauge::default(), Gauge::default());
    registry.register(
        "process_resident_memory_bytes",
        "Resident memory",
        rss.clone(),
    );
    registry.register(
        "process_virtual_memory_bytes",
        "Virtual memory",
        vsz.clone(),
    );
    (rss, vsz)
}

impl BackendMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "ratelimit_backend_errors",
            "Failed backend calls by kind",
            self.errors.clone(),
        );
        registry.register(
            "ratelimit_backend_duration_seconds",
            "Backend round trip (one script call)",
            self.duration.clone(),
        );
        registry.register(
            "ratelimit_backend_up",
            "1 while the backend is reachable",
            self.up.clone(),
        );
        registry.register(
            "ratelimit_local_cache_hits",
            "Requests answered by the over-limit cache without a backend call",
            self.local_cache_hits.clone(),
        );
        registry.register(
            "ratelimit_failure_mode_decisions",
            "Requests decided by the failure mode while the backend was unavailable",
            self.failure_mode_decisions.clone(),
        );
        registry.register(
            "ratelimit_redis_replicas",
            "Replicas alive on Redis as last counted there (share failure mode only)",
            self.replicas.clone(),
        );
        registry.register(
            "ratelimit_share_written_back_hits",
            "Hits admitted while Redis was away (share failure mode) and written back",
            self.written_back.clone(),
        );
        registry.register(
            "ratelimit_share_lost_hits",
            "Hits admitted while Redis was away (share failure mode) that Redis did not take back",
            self.written_back_lost.clone(),
        );
        registry.register(
            "ratelimit_redis_batch_requests",
            "Requests decided together in one Redis script call (coalesced under load)",
            self.batch_requests.clone(),
        );
    }
}

impl MemoryMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "ratelimit_memory_bytes",
            "Bytes of counter state the memory backend holds, keys included",
            self.bytes.clone(),
        );
        registry.register(
            "ratelimit_memory_evictions",
            "Live counters given up at --memory-max-bytes (each may admit up to its limit again)",
            self.evictions.clone(),
        );
        registry.register(
            "ratelimit_memory_holds_dropped",
            "Holds given up to keep their counter within --memory-max-bytes (their hits stay counted; their refunds give nothing back)",
            self.holds_dropped.clone(),
        );
        registry.register(
            "ratelimit_memory_places_refused",
            "Concurrency places refused because their counter had no room left within --memory-max-bytes",
            self.places_refused.clone(),
        );
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics in a new registry.
    pub fn new() -> Metrics {
        Self::with_reference(false)
    }

    /// Fresh metrics, with envoyproxy/ratelimit's per-rule families and the process's memory
    /// when `reference` (for Envoy Gateway's dashboard).
    pub fn with_reference(reference: bool) -> Metrics {
        Self::with_families(reference, false)
    }

    /// Fresh metrics, with envoyproxy/ratelimit's per-rule families when `reference`, and its
    /// per-rule stats for the statsd sink when `statsd`.
    pub fn with_families(reference: bool, statsd: bool) -> Metrics {
        let mut registry = Registry::default();
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "ratelimit_decisions",
            "Limit decisions per domain, rule and outcome",
            decisions.clone(),
        );
        let reference = reference.then(|| ReferenceMetrics::registered(&mut registry));
        let process = process_gauges(&mut registry);
        let workers_active = Gauge::default();
        registry.register(
            "ratelimit_worker_threads_active",
            "tokio worker threads taking tasks now (the worker gate holds the others at a light load)",
            workers_active.clone(),
        );

        let mut decisions = DecisionMetrics::new(decisions, reference);
        decisions.statsd = statsd.then(StatsdRules::default);
        registry.register(
            "ratelimit_accounted_hits",
            "Hits of cost reports recorded past a limit (report_over_limit) and of refunds (refund), per domain and rule",
            decisions.accounted.clone(),
        );
        registry.register(
            "ratelimit_places_in_use",
            "Places of a concurrency rule this replica took and that have not ended, less those it released: summed over the replicas of one store, the places in use",
            decisions.places_in_use.clone(),
        );
        registry.register(
            "ratelimit_rule_hits",
            "Hits asked of each configured limit, by domain, rule (its config path) and limit (its name, or place on the rule): as many series as the config has limits, whatever the requests' values",
            decisions.rule_hits.clone(),
        );
        registry.register(
            "ratelimit_rule_over_limit_hits",
            "Hits over each configured limit (refused, or for a shadow-mode rule, that would have been), labelled as ratelimit_rule_hits",
            decisions.rule_over_limit_hits.clone(),
        );
        registry.register(
            "ratelimit_rule_limit",
            "Each configured limit's requests_per_unit, from its rule's first decision under the config in force",
            decisions.rule_limit.clone(),
        );
        registry.register(
            "ratelimit_rule_window_seconds",
            "Each configured limit's window in seconds (unit times unit_multiplier), as ratelimit_rule_limit",
            decisions.rule_window.clone(),
        );
        registry.register(
            "ratelimit_places_ended",
            "Places of a concurrency rule that ended unreleased (a crashed Envoy, or a lifetime shorter than a stream), counted when a request on their counter found them",
            decisions.places_ended.clone(),
        );
        let config_loads = Family::<LoadLabels, Counter>::default();
        at_zero(
            &config_loads,
            [LoadResult::success, LoadResult::error].map(|result| LoadLabels { result }),
        );
        registry.register(
            "ratelimit_config_loads",
            "Config loads by result; a failed reload keeps the previous config",
            config_loads.clone(),
        );
        let statsd_flushes = Family::<LoadLabels, Counter>::default();
        registry.register(
            "ratelimit_statsd_flushes",
            "Flushes to the statsd collector (--statsd-addr) by result; a failed one's stats wait for the next (TCP) or are dropped (UDP)",
            statsd_flushes.clone(),
        );
        let statsd_lines_lost = Counter::default();
        registry.register(
            "ratelimit_statsd_lines_lost",
            "Stat lines the statsd collector may not have had: UDP datagrams that could not be sent, TCP lines written to a connection the collector then reset, and a line cut by a connection given up (each line is sent at most once)",
            statsd_lines_lost.clone(),
        );
        let config_last_load = Gauge::default();
        registry.register(
            "ratelimit_config_last_load_success",
            "1 when the last config load succeeded, 0 after a failed one (the previous config stays in force) or before the first",
            config_last_load.clone(),
        );
        let config_rules = Gauge::default();
        registry.register(
            "ratelimit_config_rules",
            "Limits in the config in force",
            config_rules.clone(),
        );
        let request_duration = Histogram::new([
            0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
            0.05, 0.1, 0.25, 1.0,
        ]);
        registry.register(
            "ratelimit_request_duration_seconds",
            "Time to answer ShouldRateLimit",
            request_duration.clone(),
        );
        let grpc_errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "ratelimit_grpc_errors",
            "ShouldRateLimit calls answered with a gRPC error, by code",
            grpc_errors.clone(),
        );
        registry.register(
            "ratelimit_calls_undone",
            "Admitted ShouldRateLimit calls whose answer never reached the caller (cancelled by the peer, or past their deadline, before it went out): what they took was given back (places freed, reservations and hits refunded)",
            decisions.calls_undone.clone(),
        );
        let grpc_resets = Family::<ResetLabels, Counter>::default();
        registry.register(
            "ratelimit_grpc_resets",
            "HTTP/2 streams (rst_stream) and connections (goaway) the gRPC port ended with an error, by code, before the service answered their calls: Envoy lets each such call's request through. A header block over --grpc-max-header-bytes ends with protocol_error, a stream past 1024 on a connection with refused_stream",
            grpc_resets.clone(),
        );
        let backend = BackendMetrics::default();
        backend.register(&mut registry);
        let in_flight = Gauge::default();
        registry.register(
            "ratelimit_requests_in_flight",
            "ShouldRateLimit calls being handled now",
            in_flight.clone(),
        );
        let memory = MemoryMetrics::default();
        memory.register(&mut registry);
        let tls_reloads = Family::<LoadLabels, Counter>::default();
        registry.register(
            "ratelimit_tls_reloads",
            "Reloads of the gRPC listener's TLS files by result; a failed one keeps the previous",
            tls_reloads.clone(),
        );
        let rlqs = RlqsMetrics::default();
        rlqs.register(&mut registry);
        let admin = AdminMetrics::default();
        admin.register(&mut registry);
        Metrics {
            admin,
            rlqs,
            tls_reloads,
            memory,
            in_flight,
            backend,
            registry,
            decisions,
            process,
            workers_active,
            config_loads,
            config_rules,
            config_last_load,
            statsd_flushes,
            statsd_lines_lost,
            request_duration,
            grpc_errors,
            grpc_resets,
        }
    }

    /// Counts a config load.
    pub fn config_load(&self, result: LoadResult) {
        self.config_last_load
            .set(i64::from(matches!(result, LoadResult::success)));
        self.config_loads
            .get_or_create(&LoadLabels { result })
            .inc();
    }

    /// Counts stat lines the statsd collector may not have had.
    pub(crate) fn statsd_lines_lost(&self, lines: u64) {
        if lines > 0 {
            self.statsd_lines_lost.inc_by(lines);
        }
    }

    /// Counts a flush to the statsd collector.
    pub(crate) fn statsd_flush(&self, result: LoadResult) {
        self.statsd_flushes
            .get_or_create(&LoadLabels { result })
            .inc();
    }

    /// Counts a reload of the gRPC listener's TLS files.
    pub fn tls_reload(&self, result: LoadResult) {
        self.tls_reloads.get_or_create(&LoadLabels { result }).inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let (rss, vsz) = &self.process;
        if let Some(status) = ProcessStatus::read() {
            let gauge = |bytes: u64| i64::try_from(bytes).unwrap_or(i64::MAX);
            rss.set(gauge(status.resident_bytes));
            vsz.set(gauge(status.virtual_bytes));
        }
        let workers = crate::runtime::active_workers().or_else(|| {
            tokio::runtime::Handle::try_current()
                .ok()
                .map(|h| h.metrics().num_workers())
        });
        self.workers_active
            .set(workers.map_or(0, |n| i64::try_from(n).unwrap_or(i64::MAX)));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// The process's memory and threads, from `/proc/self/status` (Linux; `None` elsewhere): for
/// `/metrics` and the debug port's `/stats`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct ProcessStatus {
    /// `VmRSS`, in bytes.
    pub(crate) resident_bytes: u64,
    /// `VmHWM`: the most resident memory so far, in bytes.
    pub(crate) resident_peak_bytes: u64,
    /// `VmSize`, in bytes.
    pub(crate) virtual_bytes: u64,
    /// `Threads`.
    pub(crate) threads: u64,
}

impl ProcessStatus {
    /// This process's status now.
    pub(crate) fn read() -> Option<ProcessStatus> {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .map(|text| ProcessStatus::parse(&text))
    }

    /// The fields of a `/proc/<pid>/status` text (0 for a field it lacks).
    fn parse(text: &str) -> ProcessStatus {
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0)
        };
        ProcessStatus {
            resident_bytes: field("VmRSS") * 1024,
            resident_peak_bytes: field("VmHWM") * 1024,
            virtual_bytes: field("VmSize") * 1024,
            threads: field("Threads"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_status_reads_kib_fields_as_bytes() {
        let text =
            "Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\nVmSize:\t 4096 kB\nThreads:\t7\n";
        assert_eq!(
            ProcessStatus::parse(text),
            ProcessStatus {
                resident_bytes: 1 << 20,
                resident_peak_bytes: 2 << 20,
                virtual_bytes: 4 << 20,
                threads: 7,
            }
        );
        assert_eq!(ProcessStatus::parse(""), ProcessStatus::default());
        assert!(ProcessStatus::read().is_some_and(|s| s.resident_bytes > 0 && s.threads > 0));
    }

    /// What goes in comes out, however it is kept.
    #[test]
    fn rule_stats_give_back_the_counts_added() {
        let stats = RuleStats::default();
        stats.add([3, 3, 1, 0, 0]);
        stats.add([4, 0, 1, 2, 2]);
        stats.add([1, 1, 0, 0, 0]);
        assert_eq!(stats.get(), [8, 4, 2, 2, 2]);
    }

    fn count(metrics: &DecisionMetrics, decision: Decision) -> u64 {
        let domain = Arc::new("d".to_owned());
        let rule = Arc::new("k_v".to_owned());
        metrics
            .decisions
            .get_or_create(&DecisionLabels {
                domain,
                rule,
                decision,
            })
            .get()
    }

    #[test]
    fn a_rules_counters_count_in_the_families_that_filled_them_and_no_other() {
        let (domain, rule) = (Arc::new("d".to_owned()), Arc::new("k_v".to_owned()));
        let first = DecisionMetrics::new(Family::default(), Some(ReferenceMetrics::default()));
        let second = DecisionMetrics::new(Family::default(), None);
        let slot = RuleCounters::default();

        let handles = first
            .rule(&slot, &domain, &rule, true, Vec::new)
            .expect("an empty slot fills");
        handles.record(Decision::over_limit, Some([3, 0, 1, 2, 0]));
        first
            .rule(&slot, &domain, &rule, true, Vec::new)
            .expect("its own slot")
            .record(Decision::over_limit, Some([1, 0, 0, 1, 0]));
        assert_eq!(count(&first, Decision::over_limit), 2);
        assert_eq!(count(&first, Decision::within_limit), 0);
        let labels = ReferenceLabels::of(&domain, &rule);
        let reference = first.reference.as_ref().expect("on");
        assert_eq!(reference.total_hits.get_or_create(&labels).get(), 4);
        assert_eq!(reference.over_limit.get_or_create(&labels).get(), 3);
        assert_eq!(reference.within_limit.get_or_create(&labels).get(), 0);

        // Another server's metrics never count through the slot: they take the lookup path.
        assert!(second.rule(&slot, &domain, &rule, true, Vec::new).is_none());
        second.record(&domain, &rule, rule.clone(), Decision::within_limit, None);
        assert_eq!(count(&second, Decision::within_limit), 1);
        assert_eq!(count(&first, Decision::within_limit), 0);
        // A clone is the same server.
        assert!(
            first
                .clone()
                .rule(&slot, &domain, &rule, true, Vec::new)
                .is_some()
        );
    }
}
