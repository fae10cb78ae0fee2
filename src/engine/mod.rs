//! The decision engine, independent of the wire protocol. One request's path:
//!
//! 1. [`request::validate`]: bounds and required fields, else `INVALID_ARGUMENT`.
//! 2. [`Resolver::resolve`](resolve::Resolver::resolve) (pure): the snapshot in force and the request give every applicable
//!    limit and one [`Hit`](crate::limiter::Hit) per distinct counter, its key built once in its
//!    final form by the [`KeyFormat`].
//! 3. The backend decides all hits at once, all-or-nothing.
//! 4. [`report::statuses`]: verdicts back into per-descriptor statuses; one metric per limit.

mod applied;
mod places;
mod report;
mod request;
mod resolve;
pub(crate) mod top;

use std::collections::HashSet;
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;

use self::applied::Applied;
pub(crate) use self::applied::ReportedLimit;
use self::report::Tally;
pub(crate) use self::report::{Code, CounterView, Response, Status};
pub(crate) use self::request::{Descriptor, EngineError, LimitOverride, Request, RequestLimits};
pub(crate) use self::resolve::OVERRIDE_RULE;
use self::resolve::{Resolved, Resolver};
use crate::config::Snapshot;
use crate::config::overrides::OverrideSet;
use crate::limiter::key::KeyFormat;
use crate::limiter::{Accounting, Algorithm, Backend, Hit, HitKind, Outcome};
use crate::metrics::{Accounted, Decision, DecisionMetrics};
use crate::top::{LimitRef, Top, TopOptions};
use crate::value::KeyValue;

/// How the engine decides, beyond the config.
#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    /// Size bounds on requests.
    pub request_limits: RequestLimits,
    /// Fraction of a limit past which a decision counts as `near_limit`.
    pub near_limit_ratio: f64,
    /// Answer OK overall whatever the limits say (statuses still report them).
    pub global_shadow_mode: bool,
    /// Every limit soft, as envoyproxy/ratelimit's `QUOTA_MODE` (see `resolve`).
    pub global_quota_mode: bool,
    /// Return the passed descriptors' config `metadata` with each response.
    pub dynamic_metadata: bool,
    /// How limits that set no `accounting` of their own count a descriptor's hits.
    pub accounting: Accounting,
    /// The heavy-hitter sketches behind `/top`.
    pub top: TopOptions,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            request_limits: RequestLimits::default(),
            near_limit_ratio: 0.8,
            global_shadow_mode: false,
            global_quota_mode: false,
            dynamic_metadata: false,
            accounting: Accounting::Auto,
            top: TopOptions::default(),
        }
    }
}

/// What an admitted request took from its counters, kept until its answer has gone out, to be
/// given back ([`Engine::undo`]) if it never does.
pub(crate) struct Taken {
    domain: Arc<String>,
    /// The request's hits, as decided.
    hits: Vec<Hit>,
    /// Their verdicts.
    verdicts: Vec<crate::limiter::Verdict>,
    /// Whether the request was admitted (else its admissions took nothing).
    admitted: bool,
    /// The hits that took a place: (hit, the rule's path, the place's lifetime).
    places: Vec<(usize, String, u64)>,
}

/// A decision a backend is making, owned so that it outlives its caller.
type Deciding = std::pin::Pin<
    Box<dyn Future<Output = (Vec<Hit>, Result<Outcome, crate::limiter::BackendError>)> + Send>,
>;

/// A decision under way for a caller ([`Engine::decide_whole`]): dropped before it is done, it
/// finishes in a task of its own, and what it admitted is given back.
struct Pending {
    decision: Option<Deciding>,
    backend: Arc<dyn Backend>,
    undone: prometheus_client::metrics::counter::Counter,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(decision) = self.decision.take() else {
            return;
        };
        let (backend, undone) = (self.backend.clone(), self.undone.clone());
        let finish = async move {
            let (hits, Ok(outcome)) = decision.await else {
                return;
            };
            let taken = Taken {
                domain: Arc::default(),
                hits,
                verdicts: outcome.verdicts,
                admitted: outcome.admitted,
                places: Vec::new(),
            };
            if let Some(refunds) = taken.refunds() {
                undone.inc();
                // Never recorded as taken (the caller went before it heard), so the places'
                // gauges are left alone.
                if let Err(e) = backend.decide(&refunds.hits).await {
                    tracing::debug!(error = %e, "an undone call's admission could not be given back");
                }
            }
        };
        // Outside a runtime (the process ending) there is nothing left to answer.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            if crate::trace::enabled() {
                use tracing::Instrument;
                runtime.spawn(finish.in_current_span());
            } else {
                runtime.spawn(finish);
            }
        }
    }
}

