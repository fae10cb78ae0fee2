//! Protocol front ends: gRPC (Envoy's RateLimitService and health) and HTTP (operations).

pub mod admin;
pub mod conn;
pub mod grpc;
pub mod headers;
pub mod http;
pub mod json;
pub mod tls;
