//! The rate-limit decision, independent of the wire protocol: validate a request, resolve each
//! descriptor against the config snapshot, ask the backend once for all of them, and turn the
//! verdicts into per-descriptor statuses.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::config::{Domain, LimitRule, Policy, Snapshot, Unit};
use crate::limiter::{
    Algorithm, Backend, BackendError, CounterKey, Enforcement, Hit, Limit, Outcome, Verdict,
    quota_rejects,
};
use crate::metrics::{Decision, DecisionLabels, Metrics};

/// Bounds on request size; anything larger is refused as `INVALID_ARGUMENT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestLimits {
    /// Descriptors per request.
    pub max_descriptors: usize,
    /// Entries per descriptor.
    pub max_entries: usize,
    /// Bytes per entry key.
    pub max_key_bytes: usize,
    /// Bytes per entry value.
    pub max_value_bytes: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_descriptors: 64,
            max_entries: 32,
            max_key_bytes: 4096,
            max_value_bytes: 4096,
        }
    }
}

/// A limit supplied by the request itself (Envoy's `limit` override on a descriptor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitOverride {
    /// Hits per unit.
    pub requests_per_unit: u64,
    /// The unit.
    pub unit: Unit,
}

/// One descriptor of a request.
#[derive(Clone, Debug, Default)]
pub struct Descriptor<'a> {
    /// (key, value) pairs, outermost first.
    pub entries: Vec<(&'a str, &'a str)>,
    /// Replaces the configured limit when present.
    pub limit_override: Option<LimitOverride>,
    /// Hits for this descriptor; `Some(0)` checks without consuming.
    pub hits_addend: Option<u64>,
}

/// A request: a domain and its descriptors.
#[derive(Clone, Debug, Default)]
pub struct Request<'a> {
    /// The config domain.
    pub domain: &'a str,
    /// Descriptors, each decided and reported in order.
    pub descriptors: Vec<Descriptor<'a>>,
    /// Hits for descriptors without their own; 0 means 1.
    pub hits_addend: u64,
}

/// Whether a descriptor (or the request) is within its limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// Within limits (or not limited at all).
    Ok,
    /// Over a limit.
    OverLimit,
}

/// The limit reported for a descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReportedLimit {
    /// `rate_limit.name`, if configured.
    pub name: Option<Arc<str>>,
    /// Hits per unit.
    pub requests_per_unit: u64,
    /// The configured unit (not multiplied).
    pub unit: Unit,
    /// The window: unit × `unit_multiplier`.
    pub window: Duration,
}

/// The answer for one descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// OK or OVER_LIMIT.
    pub code: Code,
    /// The most restrictive limit that applied; `None` when none did.
    pub limit: Option<ReportedLimit>,
    /// Hits left under that limit.
    pub remaining: u64,
    /// Time until the limit resets (or the request would fit).
    pub reset: Option<Duration>,
}

impl Status {
    /// The status of a descriptor no limit applies to (for tests of what reads statuses).
    #[doc(hidden)]
    pub fn unlimited_for_tests() -> Status {
        Status::unlimited()
    }

    fn unlimited() -> Status {
        Status {
            code: Code::Ok,
            limit: None,
            remaining: 0,
            reset: None,
        }
    }
}

/// The answer for a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// OVER_LIMIT if any enforced limit is exceeded.
    pub overall: Code,
    /// One status per descriptor, in request order.
    pub statuses: Vec<Status>,
    /// With `--response-dynamic-metadata`: the `metadata` of the config nodes of the
    /// descriptors that passed, merged (as envoyproxy/ratelimit merges them: nested mappings
    /// merge, otherwise the first descriptor's value stays), possibly empty. `None` when off.
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

/// Merges `src` into `dest`: mappings present in both merge recursively; any other key
/// already in `dest` keeps its value.
fn merge_metadata(
    dest: &mut serde_json::Map<String, serde_json::Value>,
    src: &serde_json::Map<String, serde_json::Value>,
) {
    for (k, v) in src {
        match (dest.get_mut(k), v) {
            (Some(serde_json::Value::Object(d)), serde_json::Value::Object(s)) => {
                merge_metadata(d, s)
            }
            (Some(_), _) => {}
            (None, _) => {
                dest.insert(k.clone(), v.clone());
            }
        }
    }
}

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The request is malformed; retrying it will not help.
    #[error("{0}")]
    InvalidArgument(String),
    /// The backend could not decide.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Decision-making settings.
