//! `envoy.service.ratelimit.v3.RateLimitService` over tonic: converts Envoy's messages to the
//! protocol-free [`service`](crate::service) types and back. The only module that knows them.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as PbCode, DescriptorStatus, RateLimit, rate_limit::Unit as PbUnit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::envoy::r#type::v3::RateLimitUnit;
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tonic::{Request, Response, Status};

use crate::config::Unit;
use crate::metrics::{ErrorLabels, Metrics};
use crate::service::{self, Code, Descriptor, LimitOverride, RateLimiter, ServiceError};

/// The gRPC front end of a [`RateLimiter`].
pub struct GrpcService {
    limiter: Arc<RateLimiter>,
    metrics: Arc<Metrics>,
}

impl GrpcService {
    /// Serves `limiter`, recording timings in `metrics`.
    pub fn new(limiter: Arc<RateLimiter>, metrics: Arc<Metrics>) -> Self {
        Self { limiter, metrics }
    }
}

fn override_unit(unit: i32) -> Option<Unit> {
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

/// Converts one descriptor, refusing what we cannot honour.
fn descriptor(i: usize, d: &RateLimitDescriptor) -> Result<Descriptor<'_>, String> {
    if d.is_negative_hits {
        return Err(format!(
            "descriptors[{i}].is_negative_hits is not supported (refunds are not implemented)"
        ));
    }
    let limit_override = match &d.limit {
        None => None,
        Some(o) => Some(LimitOverride {
            requests_per_unit: o.requests_per_unit as u64,
            unit: override_unit(o.unit).ok_or_else(|| {
                format!("descriptors[{i}].limit.unit {} is not a valid unit", o.unit)
            })?,
        }),
    };
    Ok(Descriptor {
        entries: d
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
            .collect(),
        limit_override,
        hits_addend: d.hits_addend.map(|h| h.value),
    })
}

/// Converts a request (no copies of strings).
pub fn to_request(req: &RateLimitRequest) -> Result<service::Request<'_>, String> {
    Ok(service::Request {
        domain: &req.domain,
        descriptors: req
            .descriptors
            .iter()
            .enumerate()
            .map(|(i, d)| descriptor(i, d))
            .collect::<Result<_, _>>()?,
        hits_addend: req.hits_addend as u64,
    })
}

fn pb_code(code: Code) -> i32 {
    match code {
        Code::Ok => PbCode::Ok as i32,
        Code::OverLimit => PbCode::OverLimit as i32,
    }
}

/// Converts a decision to Envoy's response.
pub fn to_response(resp: service::Response) -> RateLimitResponse {
    RateLimitResponse {
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
                    seconds: d.as_secs() as i64,
                    nanos: d.subsec_nanos() as i32,
                }),
                quota: None,
            })
            .collect(),
        ..Default::default()
    }
}

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
            tonic::Code::InvalidArgument => "invalid_argument",
            tonic::Code::Unavailable => "unavailable",
            tonic::Code::DeadlineExceeded => "deadline_exceeded",
            tonic::Code::ResourceExhausted => "resource_exhausted",
            _ => "internal",
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
        let result = match to_request(req) {
            Err(message) => Err(Status::invalid_argument(message)),
            Ok(req) => match self.limiter.should_rate_limit(&req).await {
                Ok(resp) => Ok(Response::new(to_response(resp))),
                Err(ServiceError::InvalidArgument(m)) => Err(Status::invalid_argument(m)),
                // Clients get a short, stable message; what happened goes to the log.
                Err(ServiceError::Backend(e)) if e.is_transient() => {
                    tracing::warn!(error = %e, "backend unavailable");
                    Err(Status::unavailable("rate limit backend unavailable"))
                }
                Err(ServiceError::Backend(e)) => {
                    tracing::error!(error = %e, "backend failed");
                    Err(Status::internal("rate limit backend error"))
                }
            },
        };
        self.metrics
            .request_duration
            .observe(started.elapsed().as_secs_f64());
        result.map_err(|s| self.error(s))
    }
}
