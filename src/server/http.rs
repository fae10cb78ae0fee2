//! The HTTP side port: `/healthcheck`, `/metrics` (Prometheus text) and `/rlconfig`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::limiter::Backend;
use crate::metrics::Metrics;
use crate::service::RateLimiter;

/// What the HTTP handlers read.
pub struct HttpState {
    /// The decision engine (for its config snapshot).
    pub limiter: Arc<RateLimiter>,
    /// Metrics to export.
    pub metrics: Arc<Metrics>,
    /// False once shutdown has begun, so load balancers stop sending traffic.
    pub serving: Arc<AtomicBool>,
    /// The backend, for its reachability.
    pub backend: Arc<dyn Backend>,
}

/// The HTTP routes.
pub fn router(state: Arc<HttpState>) -> Router {
    Router::new()
        .route("/healthcheck", get(healthcheck))
        .route("/metrics", get(metrics))
        .route("/rlconfig", get(rlconfig))
        .with_state(state)
}

/// 200 while serving, even with the backend down: the failure mode decides what requests get,
/// and failing every replica's probe when a shared Redis blips would only add an outage.
/// The body says when the backend is unreachable.
async fn healthcheck(State(state): State<Arc<HttpState>>) -> impl IntoResponse {
    if !state.serving.load(Ordering::SeqCst) {
        return (StatusCode::INTERNAL_SERVER_ERROR, "shutting down");
    }
    if state.backend.is_up() {
        (StatusCode::OK, "OK")
    } else {
        (StatusCode::OK, "OK\nbackend: unavailable")
    }
}

async fn metrics(State(state): State<Arc<HttpState>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

async fn rlconfig(State(state): State<Arc<HttpState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        state.limiter.snapshot().dump(),
    )
}
