//! Logs and traces at start-up: logging to stderr, and tracing as envoyproxy/ratelimit offers
//! it (`TRACING_*`): spans exported over OTLP (HTTP, its default, or gRPC) with the service's
//! name, namespace and instance id as resource attributes, sampled parent-based at a ratio. A
//! ShouldRateLimit call is a span that continues the caller's W3C `traceparent`; its wait for a
//! Redis answer is a child span. The request path's side is `trace.rs`; this module takes its
//! own settings value ([`TelemetryOptions`]), built by `settings`.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_subscriber::field::MakeExt;
use tracing_subscriber::fmt::format::{Writer, debug_fn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::trace::SPAN_TARGET;

/// Logging and tracing as configured (`--log-*`, `--tracing-*`).
#[derive(Clone, Debug)]
pub struct TelemetryOptions {
    /// The log filter (`--log-level`): a level or tracing directives.
    pub(crate) log_level: String,
    /// How log lines are written.
    pub(crate) log_format: LogFormat,
    /// Span export, when on.
    pub(crate) tracing: Option<TracingOptions>,
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object a line.
    Json,
}

/// How spans leave the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// OTLP over HTTP (protobuf), to `<endpoint>/v1/traces`.
    Http,
    /// OTLP over gRPC.
    Grpc,
}

/// Tracing as configured (`--tracing-*`).
#[derive(Clone, Debug)]
pub(crate) struct TracingOptions {
    /// HTTP or gRPC.
    pub(crate) protocol: Protocol,
    /// The collector's base URL (`OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub(crate) endpoint: String,
    /// `service.name`.
    pub(crate) service_name: String,
    /// `service.namespace`, if any.
    pub(crate) service_namespace: Option<String>,
    /// `service.instance.id`, if any.
    pub(crate) service_instance_id: Option<String>,
    /// Fraction of root traces sampled (a caller's sampled flag decides for its traces).
    pub(crate) sampling_rate: f64,
}

/// Why logging or tracing could not start.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// `--log-level` is not a filter.
    #[error("--log-level: invalid filter '{0}'")]
    Filter(String),
    /// The OTLP exporter refused its settings.
    #[error("--tracing-endpoint: {0}")]
    Exporter(String),
}

/// What keeps the exporter running; dropping it flushes the spans not yet sent.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

/// The filter for `--log-level`: at a bare `info` or `warn`, the Redis client's own lines only
/// from `error` up. redis-rs logs every failed connection attempt at WARN, dozens a second
/// while a Cluster node is down (80 lines in the second after a master died), where the
/// circuit logs the outage once; directives (`warn,redis=warn`) are taken as written.
fn directives(level: &str) -> String {
    if ["info", "warn"].contains(&level.trim().to_ascii_lowercase().as_str()) {
        format!("{},redis=error", level.trim())
    } else {
        level.to_owned()
    }
}

/// Starts logging to stderr and, when `options` ask for tracing, span export. Must run inside
/// a tokio runtime when tracing (the exporter runs on it).
pub fn init(options: &TelemetryOptions) -> Result<Telemetry, TelemetryError> {
    let filter = EnvFilter::try_new(directives(&options.log_level))
        .map_err(|_| TelemetryError::Filter(options.log_level.clone()))?;
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let fmt = match options.log_format {
        LogFormat::Text => fmt.fmt_fields(escaped_fields()).boxed(),
        LogFormat::Json => fmt.json().boxed(),
    };
    let registry = tracing_subscriber::registry().with(fmt.with_filter(filter));
    let Some(options) = &options.tracing else {
        registry.init();
        return Ok(Telemetry { provider: None });
    };
    let provider = provider(options)?;
    let tracer = provider.tracer("ratelimitd");
    // Only this module's spans go to the exporter, whatever the log level.
    let spans = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(tracing_subscriber::filter::filter_fn(|m| {
            m.target() == SPAN_TARGET
        }));
    registry.with(spans).init();
    crate::trace::enable();
    Ok(Telemetry {
        provider: Some(provider),
    })
}

