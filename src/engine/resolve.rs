//! The pure step: (snapshot, request) → the hits the backend decides, with what the report
//! needs to turn verdicts back into per-descriptor statuses. No I/O, no metrics, no clock.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use super::applied::{Applicable, Applied, ReportedLimit};
use super::request::{Descriptor, LimitOverride, Request};
use crate::config::overrides::{DomainLookup, InForce, OverrideSet};
use crate::config::{Domain, LimitRule, Matched, Node, NodeLimits, Snapshot};
use crate::limiter::key::KeyFormat;
use crate::limiter::{Accounting, Algorithm, Enforcement, Hit, HitKind, Hold, HoldId, Limit};
use crate::value::KeyValue;

/// The metric rule of a request's `limit` override on a descriptor the config does not know:
/// a constant, since the entries are the client's.
pub(crate) const OVERRIDE_RULE: &str = "_override";

/// The ordinal of an override's counter, apart from every configured limit's.
const OVERRIDE_ORDINAL: u16 = u16::MAX;

/// The hit of a request's own `limit` override on a descriptor: a fixed window of the
/// override's unit, in a counter apart from every configured limit's. The one place such a
/// counter is named, for decisions and for the admin reset alike.
pub(crate) fn override_hit(
    keys: &KeyFormat,
    domain: &str,
    entries: &[KeyValue<'_>],
    o: LimitOverride,
    hits: u64,
    kind: HitKind,
) -> Hit {
    let limit = Limit {
        algorithm: Algorithm::FixedWindow,
        requests_per_unit: o.requests_per_unit,
        window_us: o.unit.seconds() * 1_000_000,
        burst: o.requests_per_unit,
        calendar: None,
    };
    Hit {
        key: keys
            .descriptor_key(domain, entries.iter().copied())
            .with_limit(&limit, OVERRIDE_ORDINAL),
        limit,
        hits,
        enforcement: Enforcement::Enforce,
        kind,
        hold: Hold::Unheld,
    }
}

/// What makes two hits one counter's for [`merge`]: the key, whether it is a refund, and a
/// refund's hold.
type MergeKey = (Vec<u8>, bool, Option<HoldId>);

/// Up to this many hits, [`merge`] finds duplicates by a scan.
const SCAN_HITS: usize = 16;

/// A request resolved against a snapshot.
#[derive(Default)]
pub(crate) struct Resolved<'s> {
    /// The domain's name as the config spells it; `None` for an unknown domain.
    pub domain: Option<&'s Arc<String>>,
    /// Every applicable limit, in request order.
    pub applied: Vec<Applied<'s>>,
    /// One hit per distinct counter, what the backend decides.
    pub hits: Vec<Hit>,
}

/// Whether `rule` counts places (a concurrency limit) rather than hits.
fn is_place(rule: &LimitRule) -> bool {
    rule.algorithm == Algorithm::Concurrency
}

/// Whether any of `rules` counts places.
fn has_places(rules: &[LimitRule]) -> bool {
    rules.iter().any(is_place)
}

/// (applied index, name, replaces) of a limit that has a name or replaces others.
type Named<'s> = (usize, Option<&'s Arc<str>>, &'s [Arc<str>]);

/// What a request is resolved against, beside the request itself: the config and the
/// operator's overrides in force, the key format, and the server's settings that decide a hit.
pub(crate) struct Resolver<'s> {
    pub snapshot: &'s Snapshot,
    pub overrides: &'s OverrideSet,
    pub keys: &'s KeyFormat,
    /// The metric rule of a request's `limit` on a descriptor the config does not know.
    pub override_rule: &'s Arc<String>,
    /// The server's `--accounting`, for limits that set none.
    pub accounting: Accounting,
    /// envoyproxy/ratelimit's global `QUOTA_MODE`: every limit is soft.
    pub quota_mode: bool,
}

