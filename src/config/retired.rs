//! Places of rules a reload took away, kept findable for their releases.
//!
//! A reload that removes a concurrency rule (or its places) leaves places in flight whose
//! requests will still release them. The domains that had them are kept beside the new
//! snapshot for the longest lifetime of the places taken away, so that a release naming a hold
//! frees its place while the rule is out of force: a reload that restores the rule finds the
//! places as their requests left them. Nothing else is decided against them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Domain, Index, NodeLimits, Snapshot};
use crate::limiter::Algorithm;

/// Most earlier configs kept for their places at once: past it the oldest goes, and its places'
/// releases free nothing (those places end at their lifetime). Each holds its rules' memory as
/// the config in force does, for at most its longest lifetime.
pub(crate) const MAX_RETIRED: usize = 4;

/// An earlier config's domains, kept for the releases of places it had.
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
        let gone = places(&old.domains)
            .into_iter()
            .filter(|(path, _)| !kept.contains_key(path))
            .map(|(_, lifetime)| lifetime)
            .max();
        self.retired.clear();
        if let Some(lifetime) = gone {
            self.retired.push(Retired {
                domains: old.domains.clone(),
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
