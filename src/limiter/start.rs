//! Starting the backend the settings name: the memory backend (swept in the background), or
//! Redis (probed) with the memory backend as its `local` failure mode.

use std::sync::Arc;
use std::time::Duration;

use super::failure_mode::{FailureMode, WithFailureMode};
use super::key::KeyFormat;
use super::redis::{RedisBackend, RedisOptions, SetupError, presence};
use super::share::Shares;
use super::{Backend, Clock, MemoryBackend};
use crate::metrics::{Metrics, ModeLabels};
use crate::shutdown::Tasks;

/// How often the memory backend drops expired counters in the background.
const SWEEP_EVERY: Duration = Duration::from_secs(10);
/// How often the Redis backend checks that Redis answers, traffic or not.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Where counters live, and the bounds every store shares.
pub(crate) struct BackendOptions {
    /// The memory backend, or Redis.
    pub(crate) kind: BackendKind,
    /// Bound of the memory backend (and the `local` failure mode).
    pub(crate) memory_max_bytes: u64,
    /// How far past its limit a cost report may take a counter, in limits (every backend).
    pub(crate) max_debt: u64,
}

/// The chosen store.
pub(crate) enum BackendKind {
    /// The embedded memory backend.
    Memory,
    /// Redis, and what to answer while it is unavailable.
    Redis {
        /// Where and how to reach it.
        redis: Box<RedisOptions>,
        /// What to answer while it is unavailable.
        failure_mode: FailureMode,
        /// `share`: how long a request waits for Redis before it is decided alone.
        share_after: Duration,
    },
}

/// A started backend.
pub(crate) struct Started {
    /// What the engine counts on.
    pub(crate) backend: Arc<dyn Backend>,
    /// Redis, when it is the store, with its failure mode: RLQS pools live there too.
    pub(crate) redis: Option<(Arc<RedisBackend>, FailureMode)>,
}

/// Starts the backend `options` name, its background tasks in `tasks`, and readies it for the
/// first burst (Redis: connected and the script loaded, or marked unreachable so that the
/// failure mode answers). `keys` is logged.
pub(crate) async fn start(
    options: &BackendOptions,
    keys: &KeyFormat,
    clock: Arc<dyn Clock>,
    metrics: &Metrics,
    tasks: &mut Tasks,
) -> Result<Started, SetupError> {
    tracing::info!(
        tzdb = super::calendar::tzdb_version(),
        "calendar windows follow the time-zone data built in"
    );
    let memory = Arc::new(
        MemoryBackend::bounded(
            clock.clone(),
            options.memory_max_bytes,
            metrics.memory.clone(),
        )
        .with_max_debt(options.max_debt),
    );
    // What one counter can keep, for an operator sizing concurrency limits: a place under
    // Envoy's x-request-id (a 36-byte UUID) costs its id, its marker byte and the overhead.
    let share = memory.counter_share();
    let per_place = 37 + super::hold::HOLD_OVERHEAD;
    tracing::info!(
        max_bytes = options.memory_max_bytes,
        counter_share = share,
        places_per_counter = share.saturating_sub(1024) / per_place,
        "memory backend: one counter keeps at most its share of the bound, holds and places included"
    );
    tasks.push({
        let memory = memory.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            loop {
                tick.tick().await;
                memory.sweep();
            }
        })
    });
    Ok(match &options.kind {
        BackendKind::Memory => Started {
            backend: memory,
            redis: None,
        },
        BackendKind::Redis {
            redis,
            failure_mode,
            share_after,
        } => {
            tracing::info!(target = ?redis.target, per_second = ?redis.per_second, hash_tag = ?keys.hash_tag(), failure_mode = failure_mode.as_str(), pipeline = redis.pipeline, max_batch = redis.max_batch, "redis backend");
            let within = super::redis::connection::response_timeout(redis.timeout);
            let redis = Arc::new(
                RedisBackend::new(RedisOptions::clone(redis), metrics.backend.clone())?
                    .with_clock(clock.clone()),
            );
            let began = tokio::time::Instant::now();
            let unready = redis.warm(within).await;
            if !unready.is_empty() {
                tracing::warn!(
                    failure_mode = failure_mode.as_str(),
                    "redis not ready at start: the failure mode answers until it is back"
                );
            } else {
                tracing::info!(
                    took = ?began.elapsed(),
                    "redis ready: connected and the script loaded"
                );
            }
            for probe in redis.spawn_probes(PROBE_EVERY) {
                tasks.push(probe);
            }
            tasks.push(redis.spawn_eviction_check());
            crate::metrics::at_zero(
                &metrics.backend.failure_mode_decisions,
                [ModeLabels {
                    mode: failure_mode.as_str(),
                }],
            );
            let shares = if *failure_mode == FailureMode::Share {
                // Counted on Redis: marked once now (a replica ready counts itself at once),
                // then every second.
                let key = presence::key(keys.prefix());
                if unready.is_empty() {
                    let _ = tokio::time::timeout(within, redis.mark_alive(&key)).await;
                }
                tasks.push(redis.spawn_presence(key));
                Some(Arc::new(Shares::new(
                    memory.clone(),
                    clock.clone(),
                    redis.replica_count(),
                    *share_after,
                )))
            } else {
                None
            };
            let backend = Arc::new(WithFailureMode::new(
                redis.clone(),
                *failure_mode,
                memory,
                shares,
                metrics.backend.clone(),
            ));
            Started {
                backend,
                redis: Some((redis, *failure_mode)),
            }
        }
    })
}
