//! What the integration tests (`tests/`) and the fuzz targets (`fuzz/`) drive directly, below
//! [`run`](crate::run): not an API, no stability promised, hidden from the documentation.

pub use crate::config::{Domain, NodeLimits, Snapshot, Unit, Wildcard, compile_file, load_paths};
pub use crate::engine::{Engine, EngineOptions};
pub use crate::limiter::redis::{RedisUrl, SCRIPT, slot};
pub use crate::limiter::{
    Algorithm, Clock, CounterKey, HashTag, KeyFormat, Limit, ManualClock, MemoryBackend,
    SystemClock,
};
pub use crate::metrics::Metrics;
pub use crate::run_with_clock;
pub use crate::server::grpc::to_request;
/// `RateLimitRequest` as the service decodes it: entries as bytes.
pub use crate::server::wire::RateLimitRequest as WireRequest;
pub use crate::xds::TYPE_URL as XDS_TYPE_URL;
/// The `RateLimitConfig` messages served over xDS.
pub use crate::xds::pb as rls_conf;

pub use crate::rlqs::fair_share::fair_shares;

/// The pool script's fair shares (`rlqs.lua`), run on the standalone Redis at `url`, for
/// the test that holds them against [`fair_shares`].
pub async fn script_fair_shares(
    url: &str,
    capacity: f64,
    demands: &[Option<f64>],
) -> Result<Vec<f64>, String> {
    use crate::limiter::redis::{RedisBackend, RedisOptions, RedisTlsFiles, Topology};
    let url = RedisUrl::parse(url).map_err(|e| e.to_string())?;
    let backend = RedisBackend::new(
        RedisOptions {
            target: Topology::Standalone(url),
            tls: RedisTlsFiles::default(),
            timeout: std::time::Duration::from_secs(5),
            local_cache_bytes: 0,
            pipeline: 1,
            max_batch: 1,
            max_debt: crate::limiter::DEFAULT_MAX_DEBT,
            per_second: None,
        },
        crate::metrics::BackendMetrics::default(),
    )
    .map_err(|e| e.to_string())?;
    backend
        .pool_shares(crate::rlqs::redis_pools::POLICY, capacity, demands)
        .await
        .map_err(|e| e.to_string())
}