#[derive(Clone, Copy, Debug)]
pub struct Policies {
    /// Size bounds on requests.
    pub request_limits: RequestLimits,
    /// Fraction of a limit past which a decision counts as `near_limit`.
    pub near_limit_ratio: f64,
    /// Answer OK overall whatever the limits say (statuses still report them).
    pub global_shadow_mode: bool,
    /// Return the passed descriptors' config `metadata` with each response.
    pub dynamic_metadata: bool,
}

impl Default for Policies {
    fn default() -> Self {
        Policies {
            request_limits: RequestLimits::default(),
            near_limit_ratio: 0.8,
            global_shadow_mode: false,
            dynamic_metadata: false,
        }
    }
}

/// The decision engine shared by every protocol front end.
pub struct RateLimiter {
    config: Arc<ArcSwap<Snapshot>>,
    backend: Arc<dyn Backend>,
    metrics: Arc<Metrics>,
    policies: Policies,
    value_rules: ValueRules,
    override_rule: Arc<String>,
}

/// A limit that applies to a descriptor, before the backend has seen it.
struct Applied<'s> {
    descriptor: usize,
    limit: Limit,
    reported: ReportedLimit,
    enforcement: Enforcement,
    rule: Arc<String>,
    /// The config node's `metadata`, if any.
    metadata: Option<&'s serde_json::Value>,
    /// The rule label carries request values (`detailed_metric`, `value_to_metric`).
    rule_has_values: bool,
    name: Option<&'s Arc<str>>,
    replaces: &'s [Arc<str>],
    key: Option<CounterKey>,
}

impl Applied<'_> {
    /// The hit of `hits` on this limit's counter (its key moves into the hit).
    fn take_hit(&mut self, hits: u64) -> Hit {
        Hit {
            key: self.key.take().expect("each key is used once"),
            limit: self.limit,
            hits,
            enforcement: self.enforcement,
        }
    }
}

const OVERRIDE_INDEX: u16 = u16::MAX;

/// The metric rule of a request's `limit` override on a descriptor the config does not know:
/// a constant, since the entries are the client's.
pub const OVERRIDE_RULE: &str = "_override";
/// The metric rule standing for every further label once [`MAX_VALUE_RULES`] are in use.
pub const OVERFLOW_RULE: &str = "_other";
/// Distinct rule labels carrying request values (`detailed_metric`, `value_to_metric`) the
/// metrics keep; later ones are counted under [`OVERFLOW_RULE`], so clients cannot grow
/// `/metrics` without bound even where the config asks for their values.
pub const MAX_VALUE_RULES: usize = 1000;

/// The set of value-carrying rule labels in use, capped at [`MAX_VALUE_RULES`].
#[derive(Default)]
struct ValueRules {
    seen: parking_lot::Mutex<std::collections::HashSet<Arc<String>>>,
    overflow: std::sync::OnceLock<Arc<String>>,
}

impl ValueRules {
    /// `rule` if it is (or may become) one of the kept labels, else the overflow label.
    fn label(&self, rule: &Arc<String>) -> Arc<String> {
        let mut seen = self.seen.lock();
        if seen.contains(rule) || (seen.len() < MAX_VALUE_RULES && seen.insert(rule.clone())) {
            return rule.clone();
        }
        self.overflow
            .get_or_init(|| Arc::new(OVERFLOW_RULE.to_owned()))
            .clone()
    }
}

impl RateLimiter {
    /// An engine reading rules from `config` and counting in `backend`.
    pub fn new(
        config: Arc<ArcSwap<Snapshot>>,
        backend: Arc<dyn Backend>,
        metrics: Arc<Metrics>,
        policies: Policies,
    ) -> RateLimiter {
        RateLimiter {
            config,
            backend,
            metrics,
            policies,
            value_rules: ValueRules::default(),
            override_rule: Arc::new(OVERRIDE_RULE.to_owned()),
        }
    }

