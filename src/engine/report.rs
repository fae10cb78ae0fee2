//! The report step: verdicts back into per-descriptor statuses, the overall code and the
//! passed descriptors' metadata, with one decision per applied limit for the metrics.

use std::sync::Arc;
use std::time::Duration;

use super::applied::{Applied, ReportedLimit};
use crate::limiter::{Algorithm, Enforcement, Hit, HitKind, Outcome, Verdict, soft_rejects};
use crate::metrics::Decision;

/// Whether a descriptor (or the request) is within its limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// Within limits (or not limited at all).
    Ok,
    /// Over a limit.
    OverLimit,
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
    /// The config path of the rule whose limit refused the descriptor (`None` when it passed,
    /// or when not asked for): never a request value.
    pub refused_by: Option<Arc<String>>,
}

impl Status {
    /// The status of a descriptor no limit applies to.
    pub(crate) fn unlimited() -> Status {
        Status {
            code: Code::Ok,
            limit: None,
            remaining: 0,
            reset: None,
            refused_by: None,
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
    /// The soft limits the request is over (it went on; the upstream is told), in request
    /// order.
    pub soft: Vec<SoftOver>,
}

/// A soft limit a request is over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SoftOver {
    /// The descriptor's index in the request.
    pub descriptor: usize,
    /// The limit, and what it reports: as a [`Status`] of code OK.
    pub status: Status,
}

/// The soft limits over in a decided request: those of its admissions (a refused request
/// never reaches the upstream, and a report or refund asks nothing).
pub(crate) fn soft_over(applied: &[Applied<'_>], hits: &[Hit], outcome: &Outcome) -> Vec<SoftOver> {
    if !outcome.admitted {
        return Vec::new();
    }
    applied
        .iter()
        .filter(|a| {
            a.limit.reported.soft
                && outcome.verdicts[a.hit].over
                && hits[a.hit].kind == HitKind::Admission
        })
        .map(|a| {
            let v = &outcome.verdicts[a.hit];
            SoftOver {
                descriptor: a.limit.descriptor,
                status: Status {
                    code: Code::Ok,
                    limit: Some(a.limit.reported.clone()),
                    remaining: v.remaining,
                    reset: Some(v.reset),
                    refused_by: None,
                },
            }
        })
        .collect()
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

/// One status per descriptor of a request with `descriptors` descriptors: the most
/// restrictive of its limits. Of those that refuse it, the one that resets last (so that the
/// reset it reports is long enough for all of them), the fewest hits left between equals; when
/// none refuses, the one with the fewest hits left. Calls
/// `decided` once per applied limit with its hit's kind and metric decision.
///
/// A refund's status is its counter as the refund left it, and never rejects; a cost report
/// over its limit rejects as an admission would (Envoy ignores the answer to a report).
pub(crate) fn statuses(
    descriptors: usize,
    applied: &[Applied<'_>],
    hits: &[Hit],
    outcome: &Outcome,
    near_limit_ratio: f64,
    name_rules: bool,
    mut decided: impl FnMut(&Applied<'_>, HitKind, Decision, Tally),
) -> Vec<Status> {
    let soft_rejects = soft_rejects(hits, |i| outcome.verdicts[i].over);
    let mut best: Vec<Option<(bool, u64, Duration, usize)>> = vec![None; descriptors];
    let soft = |k: usize| applied[k].limit.reported.soft;
    for (k, a) in applied.iter().enumerate() {
        let (hit, v) = (&hits[a.hit], &outcome.verdicts[a.hit]);
        let rejects = v.over
            && hit.kind != HitKind::Refund
            && match a.limit.enforcement {
                Enforcement::Enforce => true,
                Enforcement::Soft => soft_rejects,
                Enforcement::Shadow => false,
            };
        let remaining = if v.over || outcome.admitted || hit.kind != HitKind::Admission {
            v.remaining
        } else {
            // Nothing was consumed: what the verdict counted for this request is still there.
            v.remaining.saturating_add(hit.hits)
        };
        let limit = hit.limit.requests_per_unit;
        let tally = Tally {
            hits: hit.hits,
            limit,
            over: v.over,
            used_before: if v.over {
                limit.saturating_sub(v.fits)
            } else {
                limit.saturating_sub(v.remaining.saturating_add(hit.hits))
            },
        };
        let decision = match decision(hit, a.limit.enforcement, v, remaining, near_limit_ratio) {
            Decision::shadow_mode if a.limit.reported.soft => Decision::soft_limit,
            d => d,
        };
        decided(a, hit.kind, decision, tally);
        let reset = v.reset;
        let slot = &mut best[a.limit.descriptor];
        let better = match slot {
            None => true,
            Some((r, rem, until, j)) => {
                if rejects != *r {
                    rejects
                } else if rejects {
                    // Of the limits that refuse, the one the client must wait longest for:
                    // a client that waits what it is told is admitted.
                    reset > *until || (reset == *until && remaining < *rem)
                } else if soft(k) != soft(*j) {
                    // A soft limit reports only where no other limit does: it never refuses.
                    !soft(k)
                } else {
                    remaining < *rem
                }
            }
        };
        if better {
            *slot = Some((rejects, remaining, reset, k));
        }
    }
    best.into_iter()
        .map(|b| match b {
            None => Status::unlimited(),
            Some((rejects, remaining, _, k)) => Status {
                code: if rejects { Code::OverLimit } else { Code::Ok },
                limit: Some(applied[k].limit.reported.clone()),
                remaining,
                reset: Some(outcome.verdicts[applied[k].hit].reset),
                refused_by: (rejects && name_rules).then(|| {
                    let a = &applied[k].limit;
                    a.node.map_or_else(|| (*a.rule).clone(), |n| n.path.clone())
                }),
            },
        })
        .collect()
}

/// One limit's part in a request, for envoyproxy/ratelimit's counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tally {
    /// The hits the request adds.
    pub(crate) hits: u64,
    /// The limit's requests per unit.
    pub(crate) limit: u64,
    /// The hits did not fit.
    pub(crate) over: bool,
    /// The counter before those hits (the limit when not known, e.g. from the over-limit cache).
    pub(crate) used_before: u64,
}

/// What envoyproxy/ratelimit adds to a rule's stats for `tally`: total hits, within, near,
/// over and shadow, in hits, with that service's arithmetic: hits past the near-limit threshold
/// are near; of a request that crosses the limit, the hits past it are over and those below
/// it (past the near threshold) near; a shadow-mode limit counts its over hits as shadow too.
pub(crate) fn reference_counts(tally: Tally, near_limit_ratio: f64, shadow: bool) -> [u64; 5] {
    let Tally {
        hits,
        limit,
        over,
        used_before: before,
    } = tally;
    // As the reference computes it: float32, floored.
    let near = (limit as f32 * near_limit_ratio as f32).floor() as u64;
    let after = before.saturating_add(hits);
    if over {
        let (over_hits, near_hits) = if before >= limit || after <= limit {
            (hits, 0)
        } else {
            (after - limit, limit - near.max(before))
        };
        [
            hits,
            0,
            near_hits,
            over_hits,
            if shadow { over_hits } else { 0 },
        ]
    } else {
        let near_hits = if after <= near {
            0
        } else if before >= near {
            hits
        } else {
            after - near
        };
        [hits, hits, near_hits, 0, 0]
    }
}

fn decision(
    hit: &Hit,
    enforcement: Enforcement,
    v: &Verdict,
    remaining: u64,
    near_limit_ratio: f64,
) -> Decision {
    let rpu = hit.limit.requests_per_unit;
    if v.over {
        if enforcement == Enforcement::Shadow {
            Decision::shadow_mode
        } else {
            Decision::over_limit
        }
    } else {
        let threshold = (rpu as f64 * near_limit_ratio).floor() as u64;
        if rpu.saturating_sub(remaining) > threshold {
            Decision::near_limit
        } else {
            Decision::within_limit
        }
    }
}

/// The merged `metadata` of the limited descriptors that passed, in request order.
pub(super) fn passed_metadata(
    applied: &[Applied<'_>],
    statuses: &[Status],
) -> serde_json::Map<String, serde_json::Value> {
    let mut merged = serde_json::Map::new();
    let mut seen = Vec::new();
    for a in applied {
        if statuses[a.limit.descriptor].code != Code::Ok || seen.contains(&a.limit.descriptor) {
            continue;
        }
        seen.push(a.limit.descriptor);
        if let Some(serde_json::Value::Object(m)) = a.limit.metadata {
            merge_metadata(&mut merged, m);
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_the_reference() {
        let t = |hits, used_before, over| Tally {
            hits,
            limit: 10,
            over,
            used_before,
        };
        // Near threshold: floor(10 × 0.8) = 8.
        assert_eq!(
            reference_counts(t(1, 4, false), 0.8, false),
            [1, 1, 0, 0, 0]
        );
        assert_eq!(
            reference_counts(t(1, 8, false), 0.8, false),
            [1, 1, 1, 0, 0]
        );
        assert_eq!(
            reference_counts(t(3, 7, false), 0.8, false),
            [3, 3, 2, 0, 0]
        );
        // Already at the limit: every hit is over.
        assert_eq!(
            reference_counts(t(1, 10, true), 0.8, false),
            [1, 0, 0, 1, 0]
        );
        assert_eq!(reference_counts(t(2, 10, true), 0.8, true), [2, 0, 0, 2, 2]);
        // Crossing it from 7 with 5 hits: 8..10 near (2), 11 and 12 over (2); shadow counts
        // the over part only.
        assert_eq!(reference_counts(t(5, 7, true), 0.8, false), [5, 0, 2, 2, 0]);
        assert_eq!(reference_counts(t(5, 7, true), 0.8, true), [5, 0, 2, 2, 2]);
        // From below the near threshold: near counts from the threshold.
        assert_eq!(
            reference_counts(t(12, 3, true), 0.8, false),
            [12, 0, 2, 5, 0]
        );
    }
}