/// The refunds that undo a request's admissions, and which hit each undoes.
struct Refunds {
    hits: Vec<Hit>,
    of: Vec<usize>,
}

impl Taken {
    /// A refund of each admission the request committed (one that fit, with hits): a named
    /// hold gives back what it took (a place is freed); an unheld counter, or one of a node
    /// that keeps holds where the request named none, gets its hits back (a concurrency limit
    /// took no place without an id). Cost reports and refunds happened: they stay.
    fn refunds(&self) -> Option<Refunds> {
        if !self.admitted {
            return None;
        }
        let mut refunds = Refunds {
            hits: Vec::new(),
            of: Vec::new(),
        };
        for (i, (hit, verdict)) in self.hits.iter().zip(&self.verdicts).enumerate() {
            if hit.kind != HitKind::Admission || hit.hits == 0 || verdict.over {
                continue;
            }
            let hold = match &hit.hold {
                crate::limiter::Hold::Unnamed if hit.is_place() => continue,
                crate::limiter::Hold::Unnamed => crate::limiter::Hold::Unheld,
                hold => hold.clone(),
            };
            refunds.hits.push(Hit {
                kind: HitKind::Refund,
                hold,
                ..hit.clone()
            });
            refunds.of.push(i);
        }
        (!refunds.hits.is_empty()).then_some(refunds)
    }
}

/// The metric rule standing for every further label once [`MAX_VALUE_RULES`] are in use.
pub(crate) const OVERFLOW_RULE: &str = "_other";
/// Distinct rule labels carrying request values (`detailed_metric`, `value_to_metric`) the
/// metrics keep; later ones are counted under [`OVERFLOW_RULE`], so clients cannot grow
/// `/metrics` without bound even where the config asks for their values.
pub(crate) const MAX_VALUE_RULES: usize = 1000;

/// The set of value-carrying rule labels in use, capped at [`MAX_VALUE_RULES`].
#[derive(Default)]
struct ValueRules {
    seen: parking_lot::Mutex<HashSet<Arc<String>>>,
    overflow: OnceLock<Arc<String>>,
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

/// The decision engine shared by every front end (gRPC, `/json`, the admin API).
pub struct Engine {
    config: Arc<ArcSwap<Snapshot>>,
    backend: Arc<dyn Backend>,
    keys: KeyFormat,
    decisions: DecisionMetrics,
    options: EngineOptions,
    value_rules: ValueRules,
    override_rule: Arc<String>,
    top: Arc<Top>,
    /// Concurrency rules' places in use.
    places: Arc<places::Places>,
    /// The operator's overrides in force (`crate::overrides` swaps them).
    overrides: Arc<ArcSwap<OverrideSet>>,
}

impl Engine {
    /// An engine reading rules from `config`, keying counters as `keys` says, counting in
    /// `backend` and recording each limit's decision in `decisions`.
    pub fn new(
        config: Arc<ArcSwap<Snapshot>>,
        backend: Arc<dyn Backend>,
        keys: KeyFormat,
        decisions: DecisionMetrics,
        options: EngineOptions,
    ) -> Engine {
        Engine {
            config,
            backend,
            keys,
            decisions,
            options,
            value_rules: ValueRules::default(),
            override_rule: Arc::new(OVERRIDE_RULE.to_owned()),
            top: Arc::new(Top::new(options.top)),
            places: Arc::default(),
            overrides: Arc::default(),
        }
    }

    /// This engine, applying the overrides `overrides` holds.
    pub(crate) fn with_overrides(mut self, overrides: Arc<ArcSwap<OverrideSet>>) -> Engine {
        self.overrides = overrides;
        self
    }

