//! Pools shared by every replica on one Redis (`--backend redis`). Each grant is one atomic
//! call of `rlqs.lua` on its pool: the members' demands, liveness and leases live in Redis
//! with expiries, the pool's running sums and shares too, so two replicas never hand out the
//! same capacity, and a call's work in Redis does not grow with the pool (the script says
//! how). What stays here is what only this replica sees: each participant's smoothed demand
//! (its reports arrive here), what each of its members holds, and the streams to push when a
//! call ends a recomputation of a pool's shares and a member's share moved. A push that lowers
//! a grant is answered here from the shares that call returned, without a call of its own
//! ([`RedisPools::lowered`] says why that keeps the limit).
//!
//! A member is connected while it was granted within the last three report intervals (its
//! replica keeps calling); a replica that dies leaves leases that count until their TTL, then
//! its members' shares go to the others, as a disconnected client's do.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::future::join_all;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::fair_share::{FLOOR_OF_EQUAL_SPLIT, HEADROOM, ask, share_of};
use super::pool::{Demand, LEASE_GRACE, moved_far, whole};
use super::{Grant, ParticipantId, PoolSpec, Signal, Usage};
use crate::limiter::BackendError;
use crate::limiter::redis::RedisBackend;
use crate::limiter::redis::rlqs::{PoolCall, PoolOp, SharePolicy, ShareTerms};

/// The policy the script applies, from the constants the memory pools use.
pub(crate) const POLICY: SharePolicy = SharePolicy {
    floor_of_equal_split: FLOOR_OF_EQUAL_SPLIT,
    headroom: HEADROOM,
};

struct Participant {
    demand: Demand,
    reported: Instant,
    signal: Weak<Signal>,
}

impl Participant {
    /// Requests per second, or none when not measured or no longer fresh (its last report is
    /// older than `stale`).
    fn rate(&self, now: Instant, stale: Duration) -> Option<f64> {
        self.demand
            .rate()
            .filter(|_| now.duration_since(self.reported) <= stale)
    }
}

/// What this replica last told one of its members of a pool.
#[derive(Clone, Copy)]
struct Told {
    tokens: u64,
    /// When Redis stops counting the grant that was recorded (at the latest: the lease is
    /// Redis's TIME at the call plus the TTL, later than this replica's clock before it).
    counted_until: Instant,
}

/// Per pool: the terms of its last recomputation this replica saw, and this replica's members
/// with what each was last told.
#[derive(Default)]
struct PoolView {
    terms: Option<ShareTerms>,
    members: HashMap<ParticipantId, Told>,
}

/// Per pool, this replica's view of it.
type PoolViews = HashMap<Box<[u8]>, PoolView>;

/// This replica's view of the shared pools.
pub(crate) struct RedisPools {
    redis: Arc<RedisBackend>,
    /// This process's part of every member id, with its separator: `<replica>.`.
    replica: String,
    participants: Mutex<HashMap<ParticipantId, Participant>>,
    /// Per pool, this replica's members and the tokens each was last granted: whom to look
    /// at when the pool's shares move.
    members: Mutex<PoolViews>,
    ttl: Duration,
    /// A member not granted for this long is disconnected; its demand is stale.
    stale: Duration,
}

impl RedisPools {
    /// The replicas alive on the pools' Redis, as last counted there (the `share` failure mode
    /// cuts each pool by it while Redis cannot answer).
    pub(crate) fn replicas(&self) -> u32 {
        self.redis.replicas()
    }

    /// Pools in `redis` whose grants last `ttl`, for clients reporting every `report_interval`.
    pub(crate) fn new(
        redis: Arc<RedisBackend>,
        ttl: Duration,
        report_interval: Duration,
    ) -> RedisPools {
        let random = RandomState::new().hash_one((
            std::process::id(),
            crate::limiter::Clock::now_us(&crate::limiter::SystemClock),
        ));
        RedisPools {
            redis,
            replica: format!("{random:x}."),
            participants: Mutex::default(),
            members: Mutex::default(),
            ttl: ttl + LEASE_GRACE,
            stale: report_interval * 3,
        }
    }

    fn member(&self, pid: ParticipantId) -> String {
        format!("{}{pid:x}", self.replica)
    }

    /// Makes `pid` a participant here (its first grant makes it one in Redis).
    pub(crate) fn join(&self, pid: ParticipantId, signal: &Arc<Signal>, now: Instant) {
        self.participants.lock().insert(
            pid,
            Participant {
                demand: Demand::default(),
                reported: now,
                signal: Arc::downgrade(signal),
            },
        );
    }

    /// Grants `pid` its part of each of `pools` (in their order), with `usage` measured first
    /// when this is a report (`Some`); all or an error.
    pub(crate) async fn grant(
        &self,
        pid: ParticipantId,
        pools: &[PoolSpec],
        usage: Option<Option<Usage>>,
        now: Instant,
    ) -> Result<Vec<Grant>, BackendError> {
        // Requests per second, or none when not measured or no longer fresh.
        let rate = {
            let mut participants = self.participants.lock();
            let p = participants.entry(pid).or_insert_with(|| Participant {
                demand: Demand::default(),
                reported: now,
                signal: Weak::new(),
            });
            if let Some(usage) = usage {
                p.reported = now;
                p.demand.measure(usage);
            }
            p.rate(now, self.stale)
        };
        let member = self.member(pid);
        let member = &member;
        let calls = pools.iter().map(|spec| async move {
            let demand = rate.map(|r| r * spec.window_s as f64);
            if usage.is_none()
                && let Some(lower) = self.lowered(pid, spec, demand, now)
            {
                return Ok(lower);
            }
            self.call(spec, pid, member, PoolOp::Grant(demand)).await
        });
        let mut grants = Vec::with_capacity(pools.len());
        for reply in join_all(calls).await {
            grants.push(reply?);
        }
        Ok(grants)
    }