impl<'s> Resolver<'s> {
    /// Resolves `req`: every limit that applies to each descriptor (the operator's override of
    /// its entries, else its own `limit`, else the limits of the node its entries land on;
    /// minus those another applicable limit `replaces`), and one hit per distinct counter and
    /// kind, keyed in `keys`' format. Each hit's kind: a refund for `is_negative_hits`, else as
    /// the limit's `accounting` says, else as the server's does. An unknown domain, or
    /// descriptors no limit applies to, resolve to nothing.
    ///
    /// With `quota_mode`, as envoyproxy/ratelimit counts soft descriptors, one that passes
    /// whatever its counters say (in shadow mode, or matching no limit) means not all of them
    /// can be over, so the request is never refused: its soft limits then report as shadow ones
    /// do. `unlimited` descriptors do not count.
    pub(crate) fn resolve(&self, req: &Request<'_>) -> Resolved<'s> {
        let domain = self.snapshot.domain(req.domain);
        let retired = self.snapshot.has_retired();
        let Some(name) = domain.map(|d| &d.name).or_else(|| {
            retired
                .then(|| self.snapshot.retired_domains(req.domain).next())
                .flatten()
                .map(|d| &d.name)
        }) else {
            return Resolved::default();
        };
        let mut found = Found::new(self, req);
        for (i, d) in req.descriptors.iter().enumerate() {
            let placed = found.hits.len();
            if let Some(domain) = domain {
                found.descriptor(domain, req.domain, i, d);
            }
            if retired && d.refund && !found.hits[placed..].iter().any(Hit::is_place) {
                found.release_retired(req.domain, i, d);
            }
        }
        found.soften();
        found.drop_replaced();
        let Found {
            mut applied,
            mut hits,
            ..
        } = found;
        merge(&mut applied, &mut hits);
        Resolved {
            domain: Some(name),
            applied,
            hits,
        }
    }
}

/// The limits found so far for a request, in request order: `applied[i]` comes with `hits[i]`
/// until [`merge`] pairs them (most descriptors have one limit).
struct Found<'s, 'r> {
    at: &'r Resolver<'s>,
    /// The operator's overrides of the request's domain: looked up only where there are some.
    operators: Option<DomainLookup<'s>>,
    /// The hits of a descriptor that sends none of its own.
    default_hits: u64,
    /// A limit's enforcement unless its node says otherwise.
    enforce: Enforcement,
    applied: Vec<Applied<'s>>,
    hits: Vec<Hit>,
    /// Limits that take part in `replaces`: rare, so the common request allocates nothing.
    named: Vec<Named<'s>>,
    /// Whether a soft descriptor passes whatever the counters say.
    soft_passes: bool,
}

impl<'s, 'r> Found<'s, 'r> {
    fn new(at: &'r Resolver<'s>, req: &Request<'_>) -> Found<'s, 'r> {
        Found {
            at,
            operators: match at.overrides.is_empty() {
                true => None,
                false => at.overrides.domain(req.domain),
            },
            default_hits: req.hits_addend.max(1),
            enforce: match at.quota_mode {
                true => Enforcement::Soft,
                false => Enforcement::Enforce,
            },
            applied: Vec::with_capacity(req.descriptors.len()),
            hits: Vec::with_capacity(req.descriptors.len()),
            named: Vec::new(),
            soft_passes: false,
        }
    }

    /// The limits of descriptor `i`: the operator's override of its entries where a rule
    /// matches them, else its own `limit` (beside the node's concurrency limits, which a
    /// request cannot lift), else its node's limits.
    fn descriptor(&mut self, domain: &'s Domain, name: &str, i: usize, d: &Descriptor<'_>) {
        // A descriptor with no entries (Envoy sends one for a rate limit whose actions found
        // nothing, e.g. an absent header under `skip_if_absent`) matches nothing, whatever
        // else it carries: as envoyproxy/ratelimit decides it, OK and no counter.
        if d.entries.is_empty() {
            self.soft_passes |= self.at.quota_mode;
            return;
        }
        let matched = domain.lookup(&d.entries, self.at.keys);
        let operator = self.operator(&matched, d);
        if operator.is_none()
            && let Some(o) = d.limit_override
        {
            self.request_limit(name, i, d, o, matched.as_ref());
            if let Some(m) = matched
                && let Some(NodeLimits::Limits(rules)) = &m.node.limits
            {
                self.node_limits(i, d, m, rules, None, Takes::Places);
            }
            return;
        }
        let Some(matched) = matched else {
            self.soft_passes |= self.at.quota_mode;
            return;
        };
        let rules: &'s [LimitRule] = match (operator, &matched.node.limits) {
            (Some(op), _) => &op.limits,
            (None, Some(NodeLimits::Limits(rules))) => rules,
            (None, _) => return, // unlimited
        };
        // An operator's override replaces the node's places only with places of its own: one
        // of rate limits alone leaves the node's concurrency limits in force, on the same
        // places (as a request's own `limit` does).
        if let (Some(_), Some(NodeLimits::Limits(own))) = (operator, &matched.node.limits)
            && has_places(own)
            && !has_places(rules)
        {
            let node = Matched {
                key: matched.key.clone(),
                rule: matched.rule.clone(),
                hold: matched.hold.clone(),
                ..matched
            };
            self.node_limits(i, d, node, own, None, Takes::Places);
        }
        self.node_limits(i, d, matched, rules, operator, Takes::All);
    }