    /// The snapshot in force.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.config.load_full()
    }

    fn validate(&self, req: &Request<'_>) -> Result<(), ServiceError> {
        let bounds = &self.policies.request_limits;
        let invalid = |m: String| Err(ServiceError::InvalidArgument(m));
        if req.domain.is_empty() {
            return invalid("domain must not be empty".into());
        }
        if req.descriptors.is_empty() {
            return invalid("descriptors must not be empty".into());
        }
        if req.descriptors.len() > bounds.max_descriptors {
            return invalid(format!(
                "{} descriptors exceed the maximum of {}",
                req.descriptors.len(),
                bounds.max_descriptors
            ));
        }
        for (i, d) in req.descriptors.iter().enumerate() {
            if d.entries.is_empty() {
                return invalid(format!("descriptors[{i}] has no entries"));
            }
            if d.entries.len() > bounds.max_entries {
                return invalid(format!(
                    "descriptors[{i}] has {} entries, more than the maximum of {}",
                    d.entries.len(),
                    bounds.max_entries
                ));
            }
            for (j, (k, v)) in d.entries.iter().enumerate() {
                if k.is_empty() {
                    return invalid(format!(
                        "descriptors[{i}].entries[{j}].key must not be empty"
                    ));
                }
                if k.len() > bounds.max_key_bytes {
                    return invalid(format!(
                        "descriptors[{i}].entries[{j}].key is {} bytes, more than the maximum of {}",
                        k.len(),
                        bounds.max_key_bytes
                    ));
                }
                if v.len() > bounds.max_value_bytes {
                    return invalid(format!(
                        "descriptors[{i}].entries[{j}].value is {} bytes, more than the maximum of {}",
                        v.len(),
                        bounds.max_value_bytes
                    ));
                }
            }
        }
        Ok(())
    }

    /// Decides a request: all-or-nothing across its descriptors.
    pub async fn should_rate_limit(&self, req: &Request<'_>) -> Result<Response, ServiceError> {
        self.validate(req)?;
        let snapshot = self.config.load_full();
        let unlimited = || Response {
            overall: Code::Ok,
            statuses: vec![Status::unlimited(); req.descriptors.len()],
            metadata: self.policies.dynamic_metadata.then(serde_json::Map::new),
        };
        let Some(domain) = snapshot.domain(req.domain) else {
            return Ok(unlimited());
        };
        let mut applied = applicable(domain, req, &self.override_rule);
        if applied.is_empty() {
            return Ok(unlimited());
        }
        let default_hits = req.hits_addend.max(1);
        let (hits, origin) = merge(applied.iter_mut().map(|a| {
            let hits = req.descriptors[a.descriptor]
                .hits_addend
                .unwrap_or(default_hits);
            a.take_hit(hits)
        }));
        let outcome = self.backend.decide(&hits).await?;
        let statuses = self.statuses(&domain.name, req, &applied, &origin, &hits, &outcome);
        let overall = if outcome.admitted || self.policies.global_shadow_mode {
            Code::Ok
        } else {
            Code::OverLimit
        };
        let metadata = self
            .policies
            .dynamic_metadata
            .then(|| passed_metadata(&applied, &statuses));
        Ok(Response {
            overall,
            statuses,
            metadata,
        })
    }

    /// One status per descriptor: the most restrictive of its limits (an enforced over first,
    /// then the fewest hits left). Records each limit's decision in the metrics.
    fn statuses(
        &self,
        domain: &Arc<String>,
        req: &Request<'_>,
        applied: &[Applied<'_>],
        origin: &[usize],
        hits: &[Hit],
        outcome: &Outcome,
    ) -> Vec<Status> {
        let quota_rejects = quota_rejects(hits, |i| outcome.verdicts[i].over);
        let mut best: Vec<Option<(bool, u64, usize)>> = vec![None; req.descriptors.len()];
        for (k, a) in applied.iter().enumerate() {
            let (hit, v) = (&hits[origin[k]], &outcome.verdicts[origin[k]]);
            let rejects = v.over
                && match a.enforcement {
                    Enforcement::Enforce => true,
                    Enforcement::Quota => quota_rejects,
                    Enforcement::Shadow => false,
                };
            let remaining = if v.over {
                0
            } else if outcome.admitted {
                v.remaining
            } else {
                // Nothing was consumed: what the verdict counted for this request is still there.
                v.remaining.saturating_add(hit.hits)
            };
            self.record(domain, a, v, remaining);
            let slot = &mut best[a.descriptor];
            let better = match slot {
                None => true,
                Some((r, rem, _)) => (rejects && !*r) || (rejects == *r && remaining < *rem),
            };
            if better {
                *slot = Some((rejects, remaining, k));
            }
        }
        best.into_iter()
            .map(|b| match b {
                None => Status::unlimited(),
                Some((rejects, remaining, k)) => Status {
                    code: if rejects { Code::OverLimit } else { Code::Ok },
                    limit: Some(applied[k].reported.clone()),
                    remaining,
                    reset: Some(outcome.verdicts[origin[k]].reset),
                },
            })
            .collect()
    }

    fn record(&self, domain: &Arc<String>, a: &Applied<'_>, v: &Verdict, remaining: u64) {
        let rpu = a.limit.requests_per_unit;
        let decision = if v.over {
            if a.enforcement == Enforcement::Shadow {
                Decision::shadow_mode
            } else {
                Decision::over_limit
            }
        } else {
            let threshold = (rpu as f64 * self.policies.near_limit_ratio).floor() as u64;
            if rpu.saturating_sub(remaining) > threshold {
                Decision::near_limit
            } else {
                Decision::within_limit
            }
        };
        let rule = if a.rule_has_values {
            self.value_rules.label(&a.rule)
        } else {
            a.rule.clone()
        };
        self.metrics
            .decisions
            .get_or_create(&DecisionLabels {
                domain: domain.clone(),
                rule,
                decision,
            })
            .inc();
    }
}

