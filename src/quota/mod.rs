//! RLQS below the protocol: what a bucket id maps to in the config, and the quota pools whose
//! fair shares decide each bucket's assignment. `server::rlqs` speaks the protocol over this;
//! nothing here knows gRPC.

pub(crate) mod pool;
pub(crate) mod share;

use std::time::Duration;

use crate::config::{NodeLimits, Snapshot};
use crate::limiter::key::KeyFormat;

pub(crate) use pool::{Grant, ParticipantId, PoolSpec, Pools, Signal, Usage};

/// How the quota server behaves (the defaults are the `--rlqs-*` flags').
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QuotaOptions {
    /// How long an assignment lasts (whole seconds: Envoy reads no fraction).
    pub(crate) assignment_ttl: Duration,
    /// A bucket reported idle this long is abandoned.
    pub(crate) abandon_after: Duration,
    /// How often clients are expected to report (Envoy: every 5 s).
    pub(crate) report_interval: Duration,
    /// Buckets one stream may hold.
    pub(crate) max_buckets_per_stream: usize,
}

/// What the config makes of a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    /// Not limited: unknown domain, no match, `unlimited`, shadow mode.
    Allow,
    /// A limit of zero.
    Deny,
    /// Limited by these pools (one per limit of the node), assigned as one token bucket that
    /// refills every `fill_s` seconds (the longest of their windows, fixed for the bucket).
    Pools { fill_s: u64, pools: Vec<PoolSpec> },
}

/// What a bucket is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Assignment {
    /// Allow every request.
    Allow,
    /// Deny every request.
    Deny,
    /// A token bucket.
    Bucket {
        /// Tokens the bucket holds at most.
        max_tokens: u64,
        /// Tokens added every `fill_s` seconds.
        tokens_per_fill: u64,
        /// The refill interval, whole seconds.
        fill_s: u64,
    },
}

/// Resolves a bucket id (unordered entries) of `domain` to its target: the node a descriptor of
/// the same entries, ordered by the tree, lands on (see `Domain::order_entries`), and the
/// counter of each of its limits as its pool.
pub(crate) fn resolve(
    snapshot: &Snapshot,
    domain: &str,
    entries: &[(&str, &str)],
    keys: &KeyFormat,
    global_shadow: bool,
) -> Target {
    if global_shadow {
        return Target::Allow;
    }
    let Some(d) = snapshot.domain(domain) else {
        return Target::Allow;
    };
    let Some(ordered) = d.order_entries(entries) else {
        return Target::Allow;
    };
    let Some(matched) = d.resolve(&ordered, keys) else {
        return Target::Allow;
    };
    let rules = match matched.node.limits.as_ref() {
        Some(NodeLimits::Limits(rules)) if !matched.node.shadow_mode => rules,
        _ => return Target::Allow,
    };
    if rules.iter().any(|r| r.requests_per_unit == 0) {
        return Target::Deny;
    }
    let pools: Vec<PoolSpec> = rules
        .iter()
        .map(|r| {
            let limit = r.limit();
            PoolSpec {
                key: matched
                    .key
                    .for_limit(&limit, r.ordinal)
                    .as_bytes()
                    .to_vec()
                    .into_boxed_slice(),
                limit: r.requests_per_unit,
                window_s: r.window_seconds(),
                burst: r.burst.max(1),
            }
        })
        .collect();
    let fill_s = pools.iter().map(|p| p.window_s).max().unwrap_or(1);
    Target::Pools { fill_s, pools }
}

impl Target {
    /// The assignment, with `grant` asked for this bucket's part of each pool (a pool that has
    /// lost it, e.g. to a reload in between, allows until the next answer).
    pub(crate) fn assign(&self, grant: impl FnMut(&PoolSpec) -> Option<Grant>) -> Assignment {
        match self {
            Target::Allow => Assignment::Allow,
            Target::Deny => Assignment::Deny,
            Target::Pools { fill_s, pools } => pools
                .iter()
                .map(grant)
                .collect::<Option<Vec<Grant>>>()
                .map_or(Assignment::Allow, |g| combine(*fill_s, pools, &g)),
        }
    }
}

/// One bucket's assignment from its pools' grants (the same order as the pools): each grant
/// in tokens per `fill_s`, the least of them, and the least burst.
fn combine(fill_s: u64, pools: &[PoolSpec], grants: &[Grant]) -> Assignment {
    let tokens_per_fill = pools
        .iter()
        .zip(grants)
        .map(|(p, g)| {
            (u128::from(g.tokens) * u128::from(fill_s) / u128::from(p.window_s.max(1))) as u64
        })
        .min()
        .unwrap_or(1)
        .max(1);
    let max_tokens = grants.iter().map(|g| g.max_tokens).min().unwrap_or(1);
    Assignment::Bucket {
        max_tokens,
        tokens_per_fill,
        fill_s,
    }
}
