//! The pure step: (snapshot, request) → the hits the backend decides, with what the report
//! needs to turn verdicts back into per-descriptor statuses. No I/O, no metrics, no clock.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use super::applied::{Applicable, Applied, ReportedLimit};
use super::request::{LimitOverride, Request};
use crate::config::overrides::OverrideSet;
use crate::config::{LimitRule, NodeLimits, Snapshot};
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

/// (applied index, name, replaces) of a limit that has a name or replaces others.
type Named<'s> = (usize, Option<&'s Arc<str>>, &'s [Arc<str>]);

/// Resolves `req` against `snapshot`: every limit that applies to each descriptor (its own
/// `limit` override, else the limits of the node its entries land on, minus those another
/// applicable limit `replaces`), and one hit per distinct counter and kind, keyed in `keys`'
/// format. Each hit's kind: a refund for `is_negative_hits`, else as the limit's `accounting`
/// says, else as `accounting` (the server's) says. An unknown domain, or descriptors no limit
/// applies to, resolve to nothing.
///
/// `quota_mode` is envoyproxy/ratelimit's global `QUOTA_MODE`: every limit is soft. As that
/// service counts soft descriptors, one that passes whatever its counters say (in shadow mode,
/// or, with `quota_mode`, matching no limit) means not all of them can be over, so the request
/// is never refused: its soft limits then report as shadow ones do. `unlimited` descriptors do
/// not count.
pub(crate) fn resolve<'s>(
    snapshot: &'s Snapshot,
    overrides: &'s OverrideSet,
    req: &Request<'_>,
    keys: &KeyFormat,
    override_rule: &'s Arc<String>,
    accounting: Accounting,
    quota_mode: bool,
) -> Resolved<'s> {
    let Some(domain) = snapshot.domain(req.domain) else {
        return Resolved::default();
    };
    // The operator's overrides of this domain: looked up only where there are some.
    let operators = match overrides.is_empty() {
        true => None,
        false => overrides.domain(req.domain),
    };
    let default_hits = req.hits_addend.max(1);
    // `found[i]` comes with `hits[i]` until `merge` pairs them (most descriptors have one
    // limit).
    let mut found: Vec<Applied<'s>> = Vec::with_capacity(req.descriptors.len());
    let mut hits: Vec<Hit> = Vec::with_capacity(req.descriptors.len());
    // Limits that take part in `replaces`: rare, so the common request allocates nothing.
    let mut named: Vec<Named<'s>> = Vec::new();
    // A soft descriptor passes whatever the counters say.
    let mut soft_passes = false;
    let enforce = if quota_mode {
        Enforcement::Soft
    } else {
        Enforcement::Enforce
    };
    for (i, d) in req.descriptors.iter().enumerate() {
        // A descriptor with no entries (Envoy sends one for a rate limit whose actions found
        // nothing, e.g. an absent header under `skip_if_absent`) matches nothing, whatever
        // else it carries: as envoyproxy/ratelimit decides it, OK and no counter.
        if d.entries.is_empty() {
            soft_passes |= quota_mode;
            continue;
        }
        let hits_addend = d.hits_addend.unwrap_or(default_hits);
        let kind = |limit: Option<Accounting>| {
            if d.refund {
                HitKind::Refund
            } else {
                limit.unwrap_or(accounting).kind(d.hits_addend)
            }
        };
        let matched = domain.lookup(&d.entries, keys);
        // An operator's override of these entries (less a hold's id), where a rule matches
        // them, comes first: before the request's own limit and the rule's.
        let operator = match (operators, &matched) {
            (Some(o), Some(m)) => {
                let held = usize::from(m.hold.id().is_some());
                o.get(&d.entries[..d.entries.len() - held])
            }
            _ => None,
        };
        if operator.is_none()
            && let Some(o) = d.limit_override
        {
            // The metric label comes from the config, never from the request's entries: the
            // node the descriptor matches, else a constant.
            let (rule, rule_has_values, node, path) = match matched {
                Some(m) => (
                    m.rule,
                    m.rule_has_values,
                    Some(m.node),
                    m.node.path.as_str(),
                ),
                None => (Cow::Borrowed(override_rule), false, None, OVERRIDE_RULE),
            };
            found.push(Applied::unmerged(Applicable {
                descriptor: i,
                reported: ReportedLimit {
                    name: None,
                    requests_per_unit: o.requests_per_unit,
                    unit: o.unit,
                    window: Duration::from_secs(o.unit.seconds()),
                    calendar: false,
                },
                enforcement: enforce,
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
            hits.push(Hit {
                enforcement: enforce,
                ..override_hit(keys, req.domain, &d.entries, o, hits_addend, kind(None))
            });
            continue;
        }
        let Some(matched) = matched else {
            soft_passes |= quota_mode;
            continue;
        };
        let rules: &[LimitRule] = match (operator, &matched.node.limits) {
            (Some(op), _) => &op.limits,
            (None, Some(NodeLimits::Limits(rules))) => rules,
            (None, _) => continue, // unlimited
        };
        let enforcement = if matched.node.shadow_mode {
            soft_passes |= quota_mode || matched.node.soft;
            Enforcement::Shadow
        } else if matched.node.soft {
            Enforcement::Soft
        } else {
            enforce
        };
        let mut base = Some(matched.key);
        for (r, rule) in rules.iter().enumerate() {
            let limit = rule.limit();
            // The descriptor's key goes to its last limit as it is; the others get copies.
            let key = if r + 1 == rules.len() {
                base.take()
                    .expect("the last limit takes the key")
                    .with_identity(&rule.identity)
            } else {
                base.as_ref()
                    .expect("kept for the last limit")
                    .for_identity(&rule.identity)
            };
            if rule.name.is_some() || !rule.replaces.is_empty() {
                named.push((found.len(), rule.name.as_ref(), &rule.replaces));
            }
            found.push(Applied::unmerged(Applicable {
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
            // A concurrency limit's hits are places: taken by an admission, released by a
            // refund, never reported.
            let kind = match rule.algorithm {
                Algorithm::Concurrency if !d.refund => HitKind::Admission,
                _ => kind(rule.accounting),
            };
            hits.push(Hit {
                key,
                limit,
                hits: hits_addend,
                enforcement,
                kind,
                hold: matched.hold.clone(),
            });
        }
    }
    if soft_passes {
        for h in &mut hits {
            if h.enforcement == Enforcement::Soft {
                h.enforcement = Enforcement::Shadow;
            }
        }
        for a in &mut found {
            if a.limit.enforcement == Enforcement::Soft {
                a.limit.enforcement = Enforcement::Shadow;
            }
        }
    }
    // `replaces`: a limit named by another applicable limit's `replaces` does not apply.
    if named.iter().any(|(_, _, r)| !r.is_empty()) {
        let replaced: Vec<&Arc<str>> = named.iter().flat_map(|(_, _, r)| r.iter()).collect();
        let mut keep = vec![true; found.len()];
        for (a, name, _) in &named {
            if name.is_some_and(|n| replaced.contains(&n)) {
                keep[*a] = false;
            }
        }
        let mut k = keep.iter();
        found.retain(|_| *k.next().expect("one flag per limit"));
        let mut k = keep.iter();
        hits.retain(|_| *k.next().expect("one flag per hit"));
    }
    merge(&mut found, &mut hits);
    Resolved {
        domain: Some(&domain.name),
        applied: found,
        hits,
    }
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
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    static NO_OVERRIDES: std::sync::LazyLock<OverrideSet> =
        std::sync::LazyLock::new(OverrideSet::default);
    use crate::config::compile_file;
    use crate::engine::request::Descriptor;

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
        let r = resolve(
            &s,
            &NO_OVERRIDES,
            &req,
            &keys,
            &rule,
            Accounting::Auto,
            false,
        );
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
        let again = resolve(
            &s,
            &NO_OVERRIDES,
            &req,
            &keys,
            &rule,
            Accounting::Auto,
            false,
        );
        assert_eq!(again.hits.len(), 2);
        assert_eq!(again.hits[1].key, r.hits[1].key);
        // An unknown domain resolves to nothing.
        let other = Request { domain: "x", ..req };
        assert!(
            resolve(
                &s,
                &NO_OVERRIDES,
                &other,
                &keys,
                &rule,
                Accounting::Auto,
                false
            )
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
                let r = resolve(
                    &s,
                    &NO_OVERRIDES,
                    &req,
                    &keys,
                    &rule,
                    Accounting::Auto,
                    false,
                );
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
        let r = resolve(
            &s,
            &NO_OVERRIDES,
            &req,
            &keys,
            &rule,
            Accounting::Auto,
            false,
        );
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
        let r = resolve(
            &s,
            &NO_OVERRIDES,
            &req,
            &keys,
            &rule,
            Accounting::Admission,
            false,
        );
        assert_eq!(r.hits[0].kind, HitKind::Admission);
        let r = resolve(
            &s,
            &NO_OVERRIDES,
            &req,
            &keys,
            &rule,
            Accounting::Report,
            false,
        );
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