/// One limit's counter as it stands, for the admin API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CounterView {
    /// The limit.
    pub limit: ReportedLimit,
    /// How it counts.
    pub algorithm: Algorithm,
    /// Hits counted now (token bucket: tokens taken out of its capacity).
    pub used: u64,
    /// Hits still available now.
    pub remaining: u64,
    /// Until the counter is fully available again.
    pub reset: Duration,
}

impl RateLimiter {
    /// The hits (of 0) naming the counters of one descriptor, with their limits.
    fn counters_of(
        &self,
        domain: &str,
        entries: &[(&str, &str)],
    ) -> Result<Vec<(ReportedLimit, Hit)>, ServiceError> {
        let req = Request {
            domain,
            descriptors: vec![Descriptor {
                entries: entries.to_vec(),
                limit_override: None,
                hits_addend: Some(0),
            }],
            hits_addend: 0,
        };
        self.validate(&req)?;
        let snapshot = self.config.load_full();
        let Some(domain) = snapshot.domain(domain) else {
            return Ok(Vec::new());
        };
        Ok(applicable(domain, &req, &self.override_rule)
            .into_iter()
            .map(|mut a| {
                let hit = a.take_hit(0);
                (a.reported, hit)
            })
            .collect())
    }

    /// Every limit that applies to a descriptor, with its counter as it stands. Consumes
    /// nothing.
    pub async fn inspect(
        &self,
        domain: &str,
        entries: &[(&str, &str)],
    ) -> Result<Vec<CounterView>, ServiceError> {
        let counters = self.counters_of(domain, entries)?;
        if counters.is_empty() {
            return Ok(Vec::new());
        }
        let hits: Vec<Hit> = counters.iter().map(|(_, h)| h.clone()).collect();
        let outcome = self.backend.decide(&hits).await?;
        Ok(counters
            .into_iter()
            .zip(outcome.verdicts)
            .map(|((limit, hit), v)| {
                let capacity = match hit.limit.algorithm {
                    Algorithm::TokenBucket => hit.limit.burst,
                    _ => hit.limit.requests_per_unit,
                };
                CounterView {
                    limit,
                    algorithm: hit.limit.algorithm,
                    used: capacity.saturating_sub(v.remaining),
                    remaining: v.remaining,
                    reset: v.reset,
                }
            })
            .collect())
    }

    /// Resets every counter of a descriptor; returns how many were held.
    pub async fn reset(
        &self,
        domain: &str,
        entries: &[(&str, &str)],
    ) -> Result<usize, ServiceError> {
        let hits: Vec<Hit> = self
            .counters_of(domain, entries)?
            .into_iter()
            .map(|(_, h)| h)
            .collect();
        if hits.is_empty() {
            return Ok(0);
        }
        Ok(self.backend.reset(&hits).await?)
    }
}

