//! The request path's tracing: whether spans are made at all ([`enabled`]), the target every
//! exported span carries ([`SPAN_TARGET`]) and the span of one ShouldRateLimit call
//! ([`request_span`]), which continues the caller's W3C `traceparent`. The server and the Redis
//! backend call these; start-up (`telemetry.rs`) switches them on. Nothing here imports from
//! the crate.
//!
//! When tracing is off no span is made: the request path checks one flag and goes on.

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// Whether spans are exported; set once, at start.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// True when ShouldRateLimit calls are traced.
pub(crate) fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Turns span making on, once the exporter runs.
pub(crate) fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// The target of every span this service exports.
pub(crate) const SPAN_TARGET: &str = "ratelimitd::trace";

/// The span of one ShouldRateLimit call, continuing the caller's trace (`traceparent` in
/// `metadata`) when there is one.
pub(crate) fn request_span(metadata: &tonic::metadata::MetadataMap, domain: &str) -> tracing::Span {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let span = tracing::info_span!(target: SPAN_TARGET, "ShouldRateLimit", domain);
    let parent = TraceContextPropagator::new().extract(&Metadata(metadata));
    let _ = span.set_parent(parent);
    span
}

/// gRPC metadata as the propagator reads it.
struct Metadata<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for Metadata<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}