    /// Starts the task that keeps the places-in-use gauges current (it sleeps until a
    /// concurrency limit's first place).
    pub(crate) fn spawn_places(&self, tasks: &mut crate::shutdown::Tasks) {
        tasks.push(tokio::spawn(self.places.clone().keep()));
    }

    /// The longest value counted and shown as it is (a longer one: as its digest).
    pub fn longest_value(&self) -> usize {
        self.keys.longest_value()
    }

    /// The snapshot in force.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.config.load_full()
    }

    /// Decides a request: all-or-nothing across its descriptors.
    pub async fn should_rate_limit(&self, req: &Request<'_>) -> Result<Response, EngineError> {
        Ok(self.decide(req, false).await?.0)
    }

    /// As [`Engine::should_rate_limit`], with what the request took (`None`: nothing), for
    /// [`Engine::undo`] should its answer never reach the caller. A caller dropped while
    /// the store decides undoes an admission itself.
    pub(crate) async fn should_rate_limit_undoably(
        &self,
        req: &Request<'_>,
    ) -> Result<(Response, Option<Taken>), EngineError> {
        self.decide(req, false).await
    }

    /// Gives back what a request took whose answer never reached its caller (a call the peer
    /// cancelled, or whose deadline passed, before its answer went out): its admissions are
    /// refunded (a hold's, what it took; a place is freed), as if the call never came. In a
    /// task of its own; counted in `ratelimit_calls_undone_total`.
    pub(crate) fn undo(self: &Arc<Self>, taken: Taken) {
        let engine = self.clone();
        tokio::spawn(async move {
            let Some(refunds) = taken.refunds() else {
                return;
            };
            engine.decisions.calls_undone.inc();
            let outcome = match engine.backend.decide_at_once(&refunds.hits) {
                Some(outcome) => outcome,
                None => match engine.backend.decide(&refunds.hits).await {
                    Ok(outcome) => outcome,
                    Err(e) => {
                        // The place's lifetime (a hold's window) is the backstop.
                        tracing::debug!(error = %e, "an undone call's admission could not be given back");
                        return;
                    }
                },
            };
            for change in &outcome.places {
                let original = refunds.of[change.hit];
                if let Some((_, rule, lifetime)) =
                    taken.places.iter().find(|(hit, ..)| *hit == original)
                {
                    engine
                        .places
                        .record(&engine.decisions, &taken.domain, rule, *lifetime, change);
                }
            }
        });
    }

    /// Decides `hits` on a backend that waits (Redis) so that a caller dropped meanwhile (a
    /// cancelled call) leaves the decision whole: what is left of it then goes on in a task of
    /// its own, and an admission it made is given back at once. Nothing a request took
    /// outlives a caller that never heard of it; a caller that stays costs no task.
    async fn decide_whole(&self, hits: Vec<Hit>) -> Result<(Vec<Hit>, Outcome), EngineError> {
        let backend = self.backend.clone();
        let mut pending = Pending {
            decision: Some(Box::pin(async move {
                let outcome = backend.decide(&hits).await;
                (hits, outcome)
            })),
            backend: self.backend.clone(),
            undone: self.decisions.calls_undone.clone(),
        };
        let (hits, outcome) = std::future::poll_fn(|cx| {
            let decision = pending.decision.as_mut().expect("polled until done");
            let done = std::task::ready!(decision.as_mut().poll(cx));
            pending.decision = None;
            std::task::Poll::Ready(done)
        })
        .await;
        Ok((hits, outcome?))
    }

    /// As [`Engine::should_rate_limit`], each refused status naming its rule
    /// ([`Status::refused_by`]): for answers that show it (`POST /json`). Envoy's answer has no
    /// place for it, so its path does not take the rule's name for each refusal (a reference
    /// count every worker would write).
    pub async fn should_rate_limit_naming_rules(
        &self,
        req: &Request<'_>,
    ) -> Result<Response, EngineError> {
        Ok(self.decide(req, true).await?.0)
    }