    /// A release of a place the config in force has not: found in the earlier configs kept
    /// for it (`config/retired.rs`), newest first, and given back there.
    fn release_retired(&mut self, name: &str, i: usize, d: &Descriptor<'_>) {
        if d.entries.is_empty() {
            return;
        }
        for domain in self.at.snapshot.retired_domains(name) {
            if let Some(m) = domain.lookup(&d.entries, self.at.keys)
                && m.hold.id().is_some()
                && let Some(NodeLimits::Limits(rules)) = &m.node.limits
                && has_places(rules)
            {
                self.node_limits(i, d, m, rules, None, Takes::Places);
                return;
            }
        }
    }

    /// The operator's override of a matched descriptor's entries (less a hold's id).
    fn operator(&self, matched: &Option<Matched<'s>>, d: &Descriptor<'_>) -> Option<&'s InForce> {
        let (o, m) = (self.operators.as_ref()?, matched.as_ref()?);
        let held = usize::from(m.hold.id().is_some());
        o.get(&d.entries[..d.entries.len() - held])
    }

    /// The kind of descriptor `d`'s hit on a rate limit whose own accounting is `limit`.
    fn kind(&self, d: &Descriptor<'_>, limit: Option<Accounting>) -> HitKind {
        match d.refund {
            true => HitKind::Refund,
            false => limit.unwrap_or(self.at.accounting).kind(d.hits_addend),
        }
    }

    /// A request's own `limit` on descriptor `i`: a fixed window of its unit, in a counter of
    /// its own. The metric label comes from the config, never from the request's entries: the
    /// node the descriptor matches, else a constant.
    fn request_limit(
        &mut self,
        name: &str,
        i: usize,
        d: &Descriptor<'_>,
        o: LimitOverride,
        matched: Option<&Matched<'s>>,
    ) {
        let (rule, rule_has_values, node, path) = match matched {
            Some(m) => (
                m.rule.clone(),
                m.rule_has_values,
                Some(m.node),
                m.node.path.as_str(),
            ),
            None => (
                Cow::Borrowed(self.at.override_rule),
                false,
                None,
                OVERRIDE_RULE,
            ),
        };
        self.applied.push(Applied::unmerged(Applicable {
            descriptor: i,
            reported: ReportedLimit {
                name: None,
                requests_per_unit: o.requests_per_unit,
                unit: o.unit,
                window: Duration::from_secs(o.unit.seconds()),
                calendar: false,
                answer: None,
                soft: false,
            },
            enforcement: self.enforce,
            rule,
            rule_has_values,
            node,
            metadata: None,
            path,
            index: crate::top::OVERRIDE,
            top_values: crate::top::Values::Show,
            named_hold: false,
            operator: None,
        }));
        let hits = d.hits_addend.unwrap_or(self.default_hits);
        let kind = self.kind(d, None);
        self.hits.push(Hit {
            enforcement: self.enforce,
            ..override_hit(self.at.keys, name, &d.entries, o, hits, kind)
        });
    }

    /// The enforcement of a node's limits; notes a shadow node that lets a soft request pass.
    fn enforcement(&mut self, node: &Node) -> Enforcement {
        if node.shadow_mode {
            self.soft_passes |= self.at.quota_mode || node.soft;
            Enforcement::Shadow
        } else if node.soft {
            Enforcement::Soft
        } else {
            self.enforce
        }
    }

    /// The hits of `rules` (the node's, or an operator's override of them) on descriptor `i`,
    /// or only of its concurrency limits. A concurrency limit's hits are places: taken by an
    /// admission, released by a refund; a cost report (the descriptor's own `hits_addend`)
    /// takes none, so a settlement's report never takes the place its refund freed.
    fn node_limits(
        &mut self,
        i: usize,
        d: &Descriptor<'_>,
        matched: Matched<'s>,
        rules: &'s [LimitRule],
        operator: Option<&'s InForce>,
        takes: Takes,
    ) {
        let hits_addend = d.hits_addend.unwrap_or(self.default_hits);
        // Places are kept where the node keeps holds: an operator's override may give a
        // concurrency limit to a node that keeps none, where it takes nothing.
        let held = matched.hold.is_held();
        let counts = |rule: &LimitRule| match is_place(rule) {
            true => {
                held && (d.refund || Accounting::Auto.kind(d.hits_addend) == HitKind::Admission)
            }
            false => takes == Takes::All,
        };
        // A node's enforcement counts (a shadow node lets a soft request pass) where the
        // descriptor takes its limits, even none of them (a report on places alone); beside a
        // request's own limit only where a place is taken.
        let enforcement = (takes == Takes::All).then(|| self.enforcement(matched.node));
        let Some(last) = rules.iter().rposition(counts) else {
            return;
        };
        let enforcement = enforcement.unwrap_or_else(|| self.enforcement(matched.node));
        let mut base = Some(matched.key);
        for (r, rule) in rules.iter().enumerate().take(last + 1) {
            if !counts(rule) {
                continue;
            }
            // The descriptor's key goes to its last limit as it is; the others get copies.
            let key = if r == last {
                base.take()
                    .expect("the last limit takes the key")
                    .with_identity(&rule.identity)
            } else {
                base.as_ref()
                    .expect("kept for the last limit")
                    .for_identity(&rule.identity)
            };
            if rule.name.is_some() || !rule.replaces.is_empty() {
                self.named
                    .push((self.applied.len(), rule.name.as_ref(), &rule.replaces));
            }
            // A soft limit never refuses: to the backend it is a shadow one.
            let enforcement = match rule.soft {
                true => Enforcement::Shadow,
                false => enforcement,
            };
            self.applied.push(Applied::unmerged(Applicable {
                descriptor: i,
                reported: reported(rule),
                enforcement,
                rule: matched.rule.clone(),
                rule_has_values: matched.rule_has_values,
                node: Some(matched.node),
                metadata: matched.node.metadata(),
                path: matched.node.path.as_str(),
                index: r as u16,
                top_values: rule.top_values,
                named_hold: matched.hold.id().is_some(),
                operator: operator.map(|op| &op.id),
            }));
            let kind = match is_place(rule) && !d.refund {
                true => HitKind::Admission,
                false => self.kind(d, rule.accounting),
            };
            self.hits.push(Hit {
                key,
                limit: rule.limit(),
                hits: hits_addend,
                enforcement,
                kind,
                hold: matched.hold.clone(),
            });
        }
    }

    /// Where a soft descriptor passes, every soft limit of the request reports as shadow.
    fn soften(&mut self) {
        if !self.soft_passes {
            return;
        }
        for h in &mut self.hits {
            if h.enforcement == Enforcement::Soft {
                h.enforcement = Enforcement::Shadow;
            }
        }
        for a in &mut self.applied {
            if a.limit.enforcement == Enforcement::Soft {
                a.limit.enforcement = Enforcement::Shadow;
            }
        }
    }

    /// `replaces`: a limit named by another applicable limit's `replaces` does not apply.
    fn drop_replaced(&mut self) {
        if !self.named.iter().any(|(_, _, r)| !r.is_empty()) {
            return;
        }
        let replaced: Vec<&Arc<str>> = self.named.iter().flat_map(|(_, _, r)| r.iter()).collect();
        let mut keep = vec![true; self.applied.len()];
        for (a, name, _) in &self.named {
            if name.is_some_and(|n| replaced.contains(&n)) {
                keep[*a] = false;
            }
        }
        let mut k = keep.iter();
        self.applied
            .retain(|_| *k.next().expect("one flag per limit"));
        let mut k = keep.iter();
        self.hits.retain(|_| *k.next().expect("one flag per hit"));
    }
}

