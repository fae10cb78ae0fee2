//! ratelimitd: an external rate-limit service for Envoy and Istio.
//!
//! [`run`] starts the whole service on listeners the caller has bound, so tests can run a real
//! server on port 0; `main.rs` only parses flags, binds and waits for a signal.
#![forbid(unsafe_code)]

pub mod cli;
mod config;
mod engine;
mod limiter;
mod logs;
mod metrics;
mod overrides;
mod rlqs;
mod run;
pub mod runtime;
mod server;
pub mod settings;
mod shutdown;
mod source;
mod statsd;
pub mod telemetry;
mod top;
mod trace;
mod value;
mod xds;

pub use crate::config::ConfigError;
pub use crate::limiter::redis::SetupError;
pub use crate::run::{RunError, check_config, run};
/// The admin API's messages and its gRPC client (`--admin`), for tools that read or reset
/// counters.
pub use crate::server::admin::pb as admin;
pub use crate::server::serve::{
    GrpcSocket, ListenError, Listeners, MAX_HTTP_CONNECTIONS, MAX_MESSAGE_BYTES,
    MAX_STREAMS_PER_CONNECTION, bind,
};
pub use crate::shutdown::{HEALTH_SERVICES, Shutdown};
pub use crate::source::CheckError;

/// What the integration tests (`tests/`) and the fuzz targets (`fuzz/`) drive directly, below
/// [`run`]: not an API, no stability promised, hidden from the documentation.
#[doc(hidden)]
pub mod testing;

#[doc(hidden)]
pub use crate::run::run_with_clock;
