//! RLQS below the protocol: what a bucket id maps to in the config, and the RLQS pools whose
//! fair shares decide each bucket's assignment. `server::rlqs` speaks the protocol over this;
//! nothing here knows gRPC.

pub(crate) mod fair_share;
pub(crate) mod pool;
pub(crate) mod redis_pools;

use std::sync::Arc;
use std::time::Duration;

use crate::config::{NodeLimits, Snapshot};
use crate::limiter::failure_mode::FailureMode;
use crate::limiter::key::KeyFormat;
use crate::metrics::{ModeLabels, RlqsMetrics};
use crate::value::KeyValue;

pub(crate) use pool::{Grant, LocalPools, ParticipantId, PoolSpec, Signal, Usage};
pub(crate) use redis_pools::RedisPools;

/// How the quota server behaves (the defaults are the `--rlqs-*` flags').
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BucketOptions {
    /// How long an assignment lasts (whole seconds: Envoy reads no fraction).
    pub(crate) assignment_ttl: Duration,
    /// A bucket reported idle this long is abandoned.
    pub(crate) abandon_after: Duration,
    /// How often clients are expected to report (Envoy: every 5 s).
    pub(crate) report_interval: Duration,
    /// Buckets one stream may hold.
    pub(crate) max_buckets_per_stream: usize,
    /// Bytes the buckets of every stream may be charged together; a connection's streams get
    /// at most a quarter of it.
    pub(crate) max_bytes: usize,
}

/// What the config makes of a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum BucketRule {
    /// Not limited: unknown domain, no match, `unlimited`, shadow mode.
    Allow,
    /// A limit of zero.
    Deny,
    /// Limited by these pools (one per limit of the node), assigned as one token bucket that
    /// refills every `fill_s` seconds (the longest of their windows, fixed for the bucket).
    LocalPools { fill_s: u64, pools: Vec<PoolSpec> },
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
        /// When the server stops counting it (its grants' earliest `until`).
        until: tokio::time::Instant,
    },
}

/// Maps a bucket id (unordered entries) of `domain` to its target: the node a descriptor of
/// the same entries, ordered by the tree, lands on (see `Domain::order_entries`), and the
/// counter of each of its limits as its pool.
pub(crate) fn bucket_rule(
    snapshot: &Snapshot,
    domain: &str,
    entries: &[KeyValue<'_>],
    keys: &KeyFormat,
    global_shadow: bool,
) -> BucketRule {
    if global_shadow {
        return BucketRule::Allow;
    }
    let Some(d) = snapshot.domain(domain) else {
        return BucketRule::Allow;
    };
    let Some(ordered) = d.order_entries(entries) else {
        return BucketRule::Allow;
    };
    let Some(matched) = d.lookup(&ordered, keys) else {
        return BucketRule::Allow;
    };
    let rules = match matched.node.limits.as_ref() {
        Some(NodeLimits::Limits(rules)) if !matched.node.shadow_mode => rules,
        _ => return BucketRule::Allow,
    };
    // A concurrency limit is not assigned: a quota report never releases a place
    // (docs/rlqs.md).
    let rates = || {
        rules
            .iter()
            .filter(|r| r.algorithm != crate::limiter::Algorithm::Concurrency)
    };
    if rates().next().is_none() {
        return BucketRule::Allow;
    }
    if rates().any(|r| r.requests_per_unit == 0) {
        return BucketRule::Deny;
    }
    let pools: Vec<PoolSpec> = rates()
        .map(|r| PoolSpec {
            key: matched
                .key
                .for_identity(&r.identity)
                .as_bytes()
                .to_vec()
                .into_boxed_slice(),
            limit: r.requests_per_unit,
            window_s: r.window_seconds(),
            burst: r.burst.max(1),
        })
        .collect();
    let fill_s = pools.iter().map(|p| p.window_s).max().unwrap_or(1);
    BucketRule::LocalPools { fill_s, pools }
}

impl BucketRule {
    /// The pools a bucket of this target takes part in.
    fn pools(&self) -> &[PoolSpec] {
        match self {
            BucketRule::LocalPools { pools, .. } => pools,
            _ => &[],
        }
    }
}

/// Why a bucket is asked for its assignment.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Ask {
    /// Its client reported (the usage, when it measured any).
    Report(Option<Usage>),
    /// Its share moved or its rule changed: the current grant, no new measure.
    Push,
}

/// Where the pools are: this replica's memory, or Redis shared with every replica.
pub(crate) enum Pools {
    /// Each replica shares each limit among its own streams.
    Local(LocalPools),
    /// Replicas on one Redis share one pool per limit; while Redis cannot answer, the failure
    /// mode decides (`local`: this replica's own pools, as `Local`).
    InRedis {
        pools: Box<RedisPools>,
        failure: FailureMode,
        local: LocalPools,
        metrics: RlqsMetrics,
    },
}

