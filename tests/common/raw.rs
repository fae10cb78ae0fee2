//! A client that sends what Envoy can send and a Rust protobuf string cannot hold: descriptor
//! entries of any bytes (HTTP's obs-text, 0x80-0xFF, copied from a header as it is). Its
//! messages are written here from Envoy's field numbers, apart from the service's own.

use std::net::SocketAddr;

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::UInt64Value;
use tonic::transport::Channel;

/// `envoy.service.ratelimit.v3.RateLimitRequest` with bytes where Envoy has strings.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct RawRequest {
    #[prost(bytes = "vec", tag = "1")]
    pub domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<RawDescriptor>,
    #[prost(uint32, tag = "3")]
    pub hits_addend: u32,
}

/// `envoy.extensions.common.ratelimit.v3.RateLimitDescriptor`, entries as bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct RawDescriptor {
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<RawEntry>,
    #[prost(message, optional, tag = "3")]
    pub hits_addend: Option<UInt64Value>,
    #[prost(bool, tag = "4")]
    pub is_negative_hits: bool,
}

/// `RateLimitDescriptor.Entry`, as bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct RawEntry {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

/// A request of one descriptor with one entry.
pub(crate) fn raw(domain: &str, key: &str, value: &[u8]) -> RawRequest {
    RawRequest {
        domain: domain.into(),
        descriptors: vec![RawDescriptor {
            entries: vec![RawEntry {
                key: key.into(),
                value: value.to_vec(),
            }],
            hits_addend: None,
            is_negative_hits: false,
        }],
        hits_addend: 0,
    }
}

/// A gRPC connection to `ShouldRateLimit` that sends [`RawRequest`]s.
pub(crate) struct RawClient(tonic::client::Grpc<Channel>);

impl RawClient {
    pub(crate) async fn connect(addr: SocketAddr) -> RawClient {
        let channel = Channel::from_shared(format!("http://{addr}"))
            .expect("a URL")
            .connect()
            .await
            .expect("connect");
        // Envoy's default header limit is 60 KiB, and a request may carry several such values.
        RawClient(tonic::client::Grpc::new(channel).max_encoding_message_size(64 << 20))
    }

    /// The call's answer, or the status it failed with.
    pub(crate) async fn call(
        &mut self,
        req: RawRequest,
    ) -> Result<RateLimitResponse, tonic::Status> {
        self.0
            .ready()
            .await
            .map_err(|e| tonic::Status::unknown(e.to_string()))?;
        let path = http::uri::PathAndQuery::from_static(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        );
        let codec = tonic_prost::ProstCodec::<RawRequest, RateLimitResponse>::default();
        self.0
            .unary(tonic::Request::new(req), path, codec)
            .await
            .map(tonic::Response::into_inner)
    }
}

/// `envoy.service.rate_limit_quota.v3.RateLimitQuotaUsageReports`, bucket ids as bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct RawReports {
    #[prost(bytes = "vec", tag = "1")]
    pub domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    pub bucket_quota_usages: Vec<RawUsage>,
}

/// `BucketQuotaUsage`: a bucket id (its map as repeated entries) and its counts.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct RawUsage {
    #[prost(message, optional, tag = "1")]
    pub bucket_id: Option<RawBucketId>,
    #[prost(uint64, tag = "3")]
    pub num_requests_allowed: u64,
}

/// `BucketId`, `map<string, string>` being repeated (key = 1, value = 2) on the wire.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct RawBucketId {
    #[prost(message, repeated, tag = "1")]
    pub bucket: Vec<RawEntry>,
}

/// A usage entry of a one-pair bucket id.
pub(crate) fn raw_usage(key: &str, value: &[u8]) -> RawUsage {
    RawUsage {
        bucket_id: Some(RawBucketId {
            bucket: vec![RawEntry {
                key: key.into(),
                value: value.to_vec(),
            }],
        }),
        num_requests_allowed: 1,
    }
}

/// An RLQS stream that sends [`RawReports`]: the sender, and the answers as they come.
pub(crate) async fn raw_rlqs(
    addr: SocketAddr,
) -> (
    tokio::sync::mpsc::Sender<RawReports>,
    tonic::Streaming<envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse>,
) {
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse;
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("a URL")
        .connect()
        .await
        .expect("connect");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let path = http::uri::PathAndQuery::from_static(
        "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas",
    );
    let codec = tonic_prost::ProstCodec::<RawReports, RateLimitQuotaResponse>::default();
    let answers = grpc
        .streaming(
            tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx)),
            path,
            codec,
        )
        .await
        .expect("the stream opens")
        .into_inner();
    (tx, answers)
}
