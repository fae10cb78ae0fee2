//! Every metric the service exports, named in one place (Prometheus text format on /metrics).
//! One registry per server instance, so tests can run several servers in one process.

use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// The outcome of one limit for one descriptor.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Decision {
    /// Within the limit, below the near-limit ratio.
    within_limit,
    /// Within the limit, past `--near-limit-ratio` of it.
    near_limit,
    /// Over the limit and enforced.
    over_limit,
    /// Over the limit of a shadow-mode rule (reported, not enforced).
    shadow_mode,
}

/// Labels of `ratelimit_decisions_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// The request's domain.
    pub domain: Arc<String>,
    /// The rule's config path (request values only where the config asks for them).
    pub rule: Arc<String>,
    /// What happened.
    pub decision: Decision,
}

/// Result of a config load.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum LoadResult {
    /// The new snapshot is in force.
    success,
    /// Refused; the previous snapshot stays in force.
    error,
}

/// Labels of `ratelimit_config_loads_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoadLabels {
    /// success or error.
    pub result: LoadResult,
}

/// Labels of `ratelimit_grpc_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// The gRPC status code name (invalid_argument, unavailable, …).
    pub code: String,
}

/// Labels of `ratelimit_backend_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// timeout, connection, cluster, noscript, circuit_open or other.
    pub kind: &'static str,
}

/// Labels of `ratelimit_failure_mode_decisions_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabels {
    /// error, allow, deny or local.
    pub mode: &'static str,
}

/// What the memory backend (or the `local` failure mode) reports: bytes of counter state held
/// and counters given up at the `--memory-max-bytes` bound.
#[derive(Clone, Default)]
pub struct MemoryMetrics {
    /// `ratelimit_memory_bytes`.
    pub bytes: Gauge,
    /// `ratelimit_memory_evictions_total`.
    pub evictions: Counter,
}

/// The service's metrics and the registry that exports them.
pub struct Metrics {
    registry: Registry,
    /// `ratelimit_decisions_total{domain,rule,decision}`.
    pub decisions: Family<DecisionLabels, Counter>,
    /// `ratelimit_config_loads_total{result}`.
    pub config_loads: Family<LoadLabels, Counter>,
    /// `ratelimit_config_rules`: rules in the snapshot in force.
    pub config_rules: Gauge,
    /// `ratelimit_request_duration_seconds`: ShouldRateLimit handling time.
    pub request_duration: Histogram,
    /// `ratelimit_grpc_errors_total{code}`: requests answered with a gRPC error.
    pub grpc_errors: Family<ErrorLabels, Counter>,
    /// `ratelimit_requests_in_flight`: ShouldRateLimit calls being handled now.
    pub in_flight: Gauge,
    /// `ratelimit_backend_errors_total{kind}`: failed backend calls.
    pub backend_errors: Family<KindLabels, Counter>,
    /// `ratelimit_backend_duration_seconds`: one backend round trip (one script call).
    pub backend_duration: Histogram,
    /// `ratelimit_backend_up`: 1 while the backend is reachable.
    pub backend_up: Gauge,
    /// `ratelimit_local_cache_hits_total`: requests answered by the over-limit cache.
    pub local_cache_hits: Counter,
    /// `ratelimit_failure_mode_decisions_total{mode}`: requests decided by the failure mode.
    pub failure_mode_decisions: Family<ModeLabels, Counter>,
    /// The memory backend's bytes and evictions.
    pub memory: MemoryMetrics,
    /// `ratelimit_tls_reloads_total{result}`: reloads of the gRPC listener's TLS files.
    pub tls_reloads: Family<LoadLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics in a new registry.
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "ratelimit_decisions",
            "Limit decisions per domain, rule and outcome",
            decisions.clone(),
        );
        let config_loads = Family::<LoadLabels, Counter>::default();
        registry.register(
            "ratelimit_config_loads",
            "Config loads by result; a failed reload keeps the previous config",
            config_loads.clone(),
        );
        let config_rules = Gauge::default();
        registry.register(
            "ratelimit_config_rules",
            "Limits in the config in force",
            config_rules.clone(),
        );
        let request_duration = Histogram::new([
            0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
            0.05, 0.1, 0.25, 1.0,
        ]);
        registry.register(
            "ratelimit_request_duration_seconds",
            "Time to answer ShouldRateLimit",
            request_duration.clone(),
        );
        let grpc_errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "ratelimit_grpc_errors",
            "ShouldRateLimit calls answered with a gRPC error, by code",
            grpc_errors.clone(),
        );
        let backend_errors = Family::<KindLabels, Counter>::default();
        registry.register(
            "ratelimit_backend_errors",
            "Failed backend calls by kind",
            backend_errors.clone(),
        );
        let backend_duration = Histogram::new([
            0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
            0.25, 1.0,
        ]);
        registry.register(
            "ratelimit_backend_duration_seconds",
            "Backend round trip (one script call)",
            backend_duration.clone(),
        );
        let backend_up = Gauge::default();
        backend_up.set(1);
        registry.register(
            "ratelimit_backend_up",
            "1 while the backend is reachable",
            backend_up.clone(),
        );
        let local_cache_hits = Counter::default();
        registry.register(
            "ratelimit_local_cache_hits",
            "Requests answered by the over-limit cache without a backend call",
            local_cache_hits.clone(),
        );
        let failure_mode_decisions = Family::<ModeLabels, Counter>::default();
        registry.register(
            "ratelimit_failure_mode_decisions",
            "Requests decided by the failure mode while the backend was unavailable",
            failure_mode_decisions.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "ratelimit_requests_in_flight",
            "ShouldRateLimit calls being handled now",
            in_flight.clone(),
        );
        let memory = MemoryMetrics::default();
        registry.register(
            "ratelimit_memory_bytes",
            "Bytes of counter state the memory backend holds, keys included",
            memory.bytes.clone(),
        );
        registry.register(
            "ratelimit_memory_evictions",
            "Live counters given up at --memory-max-bytes (each may admit up to its limit again)",
            memory.evictions.clone(),
        );
        let tls_reloads = Family::<LoadLabels, Counter>::default();
        registry.register(
            "ratelimit_tls_reloads",
            "Reloads of the gRPC listener's TLS files by result; a failed one keeps the previous",
            tls_reloads.clone(),
        );
        Metrics {
            tls_reloads,
            memory,
            in_flight,
            backend_errors,
            backend_duration,
            backend_up,
            local_cache_hits,
            failure_mode_decisions,
            registry,
            decisions,
            config_loads,
            config_rules,
            request_duration,
            grpc_errors,
        }
    }

    /// Counts a config load.
    pub fn config_load(&self, result: LoadResult) {
        self.config_loads
            .get_or_create(&LoadLabels { result })
            .inc();
    }

    /// Counts a reload of the gRPC listener's TLS files.
    pub fn tls_reload(&self, result: LoadResult) {
        self.tls_reloads.get_or_create(&LoadLabels { result }).inc();
    }

    /// Counts a failed backend call.
    pub fn backend_error(&self, kind: &'static str) {
        self.backend_errors
            .get_or_create(&KindLabels { kind })
            .inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}