fn provider(options: &TracingOptions) -> Result<SdkTracerProvider, TelemetryError> {
    let exporter = match options.protocol {
        Protocol::Http => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(format!(
                "{}/v1/traces",
                options.endpoint.trim_end_matches('/')
            ))
            .build(),
        Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(options.endpoint.clone())
            .build(),
    }
    .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
    let processor =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            exporter,
            opentelemetry_sdk::runtime::Tokio,
        )
        .build();
    let mut resource =
        opentelemetry_sdk::Resource::builder().with_service_name(options.service_name.clone());
    if let Some(ns) = &options.service_namespace {
        resource = resource.with_attribute(opentelemetry::KeyValue::new(
            "service.namespace",
            ns.clone(),
        ));
    }
    if let Some(id) = &options.service_instance_id {
        resource = resource.with_attribute(opentelemetry::KeyValue::new(
            "service.instance.id",
            id.clone(),
        ));
    }
    Ok(SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            options.sampling_rate,
        ))))
        .with_resource(resource.build())
        .build())
}

/// The text format's fields, each value written so that no value a caller chose (an override's
/// reason, a descriptor's value) can forge a line or a field: a value with a space, `=`, `"`,
/// `\\` or a control character is quoted and escaped as Rust escapes a string, the message has
/// its control characters escaped, and a value already quoted that way (a `?` field) is kept.
/// The JSON format escapes every value itself.
fn escaped_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + Send + Sync + 'static
{
    debug_fn(
        |w: &mut Writer<'_>, field: &tracing::field::Field, value: &dyn std::fmt::Debug| {
            let raw = format!("{value:?}");
            if field.name() == "message" {
                return write_controls_escaped(w, &raw);
            }
            if is_plain(&raw) || is_quoted(&raw) {
                write!(w, "{}={raw}", field.name())
            } else {
                write!(w, "{}={raw:?}", field.name())
            }
        },
    )
    .delimited(" ")
}

fn write_controls_escaped(w: &mut Writer<'_>, text: &str) -> std::fmt::Result {
    for c in text.chars() {
        if c.is_control() {
            write!(w, "{}", c.escape_default())?;
        } else {
            w.write_char(c)?;
        }
    }
    Ok(())
}

/// A value that reads as itself: no space, `=`, quote, backslash or control character.
fn is_plain(raw: &str) -> bool {
    !raw.is_empty()
        && raw
            .chars()
            .all(|c| !(c.is_whitespace() || c.is_control() || matches!(c, '=' | '"' | '\\')))
}

/// A string as Rust's `Debug` writes one: quoted, every inner quote escaped, no control
/// character.
fn is_quoted(raw: &str) -> bool {
    let Some(inner) = raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) else {
        return false;
    };
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.next().is_none() => return false,
            '"' => return false,
            c if c.is_control() => return false,
            _ => {}
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_level_quiets_the_redis_clients_warnings() {
        assert_eq!(directives("warn"), "warn,redis=error");
        assert_eq!(directives("INFO"), "INFO,redis=error");
        assert_eq!(directives("debug"), "debug", "debugging shows everything");
        assert_eq!(
            directives("warn,redis=warn"),
            "warn,redis=warn",
            "as written"
        );
        assert!(EnvFilter::try_new(directives("info")).is_ok());
    }

    #[test]
    fn values_that_could_forge_a_field_or_a_line_are_quoted() {
        assert!(is_plain("alice") && is_plain("Some(3)") && !is_plain("tenant=acme"));
        assert!(!is_plain("a b") && !is_plain("a\nb") && !is_plain(""));
        assert!(is_quoted("\"a b\"") && is_quoted("\"a\\\"b\""));
        assert!(!is_quoted("\"x\" by=alice \"y\"") && !is_quoted("\"a\nb\""));
        assert!(!is_quoted("\"a\\\""));
    }
}