/// Which of a node's limits a descriptor takes: all of them, or (beside a request's own
/// `limit`) only its concurrency limits.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Takes {
    All,
    Places,
}

/// Merges hits on the same counter (a request may carry the same descriptor twice, or two
/// descriptors may share a counter), so each counter is checked once with the sum of its hits:
/// checked separately, both would fit and both would be committed, over-admitting. Refunds
/// merge only with refunds of the same hold (each gives back what its own hold took); an
/// admission merged with a cost report is a report (the usage happened; never over-admits);
/// admissions naming different holds of one counter take one hold, the first named, for
/// their sum (one request takes one place; a refund gives back what the request took). Points each
/// limit at its merged hit. `applied[i]` came with `hits[i]`; in place, `hits` keeping the
/// first of each counter's hits in order.
///
/// Linear in the number of hits: a short scan for the usual few, an index past [`SCAN_HITS`]
/// (a scan over thousands of long keys cost a request of 63 descriptors × 100 limits over a
/// hundred milliseconds of CPU).
fn merge(applied: &mut [Applied<'_>], hits: &mut Vec<Hit>) {
    // Made only past the scan: even an empty `HashMap` seeds its hasher from a thread local.
    let refund = |h: &Hit| h.kind == HitKind::Refund;
    // What else must be equal for two hits of one counter to merge: a refund's hold.
    let apart = |h: &Hit| match (&h.hold, refund(h)) {
        (Hold::Named(id), true) => Some(id.clone()),
        _ => None,
    };
    let mut index: Option<std::collections::HashMap<MergeKey, usize>> =
        (hits.len() > SCAN_HITS).then(|| std::collections::HashMap::with_capacity(hits.len()));
    // hits[..kept] are the merged hits so far; hits[kept..i] were merged into them.
    let mut kept = 0;
    for i in 0..hits.len() {
        let found = if let Some(index) = &mut index {
            let k = (
                hits[i].key.as_bytes().to_vec(),
                refund(&hits[i]),
                apart(&hits[i]),
            );
            match index.entry(k) {
                std::collections::hash_map::Entry::Occupied(e) => Some(*e.get()),
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(kept);
                    None
                }
            }
        } else {
            hits[..kept].iter().position(|m| {
                m.key == hits[i].key && refund(m) == refund(&hits[i]) && apart(m) == apart(&hits[i])
            })
        };
        match found {
            Some(m) => {
                let (merged, rest) = hits.split_at_mut(i);
                let (into, hit) = (&mut merged[m], &rest[0]);
                into.hits = into.hits.saturating_add(hit.hits);
                // The same key can carry different limits only through request overrides:
                // keep the stricter.
                into.limit.requests_per_unit = into
                    .limit
                    .requests_per_unit
                    .min(hit.limit.requests_per_unit);
                into.limit.burst = into.limit.burst.min(hit.limit.burst);
                into.enforcement = stricter(into.enforcement, hit.enforcement);
                if hit.kind == HitKind::Report {
                    into.kind = HitKind::Report;
                }
                if into.hold.id().is_none() && hit.hold.id().is_some() {
                    into.hold = hit.hold.clone();
                }
                applied[i].hit = m;
            }
            None => {
                hits.swap(kept, i);
                applied[i].hit = kept;
                kept += 1;
            }
        }
    }
    hits.truncate(kept);
}

