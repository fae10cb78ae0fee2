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
