//! Compiles proto/ with protox, so no system `protoc` is needed: the admin API (client and
//! server), and the `RateLimitConfig` messages Envoy Gateway serves over xDS (messages only;
//! their `google.protobuf` types are envoy-types', as in the ADS messages that carry them).
//! And `RateLimitService` itself, described in Rust (tonic's manual builder): its request is
//! `server::wire`'s, whose entries are bytes, so that a value that is not UTF-8 is decoded and
//! decided, never refused by the decoder (a failed call lets Envoy's request through).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let admin = "proto/ratelimitd/admin/v1/admin.proto";
    let rls_conf = "proto/ratelimit/config/ratelimit/v3/rls_conf.proto";
    for proto in [admin, rls_conf] {
        println!("cargo:rerun-if-changed={proto}");
    }
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(protox::compile([admin], ["proto"])?)?;
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        .extern_path(
            ".google.protobuf.Struct",
            "::envoy_types::pb::google::protobuf::Struct",
        )
        .compile_fds(protox::compile([rls_conf], ["proto"])?)?;
    let rls = tonic_prost_build::manual::Service::builder()
        .name("RateLimitService")
        .package("envoy.service.ratelimit.v3")
        .method(
            tonic_prost_build::manual::Method::builder()
                .name("should_rate_limit")
                .route_name("ShouldRateLimit")
                .input_type("crate::server::wire::RateLimitRequest")
                .output_type("::envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse")
                .codec_path("::tonic_prost::ProstCodec")
                .build(),
        )
        .build();
    // RLQS likewise: a bucket id is built from request headers too.
    let rlqs = tonic_prost_build::manual::Service::builder()
        .name("RateLimitQuotaService")
        .package("envoy.service.rate_limit_quota.v3")
        .method(
            tonic_prost_build::manual::Method::builder()
                .name("stream_rate_limit_quotas")
                .route_name("StreamRateLimitQuotas")
                .input_type("crate::server::wire::UsageReports")
                .output_type(
                    "::envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse",
                )
                .codec_path("::tonic_prost::ProstCodec")
                .client_streaming()
                .server_streaming()
                .build(),
        )
        .build();
    tonic_prost_build::manual::Builder::new()
        .build_client(false)
        .compile(&[rls, rlqs]);
    Ok(())
}