    async fn decide(
        &self,
        req: &Request<'_>,
        name_rules: bool,
    ) -> Result<(Response, Option<Taken>), EngineError> {
        request::validate(req, &self.options.request_limits)?;
        let snapshot = self.config.load();
        if !snapshot.is_loaded() {
            return Err(EngineError::NoConfig);
        }
        // A request this large is costly from its first step: the worker gate lets every
        // worker take tasks while it is handled.
        let costly = crate::runtime::Costly::of(req.descriptors.len());
        let overrides = self.overrides.load();
        let Resolved {
            domain,
            applied,
            hits,
        } = Resolver {
            snapshot: &snapshot,
            overrides: &overrides,
            keys: &self.keys,
            override_rule: &self.override_rule,
            accounting: self.options.accounting,
            quota_mode: self.options.global_quota_mode,
        }
        .resolve(req);
        request::validate_counters(&hits, &self.options.request_limits)?;
        let _costly = costly.or_else(|| crate::runtime::Costly::of(hits.len()));
        let Some(domain) = domain.filter(|_| !hits.is_empty()) else {
            let response = Response {
                overall: Code::Ok,
                statuses: vec![Status::unlimited(); req.descriptors.len()],
                metadata: self.options.dynamic_metadata.then(serde_json::Map::new),
                soft: Vec::new(),
            };
            return Ok((response, None));
        };
        let (hits, outcome) = match self.backend.decide_at_once(&hits) {
            Some(outcome) => (hits, outcome),
            None => self.decide_whole(hits).await?,
        };
        for change in &outcome.places {
            if let Some(a) = applied.iter().find(|a| a.hit == change.hit) {
                let lifetime = hits[change.hit].limit.window_us;
                self.places
                    .record(&self.decisions, domain, a.limit.path, lifetime, change);
            }
        }
        let statuses = report::statuses(
            req.descriptors.len(),
            &applied,
            &hits,
            &outcome,
            self.options.near_limit_ratio,
            name_rules || tracing::enabled!(tracing::Level::DEBUG),
            |a, kind, decision, tally| {
                // The hits this descriptor asked for (not those of others sharing its counter).
                let d = &req.descriptors[a.limit.descriptor];
                let own = d.hits_addend.unwrap_or(req.hits_addend.max(1));
                self.record(domain, a, kind, decision, tally, own);
                if kind != HitKind::Refund {
                    self.count_top(domain, req, a, &hits[a.hit], own, tally.over);
                }
            },
        );
        if tracing::enabled!(tracing::Level::DEBUG) {
            // A refusal's line: the rule, never the values.
            for (descriptor, s) in statuses.iter().enumerate() {
                if let Some(rule) = &s.refused_by {
                    tracing::debug!(domain = %domain, rule = %rule, descriptor, "over the limit");
                }
            }
        }
        let overall = if outcome.admitted || self.options.global_shadow_mode {
            Code::Ok
        } else {
            Code::OverLimit
        };
        let metadata = self
            .options
            .dynamic_metadata
            .then(|| report::passed_metadata(&applied, &statuses));
        let soft = report::soft_over(&applied, &hits, &outcome);
        // What the request took, should its answer never go out: its hits and verdicts
        // moved, not copied; the rules of its places only when it has some.
        let taken = outcome.admitted.then(|| Taken {
            domain: domain.clone(),
            places: outcome
                .places
                .iter()
                .filter_map(|c| {
                    let a = applied.iter().find(|a| a.hit == c.hit)?;
                    Some((c.hit, a.limit.path.to_owned(), hits[c.hit].limit.window_us))
                })
                .collect(),
            hits,
            verdicts: outcome.verdicts,
            admitted: outcome.admitted,
        });
        let response = Response {
            overall,
            statuses,
            metadata,
            soft,
        };
        Ok((response, taken))
    }

