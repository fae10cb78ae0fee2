//! Compiles proto/ with protox, so no system `protoc` is needed: the admin API (client and
//! server), and the `RateLimitConfig` messages Envoy Gateway serves over xDS (messages only;
//! their `google.protobuf` types are envoy-types', as in the ADS messages that carry them).

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
    Ok(())
}