    /// `pid` no longer asks for `pools`: its leases count until they run out.
    pub(crate) async fn leave(&self, pid: ParticipantId, pools: &[PoolSpec]) {
        self.participants.lock().remove(&pid);
        {
            let mut members = self.members.lock();
            for spec in pools {
                if let Some(m) = members.get_mut(&spec.key) {
                    m.members.remove(&pid);
                    if m.members.is_empty() {
                        members.remove(&spec.key);
                    }
                }
            }
        }
        let member = self.member(pid);
        let calls = pools
            .iter()
            .map(|spec| self.call(spec, pid, &member, PoolOp::Leave));
        for result in join_all(calls).await {
            if let Err(e) = result {
                // Its liveness runs out in Redis by itself.
                tracing::debug!(error = %e, "RLQS leave not recorded");
            }
        }
    }

    /// One script call (queued in the backend's RLQS lane, which bounds how many reach Redis
    /// at once); what `pid` holds is noted, and when the call ended a recomputation of the
    /// pool's shares, this replica's members whose share moved are pushed.
    async fn call(
        &self,
        spec: &PoolSpec,
        pid: ParticipantId,
        member: &str,
        op: PoolOp,
    ) -> Result<Grant, BackendError> {
        let asked = Instant::now();
        let reply = self
            .redis
            .pool(&PoolCall {
                pool: &spec.key,
                member,
                limit: spec.limit,
                burst: spec.burst,
                lease: self.ttl,
                alive: self.stale,
                op,
                policy: POLICY,
            })
            .await?;
        {
            let mut members = self.members.lock();
            // A member that left meanwhile is not noted again.
            if let PoolOp::Grant(_) = op
                && self.participants.lock().contains_key(&pid)
            {
                members.entry(spec.key.clone()).or_default().members.insert(
                    pid,
                    Told {
                        tokens: reply.tokens,
                        counted_until: asked + self.ttl,
                    },
                );
            }
            if let Some(terms) = reply.pass
                && let Some(view) = members.get_mut(&spec.key)
            {
                view.terms = Some(terms);
            }
        }
        if let Some(terms) = reply.pass {
            self.push_moved(spec, &terms);
        }
        Ok(Grant {
            tokens: reply.tokens,
            max_tokens: reply.max_tokens,
            until: asked + self.ttl,
        })
    }

    /// A push that lowers `pid`'s grant of `spec`'s pool, answered here from the pool's last
    /// shares without a call: when one large report moves every share of a pool of 30,000
    /// down, its pushes would otherwise be as many script calls again. Redis keeps counting
    /// the larger grant recorded until the member's next report replaces it (the limit holds,
    /// with room to spare meanwhile), and the lower grant is leased no longer than Redis
    /// counts that one, in whole seconds. A push whose share no longer moved far from what
    /// the member holds (marked at one pass end, answered after a later report or pass put it
    /// back) is answered with what it holds, also without a call: under load such pushes
    /// were a script call each. `None`: a rise past the threshold, or too little lease left;
    /// the push calls Redis.
    fn lowered(
        &self,
        pid: ParticipantId,
        spec: &PoolSpec,
        demand: Option<f64>,
        now: Instant,
    ) -> Option<Grant> {
        let mut members = self.members.lock();
        let view = members.get_mut(&spec.key)?;
        let terms = view.terms?;
        let told = view.members.get_mut(&pid)?;
        if told.counted_until.saturating_duration_since(now) < Duration::from_secs(1) {
            return None;
        }
        let mut tokens = share(&terms, demand);
        if tokens >= told.tokens {
            if moved_far(told.tokens, tokens) {
                return None;
            }
            tokens = told.tokens;
        }
        told.tokens = tokens;
        Some(Grant {
            tokens,
            max_tokens: spec.burst_part(tokens),
            until: told.counted_until,
        })
    }

    /// Marks this replica's members of `spec`'s pool whose share under `terms` is far from
    /// what they hold, so their streams send them a new grant now. Linear in this replica's
    /// members of the pool, once per recomputation of its shares (every ~2n/8 calls on it).
    ///
    /// A share that fell is pushed without a call ([`RedisPools::lowered`]). A share that
    /// rose is pushed only as far as the tokens no grant holds (`terms.free`) pay for it: the
    /// rest would call Redis only to be told the capacity is still held (one large report
    /// made every pass end push all 20,000 other members up and down again, 90,000 calls
    /// in 9 s); they get their share at their next report, or at a later pass that frees it.
    fn push_moved(&self, spec: &PoolSpec, terms: &ShareTerms) {
        let members = self.members.lock();
        let Some(view) = members.get(&spec.key) else {
            return;
        };
        let participants = self.participants.lock();
        let now = Instant::now();
        let mut free = terms.free;
        for (pid, Told { tokens, .. }) in &view.members {
            let Some(p) = participants.get(pid) else {
                continue;
            };
            let demand = p.rate(now, self.stale).map(|r| r * spec.window_s as f64);
            let share = share(terms, demand);
            if !moved_far(*tokens, share) {
                continue;
            }
            if share > *tokens {
                let Some(left) = free.checked_sub(share - tokens) else {
                    continue;
                };
                free = left;
            }
            if let Some(signal) = p.signal.upgrade() {
                signal.mark(*pid);
            }
        }
    }
}

/// A member's share under a pass's `terms`, in whole tokens, as the script computes it:
/// `share_of(ask, level, extra)`.
fn share(terms: &ShareTerms, demand: Option<f64>) -> u64 {
    whole(share_of(
        ask(demand, terms.capacity, terms.least),
        terms.level,
        terms.extra,
    ))
}
