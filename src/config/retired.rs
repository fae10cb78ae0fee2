//! Places of rules a reload took away, kept findable for their releases.
//!
//! A reload that removes a concurrency rule (or its places) leaves places in flight whose
//! requests will still release them. The rules taken away are kept beside the new snapshot for
//! the longest lifetime of their places, so that a release naming a hold frees its place while
//! the rule is out of force: a reload that restores the rule finds the places as their
//! requests left them. Nothing else is decided against them. What is kept is a copy of those
//! rules' nodes and the nodes on the way to them, nothing else of the earlier config: a
//! renamed one-day rule in a config of 40,000 descriptors keeps a few nodes for a day, not the
//! 40,000. (A release that lands on such a node in the copy where the earlier config had a
//! sibling it would have matched first names a hold that node's counter never took: it gives
//! nothing back.)

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Domain, Extra, Index, KeyNodes, Level, Node, NodeLimits, Snapshot, Wildcard};
use crate::limiter::Algorithm;

/// Most earlier configs' removed rules kept for their places at once: past it the oldest go,
/// and their places' releases free nothing (those places end at their lifetime). Each holds
/// its removed rules' nodes (and those on the way to them), for at most their longest
/// lifetime.
pub(crate) const MAX_RETIRED: usize = 4;

/// An earlier config's removed concurrency rules, kept for the releases of their places.
#[derive(Clone, Debug)]
pub(crate) struct Retired {
    domains: Arc<Index<Domain>>,
    until: Instant,
}

impl Snapshot {
    /// Keeps, beside this snapshot, what `old` (the config it replaces) had for places this one
    /// has not: `old`'s domains for the longest lifetime of the places taken away, and the
    /// earlier configs `old` kept that are still in force, newest first.
    pub(crate) fn retire(&mut self, old: &Snapshot, now: Instant) {
        let kept = places(&self.domains);
        let gone: HashMap<(Arc<String>, String), Duration> = places(&old.domains)
            .into_iter()
            .filter(|(path, _)| !kept.contains_key(path))
            .collect();
        self.retired.clear();
        if let Some(lifetime) = gone.values().max().copied() {
            let domains = old
                .domains
                .values()
                .filter_map(|d| {
                    let root = d.root.pruned(&mut |node| {
                        gone.contains_key(&(d.name.clone(), node.path.to_string()))
                    })?;
                    let copy = Domain {
                        name: d.name.clone(),
                        escaped_name: d.escaped_name.clone(),
                        root,
                        line: d.line,
                    };
                    Some((Box::from(d.name.as_str()), copy))
                })
                .collect();
            self.retired.push(Retired {
                domains: Arc::new(Index::new(domains)),
                until: now + lifetime,
            });
        }
        let earlier = old.retired.iter().filter(|r| r.until > now).cloned();
        self.retired.extend(earlier);
        self.retired.truncate(MAX_RETIRED);
    }

    /// The earlier configs' `domain`, newest first, where a release may still find its place.
    pub(crate) fn retired_domains<'s, 'n>(
        &'s self,
        domain: &'n str,
    ) -> impl Iterator<Item = &'s Domain> + use<'s, 'n> {
        self.retired
            .iter()
            .filter_map(move |r| r.domains.get(domain))
    }

    /// Whether an earlier config is kept for its places (the request path looks no further
    /// without one).
    pub(crate) fn has_retired(&self) -> bool {
        !self.retired.is_empty()
    }
}

impl Level {
    /// A copy of the nodes `keep` picks and of those on the way to them, or `None` when it
    /// picks none here. Only a kept node's limits are copied; its metric counters start anew.
    fn pruned(&self, keep: &mut impl FnMut(&Node) -> bool) -> Option<Level> {
        let mut keys = HashMap::new();
        for (key, nodes) in self.keys.iter() {
            let mut exact = HashMap::new();
            for (value, node) in nodes.exact.iter() {
                if let Some(copy) = node.pruned(keep) {
                    exact.insert(Box::from(value), copy);
                }
            }
            let wildcards: Vec<(Wildcard, Node)> = nodes
                .wildcards
                .iter()
                .filter_map(|(w, node)| Some((w.clone(), node.pruned(keep)?)))
                .collect();
            let any = nodes
                .any
                .as_deref()
                .and_then(|node| node.pruned(keep))
                .map(Box::new);
            if exact.is_empty() && wildcards.is_empty() && any.is_none() {
                continue;
            }
            let copy = KeyNodes {
                first: nodes.first,
                exact: Index::new(exact),
                wildcards,
                any,
            };
            keys.insert(Box::from(key), copy);
        }
        (!keys.is_empty()).then(|| Level {
            keys: Index::new(keys),
        })
    }
}

