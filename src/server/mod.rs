//! Protocol front ends: gRPC (Envoy's RateLimitService and health) and HTTP (operations).

pub mod grpc;
pub mod http;
pub mod tls;
