//! Protocol front ends: gRPC (Envoy's RateLimitService and health) and HTTP (operations).

pub(crate) mod admin;
pub(crate) mod conn;
pub(crate) mod grpc;
pub(crate) mod headers;
pub(crate) mod http;
pub(crate) mod json;
pub(crate) mod rlqs;
pub(crate) mod tls;