    fn record(
        &self,
        domain: &Arc<String>,
        a: &Applied<'_>,
        kind: HitKind,
        decision: Decision,
        tally: Tally,
        own: u64,
    ) {
        // A refund is no decision (envoyproxy/ratelimit would count its hits as hits); a report
        // past the limit is a decision, and its hits are counted as recorded anyway.
        let accounted = match kind {
            HitKind::Refund => Some(Accounted::refund),
            HitKind::Report if tally.over => Some(Accounted::report_over_limit),
            _ => None,
        };
        if let Some(accounted) = accounted.filter(|_| tally.hits > 0) {
            self.decisions.record_accounted(
                domain,
                a.limit.path,
                self.rule_label(a),
                accounted,
                tally.hits,
            );
        }
        if kind == HitKind::Refund {
            return;
        }
        let reference = self.decisions.wants_reference_counts().then(|| {
            report::reference_counts(
                tally,
                self.options.near_limit_ratio,
                a.limit.enforcement == crate::limiter::Enforcement::Shadow,
            )
        });
        let handles = a.limit.node.and_then(|node| {
            self.decisions.rule(
                &node.counters,
                domain,
                &node.path,
                !a.limit.rule_has_values,
                || limit_specs(node),
            )
        });
        let counted = a.limit.operator.is_none()
            && handles.is_some_and(|h| h.count(a.limit.index, own, tally.over));
        if !counted {
            // The request's own limit, an operator's override, or a rule whose handles another
            // server's metrics hold (tests run several).
            let (rule, limit) = match a.limit.node {
                Some(node) if a.limit.operator.is_some() => (
                    &node.path,
                    Arc::new(crate::metrics::OPERATOR_LIMIT.to_owned()),
                ),
                Some(node) => (&node.path, limit_label(node, a.limit.index)),
                None => (
                    &*a.limit.rule,
                    Arc::new(crate::metrics::REQUEST_LIMIT.to_owned()),
                ),
            };
            self.decisions
                .count_limit(domain, rule, limit, own, tally.over);
        }
        match handles.filter(|_| !a.limit.rule_has_values) {
            Some(counters) => counters.record(decision, reference),
            None => self.decisions.record(
                domain,
                a.limit.path,
                self.rule_label(a),
                decision,
                reference,
            ),
        }
    }

    /// Counts `a`'s descriptor in its limit's heavy-hitter sketch: the `hits` it asked for
    /// (its own, not those of other descriptors sharing its counter), refused if `over`.
    fn count_top(
        &self,
        domain: &str,
        req: &Request<'_>,
        a: &Applied<'_>,
        hit: &crate::limiter::Hit,
        hits: u64,
        over: bool,
    ) {
        if !self.top.is_on() {
            return;
        }
        let d = &req.descriptors[a.limit.descriptor];
        let reported = &a.limit.reported;
        let limit = LimitRef {
            domain,
            rule: a.limit.path,
            index: a.limit.index,
            name: reported.name.as_deref(),
            algorithm: hit.limit.algorithm.as_str(),
            unit: reported.unit.as_str(),
            window_seconds: reported.window.as_secs(),
            requests_per_unit: reported.requests_per_unit,
            values: a.limit.top_values,
        };
        // A hold's id is no part of who asked: each request has its own.
        let entries = match a.limit.named_hold {
            true => &d.entries[..d.entries.len() - 1],
            false => &d.entries[..],
        };
        self.top.record(&limit, entries, hits, over);
    }

    /// The heavy-hitter sketches.
    pub(crate) fn top(&self) -> &Arc<Top> {
        &self.top
    }

    /// The metric `rule` label of `a`: its config path, or where that carries request values,
    /// one of the [`MAX_VALUE_RULES`] kept (else [`OVERFLOW_RULE`]).
    fn rule_label(&self, a: &Applied<'_>) -> Arc<String> {
        if a.limit.rule_has_values {
            self.value_rules.label(&a.limit.rule)
        } else {
            (*a.limit.rule).clone()
        }
    }

