//! `envoy.service.ratelimit.v3.RateLimitService` over tonic: converts Envoy's messages to the
//! protocol-free [`crate::engine`] request types and back. With `json.rs` (the same
//! messages as JSON) the only module that knows RLS's types; Envoy's other types are used by
//! `rlqs.rs` (RLQS), `xds/` (the ADS client) and `serve.rs` (registering the services).

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as PbCode, DescriptorStatus, RateLimit, rate_limit::Unit as PbUnit,
};
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};
use tonic::{Request, Response, Status};

use super::answer;
use super::conn::Delivery;
use super::headers::{self, HeaderMode};
use super::wire::rate_limit_service_server::RateLimitService;
use super::wire::{RateLimitDescriptor, RateLimitRequest};

use crate::config::Unit;
use crate::config::answer::Answer;
use crate::engine::{self, Code, Descriptor, Engine, EngineError, LimitOverride};
use crate::logs::{self, Throttle};
use crate::metrics::{ErrorLabels, Metrics};
use crate::value::shown;

/// The gRPC front end of an [`Engine`].
pub(crate) struct GrpcService {
    engine: Arc<Engine>,
    metrics: Arc<Metrics>,
    telling: Telling,
}

impl GrpcService {
    /// Serves `engine`, recording timings in `metrics`, telling clients as `telling` says.
    pub(crate) fn new(engine: Arc<Engine>, metrics: Arc<Metrics>, telling: Telling) -> Self {
        crate::metrics::at_zero(
            &metrics.grpc_errors,
            ERROR_CODES.map(|code| ErrorLabels {
                code: code.to_owned(),
            }),
        );
        Self {
            engine,
            metrics,
            telling,
        }
    }
}

/// The gRPC status of a request that got no decision. Clients get a short, stable message;
/// what happened goes to the log.
pub(crate) fn to_status(e: EngineError) -> Status {
    match e {
        EngineError::InvalidArgument(m) => Status::invalid_argument(m),
        // envoyproxy/ratelimit's answer before its first config.
        EngineError::NoConfig => Status::unknown(EngineError::NoConfig.to_string()),
        EngineError::Backend(e) if e.is_transient() => {
            // Every request while the store is away: once per interval in the log.
            static LOG: Throttle = Throttle::new(logs::EVERY);
            if let Some(held_back) = LOG.pass() {
                tracing::warn!(error = %e, held_back, "backend unavailable");
            }
            Status::unavailable("rate limit backend unavailable")
        }
        EngineError::Backend(e) => {
            static LOG: Throttle = Throttle::new(logs::EVERY);
            if let Some(held_back) = LOG.pass() {
                tracing::error!(error = %e, held_back, "backend failed");
            }
            Status::internal("rate limit backend error")
        }
    }
}

fn json_to_value(v: &serde_json::Value) -> Value {
    Value {
        kind: Some(match v {
            serde_json::Value::Null => Kind::NullValue(0),
            serde_json::Value::Bool(b) => Kind::BoolValue(*b),
            serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
            serde_json::Value::String(s) => Kind::StringValue(s.clone()),
            serde_json::Value::Array(a) => Kind::ListValue(ListValue {
                values: a.iter().map(json_to_value).collect(),
            }),
            serde_json::Value::Object(o) => Kind::StructValue(json_to_struct(o)),
        }),
    }
}

fn json_to_struct(o: &serde_json::Map<String, serde_json::Value>) -> Struct {
    Struct {
        fields: o
            .iter()
            .map(|(k, v)| (k.clone(), json_to_value(v)))
            .collect(),
    }
}

/// The dynamic metadata envoyproxy/ratelimit returns: the domain, each descriptor (entries as
/// `key=value`, its override and hits), the request's hits, and the merged `metadata` of the
/// descriptors that passed.
pub(crate) fn dynamic_metadata(
    req: &RateLimitRequest,
    metadata: Option<&serde_json::Map<String, serde_json::Value>>,
    longest_value: usize,
) -> serde_json::Value {
    use serde_json::json;
    let descriptors: Vec<serde_json::Value> = req
        .descriptors
        .iter()
        .map(|d| {
            let mut o = serde_json::Map::new();
            let entries: Vec<String> = d
                .entries
                .iter()
                .map(|e| {
                    format!(
                        "{}={}",
                        shown(&e.key, longest_value),
                        shown(&e.value, longest_value)
                    )
                })
                .collect();
            o.insert("entries".into(), json!(entries));
            if let Some(l) = &d.limit {
                let unit = RateLimitUnit::try_from(l.unit)
                    .map_or_else(|_| l.unit.to_string(), |u| u.as_str_name().to_owned());
                o.insert(
                    "limit".into(),
                    json!(format!(
                        "requests_per_unit:{} unit:{unit}",
                        l.requests_per_unit
                    )),
                );
            }
            if let Some(h) = &d.hits_addend {
                o.insert("hitsAddend".into(), json!(h.value as f64));
            }
            serde_json::Value::Object(o)
        })
        .collect();
    let mut fields = serde_json::Map::new();
    fields.insert("domain".into(), json!(shown(&req.domain, longest_value)));
    fields.insert("descriptors".into(), json!(descriptors));
    if req.hits_addend != 0 {
        fields.insert("hitsAddend".into(), json!(req.hits_addend as f64));
    }
    if let Some(m) = metadata.filter(|m| !m.is_empty()) {
        fields.insert("metadata".into(), serde_json::Value::Object(m.clone()));
    }
    serde_json::Value::Object(fields)
}

