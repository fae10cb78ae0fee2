//! The replicas alive on one Redis, counted there: each replica marks itself in one sorted set
//! (scored by Redis' own clock) every second and counts the marks younger than three seconds.
//! The `share` failure mode cuts each limit by this count while Redis is away.

use std::sync::Arc;
use std::time::Duration;

use super::RedisBackend;
use crate::limiter::BackendError;
use crate::limiter::share::ReplicaCount;

/// How often a replica marks itself.
pub(crate) const EVERY: Duration = Duration::from_secs(1);
/// How long a mark counts: a replica that stopped marking (stopped, crashed, cut off) leaves
/// the count this long after its last mark.
const LIVES: Duration = Duration::from_secs(3);

/// A name for a replica, unlike any other's (each backend draws its own: one process may run
/// several services, as the tests do).
pub(super) fn new_name() -> String {
    // A RandomState's keys are drawn at random for each one.
    let state = std::hash::RandomState::new();
    format!(
        "{:016x}",
        std::hash::BuildHasher::hash_one(&state, std::process::id())
    )
}

/// The sorted set of the replicas' marks, beside the counters.
pub(crate) fn key(prefix: &[u8]) -> Vec<u8> {
    [prefix, b"{ratelimitd}:replicas"].concat()
}

/// Marks `replica`, drops marks past their life and counts the rest, on Redis' clock.
const MARK: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lives = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - lives)
redis.call('PEXPIRE', KEYS[1], lives)
return redis.call('ZCARD', KEYS[1])
";

impl RedisBackend {
    /// This replica's name (here and in `/top`'s exchange).
    pub(crate) fn replica_name(&self) -> &str {
        &self.name
    }

    /// Marks this replica alive in `key` and counts the replicas alive there.
    pub(crate) async fn mark_alive(&self, key: &[u8]) -> Result<u32, BackendError> {
        let n: u64 = self
            .command(
                redis::cmd("EVAL")
                    .arg(MARK)
                    .arg(1)
                    .arg(key)
                    .arg(&self.name)
                    .arg(LIVES.as_millis() as u64),
            )
            .await?;
        let n = n.clamp(1, u64::from(u32::MAX)) as u32;
        self.replicas.set(n);
        self.metrics.replicas.set(i64::from(n));
        Ok(n)
    }

    /// Marks this replica alive every [`EVERY`] until the backend is dropped (the count read by
    /// [`RedisBackend::replica_count`]: unchanged while Redis cannot be reached, the last one).
    pub(crate) fn spawn_presence(self: &Arc<Self>, key: Vec<u8>) -> tokio::task::JoinHandle<()> {
        let backend = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(EVERY).await;
                let Some(b) = backend.upgrade() else { return };
                let _ = b.mark_alive(&key).await;
            }
        })
    }

    /// The replicas alive on this Redis as last counted (1 until they are).
    pub(crate) fn replica_count(&self) -> ReplicaCount {
        self.replicas.clone()
    }

    /// [`RedisBackend::replica_count`]'s value.
    pub(crate) fn replicas(&self) -> u32 {
        self.replicas.get()
    }
}