    /// The hits (of 0) naming the counters of one descriptor, and the limit each reports.
    fn counters_of(
        &self,
        domain: &str,
        entries: &[KeyValue<'_>],
    ) -> Result<(Vec<ReportedLimit>, Vec<crate::limiter::Hit>), EngineError> {
        let req = Request {
            domain,
            descriptors: vec![Descriptor {
                entries: entries.to_vec(),
                limit_override: None,
                hits_addend: Some(0),
                refund: false,
            }],
            hits_addend: 0,
        };
        request::validate(&req, &self.options.request_limits)?;
        let snapshot = self.config.load();
        let overrides = self.overrides.load();
        let Resolved { applied, hits, .. } = Resolver {
            snapshot: &snapshot,
            overrides: &overrides,
            keys: &self.keys,
            override_rule: &self.override_rule,
            accounting: Accounting::Admission,
            quota_mode: false,
        }
        .resolve(&req);
        let mut limits: Vec<Option<ReportedLimit>> = vec![None; hits.len()];
        for a in applied {
            limits[a.hit].get_or_insert(a.limit.reported);
        }
        let limits = limits
            .into_iter()
            .map(|l| l.expect("every hit comes from an applied limit"))
            .collect();
        Ok((limits, hits))
    }

    /// Every limit of a descriptor whose node keeps holds, with its live holds. Consumes
    /// nothing.
    pub(crate) async fn holds(
        &self,
        domain: &str,
        entries: &[KeyValue<'_>],
    ) -> Result<Vec<(ReportedLimit, Algorithm, Vec<crate::limiter::HoldView>)>, EngineError> {
        let (limits, hits) = self.counters_of(domain, entries)?;
        let (limits, hits): (Vec<_>, Vec<_>) = limits
            .into_iter()
            .zip(hits)
            .filter(|(_, h)| h.hold.is_held())
            .unzip();
        let holds = self.backend.holds(&hits).await?;
        Ok(limits
            .into_iter()
            .zip(&hits)
            .zip(holds)
            .map(|((limit, hit), holds)| (limit, hit.limit.algorithm, holds))
            .collect())
    }

    /// Ends every hold of a descriptor's limits; returns how many there were.
    pub(crate) async fn clear_holds(
        &self,
        domain: &str,
        entries: &[KeyValue<'_>],
    ) -> Result<usize, EngineError> {
        let (_, mut hits) = self.counters_of(domain, entries)?;
        hits.retain(|h| h.hold.is_held());
        Ok(self.backend.clear_holds(&hits).await?)
    }

    /// Every limit that applies to a descriptor, with its counter as it stands. Consumes
    /// nothing.
    pub async fn inspect(
        &self,
        domain: &str,
        entries: &[KeyValue<'_>],
    ) -> Result<Vec<CounterView>, EngineError> {
        let (limits, hits) = self.counters_of(domain, entries)?;
        if hits.is_empty() {
            return Ok(Vec::new());
        }
        let outcome = self.backend.decide(&hits).await?;
        Ok(limits
            .into_iter()
            .zip(&hits)
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

    /// Resets every counter of a descriptor, those its requests' `limit` overrides made
    /// included (one per unit); returns how many were held.
    pub async fn reset(
        &self,
        domain: &str,
        entries: &[KeyValue<'_>],
    ) -> Result<usize, EngineError> {
        let (_, mut hits) = self.counters_of(domain, entries)?;
        hits.extend(crate::config::Unit::ALL.into_iter().map(|unit| {
            let o = LimitOverride {
                requests_per_unit: 0,
                unit,
            };
            resolve::override_hit(&self.keys, domain, entries, o, 0, HitKind::Admission)
        }));
        Ok(self.backend.reset(&hits).await?)
    }
}

/// The limits of `node`'s rule as the per-limit metrics label and gauge them.
fn limit_specs(node: &crate::config::Node) -> Vec<crate::metrics::LimitSpec> {
    let Some(crate::config::NodeLimits::Limits(rules)) = &node.limits else {
        return Vec::new();
    };
    rules
        .iter()
        .enumerate()
        .map(|(i, r)| crate::metrics::LimitSpec {
            label: rule_limit_label(i, r),
            requests_per_unit: r.requests_per_unit,
            window_seconds: r.window_seconds(),
            soft: r.soft,
        })
        .collect()
}

/// The `limit` label of the limit `r` at place `i` on its rule: its name, else its place.
fn rule_limit_label(i: usize, r: &crate::config::LimitRule) -> Arc<String> {
    Arc::new(
        r.name
            .as_deref()
            .map_or_else(|| i.to_string(), str::to_owned),
    )
}

/// The `limit` label of the limit at `index` on `node`'s rule (`u16::MAX`: the request's own).
fn limit_label(node: &crate::config::Node, index: u16) -> Arc<String> {
    let i = usize::from(index);
    match &node.limits {
        Some(crate::config::NodeLimits::Limits(rules)) if i < rules.len() => {
            rule_limit_label(i, &rules[i])
        }
        _ => Arc::new(crate::metrics::REQUEST_LIMIT.to_owned()),
    }
}