/// An override's unit, or `None` for one that names no unit this service knows: `UNKNOWN`
/// (0) is what Envoy sends when a `limit` read from dynamic metadata says `"UNKNOWN"`, so a
/// request can carry it. `WEEK` (7) is the response's numbering, which newer protos share.
fn override_unit(unit: i32) -> Option<Unit> {
    if unit == PbUnit::Week as i32 {
        return Some(Unit::Week);
    }
    match RateLimitUnit::try_from(unit).ok()? {
        RateLimitUnit::Unknown => None,
        RateLimitUnit::Second => Some(Unit::Second),
        RateLimitUnit::Minute => Some(Unit::Minute),
        RateLimitUnit::Hour => Some(Unit::Hour),
        RateLimitUnit::Day => Some(Unit::Day),
        RateLimitUnit::Month => Some(Unit::Month),
        RateLimitUnit::Year => Some(Unit::Year),
    }
}

fn pb_unit(unit: Unit) -> PbUnit {
    match unit {
        Unit::Second => PbUnit::Second,
        Unit::Minute => PbUnit::Minute,
        Unit::Hour => PbUnit::Hour,
        Unit::Day => PbUnit::Day,
        Unit::Week => PbUnit::Week,
        Unit::Month => PbUnit::Month,
        Unit::Year => PbUnit::Year,
    }
}

/// What an Envoy request asks that this service cannot honour (answered `INVALID_ARGUMENT`,
/// or 400 on `/json`). Only Envoy's configuration can send it, never a client through Envoy
/// (docs/operations.md, "What a client can cause").
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// A domain that is not UTF-8 (Envoy's configuration names it, and Envoy's configuration
    /// is UTF-8).
    #[error("domain is not UTF-8")]
    Domain,
}

/// Converts one descriptor. A `limit` override whose unit is none this service knows is left
/// out, so the configured limit decides: the override may come from dynamic metadata that a
/// request shaped, and a failed call would let the request through.
fn descriptor(d: &RateLimitDescriptor) -> Descriptor<'_> {
    let limit_override = d.limit.as_ref().and_then(|o| {
        Some(LimitOverride {
            requests_per_unit: o.requests_per_unit as u64,
            unit: override_unit(o.unit)?,
        })
    });
    Descriptor {
        entries: d
            .entries
            .iter()
            .map(|e| (e.key.as_slice(), e.value.as_slice()))
            .collect(),
        limit_override,
        hits_addend: d.hits_addend.map(|h| h.value),
        refund: d.is_negative_hits,
    }
}

/// Converts a request (no copies of strings).
pub fn to_request(req: &RateLimitRequest) -> Result<engine::Request<'_>, RequestError> {
    Ok(engine::Request {
        domain: std::str::from_utf8(&req.domain).map_err(|_| RequestError::Domain)?,
        descriptors: req.descriptors.iter().map(descriptor).collect(),
        hits_addend: req.hits_addend as u64,
    })
}

fn pb_code(code: Code) -> i32 {
    match code {
        Code::Ok => PbCode::Ok as i32,
        Code::OverLimit => PbCode::OverLimit as i32,
    }
}

/// How a response tells the client: the `--response-headers` mode and the server's default
/// `answer` (for limits without their own).
#[derive(Clone, Debug)]
pub(crate) struct Telling {
    /// The headers mode.
    pub(crate) headers: HeaderMode,
    /// The default answer.
    pub(crate) answer: Option<Arc<Answer>>,
}