fn stricter(a: Enforcement, b: Enforcement) -> Enforcement {
    let rank = |e| match e {
        Enforcement::Enforce => 2,
        Enforcement::Soft => 1,
        Enforcement::Shadow => 0,
    };
    if rank(a) >= rank(b) { a } else { b }
}

fn reported(rule: &LimitRule) -> ReportedLimit {
    ReportedLimit {
        name: rule.name.clone(),
        requests_per_unit: rule.requests_per_unit,
        unit: rule.unit,
        window: Duration::from_secs(rule.window_seconds()),
        calendar: rule.calendar.is_some(),
        answer: rule.answer.clone(),
        soft: rule.soft,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    static NO_OVERRIDES: std::sync::LazyLock<OverrideSet> =
        std::sync::LazyLock::new(OverrideSet::default);
    use crate::config::compile_file;

    fn resolver<'s>(
        snapshot: &'s Snapshot,
        keys: &'s KeyFormat,
        override_rule: &'s Arc<String>,
        accounting: Accounting,
        quota_mode: bool,
    ) -> Resolver<'s> {
        Resolver {
            snapshot,
            overrides: &NO_OVERRIDES,
            keys,
            override_rule,
            accounting,
            quota_mode,
        }
    }

    fn snapshot(yaml: &str) -> Snapshot {
        Snapshot::new(vec![compile_file(Path::new("t.yaml"), yaml).unwrap()])
    }

    fn request<'a>(descriptors: &[&[(&'a str, &'a str)]]) -> Request<'a> {
        Request {
            domain: "d",
            descriptors: descriptors
                .iter()
                .map(|e| Descriptor {
                    entries: e
                        .iter()
                        .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
                        .collect(),
                    ..Default::default()
                })
                .collect(),
            hits_addend: 0,
        }
    }

    #[test]
    fn resolving_is_pure_and_merges_shared_counters() {
        let s = snapshot(
            "domain: d
descriptors:
  - key: a
    rate_limits:
      - {unit: second, requests_per_unit: 3}
      - {unit: minute, requests_per_unit: 5, algorithm: sliding_window}
  - key: b
    rate_limit: {unlimited: true}
",
        );
        let keys = KeyFormat::new("p:", crate::limiter::key::HashTag::Domain).unwrap();
        let rule = Arc::new(OVERRIDE_RULE.to_owned());
        let req = request(&[&[("a", "1")], &[("b", "x")], &[("a", "1")], &[("c", "y")]]);
        let r = resolver(&s, &keys, &rule, Accounting::Auto, false).resolve(&req);
        // Two limits for each `a` descriptor, both descriptors sharing the two counters.
        assert_eq!(r.applied.len(), 4);
        assert_eq!(r.hits.len(), 2);
        assert_eq!(r.hits.iter().map(|h| h.hits).collect::<Vec<_>>(), [2, 2]);
        assert_eq!(
            r.applied
                .iter()
                .map(|a| (a.limit.descriptor, a.hit))
                .collect::<Vec<_>>(),
            [(0, 0), (0, 1), (2, 0), (2, 1)]
        );
        assert_eq!(r.hits[0].key.as_bytes(), b"p:{d}:a:1:f1000000:0");
        assert_eq!(r.hits[1].key.as_bytes(), b"p:{d}:a:1:s60000000:0");
        // The same inputs give the same hits: nothing but the arguments decides them.
        let again = resolver(&s, &keys, &rule, Accounting::Auto, false).resolve(&req);
        assert_eq!(again.hits.len(), 2);
        assert_eq!(again.hits[1].key, r.hits[1].key);
        // An unknown domain resolves to nothing.
        let other = Request { domain: "x", ..req };
        assert!(
            resolver(&s, &keys, &rule, Accounting::Auto, false)
                .resolve(&other)
                .hits
                .is_empty()
        );
    }

    /// The config's own names are escaped once, when it compiles, and only the request's
    /// values per request: the keys are byte for byte those `descriptor_key` builds from the
    /// same entries (exact values, a shared wildcard's pattern, a wildcard's and an open key's
    /// own values), escaping included.
    #[test]
    fn names_escaped_at_compile_give_the_keys_descriptor_key_gives() {
        let s = snapshot(
            r#"domain: "d o%"
descriptors:
  - key: "k 1"
    value: "a:b"
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: "k 1"
    value: "x y*"
    share_threshold: true
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: "k 1"
    value: "w*"
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: "k:2"
    rate_limit: {unit: second, requests_per_unit: 3}
"#,
        );
        let rule = Arc::new(OVERRIDE_RULE.to_owned());
        let limit = Limit {
            algorithm: Algorithm::FixedWindow,
            requests_per_unit: 3,
            window_us: 1_000_000,
            burst: 3,
            calendar: None,
        };
        for tag in [
            crate::limiter::key::HashTag::Domain,
            crate::limiter::key::HashTag::Descriptor,
        ] {
            let keys = KeyFormat::new("p:", tag).unwrap();
            for (entry, counted) in [
                (("k 1", "a:b"), "a:b"),
                (("k 1", "x y z"), "x y*"),
                (("k 1", "w%1"), "w%1"),
                (("k:2", "v{2}\n"), "v{2}\n"),
            ] {
                let req = Request {
                    domain: "d o%",
                    descriptors: vec![Descriptor {
                        entries: vec![(entry.0.as_bytes(), entry.1.as_bytes())],
                        ..Default::default()
                    }],
                    hits_addend: 0,
                };
                let r = resolver(&s, &keys, &rule, Accounting::Auto, false).resolve(&req);
                let want = keys
                    .descriptor_key("d o%", [(entry.0, counted)])
                    .with_limit(&limit, 0);
                assert_eq!(r.hits.len(), 1, "{entry:?}");
                assert_eq!(r.hits[0].key, want, "{entry:?}");
            }
        }
    }

    /// Refunds are never summed with the hits they would cancel: they are given back first, on
    /// their own; a report merged with an admission is a report.
    #[test]
    fn refunds_merge_apart_and_reports_absorb_admissions() {
        let s = snapshot(
            "domain: d
descriptors:
  - key: a
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: b
    rate_limit: {unit: second, requests_per_unit: 3, accounting: admission}
",
        );
        let keys = KeyFormat::new("p:", crate::limiter::key::HashTag::Domain).unwrap();
        let rule = Arc::new(OVERRIDE_RULE.to_owned());
        let d = |k: &'static str, hits_addend: Option<u64>, refund: bool| Descriptor {
            entries: vec![(k.as_bytes(), b"1".as_slice())],
            hits_addend,
            refund,
            ..Default::default()
        };
        let req = Request {
            domain: "d",
            descriptors: vec![
                d("a", None, false),
                d("a", Some(4), true),
                d("a", Some(5), false),
                d("a", Some(2), true),
                d("b", Some(6), false),
            ],
            hits_addend: 0,
        };
        let r = resolver(&s, &keys, &rule, Accounting::Auto, false).resolve(&req);
        let got: Vec<(HitKind, u64)> = r.hits.iter().map(|h| (h.kind, h.hits)).collect();
        assert_eq!(
            got,
            [
                (HitKind::Report, 6),
                (HitKind::Refund, 6),
                (HitKind::Admission, 6)
            ]
        );
        // The server's accounting applies where the limit sets none.
        let r = resolver(&s, &keys, &rule, Accounting::Admission, false).resolve(&req);
        assert_eq!(r.hits[0].kind, HitKind::Admission);
        let r = resolver(&s, &keys, &rule, Accounting::Report, false).resolve(&req);
        assert_eq!(r.hits[2].kind, HitKind::Admission, "the limit's own wins");
    }

    fn applicable() -> Applicable<'static> {
        Applicable {
            descriptor: 0,
            reported: ReportedLimit {
                name: None,
                requests_per_unit: 1,
                unit: crate::config::Unit::Second,
                window: Duration::from_secs(1),
                calendar: false,
                answer: None,
                soft: false,
            },
            enforcement: Enforcement::Enforce,
            rule: Cow::Owned(Arc::new(String::new())),
            rule_has_values: false,
            node: None,
            metadata: None,
            path: "",
            index: 0,
            top_values: crate::top::Values::Show,
            named_hold: false,
            operator: None,
        }
    }

    proptest::proptest! {
        /// Merging in place, by a scan (few hits) or an index (many): each counter once, in
        /// the order of its first hit, carrying the sum of its hits; every limit points at
        /// its counter's merged hit.
        #[test]
        fn merging_keeps_each_counter_once_with_all_its_hits(
            picks in proptest::collection::vec((0u8..6, 1u64..4), 0..40),
        ) {
            let hit = |k: u8, n: u64| Hit {
                key: crate::limiter::CounterKey::new("d", [("k", &*k.to_string())]),
                limit: crate::limiter::Limit {
                    algorithm: Algorithm::FixedWindow,
                    requests_per_unit: 10,
                    window_us: 1_000_000,
                    burst: 10,
                    calendar: None,
                },
                hits: n,
                enforcement: Enforcement::Enforce,
                kind: HitKind::Admission,
                hold: Hold::Unheld,
            };
            let mut applied: Vec<Applied<'_>> =
                picks.iter().map(|_| Applied::unmerged(applicable())).collect();
            let mut hits: Vec<Hit> = picks.iter().map(|&(k, n)| hit(k, n)).collect();
            merge(&mut applied, &mut hits);
            let mut first: Vec<u8> = Vec::new();
            for &(k, _) in &picks {
                if !first.contains(&k) {
                    first.push(k);
                }
            }
            proptest::prop_assert_eq!(hits.len(), first.len());
            for (m, &k) in first.iter().enumerate() {
                proptest::prop_assert_eq!(&hits[m].key, &hit(k, 0).key);
                let sum: u64 = picks.iter().filter(|p| p.0 == k).map(|p| p.1).sum();
                proptest::prop_assert_eq!(hits[m].hits, sum);
            }
            for (a, &(k, _)) in applied.iter().zip(&picks) {
                proptest::prop_assert_eq!(&hits[a.hit].key, &hit(k, 0).key);
            }
        }
    }
}