impl Pools {
    /// Pools where the backend keeps its counters: in Redis when it is the store (its failure
    /// mode deciding while it cannot answer, with this replica's own pools for `local`), else
    /// this replica's own.
    pub(crate) fn beside(
        redis: Option<(Arc<crate::limiter::redis::RedisBackend>, FailureMode)>,
        options: &BucketOptions,
        metrics: RlqsMetrics,
    ) -> Pools {
        let (ttl, interval) = (options.assignment_ttl, options.report_interval);
        let local = LocalPools::new(ttl, interval);
        match redis {
            None => Pools::Local(local),
            Some((redis, failure)) => Pools::InRedis {
                pools: Box::new(RedisPools::new(redis, ttl, interval)),
                failure,
                local,
                metrics,
            },
        }
    }

    /// Makes `pid` a participant of `target`'s pools.
    pub(crate) fn join(
        &self,
        pid: ParticipantId,
        target: &BucketRule,
        signal: &Arc<Signal>,
        now: tokio::time::Instant,
    ) {
        if target.pools().is_empty() {
            return;
        }
        match self {
            Pools::Local(pools) => {
                for p in target.pools() {
                    pools.join(p, pid, signal, now);
                }
            }
            Pools::InRedis { pools, .. } => pools.join(pid, signal, now),
        }
    }

    /// `pid` no longer takes part in `target`'s pools: its leases count until they run out.
    pub(crate) async fn leave(
        &self,
        pid: ParticipantId,
        target: &BucketRule,
        now: tokio::time::Instant,
    ) {
        let (local, shared) = match self {
            Pools::Local(pools) => (pools, None),
            Pools::InRedis { pools, local, .. } => (local, Some(pools)),
        };
        for p in target.pools() {
            local.leave(&p.key, pid, now);
        }
        if let Some(shared) = shared
            && !target.pools().is_empty()
        {
            shared.leave(pid, target.pools()).await;
        }
    }

    /// What `pid`, a bucket of `target`, is told now; `None`: nothing (Redis cannot answer and
    /// the failure mode is `error`: the client keeps its assignment until its TTL, then
    /// follows its own `expired_assignment_behavior`).
    pub(crate) async fn assign(
        &self,
        pid: ParticipantId,
        target: &BucketRule,
        ask: Ask,
        signal: &Arc<Signal>,
        now: tokio::time::Instant,
    ) -> Option<Assignment> {
        let BucketRule::LocalPools { fill_s, pools } = target else {
            return Some(match target {
                BucketRule::Deny => Assignment::Deny,
                _ => Assignment::Allow,
            });
        };
        let grants = match self {
            Pools::Local(local) => Self::local_grants(local, pid, pools, ask, now),
            Pools::InRedis {
                pools: shared,
                failure,
                local,
                metrics,
            } => {
                let usage = match ask {
                    Ask::Report(usage) => Some(usage),
                    Ask::Push => None,
                };
                match shared.grant(pid, pools, usage, now).await {
                    Ok(grants) => Some(grants),
                    Err(e) => {
                        let mode = if e.is_transient() {
                            *failure
                        } else {
                            FailureMode::Error
                        };
                        tracing::debug!(error = %e, mode = mode.as_str(), "RLQS pool unavailable; failure mode decides");
                        metrics
                            .failure_mode_decisions
                            .get_or_create(&ModeLabels {
                                mode: mode.as_str(),
                            })
                            .inc();
                        match mode {
                            FailureMode::Error => return None,
                            FailureMode::Allow => return Some(Assignment::Allow),
                            FailureMode::Deny => return Some(Assignment::Deny),
                            FailureMode::Local => {
                                for p in pools {
                                    local.join(p, pid, signal, now);
                                }
                                Self::local_grants(local, pid, pools, ask, now)
                            }
                            FailureMode::Share => {
                                // This replica's own pools, each at its share of the limit.
                                let n = u64::from(shared.replicas());
                                let pools: Vec<PoolSpec> = pools
                                    .iter()
                                    .map(|p| PoolSpec {
                                        limit: (p.limit / n).max(1),
                                        burst: (p.burst / n).max(1),
                                        ..p.clone()
                                    })
                                    .collect();
                                for p in &pools {
                                    local.join(p, pid, signal, now);
                                }
                                Self::local_grants(local, pid, &pools, ask, now)
                            }
                        }
                    }
                }
            }
        };
        // A pool that lost the participant (a reload in between) allows until the next answer.
        Some(grants.map_or(Assignment::Allow, |g| combine(*fill_s, pools, &g)))
    }

    fn local_grants(
        local: &LocalPools,
        pid: ParticipantId,
        pools: &[PoolSpec],
        ask: Ask,
        now: tokio::time::Instant,
    ) -> Option<Vec<Grant>> {
        pools
            .iter()
            .map(|p| match ask {
                Ask::Report(usage) => local.report(&p.key, pid, usage, now),
                Ask::Push => local.regrant(&p.key, pid, now),
            })
            .collect()
    }

    /// Drops this replica's expired leases and empty pools.
    pub(crate) fn sweep(&self, now: tokio::time::Instant) {
        match self {
            Pools::Local(pools) | Pools::InRedis { local: pools, .. } => pools.sweep(now),
        }
    }

    /// Pools held in this process (shared pools: those used while Redis could not answer).
    pub(crate) fn len(&self) -> usize {
        match self {
            Pools::Local(pools) | Pools::InRedis { local: pools, .. } => pools.len(),
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
        until: grants
            .iter()
            .map(|g| g.until)
            .min()
            .unwrap_or_else(tokio::time::Instant::now),
    }
}