/// Converts a decision to Envoy's response, with the limits' answers (headers, a 429's body),
/// the headers `telling` asks for (those an answer names are the answer's) and, when the
/// decision carries it, dynamic metadata.
pub(crate) fn to_response(
    req: &RateLimitRequest,
    resp: engine::Response,
    telling: &Telling,
    now_s: u64,
    longest_value: usize,
) -> RateLimitResponse {
    let header = |key: String, value: String| HeaderValue {
        key,
        value,
        raw_value: Vec::new(),
    };
    let mode = headers::headers(telling.headers, &resp, now_s);
    let (mut response_headers_to_add, mut raw_body) = (Vec::new(), Vec::new());
    let mut request_headers_to_add = Vec::new();
    if let Some(rendered) = answer::render(req, &resp, telling.answer.as_deref()) {
        request_headers_to_add = rendered
            .upstream
            .into_iter()
            .map(|(key, value)| header(key, value))
            .collect();
        response_headers_to_add.reserve(rendered.headers.len() + mode.len() + 1);
        if let Some((body, content_type)) = rendered.body {
            raw_body = body;
            response_headers_to_add.push(header("content-type".to_owned(), content_type));
        }
        for (key, value) in rendered.headers {
            response_headers_to_add.push(header(key, value));
        }
    }
    let answered = response_headers_to_add.len();
    for (key, value) in mode {
        if !response_headers_to_add[..answered]
            .iter()
            .any(|h| h.key.eq_ignore_ascii_case(key))
        {
            response_headers_to_add.push(header(key.to_owned(), value));
        }
    }
    let dynamic_metadata = resp.metadata.is_some().then(|| {
        match dynamic_metadata(req, resp.metadata.as_ref(), longest_value) {
            serde_json::Value::Object(o) => json_to_struct(&o),
            _ => Struct::default(),
        }
    });
    RateLimitResponse {
        response_headers_to_add,
        request_headers_to_add,
        raw_body,
        dynamic_metadata,
        overall_code: pb_code(resp.overall),
        statuses: resp
            .statuses
            .into_iter()
            .map(|s| DescriptorStatus {
                code: pb_code(s.code),
                current_limit: s.limit.map(|l| RateLimit {
                    name: l.name.as_deref().unwrap_or_default().to_owned(),
                    requests_per_unit: u32::try_from(l.requests_per_unit).unwrap_or(u32::MAX),
                    unit: pb_unit(l.unit) as i32,
                }),
                limit_remaining: u32::try_from(s.remaining).unwrap_or(u32::MAX),
                duration_until_reset: s.reset.map(|d| PbDuration {
                    seconds: whole_seconds(d),
                    nanos: 0,
                }),
                quota: None,
            })
            .collect(),
        ..Default::default()
    }
}

/// A reset in whole seconds, rounded up: Envoy writes `x-ratelimit-reset` (and 1.40's
/// `Retry-After`) as whole seconds, truncating, so 0.93 s would read 0 and a client honouring it
/// would retry at once, refused. Rounded up, a client that waits what it is told is admitted
/// (envoyproxy/ratelimit's resets are whole seconds too).
fn whole_seconds(d: Duration) -> i64 {
    i64::try_from(headers::secs_ceil(d)).unwrap_or(i64::MAX)
}

/// The `code` labels of `ratelimit_grpc_errors_total`.
const ERROR_CODES: [&str; 5] = [
    "invalid_argument",
    "unavailable",
    "deadline_exceeded",
    "resource_exhausted",
    "internal",
];

/// Decrements the in-flight gauge however the call ends (even if the client goes away).
struct InFlight<'a>(&'a Metrics);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.dec();
    }
}

impl GrpcService {
    fn error(&self, status: Status) -> Status {
        let code = match status.code() {
            tonic::Code::InvalidArgument => ERROR_CODES[0],
            tonic::Code::Unavailable => ERROR_CODES[1],
            tonic::Code::DeadlineExceeded => ERROR_CODES[2],
            tonic::Code::ResourceExhausted => ERROR_CODES[3],
            _ => ERROR_CODES[4],
        }
        .to_owned();
        self.metrics
            .grpc_errors
            .get_or_create(&ErrorLabels { code })
            .inc();
        status
    }
}

#[tonic::async_trait]
impl RateLimitService for GrpcService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let started = Instant::now();
        self.metrics.in_flight.inc();
        let _done = InFlight(&self.metrics);
        let req = request.get_ref();
        let decide = async {
            match to_request(req) {
                Err(e) => Err(Status::invalid_argument(e.to_string())),
                Ok(req) => match self.engine.should_rate_limit_undoably(&req).await {
                    Ok((resp, taken)) => {
                        // What it took is given back should the answer never go out.
                        if let (Some(taken), Some(delivery)) =
                            (taken, request.extensions().get::<Delivery>())
                        {
                            delivery.on_undelivered(&self.engine, taken);
                        }
                        Ok(Response::new(to_response(
                            request.get_ref(),
                            resp,
                            &self.telling,
                            headers::now_s(self.telling.headers),
                            self.engine.longest_value(),
                        )))
                    }
                    Err(e) => Err(to_status(e)),
                },
            }
        };
        // Without tracing no span is made: one flag read.
        let result = if crate::trace::enabled() {
            use tracing::Instrument;
            let domain = shown(&req.domain, self.engine.longest_value());
            let span = crate::trace::request_span(request.metadata(), &domain);
            decide.instrument(span).await
        } else {
            decide.await
        };
        self.metrics
            .request_duration
            .observe(started.elapsed().as_secs_f64());
        result.map_err(|s| self.error(s))
    }
}
