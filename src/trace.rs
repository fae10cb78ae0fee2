//! The request path's tracing: whether spans are made at all ([`enabled`]), the target every
//! exported span carries ([`SPAN_TARGET`]) and the span of one ShouldRateLimit call
//! ([`request_span`]), which continues the caller's W3C `traceparent` or B3 headers. The
//! server and the Redis backend call these; start-up (`telemetry.rs`) switches them on. Nothing
//! here imports from the crate.
//!
//! When tracing is off no span is made: the request path checks one flag and goes on.

use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
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

/// The span of one ShouldRateLimit call, continuing the caller's trace when there is one: W3C
/// `traceparent` first, else B3 (the single `b3` header, else `x-b3-traceid` and its
/// siblings), as envoyproxy/ratelimit accepts both.
pub(crate) fn request_span(metadata: &tonic::metadata::MetadataMap, domain: &str) -> tracing::Span {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let span = tracing::info_span!(target: SPAN_TARGET, "ShouldRateLimit", domain);
    let carrier = Metadata(metadata);
    let mut parent = TraceContextPropagator::new().extract(&carrier);
    if !parent.span().span_context().is_valid()
        && let Some(b3) = b3(&carrier)
    {
        parent = opentelemetry::Context::new().with_remote_span_context(b3);
    }
    let _ = span.set_parent(parent);
    span
}

/// The caller's span from B3 headers: `b3: {trace}-{span}[-{sampled}[-{parent}]]`, else
/// `x-b3-traceid`, `x-b3-spanid`, `x-b3-sampled` and `x-b3-flags`. A 64-bit trace id is
/// widened with zeros, as B3 specifies; sampled is `1`, `true` or debug (`d`, flags `1`).
fn b3(carrier: &dyn Extractor) -> Option<SpanContext> {
    let (trace, span, sampled) = match carrier.get("b3") {
        Some(single) => {
            let mut parts = single.split('-');
            let (trace, span) = (parts.next()?, parts.next()?);
            (trace, span, parts.next().map(|s| s == "1" || s == "d"))
        }
        None => (
            carrier.get("x-b3-traceid")?,
            carrier.get("x-b3-spanid")?,
            carrier
                .get("x-b3-sampled")
                .map(|s| s == "1" || s.eq_ignore_ascii_case("true"))
                .or_else(|| carrier.get("x-b3-flags").map(|f| f == "1")),
        ),
    };
    let trace = match trace.len() {
        32 => TraceId::from_hex(trace).ok()?,
        16 => TraceId::from_hex(&format!("{:0>32}", trace)).ok()?,
        _ => return None,
    };
    let span = (span.len() == 16)
        .then(|| SpanId::from_hex(span).ok())
        .flatten()?;
    let flags = if sampled == Some(true) {
        TraceFlags::SAMPLED
    } else {
        TraceFlags::default()
    };
    let context = SpanContext::new(trace, span, flags, true, TraceState::default());
    context.is_valid().then_some(context)
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