/// The merged `metadata` of the limited descriptors that passed, in request order.
fn passed_metadata(
    applied: &[Applied<'_>],
    statuses: &[Status],
) -> serde_json::Map<String, serde_json::Value> {
    let mut merged = serde_json::Map::new();
    let mut seen = Vec::new();
    for a in applied {
        if statuses[a.descriptor].code != Code::Ok || seen.contains(&a.descriptor) {
            continue;
        }
        seen.push(a.descriptor);
        if let Some(serde_json::Value::Object(m)) = a.metadata {
            merge_metadata(&mut merged, m);
        }
    }
    merged
}

/// Merges hits on the same counter (a request may carry the same descriptor twice, or two
/// descriptors may share a counter), so each counter is checked once with the sum of its hits:
/// checked separately, both would fit and both would be committed, over-admitting. Returns the
/// merged hits and, for each input hit, the index of its merged hit.
fn merge(hits: impl Iterator<Item = Hit>) -> (Vec<Hit>, Vec<usize>) {
    let mut merged: Vec<Hit> = Vec::new();
    let mut origin = Vec::new();
    for hit in hits {
        match merged.iter().position(|m| m.key == hit.key) {
            Some(m) => {
                let into = &mut merged[m];
                into.hits = into.hits.saturating_add(hit.hits);
                // The same key can carry different limits only through request overrides:
                // keep the stricter.
                into.limit.requests_per_unit = into
                    .limit
                    .requests_per_unit
                    .min(hit.limit.requests_per_unit);
                into.limit.burst = into.limit.burst.min(hit.limit.burst);
                into.enforcement = stricter(into.enforcement, hit.enforcement);
                origin.push(m);
            }
            None => {
                origin.push(merged.len());
                merged.push(hit);
            }
        }
    }
    (merged, origin)
}

fn stricter(a: Enforcement, b: Enforcement) -> Enforcement {
    let rank = |e| match e {
        Enforcement::Enforce => 2,
        Enforcement::Quota => 1,
        Enforcement::Shadow => 0,
    };
    if rank(a) >= rank(b) { a } else { b }
}

/// Every limit that applies to the request's descriptors, after `replaces`: a descriptor's
/// own `limit` override, else the limits of the node its entries resolve to.
fn applicable<'s>(
    domain: &'s Domain,
    req: &Request<'_>,
    override_rule: &Arc<String>,
) -> Vec<Applied<'s>> {
    let mut applied = Vec::new();
    for (i, d) in req.descriptors.iter().enumerate() {
        if let Some(o) = d.limit_override {
            let limit = Limit {
                algorithm: Algorithm::FixedWindow,
                requests_per_unit: o.requests_per_unit,
                window_us: o.unit.seconds() * 1_000_000,
                burst: o.requests_per_unit,
            };
            // The metric label comes from the config, never from the request's entries: the
            // node the descriptor matches, else a constant.
            let (rule, rule_has_values) = match domain.resolve(&d.entries) {
                Some(m) => (m.rule, m.rule_has_values),
                None => (override_rule.clone(), false),
            };
            applied.push(Applied {
                descriptor: i,
                key: Some(
                    CounterKey::new(req.domain, d.entries.iter().copied())
                        .with_limit(&limit, OVERRIDE_INDEX),
                ),
                limit,
                reported: ReportedLimit {
                    name: None,
                    requests_per_unit: o.requests_per_unit,
                    unit: o.unit,
                    window: Duration::from_secs(o.unit.seconds()),
                },
                enforcement: Enforcement::Enforce,
                rule,
                metadata: None,
                rule_has_values,
                name: None,
                replaces: &[],
            });
            continue;
        }
        let Some(matched) = domain.resolve(&d.entries) else {
            continue;
        };
        let Some(Policy::Limits(rules)) = &matched.node.policy else {
            continue; // unlimited
        };
        let enforcement = if matched.node.shadow_mode {
            Enforcement::Shadow
        } else if matched.node.quota_mode {
            Enforcement::Quota
        } else {
            Enforcement::Enforce
        };
        for rule in rules {
            let limit = rule.limit();
            applied.push(Applied {
                descriptor: i,
                key: Some(matched.key.clone().with_limit(&limit, rule.ordinal)),
                limit,
                reported: reported(rule),
                enforcement,
                rule: matched.rule.clone(),
                metadata: matched.node.metadata.as_ref(),
                rule_has_values: matched.rule_has_values,
                name: rule.name.as_ref(),
                replaces: &rule.replaces,
            });
        }
    }
    // `replaces`: a limit named by another applicable limit's `replaces` does not apply.
    let replaced: Vec<&Arc<str>> = applied.iter().flat_map(|a| a.replaces).collect();
    if !replaced.is_empty() {
        applied.retain(|a| !a.name.is_some_and(|n| replaced.contains(&n)));
    }
    applied
}

fn reported(rule: &LimitRule) -> ReportedLimit {
    ReportedLimit {
        name: rule.name.clone(),
        requests_per_unit: rule.requests_per_unit,
        unit: rule.unit,
        window: Duration::from_secs(rule.window_seconds()),
    }
}
