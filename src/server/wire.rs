//! `RateLimitService`'s request as it crosses the wire: Envoy's `RateLimitRequest`, field for
//! field, with every `string` that carries what a client sent (entry keys and values, and the
//! domain beside them) decoded as `bytes`. The two are the same on the wire (protobuf's `string`
//! is `bytes` that should be UTF-8), but prost refuses a `string` that is not UTF-8, and HTTP
//! allows any byte but NUL, CR and LF in a header value (obs-text, 0x80-0xFF), which Envoy copies
//! into a descriptor as it is: refused by the decoder, such a value would fail the call and Envoy
//! would let the request through. As bytes it is decided like any other value.
//!
//! The same for RLQS' reports (`RateLimitQuotaUsageReports`), whose bucket ids Envoy builds
//! from request headers too: a report is decoded whatever its bytes, and a bucket whose id is
//! not UTF-8 is skipped alone (`server/rlqs.rs`), never the report or the stream.
//!
//! Responses are Envoy's own messages (envoy-types): what we send is ours, and UTF-8.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::google::protobuf::{Duration, UInt64Value};

/// `envoy.service.ratelimit.v3.RateLimitRequest`, its strings as bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitRequest {
    /// The config domain (set by Envoy's configuration).
    #[prost(bytes = "vec", tag = "1")]
    pub domain: Vec<u8>,
    /// The descriptors, each decided and reported in order.
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<RateLimitDescriptor>,
    /// Hits for descriptors without their own; 0 means 1.
    #[prost(uint32, tag = "3")]
    pub hits_addend: u32,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor`, its entries as bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RateLimitDescriptor {
    /// (key, value) pairs, outermost first.
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<DescriptorEntry>,
    /// A limit that replaces the configured one.
    #[prost(message, optional, tag = "2")]
    pub limit: Option<RateLimitOverride>,
    /// This descriptor's own hits (0 checks without consuming).
    #[prost(message, optional, tag = "3")]
    pub hits_addend: Option<UInt64Value>,
    /// The hits are given back (a refund).
    #[prost(bool, tag = "4")]
    pub is_negative_hits: bool,
}

/// `RateLimitDescriptor.Entry`: any bytes, as Envoy sent them.
#[derive(Clone, PartialEq, prost::Message)]
pub struct DescriptorEntry {
    /// The entry's key (Envoy's configured `descriptor_key`, or an action's own).
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    /// The entry's value: often a request header's, so any bytes a client chose.
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

impl From<envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest> for RateLimitRequest {
    /// Envoy's message (from `/json`, where every string is UTF-8) in this form: the strings'
    /// buffers are taken, not copied.
    fn from(req: envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest) -> Self {
        RateLimitRequest {
            domain: req.domain.into_bytes(),
            descriptors: req
                .descriptors
                .into_iter()
                .map(|d| RateLimitDescriptor {
                    entries: d
                        .entries
                        .into_iter()
                        .map(|e| DescriptorEntry {
                            key: e.key.into_bytes(),
                            value: e.value.into_bytes(),
                        })
                        .collect(),
                    limit: d.limit,
                    hits_addend: d.hits_addend,
                    is_negative_hits: d.is_negative_hits,
                })
                .collect(),
            hits_addend: req.hits_addend,
        }
    }
}

/// `envoy.service.rate_limit_quota.v3.RateLimitQuotaUsageReports`, its strings as bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct UsageReports {
    /// The domain (set by Envoy's configuration; sent at least first).
    #[prost(bytes = "vec", tag = "1")]
    pub domain: Vec<u8>,
    /// One entry per bucket.
    #[prost(message, repeated, tag = "2")]
    pub bucket_quota_usages: Vec<BucketUsage>,
}

/// `RateLimitQuotaUsageReports.BucketQuotaUsage`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct BucketUsage {
    /// The bucket.
    #[prost(message, optional, tag = "1")]
    pub bucket_id: Option<BucketIdBytes>,
    /// The time the usage covers, as the client measured it.
    #[prost(message, optional, tag = "2")]
    pub time_elapsed: Option<Duration>,
    /// Requests the client let through.
    #[prost(uint64, tag = "3")]
    pub num_requests_allowed: u64,
    /// Requests the client refused.
    #[prost(uint64, tag = "4")]
    pub num_requests_denied: u64,
}

/// `envoy.service.rate_limit_quota.v3.BucketId`: its `map<string, string>` as the repeated
/// (key, value) messages a map is on the wire, each as bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct BucketIdBytes {
    /// The id's pairs, in the order sent (a map's order means nothing).
    #[prost(message, repeated, tag = "1")]
    pub bucket: Vec<DescriptorEntry>,
}

/// The generated servers of `RateLimitService` and `RateLimitQuotaService` over the messages
/// above (build.rs).
#[allow(unreachable_pub, missing_docs)]
mod generated {
    include!(concat!(
        env!("OUT_DIR"),
        "/envoy.service.ratelimit.v3.RateLimitService.rs"
    ));
    include!(concat!(
        env!("OUT_DIR"),
        "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService.rs"
    ));
}
pub(crate) use generated::{rate_limit_quota_service_server, rate_limit_service_server};
