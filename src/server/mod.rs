//! Protocol front ends: gRPC (Envoy's RateLimitService, RLQS, health and the admin API) and
//! HTTP (operations), the admin listener (the admin API and the operator's overrides, behind
//! tokens), and the servers that carry them (`serve.rs`).

pub(crate) mod admin;
pub(crate) mod admin_listener;
pub(crate) mod answer;
pub(crate) mod auth;
pub(crate) mod conn;
pub(crate) mod debug;
pub(crate) mod grpc;
pub(crate) mod h2guard;
pub(crate) mod headers;
pub(crate) mod http;
pub(crate) mod json;
pub(crate) mod rlqs;
pub(crate) mod serve;
pub(crate) mod tls;
pub(crate) mod top;
pub(crate) mod wire;
