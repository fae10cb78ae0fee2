//! Pools shared by every replica on one Redis (`--backend redis`). Each grant is one atomic
//! call of `quota.lua` on its pool: the members' demands, liveness and leases live in Redis
//! with expiries, and the share is computed there, so two replicas never hand out the same
//! capacity. What stays here is what only this replica sees: each participant's smoothed
//! demand (its reports arrive here) and the streams to push when the script says a share moved.
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

use super::pool::{Demand, SHARE_MOVE};
use super::share::{FLOOR_OF_EQUAL_SPLIT, HEADROOM};
use super::{Grant, ParticipantId, PoolSpec, Signal, Usage};
use crate::limiter::BackendError;
use crate::limiter::redis::RedisBackend;
use crate::limiter::redis::quota::{PoolCall, PoolOp, SharePolicy};

/// The policy the script applies, from the constants the memory pools use.
pub(crate) const POLICY: SharePolicy = SharePolicy {
    floor_of_equal_split: FLOOR_OF_EQUAL_SPLIT,
    headroom: HEADROOM,
    share_move: SHARE_MOVE,
};

struct Participant {
    demand: Demand,
    reported: Instant,
    signal: Weak<Signal>,
}

/// This replica's view of the shared pools.
pub(crate) struct SharedPools {
    redis: Arc<RedisBackend>,
    /// This process's part of every member id, with its separator: `<replica>.`.
    replica: String,
    participants: Mutex<HashMap<ParticipantId, Participant>>,
    ttl: Duration,
    /// A member not granted for this long is disconnected; its demand is stale.
    stale: Duration,
}

impl SharedPools {
    /// Pools in `redis` whose grants last `ttl`, for clients reporting every `report_interval`.
    pub(crate) fn new(
        redis: Arc<RedisBackend>,
        ttl: Duration,
        report_interval: Duration,
    ) -> SharedPools {
        let random =
            RandomState::new().hash_one((std::process::id(), std::time::SystemTime::now()));
        SharedPools {
            redis,
            replica: format!("{random:x}."),
            participants: Mutex::default(),
            ttl,
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
            p.demand
                .rate()
                .filter(|_| now.duration_since(p.reported) <= self.stale)
        };
        let member = self.member(pid);
        let calls = pools.iter().map(|spec| {
            let demand = rate.map(|r| r * spec.window_s as f64);
            self.call(spec, &member, PoolOp::Grant(demand))
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
        let member = self.member(pid);
        let calls = pools
            .iter()
            .map(|spec| self.call(spec, &member, PoolOp::Leave));
        for result in join_all(calls).await {
            if let Err(e) = result {
                // Its liveness runs out in Redis by itself.
                tracing::debug!(error = %e, "RLQS leave not recorded");
            }
        }
    }

    /// One script call (queued in the backend's quota lane, which bounds how many reach Redis
    /// at once); the members it names as moved that belong to this replica are pushed.
    async fn call(&self, spec: &PoolSpec, member: &str, op: PoolOp) -> Result<Grant, BackendError> {
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
        let moved: Vec<ParticipantId> = reply
            .moved
            .iter()
            .filter_map(|m| m.strip_prefix(self.replica.as_str()))
            .filter_map(|pid| ParticipantId::from_str_radix(pid, 16).ok())
            .collect();
        if !moved.is_empty() {
            let participants = self.participants.lock();
            for pid in moved {
                if let Some(signal) = participants.get(&pid).and_then(|p| p.signal.upgrade()) {
                    signal.mark(pid);
                }
            }
        }
        Ok(Grant {
            tokens: reply.tokens,
            max_tokens: reply.max_tokens,
        })
    }
}