impl Node {
    /// This node, if `keep` picks it or one below it, with only what leads to those.
    fn pruned(&self, keep: &mut impl FnMut(&Node) -> bool) -> Option<Node> {
        let kept = keep(self);
        let children = self.children.pruned(keep);
        if !kept && children.is_none() {
            return None;
        }
        Some(Node {
            value: self.value.clone(),
            escaped_key: self.escaped_key.clone(),
            counted: self.counted.clone(),
            limits: if kept { self.limits.clone() } else { None },
            shadow_mode: self.shadow_mode,
            detailed_metric: self.detailed_metric,
            share_threshold: self.share_threshold,
            value_to_metric: self.value_to_metric,
            soft: self.soft,
            extra: self.hold_key().map(|key| {
                Box::new(Extra {
                    metadata: None,
                    hold_key: Some(Box::from(key)),
                })
            }),
            children: children.unwrap_or_default(),
            path: self.path.clone(),
            line: self.line,
            counters: Default::default(),
        })
    }
}

/// The longest lifetime of places of each (domain, rule path) in `domains`.
fn places(domains: &Index<Domain>) -> HashMap<(Arc<String>, String), Duration> {
    let mut found = HashMap::new();
    for domain in domains.values() {
        domain.root.visit(&mut |node| {
            let Some(NodeLimits::Limits(rules)) = &node.limits else {
                return;
            };
            let lifetime = rules
                .iter()
                .filter(|r| r.algorithm == Algorithm::Concurrency)
                .map(|r| Duration::from_secs(r.window_seconds()))
                .max();
            if let Some(lifetime) = lifetime {
                found.insert((domain.name.clone(), node.path.to_string()), lifetime);
            }
        });
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(text: &str) -> Snapshot {
        let domain = super::super::compile_file(std::path::Path::new("d.yaml"), text).unwrap();
        Snapshot::new(vec![domain])
    }

    /// Nodes kept for the retired configs' places, all domains together.
    fn retired_nodes(s: &Snapshot) -> usize {
        let mut n = 0;
        for r in &s.retired {
            for d in r.domains.values() {
                d.root.visit(&mut |_| n += 1);
            }
        }
        n
    }

    /// A concurrency rule renamed at a reload, in a config of 2,000 other descriptors: only its
    /// own node and the one on the way to it are kept for its places' releases, not the whole
    /// earlier config (5 reloads kept up to 4 configs whole: 140 MiB more at 40,000
    /// descriptors), and a release still finds the place under the earlier name.
    #[test]
    fn a_removed_rule_keeps_its_own_nodes_not_the_earlier_config() {
        let config = |name: &str| {
            let mut text = format!(
                "domain: d\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: {name}\n        hold_key: request_id\n        rate_limit: {{algorithm: concurrency, unit: day, requests_per_unit: 5}}\n"
            );
            for i in 0..2_000 {
                text.push_str(&format!(
                    "  - key: customer\n    value: c{i}\n    rate_limit: {{unit: second, requests_per_unit: 10}}\n"
                ));
            }
            text
        };
        let now = Instant::now();
        let mut current = snapshot(&config("llm"));
        for generation in 0..5 {
            let mut next = snapshot(&config(&format!("llm{generation}")));
            next.retire(&current, now);
            current = next;
            // Each rule removed keeps its node and its parent's: 2 per config kept.
            let kept = current.retired.len();
            assert_eq!(retired_nodes(&current), 2 * kept, "generation {generation}");
        }
        assert_eq!(current.retired.len(), MAX_RETIRED);
        let domain = current
            .retired_domains("d")
            .next()
            .expect("the last removed");
        let mut found = Vec::new();
        domain
            .root
            .visit(&mut |node| found.push(node.path.to_string()));
        assert_eq!(found, ["tenant", "tenant.llm3"]);
        // The kept rule still has its limits and its hold key, as the release needs them.
        domain.root.visit(&mut |node| {
            if node.path.as_str() == "tenant.llm3" {
                assert!(matches!(&node.limits, Some(NodeLimits::Limits(r)) if r.len() == 1));
                assert_eq!(node.hold_key(), Some("request_id"));
            } else {
                assert!(node.limits.is_none());
            }
        });
    }
}
